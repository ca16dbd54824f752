"""Which locks object a guarded task uses.

Precedence, first match wins:

1. the task's own ``locks=`` option (a :class:`taskguard.Locks`);
2. ``app.conf.taskguard_locks`` (a :class:`taskguard.Locks`);
3. ``app.conf.taskguard_redis_url`` (with ``taskguard_prefix``, default ``"taskguard"``);
4. :func:`taskguard.from_env` (``TASKGUARD_REDIS_URL`` and friends).

Resolved once per Celery app and cached, so two apps in one process may use different Redis.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import taskguard
from taskguard import ConfigError, Locks, RedisLocks

__all__ = ["locks_for"]

_cache: "weakref.WeakKeyDictionary[Any, Locks]" = weakref.WeakKeyDictionary()
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
        obj = conf.get("taskguard_locks")
        url = conf.get("taskguard_redis_url")
        if obj is not None:
            if not isinstance(obj, Locks):
                raise ConfigError(f"app.conf.taskguard_locks must be a taskguard.Locks, got {type(obj).__name__}")
            locks = obj
        elif url:
            locks = RedisLocks.from_url(url, prefix=conf.get("taskguard_prefix") or "taskguard")
        else:
            try:
                locks = taskguard.from_env()
            except ConfigError as e:
                raise ConfigError(f"{e} (for Celery: set app.conf.taskguard_redis_url, app.conf.taskguard_locks, "
                                  "the task's locks= option, or the TASKGUARD_REDIS_URL variable)") from None
        _cache[app] = locks
        return locks
