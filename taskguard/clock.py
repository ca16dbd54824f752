"""Time sources: local durations from a monotonic clock, wall instants from the Redis server.

A host's wall clock (``time.time()``) can step forward or back at any moment (NTP correcting a
drifted VM, an operator, a suspended laptop); its monotonic clock cannot. So taskguard measures
every local duration — how long a lease is still presumed held, when to renew, retry or give up —
with :meth:`Clock.monotonic`, and never decides expiry with the local wall clock: Redis decides it
with its own clock (lease keys carry a TTL). Where an *instant* is needed on more than one host
(beat's slot instants and lateness), it comes from the Redis server's clock through a
:class:`ServerClock`.

The API is two methods, so a test (or a simulated schedule) can inject its own:

* ``monotonic() -> float``: seconds on a clock that never steps; only differences mean anything.
* ``time() -> float``: Unix epoch seconds (float) for instants.

plus ``refresh()``, which a clock may use to resynchronise (a :class:`ServerClock` reads the
server's ``TIME``); it never raises; and ``uncertainty()``, how far ``time()`` may be from the
clock it follows, seconds (0 for a clock that reads its source directly; optional for an injected
clock).

:data:`LOCAL` is the process's own clocks (``time.monotonic`` / ``time.time``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["LOCAL", "Clock", "FixedClock", "ServerClock"]

log = logging.getLogger("taskguard")


class Clock:
    """The local clocks: :meth:`monotonic` is ``time.monotonic``, :meth:`time` is ``time.time``.
    Subclass (or duck-type the three methods) to inject another time source."""

    def monotonic(self) -> float:
        """Seconds (float) on a clock that never steps; only differences are meaningful."""
        return time.monotonic()

    def time(self) -> float:
        """Unix epoch seconds (float)."""
        return time.time()

    def refresh(self) -> None:
        """Resynchronise with the clock's source, where it has one (here: nothing). Never raises."""

    def uncertainty(self) -> float:
        """How far :meth:`time` may be from its source's clock, either way, seconds (float, >= 0;
        here 0: it reads the source directly). A caller that must not act *before* an instant
        waits until ``time() - uncertainty()`` reaches it."""
        return 0.0


#: The process's own clocks.
LOCAL = Clock()


class FixedClock(Clock):
    """A clock that moves only when told to (tests, simulations): one callable ``now() -> float``
    gives both :meth:`time` and :meth:`monotonic`, so a lease's TTL runs out when ``now`` passes
    it, as it does in :class:`~taskguard.MemoryLocks` with an injected clock."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now

    def monotonic(self) -> float:
        return self._now()

    def time(self) -> float:
        return self._now()


class ServerClock(Clock):
    """The Redis server's wall clock, read with ``TIME`` at most every ``resample`` seconds and
    advanced by the local monotonic clock in between, so that a step of this host's wall clock
    changes nothing.

    Args:
        server_time: reads the server's clock once, returning Unix epoch seconds (float); e.g.
            :meth:`taskguard.Locks.server_time`. May raise (an outage): the clock then keeps
            advancing from its last good reading.
        resample: seconds (float, >= 0) after which :meth:`time` reads the server again by itself
            (default 60; :meth:`refresh` reads it whenever called).
        local: the clock whose :meth:`~Clock.monotonic` measures the time between readings
            (default :data:`LOCAL`).

    Until the first successful reading, :meth:`time` falls back to ``local.time()``.
    Thread-safe.
    """

    def __init__(self, server_time: Callable[[], float], *, resample: float = 60.0, local: Clock = LOCAL) -> None:
        self._server_time = server_time
        self._resample = float(resample)
        self._local = local
        self._lock = threading.Lock()
        # (server epoch seconds, local monotonic then, half the round trip of that reading)
        self._base: tuple[float, float, float] | None = None

    def monotonic(self) -> float:
        return self._local.monotonic()

    def refresh(self) -> None:
        """Read the server's clock now (half the round trip is added to the reading). A failure
        is logged at DEBUG level and leaves the last reading in use; never raises."""
        sent = self._local.monotonic()
        try:
            server = float(self._server_time())
        except Exception as e:  # noqa: BLE001  (an outage, or any error of an injected reader: keep advancing)
            log.debug("taskguard: could not read the Redis server's clock: %s", e)
            return
        got = self._local.monotonic()
        half = max(0.0, got - sent) / 2
        with self._lock:
            self._base = (server + half, got, half)

    def time(self) -> float:
        """The server's Unix epoch seconds (float), as of its last reading plus the monotonic
        time since; reads it again when the last reading is more than ``resample`` seconds old."""
        base = self._base
        if base is None or self._local.monotonic() - base[1] > self._resample:
            self.refresh()
            base = self._base
        if base is None:
            return self._local.time()
        return base[0] + (self._local.monotonic() - base[1])

    def uncertainty(self) -> float:
        """Half the round trip of the reading in use, seconds (float): the server read its clock
        somewhere within that round trip, so :meth:`time` (which assumes the middle) may be ahead
        of the server's clock or behind it by up to this much — under load, milliseconds or more.
        0.0 before the first successful reading."""
        base = self._base
        return 0.0 if base is None else base[2]
