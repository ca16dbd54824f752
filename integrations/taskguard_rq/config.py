"""Which locks object an RQ job uses: its ``locks=`` option, else one
:func:`taskguard.from_env` per process (``TASKGUARD_REDIS_URL`` and friends)."""

from __future__ import annotations

import threading

import taskguard
from taskguard import Locks

__all__ = ["locks_for"]

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
