"""In-process leases with the same behaviour as :class:`~taskguard.RedisLocks`.

For users' unit tests where the lease is not the subject: no Redis needed, same API, same
outcomes (the test suite drives both with one hypothesis state machine and compares them).
Leases live in this process only, so it gives no mutual exclusion across processes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable

from .clock import LOCAL, FixedClock
from .events import Listener
from .lease import HolderInfo, slot_of, slot_suffix
from .locks import Health, Locks

__all__ = ["MemoryLocks"]


class _Entry:
    __slots__ = ("owner", "fence", "holder", "since", "expires", "run")

    def __init__(self, owner: str, fence: int, holder: str, since: float, expires: float, run: str | None) -> None:
        self.owner, self.fence, self.holder, self.since, self.expires = owner, fence, holder, since, expires
        self.run = run


class MemoryLocks(Locks):
    """Fenced leases in a dict, thread-safe.

    Args:
        clock: returns Unix epoch seconds (float); default :func:`time.time`. Inject one to
            drive expiry in tests without sleeping: it then also measures how long handles
            presume their leases held (:class:`taskguard.clock.FixedClock`); the default keeps
            those durations on ``time.monotonic``.
        prefix, renew_fraction, max_hold, listeners: as for :class:`~taskguard.RedisLocks`.
    """

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
        super().__init__(prefix=prefix, renew_fraction=renew_fraction, max_hold=max_hold,
                         shutdown_timeout=shutdown_timeout, listeners=listeners)
        self._done: dict[tuple[str, str], float] = {}  # finished markers: (key, run id) -> until
        self._last_finished: dict[str, str] = {}  # key -> the last run recorded as finished on it
        self._releases = 0  # bumped by every release; a waiter sleeps only while it is unchanged
        self._seen = threading.local()
        self._records: dict[tuple[str, str], tuple[str, float | None]] = {}
        self._lease_records: dict[tuple[str, str], str] = {}  # (key, name) -> value, kept like the fence
        self._tats: dict[str, int] = {}  # throttles: key -> theoretical arrival time, µs
        self._shadow_tats: dict[str, int] = {}  # the same, for shadow mode's calls (throttle(shadow=True))
        self._completions: dict[str, tuple[str, float]] = {}  # once=True: key -> (record, until)
        self._queued: dict[tuple[str, str], tuple[str, float]] = {}  # unique: (key, task) -> (run id, until)
        self._clock = clock
        self.clock = LOCAL if clock is time.time else FixedClock(clock)
        self._cond = threading.Condition()
        self._leases: dict[tuple[str, int], _Entry] = {}  # (key, slot) -> its holder
        self._fences: dict[tuple[str, int], int] = {}  # (key, slot) -> its last fencing token
        self._slots: dict[str, int] = {}  # key -> slots in use, when more than one

    def __repr__(self) -> str:
        return f"<MemoryLocks prefix={self.prefix!r}>"

    def _now(self) -> float:
        return self._clock()

    def server_time(self) -> float:
        """This backend's clock (the injected one): Unix epoch seconds (float)."""
        return self._clock()

    def _live_entry(self, key: str, slot: int = 0) -> _Entry | None:
        e = self._leases.get((key, slot))
        if e is not None and self._clock() >= e.expires:
            del self._leases[(key, slot)]
            return None
        return e

    def _try_acquire(self, key: str, owner: str, ttl: float, holder_json: str, run_id: str | None,
                     wait: float = 0.0, refuse_finished: bool = False, finished_id: str | None = None,
                     markers: bool = True, limit: int = 1) -> tuple[int, int | None, float | None, str | None, int]:
        finished_id = finished_id or run_id
        with self._cond:
            self._seen.releases = self._releases
            if refuse_finished and finished_id is not None:
                if (markers and self._done.get((key, finished_id), 0) > self._clock()) or \
                        self._last_finished.get(key) == finished_id:
                    return 2, None, None, None, 0
            slots = self._slots.get(key, 1)
            live: list[tuple[int, _Entry]] = []
            free = None
            for i in range(max(limit, slots)):
                e = self._live_entry(key, i)
                if e is not None:
                    if e.owner == owner + slot_suffix(i):
                        return 1, e.fence, None, None, i
                    live.append((i, e))
                elif free is None and i < limit:
                    free = i
            same = [e for _, e in live if run_id is not None and e.run == run_id]
            if same or len(live) >= limit or free is None:
                e = same[0] if same else min((e for _, e in live), key=lambda e: e.expires)
                run = e.run if same or len(live) == 1 else None
                return 0, None, max(0.0, e.expires - self._clock()), run, 0
            fence = self._fences.get((key, free), 0) + 1
            self._fences[(key, free)] = fence
            self._last_finished.pop(key, None)
            if finished_id is not None and not refuse_finished and markers:
                self._done.pop((key, finished_id), None)
            now = self._clock()
            self._leases[(key, free)] = _Entry(owner + slot_suffix(free), fence, holder_json, now, now + ttl, run_id)
            m = max([limit, free + 1] + [i + 1 for i, _ in live])
            if m > 1:
                self._slots[key] = m
            else:
                self._slots.pop(key, None)
            return 1, fence, None, None, free

    def _wait_signal(self, key: str, timeout: float) -> None:
        with self._cond:
            if getattr(self._seen, "releases", None) == self._releases:  # no release since the last try
                self._cond.wait(timeout)

    def _renew_one(self, key: str, owner: str, ttl: float) -> bool:
        with self._cond:
            e = self._live_entry(key, slot_of(owner))
            if e is None or e.owner != owner:
                return False
            e.expires = max(e.expires, self._clock() + ttl)  # renewals only extend, as in Redis
            return True

    def _release_one(self, key: str, owner: str, finished_run: str | None = None,
                     finished_ttl: float | None = None) -> bool:
        with self._cond:
            if finished_run is not None and finished_ttl is not None:
                self._done[(key, finished_run)] = self._clock() + finished_ttl
            e = self._live_entry(key, slot_of(owner))
            if e is None or e.owner != owner:
                return False
            del self._leases[(key, slot_of(owner))]
            if finished_run is not None:
                self._last_finished[key] = finished_run
            self._releases += 1
            self._cond.notify_all()
            return True

    def _release_storing_one(self, key: str, owner: str, finished_run: str, finished_ttl: float | None,
                             record: str, record_ttl: float) -> bool:
        with self._cond:
            if self._get_completion(key) is None:  # the first completion stored stays
                self._completions[key] = (record, self._clock() + record_ttl)
            return self._release_one(key, owner, finished_run or None, finished_ttl)

    def _mark_queued_one(self, key: str, run_id: str, ttl: float, task: str) -> tuple[bool, str]:
        with self._cond:
            queued = self._queued.get((key, task))
            if queued is not None and queued[1] > self._clock():
                return False, queued[0]
            for i in range(self._slots.get(key, 1)):
                e = self._live_entry(key, i)
                meta = json.loads(e.holder) if e is not None else None
                if isinstance(meta, dict) and task in (meta.get("task"), meta.get("job")):
                    found = meta.get("task_id") or meta.get("job_id")
                    if isinstance(found, str) and found:
                        return False, found
            self._queued[(key, task)] = (run_id, self._clock() + ttl)
            return True, run_id

    def _clear_queued_one(self, key: str, run_id: str, task: str) -> bool:
        with self._cond:
            queued = self._queued.get((key, task))
            if queued is not None and queued[0] == run_id:
                del self._queued[(key, task)]
                return True
            return False

    def _get_completion(self, key: str) -> str | None:
        with self._cond:
            record, until = self._completions.get(key, (None, 0.0))
            if record is not None and until <= self._clock():
                del self._completions[key]
                return None
            return record

    def _claim_one(self, key: str, owner: str, new_owner: str, ttl: float, holder_json: str,
                   run_id: str | None = None) -> tuple[bool, int | None, float | None]:
        with self._cond:
            e = self._live_entry(key, slot_of(owner))
            if e is None:
                return False, None, -2.0
            if e.owner != owner:
                return False, None, max(0.0, e.expires - self._clock())
            e.owner, e.holder, e.expires, e.run = new_owner, holder_json, self._clock() + ttl, run_id
            return True, e.fence, None

    def _force_release_one(self, key: str) -> bool:
        return self._release_slots(key, None)

    def _release_run(self, key: str, run_id: str) -> bool:
        return self._release_slots(key, run_id)

    def _release_slots(self, key: str, run_id: str | None) -> bool:
        """Release the slot held by ``run_id`` (the first found), or every slot (``None``)."""
        with self._cond:
            done = False
            for i in range(self._slots.get(key, 1)):
                e = self._live_entry(key, i)
                if e is not None and (run_id is None or e.run == run_id):
                    del self._leases[(key, i)]
                    done = True
                    if run_id is not None:
                        break
            if done:
                self._releases += 1
                self._cond.notify_all()
            return done

    def _holders_one(self, key: str) -> list[HolderInfo]:
        with self._cond:
            out = []
            for i in range(self._slots.get(key, 1)):
                e = self._live_entry(key, i)
                if e is not None:
                    out.append(HolderInfo(key=key, holder=json.loads(e.holder), fencing_token=e.fence,
                                          ttl=max(0.0, e.expires - self._clock()), since=e.since, run_id=e.run,
                                          slot=i))
            return out

    def _owns_one(self, key: str, owner: str) -> bool:
        with self._cond:
            e = self._live_entry(key, slot_of(owner))
            return e is not None and e.owner == owner

    def _live_record(self, key: str, name: str) -> str | None:
        value, until = self._records.get((key, name), (None, None))
        if value is not None and until is not None and until <= self._clock():
            del self._records[(key, name)]
            return None
        return value

    def _throttle_one(self, key: str, interval_us: int, tau_us: int, book_us: int,
                      consume: bool = True, shadow: bool = False) -> tuple[int, int, int]:
        from .throttle import gcra

        tats = self._shadow_tats if shadow else self._tats
        with self._cond:
            now_us = int(self._clock() * 1e6)
            code, wait, remaining, new_tat = gcra(tats.get(key), now_us, interval_us, tau_us, book_us)
            if new_tat is not None and consume:
                tats[key] = new_tat
            return code, wait, remaining

    def _put_lease_record_one(self, key: str, owner: str, name: str, value: str, cond: str, expect: str) -> int:
        with self._cond:
            e = self._live_entry(key, slot_of(owner))
            if e is None or e.owner != owner:
                return -1
            cur = self._lease_records.get((key, name))
            if cur == value:
                return 1
            if (cond == "absent" and cur is not None) or (cond == "eq" and cur != expect) or \
                    (cond == "absent_or_eq" and cur is not None and cur != expect):
                return 0
            self._lease_records[(key, name)] = value
            return 1

    def _get_lease_record(self, key: str, name: str) -> str | None:
        with self._cond:
            return self._lease_records.get((key, name))

    def _put_record(self, key: str, name: str, value: str, ttl: float, cond: str, expect: str) -> bool:
        with self._cond:
            cur = self._live_record(key, name)
            if (cond == "absent" and cur is not None) or (cond == "eq" and cur != expect) or \
                    (cond == "absent_or_eq" and cur is not None and cur != expect):
                return False
            self._records[(key, name)] = (value, self._clock() + ttl)
            return True

    def _get_record(self, key: str, name: str) -> str | None:
        with self._cond:
            return self._live_record(key, name)

    def _delete_record(self, key: str, name: str, expect: str) -> bool:
        with self._cond:
            cur = self._live_record(key, name)
            if cur is None or (expect and cur != expect):
                return False
            del self._records[(key, name)]
            return True

    def _count_record(self, key: str, name: str, by: int, ttl: float | None) -> int:
        with self._cond:
            cur = self._live_record(key, name)
            until = self._records.get((key, name), (None, None))[1]
            try:
                total = int(cur or 0) + by
            except ValueError:
                raise self._not_a_counter(key, name) from None
            if not -2**63 <= total < 2**63:
                raise self._not_a_counter(key, name)
            self._records[(key, name)] = (str(total), self._clock() + ttl if ttl is not None else until)
            return total

    def check_health(self) -> Health:
        """Always healthy (nothing to reach)."""
        return Health(True, 0.0, "in-process")
