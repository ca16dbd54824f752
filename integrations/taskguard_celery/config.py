"""Which locks object a guarded task uses.

Precedence, first match wins:

1. the task's own ``locks=`` option (a :class:`taskguard.Locks`);
2. ``app.conf.taskguard_locks`` (a :class:`taskguard.Locks`);
3. ``app.conf.taskguard_redis_url`` (with ``taskguard_prefix``, default ``"taskguard"``; a
   ``sentinel://h:26379;sentinel://h2:26379`` URL, as kombu takes it, with
   ``taskguard_sentinel_master`` and, if the sentinels have one, ``taskguard_sentinel_password``;
   the durability option ``taskguard_replicas`` / ``taskguard_replica_timeout``);
4. :func:`taskguard.from_env` (``TASKGUARD_REDIS_URL`` and friends).

Resolved once per Celery app and cached, so two apps in one process may use different Redis.

Also here: the beat scheduler's settings (:func:`beat_settings`), checked when the scheduler is set
up, with the core's validators.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import taskguard
from taskguard import ConfigError, Locks
from taskguard.config import from_settings
from taskguard.schedule.settings import (
    LEADER_TTL,
    LEADER_TTL_MAX,
    SKEW,
    ScheduleSettings,
    SettingNames,
    schedule_settings,
)
from taskguard.validate import check_setting_names, closest

__all__ = [
    "locks_for",
    "use_locks",
    "beat_settings",
    "BeatSettings",
    "BEAT_LEADER_TTL",
    "BEAT_LEADER_TTL_MAX",
    "BEAT_SKEW",
]

#: Default of ``app.conf.taskguard_beat_leader_ttl``, its largest value, and the skew allowance
#: (seconds): the periodic core's (:mod:`taskguard.schedule.settings`).
BEAT_LEADER_TTL, BEAT_LEADER_TTL_MAX, BEAT_SKEW = LEADER_TTL, LEADER_TTL_MAX, SKEW

#: Every ``app.conf.taskguard_*`` setting the adapter reads (a close misspelling is refused).
SETTINGS = frozenset(
    {
        "taskguard_locks",
        "taskguard_redis_url",
        "taskguard_prefix",
        "taskguard_metrics",
        "taskguard_metrics_port",
        "taskguard_redelivery_timeout",
        "taskguard_beat_leader_ttl",
        "taskguard_beat_catch_up",
        "taskguard_beat_name",
        "taskguard_sentinel_master",
        "taskguard_sentinel_password",
        "taskguard_replicas",
        "taskguard_replica_timeout",
    }
)

_cache: weakref.WeakKeyDictionary[Any, Locks] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def locks_for(app: Any, explicit: Locks | None = None) -> Locks:
    """The locks object for ``app`` (see the module docstring). Raises ConfigError."""
    if explicit is not None:
        return explicit
    cached = _cache.get(app)  # the hot path (every guarded run): no lock once resolved
    if cached is not None:
        return cached
    with _lock:
        cached = _cache.get(app)
        if cached is not None:
            return cached
        conf = app.conf
        check_setting_names(_setting_names(app), SETTINGS, "app.conf")
        obj = conf.get("taskguard_locks")
        url = conf.get("taskguard_redis_url")
        if obj is not None:
            if not isinstance(obj, Locks):
                raise ConfigError(f"app.conf.taskguard_locks must be a taskguard.Locks, got {type(obj).__name__}")
            locks = obj
        elif url:
            locks = from_settings(
                "app.conf.taskguard_",
                url,
                conf.get("taskguard_prefix"),
                **{n: conf.get(f"taskguard_{n}") for n in _REDIS_SETTINGS},
            )
        else:
            try:
                locks = taskguard.from_env()
            except ConfigError as e:
                raise ConfigError(
                    f"{e} (for Celery: set app.conf.taskguard_redis_url, app.conf.taskguard_locks, "
                    "the task's locks= option, or the TASKGUARD_REDIS_URL variable)"
                ) from None
        _cache[app] = locks
        return locks


def _setting_names(app: Any) -> list[str]:
    """The ``taskguard_*`` settings among ``app``'s, by the names the adapter reads them under. Celery
    hands over ``taskguard_x`` and, under the app's namespace (``config_from_object(...,
    namespace="CELERY")``, Django's way), ``CELERY_TASKGUARD_X`` exactly so (celery/app/utils.py
    ``Settings``); any other spelling of a taskguard setting (``TASKGUARD_PREFIX``,
    ``celery_taskguard_prefix``) is never read: it is refused here, with the form that is, instead
    of leaving the default in force. Raises ConfigError."""
    ns = getattr(app, "namespace", None) or ""
    lead = f"{ns}_TASKGUARD_" if ns else None
    names = []
    for k in app.conf:
        if not isinstance(k, str):
            continue
        if k.startswith("taskguard_"):
            names.append(k)
            continue
        if lead is not None and k.startswith(lead) and k[len(ns) + 1 :].isupper():
            names.append(k[len(ns) + 1 :].lower())
            continue
        low = k.lower()
        if ns and low.startswith(ns.lower() + "_"):
            low = low[len(ns) + 1 :]
        if low.startswith("taskguard_"):
            meant = low if low in SETTINGS else (closest(low, SETTINGS, loose=False) or low)
            form = f"{ns}_{meant.upper()}" if ns else meant
            raise ConfigError(f"app.conf: {k} is never read by taskguard (Celery hands it no such key); write {form}")
    return names


#: The Sentinel and durability settings, passed to :func:`taskguard.config.from_settings`.
_REDIS_SETTINGS = ("sentinel_master", "sentinel_password", "replicas", "replica_timeout")


def use_locks(app: Any, locks: Locks) -> None:
    """Make ``app``'s guarded tasks use ``locks`` from now on (``app.conf.taskguard_locks``),
    forgetting what was resolved before: e.g. a test's ``MemoryLocks`` (the ``taskguard_locks``
    pytest fixture). Tasks declared with their own ``locks=`` keep theirs. Raises ConfigError when
    ``locks`` is not a :class:`taskguard.Locks`."""
    if not isinstance(locks, Locks):
        raise ConfigError(f"use_locks() needs a taskguard.Locks, got {type(locks).__name__}")
    with _lock:
        app.conf.taskguard_locks = locks
        _cache.pop(app, None)


#: The beat scheduler's settings, validated (see :func:`beat_settings`).
BeatSettings = ScheduleSettings

_BEAT_NAMES = SettingNames(
    leader_ttl="app.conf.taskguard_beat_leader_ttl",
    catch_up="app.conf.taskguard_beat_catch_up",
    name="app.conf.taskguard_beat_name",
    loop="beat_max_loop_interval",
    role="beat",
)


def beat_settings(app: Any, loop_interval: float) -> BeatSettings:
    """The beat settings of ``app``, checked by :func:`taskguard.schedule.schedule_settings`.
    ``loop_interval`` (seconds) is the scheduler's effective ``max_interval``
    (``beat_max_loop_interval`` when set, celery/beat.py ``Scheduler.__init__``).

    * ``app.conf.taskguard_beat_leader_ttl``: seconds, default 30; at least :data:`~taskguard.validate.MIN_TTL`,
      at most 3600, and at least twice the loop interval (a leader looks at its lease once per loop).
    * ``app.conf.taskguard_beat_catch_up``: seconds a new leader still publishes a slot that fell
      due during the hand-over; default leader TTL + loop interval + :data:`BEAT_SKEW`; ``0`` = none.
    * ``app.conf.taskguard_beat_name``: the leader lease's name (default: the app's ``main``).

    Raises ConfigError naming the setting."""
    conf = app.conf
    return schedule_settings(
        _BEAT_NAMES,
        leader_ttl=conf.get("taskguard_beat_leader_ttl"),
        catch_up=conf.get("taskguard_beat_catch_up"),
        name=conf.get("taskguard_beat_name"),
        default_name=app.main or "celery",
        loop_interval=float(loop_interval),
    )
