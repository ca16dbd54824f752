"""In-process leases with the same behaviour as :class:`~taskguard.RedisLocks`.

For users' unit tests where the lease is not the subject: no Redis needed, same API, same
outcomes (the test suite drives both with one hypothesis state machine and compares them).
Leases live in this process only, so it gives no mutual exclusion across processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from .clock import LOCAL, FixedClock
from .events import Listener
from .locks import Locks
from .memory_backend import MemoryBackend

__all__ = ["MemoryLocks"]


class MemoryLocks(Locks):
    """Fenced leases in a dict, thread-safe.

    Args:
        clock: returns Unix epoch seconds (float); default :func:`time.time`. Inject one to
            drive expiry in tests without sleeping: it then also measures how long handles
            presume their leases held (:class:`taskguard.clock.FixedClock`); the default keeps
            those durations on ``time.monotonic``.
        prefix, renew_fraction, max_hold, listeners: as for :class:`~taskguard.RedisLocks`.
    """

    backend: MemoryBackend

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        prefix: str = "taskguard",
        renew_fraction: float = 1 / 3,
        max_hold: float | None = None,
        shutdown_timeout: float = 5.0,
        listeners: Iterable[Listener] = (),
    ) -> None:
        super().__init__(
            MemoryBackend(clock),
            prefix=prefix,
            renew_fraction=renew_fraction,
            max_hold=max_hold,
            shutdown_timeout=shutdown_timeout,
            listeners=listeners,
        )
        self.clock = LOCAL if clock is time.time else FixedClock(clock)

    def __repr__(self) -> str:
        return f"<MemoryLocks prefix={self.prefix!r}>"
