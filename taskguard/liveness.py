"""Is a lease's holder process still alive? Answerable only for holders on this machine.

Holder metadata records ``host``, ``pid`` and, on Linux, ``pidns`` (the PID namespace, so two
containers that share a hostname are never confused). :func:`holder_is_dead` says ``True`` only
when the holder ran on this host, in this PID namespace, and its PID no longer exists — e.g. a
Celery prefork child killed by SIGKILL, whose redelivered message then need not wait out the
TTL. Everything else (another host, another namespace, a live or stopped process) is ``False``:
the TTL decides. A recycled PID makes a dead holder look alive (never the reverse), which only
costs waiting out the TTL.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["process_identity", "holder_is_dead"]


def _pidns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_identity() -> dict[str, Any]:
    """``{"host", "pid"}`` plus ``"pidns"`` where the platform tells it."""
    ident: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    ns = _pidns()
    if ns is not None:
        ident["pidns"] = ns
    return ident


def holder_is_dead(holder: Mapping[str, Any]) -> bool:
    """``True`` when ``holder`` (holder metadata) is a process of this host and PID namespace
    that no longer exists."""
    pid, ns = holder.get("pid"), holder.get("pidns")
    if not isinstance(pid, int) or ns is None or ns != _pidns() or holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by someone else
        return False
    return False
