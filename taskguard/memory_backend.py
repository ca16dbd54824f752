"""The :class:`~taskguard.backend.Backend` in a dict, thread-safe: the same answers as
:class:`~taskguard.redis_backend.RedisBackend` (the test suite compares them), in this process only."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .backend import (
    AcquireReply,
    AcquireRequest,
    AcquireStatus,
    ClaimReply,
    ClaimRequest,
    Health,
    LeaseWrite,
    QueueReply,
    RateMode,
    RateReply,
    RateVerdict,
    RecordCondition,
    RenewItem,
    not_a_counter,
)
from .lease import HolderInfo, slot_of, slot_suffix
from .throttle import gcra

__all__ = ["MemoryBackend"]

_RATE_VERDICT = {1: RateVerdict.ALLOWED, 0: RateVerdict.DENIED, 2: RateVerdict.BOOKED}


class _Entry:
    __slots__ = ("owner", "fence", "holder", "since", "expires", "run")

    def __init__(self, owner: str, fence: int, holder: str, since: float, expires: float, run: str | None) -> None:
        self.owner, self.fence, self.holder, self.since, self.expires = owner, fence, holder, since, expires
        self.run = run


def _refused(cond: RecordCondition, cur: str | None, expect: str) -> bool:
    return (
        (cond is RecordCondition.ABSENT and cur is not None)
        or (cond is RecordCondition.EQ and cur != expect)
        or (cond is RecordCondition.ABSENT_OR_EQ and cur is not None and cur != expect)
    )


class MemoryBackend:
    """Leases, records, rates, completions and queue marks in this process.

    Args:
        clock: returns Unix epoch seconds (float): the one clock deciding expiry here.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._done: dict[tuple[str, str], float] = {}  # finished markers: (key, run id) -> until
        self._last_finished: dict[str, str] = {}  # key -> the last run recorded as finished on it
        self._releases = 0  # bumped by every release; a waiter sleeps only while it is unchanged
        self._seen = threading.local()
        self._records: dict[tuple[str, str], tuple[str, float | None]] = {}
        self._lease_records: dict[tuple[str, str], str] = {}  # (key, name) -> value, kept like the fence
        self._tats: dict[str, tuple[int, int]] = {}  # throttles: key -> (theoretical arrival time, pause end), µs
        self._shadow_tats: dict[str, tuple[int, int]] = {}  # the same, for shadow mode's calls (throttle(shadow=True))
        self._completions: dict[str, tuple[str, float]] = {}  # once=True: key -> (record, until)
        # unique: (key, task) -> (run id, until, the nonce of the call that marked it)
        self._queued: dict[tuple[str, str], tuple[str, float, str | None]] = {}
        self._cond = threading.Condition()
        self._leases: dict[tuple[str, int], _Entry] = {}  # (key, slot) -> its holder
        self._fences: dict[tuple[str, int], int] = {}  # (key, slot) -> its last fencing token
        self._slots: dict[str, int] = {}  # key -> slots in use, when more than one

    def server_time(self) -> float:
        return self._clock()

    def _live_entry(self, key: str, slot: int = 0) -> _Entry | None:
        e = self._leases.get((key, slot))
        if e is not None and self._clock() >= e.expires:
            del self._leases[(key, slot)]
            return None
        return e

    # -- leases --------------------------------------------------------------------------------
    def acquire(self, request: AcquireRequest, wait: float) -> AcquireReply:
        key, owner, run_id, limit = request.key, request.owner, request.run_id, request.limit
        finished_id = request.finished_id or run_id
        with self._cond:
            self._seen.releases = self._releases
            if request.refuse_finished and finished_id is not None:
                if (
                    request.markers and self._done.get((key, finished_id), 0) > self._clock()
                ) or self._last_finished.get(key) == finished_id:
                    return AcquireReply(AcquireStatus.FINISHED)
            slots = self._slots.get(key, 1)
            live: list[tuple[int, _Entry]] = []
            free = None
            for i in range(max(limit, slots)):
                e = self._live_entry(key, i)
                if e is not None:
                    if e.owner == owner + slot_suffix(i):
                        return AcquireReply(AcquireStatus.ACQUIRED, e.fence, slot=i)
                    live.append((i, e))
                elif free is None and i < limit:
                    free = i
            same = [e for _, e in live if run_id is not None and e.run == run_id]
            if same or len(live) >= limit or free is None:
                e = same[0] if same else min((e for _, e in live), key=lambda e: e.expires)
                run = e.run if same or len(live) == 1 else None
                return AcquireReply(AcquireStatus.HELD, None, max(0.0, e.expires - self._clock()), run)
            fence = self._fences.get((key, free), 0) + 1
            self._fences[(key, free)] = fence
            self._last_finished.pop(key, None)
            if finished_id is not None and not request.refuse_finished and request.markers:
                self._done.pop((key, finished_id), None)
            now = self._clock()
            self._leases[(key, free)] = _Entry(
                owner + slot_suffix(free), fence, request.holder_json, now, now + request.ttl, run_id
            )
            m = max([limit, free + 1] + [i + 1 for i, _ in live])
            if m > 1:
                self._slots[key] = m
            else:
                self._slots.pop(key, None)
            if request.queued_mark is not None:  # the run started: no longer queued (as ACQUIRE)
                task, marked = request.queued_mark
                if self._queued.get((key, task), ("",))[0] == marked:
                    del self._queued[(key, task)]
            return AcquireReply(AcquireStatus.ACQUIRED, fence, slot=free)

    def wait_signal(self, key: str, timeout: float) -> None:
        with self._cond:
            if getattr(self._seen, "releases", None) == self._releases:  # no release since the last try
                self._cond.wait(timeout)

    def renew(self, key: str, owner: str, ttl: float) -> bool:
        with self._cond:
            e = self._live_entry(key, slot_of(owner))
            if e is None or e.owner != owner:
                return False
            e.expires = max(e.expires, self._clock() + ttl)  # renewals only extend, as in Redis
            return True

    def renew_many(self, items: Sequence[RenewItem]) -> list[Any]:
        return [self.renew(key, owner, ttl) for key, owner, ttl in items]

    def release(self, key: str, owner: str, finished_run: str | None = None, finished_ttl: float | None = None) -> bool:
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

    def release_storing(
        self, key: str, owner: str, finished_run: str, finished_ttl: float | None, record: str, record_ttl: float
    ) -> bool:
        with self._cond:
            if self.get_completion(key) is None:  # the first completion stored stays
                self._completions[key] = (record, self._clock() + record_ttl)
            return self.release(key, owner, finished_run or None, finished_ttl)

    def claim(self, request: ClaimRequest) -> ClaimReply:
        # (an in-process store has no replicas: ``replicas`` has nothing to wait for)
        r = request
        with self._cond:
            e = self._live_entry(r.key, slot_of(r.owner))
            if e is None:
                return ClaimReply(False, expired=True)
            if e.owner != r.owner:
                return ClaimReply(False, None, max(0.0, e.expires - self._clock()))
            e.owner, e.holder, e.expires, e.run = r.new_owner, r.holder_json, self._clock() + r.ttl, r.run_id
            return ClaimReply(True, e.fence)

    def force_release(self, key: str) -> bool:
        return self._release_slots(key, None)

    def release_run(self, key: str, run_id: str, fencing_token: int | None = None) -> bool:
        return self._release_slots(key, run_id, fencing_token)

    def _release_slots(self, key: str, run_id: str | None, fence: int | None = None) -> bool:
        """Release the slot held by ``run_id`` (the first found; with ``fence``, only a lease
        carrying that fencing token), or every slot (``None``)."""
        with self._cond:
            done = False
            for i in range(self._slots.get(key, 1)):
                e = self._live_entry(key, i)
                if e is not None and (run_id is None or e.run == run_id) and (fence is None or e.fence == fence):
                    del self._leases[(key, i)]
                    done = True
                    if run_id is not None:
                        break
            if done:
                self._releases += 1
                self._cond.notify_all()
            return done

    def holders(self, key: str) -> list[HolderInfo]:
        with self._cond:
            out = []
            for i in range(self._slots.get(key, 1)):
                e = self._live_entry(key, i)
                if e is not None:
                    out.append(
                        HolderInfo(
                            key=key,
                            holder=json.loads(e.holder),
                            fencing_token=e.fence,
                            ttl=max(0.0, e.expires - self._clock()),
                            since=e.since,
                            run_id=e.run,
                            slot=i,
                        )
                    )
            return out

    def owns(self, key: str, owner: str) -> bool:
        with self._cond:
            e = self._live_entry(key, slot_of(owner))
            return e is not None and e.owner == owner

    # -- records ---------------------------------------------------------------------------------
    def _live_record(self, key: str, name: str) -> str | None:
        value, until = self._records.get((key, name), (None, None))
        if value is not None and until is not None and until <= self._clock():
            del self._records[(key, name)]
            return None
        return value

    def put_lease_record(
        self, key: str, owner: str, name: str, value: str, cond: RecordCondition, expect: str
    ) -> LeaseWrite:
        with self._cond:
            e = self._live_entry(key, slot_of(owner))
            if e is None or e.owner != owner:
                return LeaseWrite.NOT_HELD
            cur = self._lease_records.get((key, name))
            if cur == value:
                return LeaseWrite.WRITTEN
            if _refused(cond, cur, expect):
                return LeaseWrite.REFUSED
            self._lease_records[(key, name)] = value
            return LeaseWrite.WRITTEN

    def get_lease_record(self, key: str, name: str) -> str | None:
        with self._cond:
            return self._lease_records.get((key, name))

    def put_record(self, key: str, name: str, value: str, ttl: float, cond: RecordCondition, expect: str) -> bool:
        with self._cond:
            if _refused(cond, self._live_record(key, name), expect):
                return False
            self._records[(key, name)] = (value, self._clock() + ttl)
            return True

    def get_record(self, key: str, name: str) -> str | None:
        with self._cond:
            return self._live_record(key, name)

    def delete_record(self, key: str, name: str, expect: str) -> bool:
        with self._cond:
            cur = self._live_record(key, name)
            if cur is None or (expect and cur != expect):
                return False
            del self._records[(key, name)]
            return True

    def count_record(self, key: str, name: str, by: int, ttl: float | None) -> int:
        with self._cond:
            cur = self._live_record(key, name)
            until = self._records.get((key, name), (None, None))[1]
            try:
                total = int(cur or 0) + by
            except ValueError:
                raise not_a_counter(key, name) from None
            if not -(2**63) <= total < 2**63:
                raise not_a_counter(key, name)
            self._records[(key, name)] = (str(total), self._clock() + ttl if ttl is not None else until)
            return total

    # -- completions, queue marks, rates -----------------------------------------------------------
    def get_completion(self, key: str) -> str | None:
        with self._cond:
            record, until = self._completions.get(key, (None, 0.0))
            if record is not None and until <= self._clock():
                del self._completions[key]
                return None
            return record

    def mark_queued(self, key: str, run_id: str, ttl: float, task: str, nonce: str | None = None) -> QueueReply:
        with self._cond:
            queued = self._queued.get((key, task))
            if queued is not None and queued[1] > self._clock():
                return QueueReply(False, queued[0])
            for i in range(self._slots.get(key, 1)):
                e = self._live_entry(key, i)
                meta = json.loads(e.holder) if e is not None else None
                if isinstance(meta, dict) and task in (meta.get("task"), meta.get("job")):
                    found = meta.get("task_id") or meta.get("job_id")
                    if isinstance(found, str) and found:
                        return QueueReply(False, found)
            self._queued[(key, task)] = (run_id, self._clock() + ttl, nonce)
            return QueueReply(True, run_id)

    def clear_queued(self, key: str, run_id: str, task: str, written_by: str | None = None) -> bool:
        with self._cond:
            queued = self._queued.get((key, task))
            if queued is not None and queued[0] == run_id and (not written_by or queued[2] == written_by):
                del self._queued[(key, task)]
                return True
            return False

    def throttle(
        self,
        key: str,
        interval_us: int,
        tau_us: int,
        book_us: int,
        consume: bool,
        shadow: bool,
        cost: int = 1,
        mode: RateMode = RateMode.CALL,
    ) -> RateReply:
        states = self._shadow_tats if shadow else self._tats
        with self._cond:
            now_us = int(self._clock() * 1e6)
            tat, pause = states.get(key, (0, 0))
            code, wait, remaining, paused, keep = gcra(
                tat, pause, now_us, interval_us, tau_us, book_us, mode if consume else RateMode.PEEK, cost
            )
            if keep is not None:
                states[key] = keep
            return RateReply(_RATE_VERDICT[code], wait, remaining, paused)

    # -- health, life cycle ------------------------------------------------------------------------
    def check_health(self) -> Health:
        return Health(True, 0.0, "in-process")

    def close(self) -> None:
        pass
