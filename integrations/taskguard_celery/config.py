"""Which locks object a guarded task uses.

Precedence, first match wins:

1. the task's own ``locks=`` option (a :class:`taskguard.Locks`);
2. ``app.conf.taskguard_locks`` (a :class:`taskguard.Locks`);
3. ``app.conf.taskguard_redis_url`` (with ``taskguard_prefix``, default ``"taskguard"``);
4. :func:`taskguard.from_env` (``TASKGUARD_REDIS_URL`` and friends).

Resolved once per Celery app and cached, so two apps in one process may use different Redis.

Also here: the beat scheduler's settings (:func:`beat_settings`), checked when the scheduler is set
up, with the core's validators.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import taskguard
from taskguard import ConfigError, Locks, RedisLocks
from taskguard.config import parse_prefix
from taskguard.urls import check_url
from taskguard.validate import check_seconds, check_setting_names, check_ttl

__all__ = ["locks_for", "use_locks", "beat_settings", "BeatSettings", "BEAT_LEADER_TTL", "BEAT_LEADER_TTL_MAX",
           "BEAT_SKEW"]

#: Default of ``app.conf.taskguard_beat_leader_ttl``, seconds.
BEAT_LEADER_TTL = 30.0
#: Longest leader TTL accepted, seconds: how long a crashed leader can keep every beat waiting.
BEAT_LEADER_TTL_MAX = 3600.0
#: Seconds allowed for the clocks of beats to differ and for a tick to come late; part of the
#: default catch-up window and the lateness every due slot is allowed.
BEAT_SKEW = 2.0

#: Every ``app.conf.taskguard_*`` setting the adapter reads (a close misspelling is refused).
SETTINGS = frozenset({"taskguard_locks", "taskguard_redis_url", "taskguard_prefix", "taskguard_metrics",
                      "taskguard_metrics_port", "taskguard_redelivery_timeout", "taskguard_beat_leader_ttl",
                      "taskguard_beat_catch_up", "taskguard_beat_name"})

_cache: weakref.WeakKeyDictionary[Any, Locks] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def locks_for(app: Any, explicit: Locks | None = None) -> Locks:
    """The locks object for ``app`` (see the module docstring). Raises ConfigError."""
    if explicit is not None:
        return explicit
    with _lock:
        cached = _cache.get(app)
        if cached is not None:
            return cached
        conf = app.conf
        check_setting_names([k for k in conf if isinstance(k, str) and k.startswith("taskguard_")], SETTINGS,
                            "app.conf")
        obj = conf.get("taskguard_locks")
        url = conf.get("taskguard_redis_url")
        if obj is not None:
            if not isinstance(obj, Locks):
                raise ConfigError(f"app.conf.taskguard_locks must be a taskguard.Locks, got {type(obj).__name__}")
            locks = obj
        elif url:
            prefix = conf.get("taskguard_prefix")
            prefix = "taskguard" if prefix is None else prefix  # "" is refused like any bad prefix
            try:
                url = check_url(url, "app.conf.taskguard_redis_url")
                prefix = parse_prefix("app.conf.taskguard_prefix", prefix)
                locks = RedisLocks.from_url(url, prefix=prefix)
            except ConfigError as e:
                msg = str(e)
                raise ConfigError(msg if msg.startswith("app.conf.")
                                  else f"app.conf.taskguard_redis_url: {msg}") from None
        else:
            try:
                locks = taskguard.from_env()
            except ConfigError as e:
                raise ConfigError(f"{e} (for Celery: set app.conf.taskguard_redis_url, app.conf.taskguard_locks, "
                                  "the task's locks= option, or the TASKGUARD_REDIS_URL variable)") from None
        _cache[app] = locks
        return locks


def use_locks(app: Any, locks: Locks) -> None:
    """Make ``app``'s guarded tasks use ``locks`` from now on (``app.conf.taskguard_locks``),
    forgetting what was resolved before: e.g. a test's ``MemoryLocks`` (the ``taskguard_locks``
    pytest fixture). Tasks declared with their own ``locks=`` keep theirs. Raises ConfigError when
    ``locks`` is not a :class:`taskguard.Locks`."""
    if not isinstance(locks, Locks):
        raise ConfigError(f"use_locks() needs a taskguard.Locks, got {type(locks).__name__}")
    from .task import GuardedTask

    with _lock:
        app.conf.taskguard_locks = locks
        _cache.pop(app, None)
    for task in list(app.tasks.values()):
        if isinstance(task, GuardedTask):
            task._locks_cache = None


@dataclasses.dataclass(frozen=True)
class BeatSettings:
    """The beat scheduler's settings, validated (see :func:`beat_settings`)."""

    leader_ttl: float
    catch_up: float
    name: str
    loop_interval: float

    @property
    def allowed_lateness(self) -> float:
        """How late (seconds) a due slot may still be published: the catch-up window, and never
        less than one beat loop plus the skew allowance (a slot due between two ticks)."""
        return max(self.catch_up, self.loop_interval + BEAT_SKEW)


def beat_settings(app: Any, loop_interval: float) -> BeatSettings:
    """The beat settings of ``app``, checked. ``loop_interval`` (seconds) is the scheduler's
    effective ``max_interval`` (``beat_max_loop_interval`` when set, celery/beat.py
    ``Scheduler.__init__``).

    * ``app.conf.taskguard_beat_leader_ttl``: seconds, default 30; at least :data:`~taskguard.validate.MIN_TTL`
      and at least twice the loop interval (a leader looks at its lease once per loop).
    * ``app.conf.taskguard_beat_catch_up``: seconds a new leader still publishes a slot that fell
      due during the hand-over; default leader TTL + loop interval + :data:`BEAT_SKEW`; ``0`` = none.
    * ``app.conf.taskguard_beat_name``: the leader lease's name (default: the app's ``main``).

    Raises ConfigError naming the setting."""
    conf = app.conf
    raw = conf.get("taskguard_beat_leader_ttl")
    try:
        leader_ttl = BEAT_LEADER_TTL if raw is None else check_ttl(raw)
    except ConfigError as e:
        raise ConfigError(f"app.conf.taskguard_beat_leader_ttl: {e}") from None
    if leader_ttl > BEAT_LEADER_TTL_MAX:
        raise ConfigError(f"app.conf.taskguard_beat_leader_ttl must be at most {BEAT_LEADER_TTL_MAX:g} s (a crashed "
                          f"leader holds every beat off for that long), got {leader_ttl:g}")
    if leader_ttl < 2 * loop_interval:
        raise ConfigError(f"app.conf.taskguard_beat_leader_ttl must be at least twice the beat loop interval "
                          f"({loop_interval:g} s, beat_max_loop_interval), got {leader_ttl:g}")
    raw = conf.get("taskguard_beat_catch_up")
    try:
        catch_up = (leader_ttl + loop_interval + BEAT_SKEW if raw is None
                    else check_seconds("catch-up window", raw, allow_zero=True))
    except ConfigError as e:
        raise ConfigError(f"app.conf.taskguard_beat_catch_up: {e}") from None
    name = conf.get("taskguard_beat_name")
    if name is None:
        name = app.main or "celery"
    elif not isinstance(name, str) or not name.strip():
        raise ConfigError(f"app.conf.taskguard_beat_name must be a non-empty str, got {name!r}")
    return BeatSettings(leader_ttl=leader_ttl, catch_up=catch_up, name=name, loop_interval=float(loop_interval))
