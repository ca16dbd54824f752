"""Which locks object an RQ job uses: its ``locks=`` option, else one
:func:`taskguard.from_env` per process (``TASKGUARD_REDIS_URL`` and friends)."""

from __future__ import annotations

import threading

import taskguard
from taskguard import Locks

__all__ = ["locks_for", "use_locks", "has_default"]

_default: Locks | None = None
_default_lock = threading.Lock()


def locks_for(explicit: Locks | None = None) -> Locks:
    """The job's ``locks=`` option, else one :func:`taskguard.from_env` per process."""
    global _default
    if explicit is not None:
        return explicit
    with _default_lock:
        if _default is None:
            _default = taskguard.from_env()
        return _default


def use_locks(locks: Locks | None) -> None:
    """Make jobs without their own ``locks=`` use ``locks`` from now on in this process (e.g. a
    test's ``MemoryLocks``, the ``taskguard_locks`` pytest fixture); ``None`` goes back to
    :func:`taskguard.from_env`. Raises ConfigError when ``locks`` is not a :class:`taskguard.Locks`."""
    global _default
    if locks is not None and not isinstance(locks, Locks):
        raise taskguard.ConfigError(f"use_locks() needs a taskguard.Locks, got {type(locks).__name__}")
    with _default_lock:
        _default = locks


def has_default() -> bool:
    """Do jobs without their own ``locks=`` have locks in this process already (given with
    :func:`use_locks`, or resolved from the environment)?"""
    return _default is not None
