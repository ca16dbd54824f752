"""Listener API: what lease operations report (acquire, renew, release, skip, lost).

A listener is any callable taking one :class:`LeaseEvent`. Register it globally with
:func:`add_listener` (every locks object in the process) or per locks object
(``RedisLocks(..., listeners=[fn])`` / ``locks.add_listener(fn)``). Listeners run synchronously
on the thread doing the operation (the heartbeat thread for background renewals); an exception a
listener raises is logged and swallowed, never breaking a lease operation.

Events carry the key, timing and status, never owner tokens or task results.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["LeaseEvent", "Listener", "add_listener", "remove_listener", "Emitter"]

log = logging.getLogger("taskguard")

#: ``kind`` values.
KINDS = ("acquire", "renew", "release", "claim", "skip", "lost", "publish")


@dataclasses.dataclass(frozen=True)
class LeaseEvent:
    """One lease operation's outcome.

    Attributes:
        kind: ``"acquire"``, ``"renew"``, ``"release"``, ``"claim"``, ``"skip"`` or ``"lost"``.
        key: the user's lease key.
        status: outcome, per kind: acquire ``"acquired" | "held" | "wait_timeout" | "error"`` or
            ``"unreplicated"`` (given back: fewer replicas than asked acknowledged it in time);
            renew ``"renewed" | "not_owner" | "error" | "max_hold"``; release
            ``"released" | "not_owner" | "error"``; claim ``"claimed" | "not_owner" | "error"``
            or ``"unreplicated"``;
            skip: the skip reason; lost: the reason the lease was found lost; publish
            ``"suppressed"`` (``unique=True`` found a run queued or running).
        duration: seconds (float) the operation took (for acquire: including any wait).
        at: Unix epoch seconds when the event was made.
        fencing_token: the lease's fencing token where known (not secret).
        ttl: the TTL in seconds the operation used, where relevant.
        holder: the non-secret holder metadata involved, where known.
        error: the error type and message for ``"error"`` statuses (never an owner token).
        task: the task / job name the lease is for, where known (from holder metadata ``task`` or
            ``job``, or the ``Skipped``); bounded, so usable as a metric label.
        shadow: ``True`` for what a guard in shadow mode (``enforce=False``) would have done: a
            ``skip`` event whose run went ahead anyway.
    """

    kind: str
    key: str
    status: str
    duration: float = 0.0
    at: float = dataclasses.field(default_factory=time.time)
    fencing_token: int | None = None
    ttl: float | None = None
    holder: Mapping[str, Any] | None = None
    error: str | None = None
    task: str | None = None
    shadow: bool = False


Listener = Callable[[LeaseEvent], None]

_global: list[Listener] = []
_global_lock = threading.Lock()


def add_listener(fn: Listener) -> Callable[[], None]:
    """Register ``fn`` for the events of every locks object; returns a function that removes it."""
    with _global_lock:
        _global.append(fn)
    return lambda: remove_listener(fn)


def remove_listener(fn: Listener) -> None:
    with _global_lock:
        if fn in _global:
            _global.remove(fn)


class Emitter:
    """Per-locks-object listener list that also feeds the global listeners."""

    def __init__(self, listeners: Iterable[Listener] = ()) -> None:
        self._listeners = list(listeners)

    def add_listener(self, fn: Listener) -> Callable[[], None]:
        """Register ``fn`` for this object's events; returns a function that removes it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    @property
    def active(self) -> bool:
        """Whether anyone listens (lets hot paths skip building events nobody reads)."""
        return bool(self._listeners or _global)

    def emit(self, event: LeaseEvent) -> None:
        for fn in (*self._listeners, *_global):
            try:
                fn(event)
            except Exception:  # a listener must never break a lease operation
                log.exception("taskguard listener %r failed on %s event", fn, event.kind)
