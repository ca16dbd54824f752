"""A periodic scheduler's settings, checked when it starts (one place for their defaults and rules)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError
from ..validate import check_seconds, check_ttl

__all__ = ["ScheduleSettings", "SettingNames", "schedule_settings", "LEADER_TTL", "LEADER_TTL_MAX", "SKEW"]

#: Default leader TTL, seconds.
LEADER_TTL = 30.0
#: Longest leader TTL accepted, seconds: how long a crashed leader can keep every scheduler waiting.
LEADER_TTL_MAX = 3600.0
#: Seconds allowed for the clocks of schedulers to differ and for a tick to come late; part of the
#: default catch-up window and the lateness every due slot is allowed.
SKEW = 2.0


@dataclasses.dataclass(frozen=True)
class ScheduleSettings:
    """A periodic scheduler's settings, validated (see :func:`schedule_settings`). Seconds (float)
    throughout; ``name`` names the leader lease (``<role>-leader:<name>``)."""

    leader_ttl: float
    catch_up: float
    name: str
    loop_interval: float

    @property
    def allowed_lateness(self) -> float:
        """How late (seconds) a due slot may still be published: the catch-up window, and never
        less than one loop plus the skew allowance (a slot due between two ticks)."""
        return max(self.catch_up, self.loop_interval + SKEW)


@dataclasses.dataclass(frozen=True)
class SettingNames:
    """How an adapter's users spell each setting (for error messages): e.g.
    ``app.conf.taskguard_beat_leader_ttl``; ``loop`` names the loop interval's own setting."""

    leader_ttl: str
    catch_up: str
    name: str
    loop: str
    role: str = "scheduler"


def schedule_settings(
    names: SettingNames,
    *,
    leader_ttl: Any = None,
    catch_up: Any = None,
    name: Any = None,
    default_name: str,
    loop_interval: float,
) -> ScheduleSettings:
    """Check a periodic scheduler's settings (``None``: the default).

    * ``leader_ttl``: seconds, default :data:`LEADER_TTL`; at least :data:`~taskguard.validate.MIN_TTL`,
      at most :data:`LEADER_TTL_MAX`, and at least twice ``loop_interval`` (a leader looks at its
      lease once per loop).
    * ``catch_up``: seconds a new leader still publishes a slot that fell due during the
      hand-over; default leader TTL + loop interval + :data:`SKEW`; ``0`` = none.
    * ``name``: the leader lease's name, a non-empty ``str`` (default ``default_name``).

    ``loop_interval``: the scheduler's effective loop interval, seconds. Raises ConfigError naming
    the setting as ``names`` spells it."""
    try:
        ttl = LEADER_TTL if leader_ttl is None else check_ttl(leader_ttl)
    except ConfigError as e:
        raise ConfigError(f"{names.leader_ttl}: {e}") from None
    if ttl > LEADER_TTL_MAX:
        raise ConfigError(
            f"{names.leader_ttl} must be at most {LEADER_TTL_MAX:g} s (a crashed leader holds every "
            f"{names.role} off for that long), got {ttl:g}"
        )
    if ttl < 2 * loop_interval:
        raise ConfigError(
            f"{names.leader_ttl} must be at least twice the {names.role} loop interval "
            f"({loop_interval:g} s, {names.loop}), got {ttl:g}"
        )
    try:
        window = (
            ttl + loop_interval + SKEW
            if catch_up is None
            else check_seconds("catch-up window", catch_up, allow_zero=True)
        )
    except ConfigError as e:
        raise ConfigError(f"{names.catch_up}: {e}") from None
    if name is None:
        name = default_name
    elif not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{names.name} must be a non-empty str, got {name!r}")
    return ScheduleSettings(leader_ttl=ttl, catch_up=window, name=name, loop_interval=float(loop_interval))
