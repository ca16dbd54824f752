"""One background thread per process that keeps live leases renewed.

Each registered lease is renewed every ``ttl * renew_fraction`` seconds (up to a quarter of that
early, so that leases falling due close together share a round). Due leases of one locks object
are renewed together (for Redis: one pipelined round trip). Outcomes:

* renewed: the handle's expiry (``expires_at``, and its monotonic deadline) moves forward;
* not the owner any more: the lease is marked lost (``lost`` event, ``on_lost`` callbacks) and
  dropped from the heartbeat;
* Redis error: reported (``renew`` event with status ``"error"``), retried soon; the lease is
  marked lost only once its TTL has passed without a successful renewal (measured on the
  monotonic clock: a step of the wall clock neither ends a held lease nor keeps a lost one);
* ``max_hold`` passed: renewal stops (``renew`` event with status ``"max_hold"``) so a hung body's
  lease expires by its TTL.

Each locks object's round runs on its own pool thread, so a slow or unreachable Redis never
delays renewals in another. The thread never dies on an error. After ``fork`` the child gets a
fresh, empty heartbeat: the leases it inherited are neither renewed nor released there (their
handles are inert in the child); it starts its own thread when it registers its own leases.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from .events import LeaseEvent

if TYPE_CHECKING:  # pragma: no cover
    from .lease import Lease

__all__ = ["Heartbeat", "get_heartbeat"]

log = logging.getLogger("taskguard")

#: Fraction of a lease's renew interval by which it may be renewed early to join a round.
COALESCE = 0.25

#: How soon (seconds) a renewal that failed on a Redis error is retried, at most.
ERROR_RETRY = 0.5

#: Shortest sleep (seconds) of the thread while no lease is registered (see ``Heartbeat``).
IDLE_MIN = 0.5


class _Entry:
    __slots__ = ("lease", "interval", "next_due", "deadline")

    def __init__(self, lease: Lease, interval: float, deadline: float | None) -> None:
        self.lease = lease
        self.interval = interval
        self.next_due = time.monotonic() + interval
        self.deadline = deadline


class Heartbeat:
    """The process's renewal thread. Use :func:`get_heartbeat`; do not build one directly."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._entries: dict[int, _Entry] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = 0.0  # when the thread's current sleep ends (monotonic)
        self._in_flight: set[int] = set()  # locks objects whose renewal round is running
        self._executor: ThreadPoolExecutor | None = None
        # How long the thread sleeps with no lease registered: the renew interval of the latest
        # lease added (bounded below by IDLE_MIN). A lease added while it sleeps is due no
        # earlier than its interval from now, so one with an interval at least this long never
        # needs to wake it: short tasks (a lease added and released long before its first
        # renewal) cost no thread wake-up each. Until the first lease it sleeps an hour.
        self._idle_sleep = 3600.0
        self.beats = 0  # renewal rounds run (for tests and benchmarks)
        self.wakeups = 0  # times add() woke the thread (for tests and benchmarks)

    def add(self, lease: Lease, fraction: float, max_hold: float | None = None) -> None:
        deadline = time.monotonic() + max_hold if max_hold is not None else None
        entry = _Entry(lease, lease.ttl * fraction, deadline)
        with self._cond:
            self._entries[id(lease)] = entry
            self._idle_sleep = min(3600.0, max(IDLE_MIN, entry.interval))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="taskguard-heartbeat", daemon=True)
                self._thread.start()
            if entry.next_due < self._wake_at:  # wake the thread only when it would sleep too long
                self.wakeups += 1
                self._cond.notify()

    def discard(self, lease: Lease) -> None:
        with self._cond:
            self._entries.pop(id(lease), None)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                # coalesce: a lease falling due within a quarter of its interval is renewed in
                # this round too (a little early), so leases taken close together share rounds;
                # leases whose locks object has a round in flight wait for it to finish
                due = [
                    e
                    for e in self._entries.values()
                    if e.next_due - COALESCE * e.interval <= now and id(e.lease.manager) not in self._in_flight
                ]
                if not due:
                    pending = [e.next_due for e in self._entries.values() if id(e.lease.manager) not in self._in_flight]
                    nxt = min(pending, default=None)
                    sleep = self._idle_sleep if nxt is None else max(nxt - now, 0.0)
                    self._wake_at = now + sleep
                    self._cond.wait(sleep)
                    self._wake_at = 0.0
                    continue
            try:
                self._beat(due)
            except Exception:  # never let the thread die
                log.exception("taskguard heartbeat round failed")
                with self._cond:
                    for e in due:
                        e.next_due = time.monotonic() + min(e.interval, ERROR_RETRY)

    def _beat(self, due: list[_Entry]) -> None:
        """Start one renewal round per locks object, each on its own pool thread, so a slow or
        unreachable Redis never delays the renewal of leases held in another."""
        self.beats += 1
        now = time.monotonic()
        groups: dict[int, list[_Entry]] = {}
        for e in due:
            lease = e.lease
            if lease.released or lease.marked_lost:
                self.discard(lease)
                continue
            if e.deadline is not None and now >= e.deadline:
                self.discard(lease)
                log.warning("lease %r passed max_hold; no longer renewed", lease.key)
                lease.manager.emitter.emit(
                    LeaseEvent(
                        "renew",
                        lease.key,
                        "max_hold",
                        fencing_token=lease.fencing_token,
                        ttl=lease.ttl,
                        holder=lease.holder,
                        task=lease.task,
                    )
                )
                continue
            groups.setdefault(id(lease.manager), []).append(e)
        if not groups:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="taskguard-renew")
        with self._cond:
            self._in_flight.update(groups)
        for group_id, entries in groups.items():
            self._executor.submit(self._renew_group, group_id, entries)

    def _renew_group(self, group_id: int, entries: list[_Entry]) -> None:
        try:
            manager = entries[0].lease.manager
            clock = manager.clock
            sent_mono, sent_wall, started = clock.monotonic(), clock.time(), time.monotonic()
            try:
                outcomes = manager.renew_many([(e.lease.key, e.lease.owner_token, e.lease.ttl) for e in entries])
            except Exception as exc:  # a bug or an unexpected error: report it per lease, keep going
                log.exception("taskguard renewal round failed")
                outcomes = [exc] * len(entries)
            took = time.monotonic() - started
            for e, outcome in zip(entries, outcomes, strict=True):
                try:
                    self._settle(e, outcome, (sent_mono, sent_wall), started, took)
                except Exception:
                    log.exception("taskguard could not settle the renewal of %r", e.lease.key)
        finally:
            with self._cond:
                self._in_flight.discard(group_id)
                self._cond.notify()

    def _settle(self, e: _Entry, outcome: object, sent: tuple[float, float], started: float, took: float) -> None:
        """``sent``: (monotonic, epoch) on the lease's clock when the round was sent; ``started``:
        ``time.monotonic()`` then (the heartbeat's own cadence)."""
        lease = e.lease
        if lease.released:  # released while the renewal was in flight: nothing to report
            self.discard(lease)
            return
        emitter = lease.manager.emitter
        emit = emitter.emit
        if outcome is True:
            lease.note_renewed(sent[0], sent[1], lease.ttl)
            with self._cond:
                # counted from when the round was sent, as the new expiry is: the cadence stays
                # one interval, not an interval plus the round trip and the settling
                e.next_due = started + e.interval
            if emitter.active:  # the common case: skip building events nobody reads
                emit(
                    LeaseEvent(
                        "renew",
                        lease.key,
                        "renewed",
                        took,
                        fencing_token=lease.fencing_token,
                        ttl=lease.ttl,
                        task=lease.task,
                    )
                )
        elif outcome is False:
            self.discard(lease)
            emit(
                LeaseEvent(
                    "renew",
                    lease.key,
                    "not_owner",
                    took,
                    fencing_token=lease.fencing_token,
                    ttl=lease.ttl,
                    task=lease.task,
                )
            )
            lease.mark_lost("renewal found another owner or no lease")
        else:
            emit(
                LeaseEvent(
                    "renew",
                    lease.key,
                    "error",
                    took,
                    fencing_token=lease.fencing_token,
                    ttl=lease.ttl,
                    error=str(outcome),
                    task=lease.task,
                )
            )
            if lease.presumed_expired():
                self.discard(lease)
                lease.mark_lost(f"renewal failed until the lease expired: {outcome}")
            else:
                log.warning("renewal of lease %r failed, retrying: %s", lease.key, outcome)
                with self._cond:
                    e.next_due = time.monotonic() + min(e.interval, ERROR_RETRY)


_heartbeat: Heartbeat | None = None
_heartbeat_lock = threading.Lock()


def get_heartbeat() -> Heartbeat:
    """The heartbeat of the current process (made on first use, and anew after ``fork``)."""
    global _heartbeat
    with _heartbeat_lock:
        if _heartbeat is None:
            _heartbeat = Heartbeat()
        return _heartbeat


def _after_fork_in_child() -> None:
    global _heartbeat, _heartbeat_lock
    _heartbeat = None  # the parent's thread does not exist here; inherited leases are dropped
    _heartbeat_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
