"""Is a lease's holder process still alive? Answerable only for holders on this machine.

Holder metadata records ``host``, ``pid`` and, on Linux, ``pidns`` (the PID namespace, so two
containers that share a hostname are never confused). :func:`holder_is_dead` says ``True`` only
when the holder ran on this host, in this PID namespace, and its PID no longer exists or is a
zombie (exited, not reaped yet) — e.g. a
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
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """A process that has exited but was not reaped yet (state ``Z``/``X`` in ``/proc/PID/stat``,
    proc(5)): it still answers ``kill(pid, 0)``, but holds nothing any more. A SIGKILLed holder
    whose parent died too is reparented to PID 1, and a PID 1 that is not a reaping init (a
    container started without one) leaves it a zombie indefinitely. ``False`` where ``/proc``
    cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")
