"""The periodic-schedule protocol: several scheduler processes, each due slot published once.

:class:`PeriodicScheduler` is framework-free; an adapter (Celery beat's
:class:`taskguard_celery.beat.SingletonBeatMixin`, an RQ cron scheduler) describes its entries as
:class:`PeriodicEntry` values and publishes a :class:`Slot` when told to (:class:`ScheduleAdapter`).

* **Leader lease.** Only the scheduler holding the leader lease (key ``<role>-leader:<name>``,
  ``settings.leader_ttl`` seconds, renewed by the heartbeat thread) publishes. Every scheduler
  seeks it on every tick (:meth:`PeriodicScheduler.leader`), so a standby takes over within one
  leader TTL plus one loop after the leader dies; a follower says once, at INFO level, that it
  waits and who leads. A lease the handle presumes lost is released, so the next acquire (its own
  or a standby's) does not wait for its TTL.
* **Slots** (:mod:`taskguard.schedule.slots`): computed from the schedule and the clock, never from
  a process's memory of the last run. The first run of an entry that never ran anywhere is the
  first slot after the scheduler started.
* **Claims** (:mod:`taskguard.schedule.claims`): claim, publish, confirm, fenced by the leader
  lease; a slot claimed but not confirmed is published again (the worker runs a slot once: the
  message names it, see :func:`slot_run`).
* **Catch-up.** A slot is published while it is at most ``settings.allowed_lateness`` late: a new
  leader publishes the most recent slot that fell due during the hand-over; older ones are logged
  and counted as missed (``stats["missed_slots"]``).
* **Clocks.** Instants and lateness are read on :attr:`PeriodicScheduler.clock` (default: the
  lease backend's server clock, refreshed once per tick); retry delays on its monotonic clock.
* **Outages.** A Redis outage or a lost leader lease never raises out of the scheduler: it stops
  publishing, logs it, and resumes (catching up the latest slot within the window).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ..clock import Clock
from ..errors import LeaseBackendError, LeaseLost, Unreplicated
from ..lease import Lease
from ..locks import Locks
from .claims import PUBLISHED, claim, confirm, read_record
from .settings import ScheduleSettings
from .slots import SLOT_KEEP_MIN, Schedule

__all__ = ["PeriodicEntry", "PeriodicScheduler", "ScheduleAdapter", "Slot", "slot_run"]


#: What :attr:`PeriodicScheduler._seen` holds while the leader lease is given back unreplicated.
_UNREPLICATED = "\x00unreplicated"


@dataclasses.dataclass(frozen=True)
class PeriodicEntry:
    """One entry as the core sees it: its ``name`` (unique per scheduler), its ``schedule``
    (:class:`~taskguard.schedule.slots.Schedule`), the guard ``options`` its runs carry (checked
    with :func:`taskguard.schedule.options.check_entry_options`) and the adapter's own entry
    (``target``)."""

    name: str
    schedule: Schedule
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    target: Any = None


@dataclasses.dataclass(frozen=True)
class Slot:
    """A claimed slot to publish: the entry's name, the slot's name (``id``), its ``instant``
    (Unix seconds), ``keep`` (seconds the worker remembers its run finished), the leader lease's
    key and fencing token it was claimed under, and the entry's guard ``options``."""

    entry: str
    id: str
    instant: float
    keep: float
    leader_key: str
    leader_fence: int | None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def header(self) -> dict[str, Any]:
        """What the published message carries (JSON-safe): ``leader_key``, ``leader_fence``,
        ``entry``, ``slot``, ``keep`` and the entry's guard options (read back by
        :func:`slot_run` and :func:`taskguard.schedule.options.apply_entry_options`)."""
        return {
            "leader_key": self.leader_key,
            "leader_fence": self.leader_fence,
            "entry": self.entry,
            "slot": self.id,
            "keep": self.keep,
            **self.options,
        }


def slot_run(header: Mapping[str, Any], prefix: str = "beat") -> tuple[str, float] | None:
    """``(run id, seconds to remember it finished)`` of a slot message's header
    (:meth:`Slot.header`), or ``None`` when it does not name a slot: every message published for
    one slot has the same run id (``"<prefix>:<entry>:<slot>"``), so a slot published twice
    (claimed, then published again by the next leader) runs once. A missing or bad ``keep`` is
    :data:`~taskguard.schedule.slots.SLOT_KEEP_MIN`."""
    entry, slot, keep = header.get("entry"), header.get("slot"), header.get("keep")
    if not isinstance(entry, str) or not entry or not isinstance(slot, str) or not slot:
        return None
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not math.isfinite(keep) or keep <= 0:
        keep = SLOT_KEEP_MIN
    return f"{prefix}:{entry}:{slot}", float(keep)


class ScheduleAdapter(Protocol):
    """What a framework's scheduler gives the core."""

    def entries(self) -> Iterable[PeriodicEntry]:
        """The entries, as they are now."""
        ...

    def publish(self, entry: PeriodicEntry, slot: Slot) -> Any:
        """Publish the run of ``entry`` for the claimed ``slot`` (its message carrying
        :meth:`Slot.header`); raise when it was not published."""
        ...


class PeriodicScheduler:
    """The leader lease, slot claims and catch-up of one scheduler process (module docstring).

    Args:
        locks: the lease backend.
        settings: checked settings (:func:`taskguard.schedule.settings.schedule_settings`).
        adapter: the framework's side (:class:`ScheduleAdapter`); needed by :meth:`tick` and by
            :meth:`publish` without ``send``.
        clock: time source (default: ``locks.server_clock()``).
        role: names the leader lease (``<role>-leader:<settings.name>``), the holder, the log
            lines and the logger (``taskguard.<role>``: ``taskguard.beat`` for Celery beat).
        on_lead: called when this scheduler becomes the leader (every entry is due for a look).
        on_retry: called when a claim or publish failed and the entry is looked at again soon.
    """

    def __init__(
        self,
        locks: Locks,
        settings: ScheduleSettings,
        *,
        adapter: ScheduleAdapter | None = None,
        clock: Clock | None = None,
        role: str = "beat",
        on_lead: Callable[[], None] | None = None,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        self.locks, self.settings, self.adapter, self.role = locks, settings, adapter, role
        self.clock: Clock = locks.server_clock() if clock is None else clock
        self.leader_key = f"{role}-leader:{settings.name}"
        self.log = logging.getLogger(f"taskguard.{role}")
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.stats: collections.Counter[str] = collections.Counter()
        self.lease: Lease | None = None
        self._on_lead, self._on_retry = on_lead, on_retry
        self._seen: str | None = None  # the leader last reported
        self._handled: dict[str, float] = {}  # entry name -> latest slot instant known handled
        self._retry_at: dict[str, float] = {}  # entry name -> when (monotonic) a failed claim/publish is retried
        self._outage = False
        self._unreplicated: dict[str, float] = {}  # entry name -> slot instant whose claim was not acknowledged
        self.started = self.now()

    # -- time ---------------------------------------------------------------------------------------
    def now(self) -> float:
        """The current instant, Unix seconds (float), on :attr:`clock`."""
        return self.clock.time()

    def refresh(self) -> None:
        """Read the clock's source again (once per tick). Never raises."""
        self.clock.refresh()

    # -- leadership ---------------------------------------------------------------------------------
    def is_leader(self) -> bool:
        """Does this scheduler hold the leader lease, as far as it knows (no round trip)?"""
        lease = self.lease
        return lease is not None and not lease.lost and not lease.released

    def leader(self) -> Lease | None:
        """The leader lease if this scheduler holds it (acquiring it when free), else ``None``.
        Never raises for an outage (logged once, counted in ``stats["redis_errors"]``)."""
        lease = self.lease
        if lease is not None and not lease.lost and not lease.released:
            return lease
        if lease is not None:
            self.log.warning(
                "%s %s lost the leader lease (%s); not publishing until it is back",
                self.role,
                self.id,
                lease.lost_reason,
            )
            self.stats["leadership_lost"] += 1
            self.lease = None
            self._give_up(lease)
        try:
            acq = self.locks.acquire(
                self.leader_key, ttl=self.settings.leader_ttl, renew=True, holder={self.role: self.id}, run_id=self.id
            )
        except LeaseBackendError as e:
            self._note_outage(e)
            return None
        self._note_recovered()
        if not acq.acquired and acq.reason == "unreplicated":
            if self._seen != _UNREPLICATED:  # once, until something else is seen (as an outage)
                self.log.warning(
                    "%s %s: took the leader lease but the replicas did not acknowledge it in time; gave it back "
                    "(not publishing; trying again every loop)",
                    self.role,
                    self.id,
                )
                self._seen = _UNREPLICATED
            self.stats["unreplicated"] += 1
            return None
        if not acq.acquired:
            leader = acq.holder_run or "unknown"
            if leader != self._seen:
                self.log.info(
                    "%s %s is waiting: %s %s leads (%s); it takes over within %gs if that one stops",
                    self.role,
                    self.id,
                    self.role,
                    leader,
                    self.leader_key,
                    self.settings.leader_ttl + self.settings.loop_interval,
                )
                self._seen = leader
            return None
        assert acq.lease is not None
        self.lease, self._seen = acq.lease, self.id
        self.log.warning("%s %s is the leader (fencing token %s)", self.role, self.id, acq.lease.fencing_token)
        if self._on_lead is not None:
            self._on_lead()  # every entry is looked at again now: catch-up of the hand-over
        return acq.lease

    def _give_up(self, lease: Lease) -> None:
        """Release a leader lease this scheduler no longer counts on (it stops renewing it either
        way): were it still held in Redis, keeping it would make the next acquire wait for its
        TTL. A release of a lease already gone does nothing."""
        if lease.released:
            return
        try:
            lease.release()
        except LeaseBackendError as e:  # it expires by its TTL (the heartbeat no longer renews it)
            self.log.warning("%s %s could not release the leader lease it gave up: %s", self.role, self.id, e)

    def _note_outage(self, error: Exception) -> None:
        if not self._outage:
            self.log.error("%s %s: Redis unreachable, not publishing until it is back: %s", self.role, self.id, error)
        self._outage = True
        self.stats["redis_errors"] += 1

    def _note_recovered(self) -> None:
        if self._outage:
            self.log.warning("%s %s: Redis is back", self.role, self.id)
        self._outage = False

    # -- when entries are due -----------------------------------------------------------------------
    def latest(self, entry: PeriodicEntry, now: float) -> tuple[float | None, float] | None:
        """``(latest due instant within the allowed lateness, seconds to the next)`` at ``now``
        (Unix seconds), or ``None`` for a schedule that cannot say (``NotImplementedError``)."""
        try:
            return entry.schedule.latest(now, self.settings.allowed_lateness + self.settings.loop_interval)
        except NotImplementedError:
            return None

    def due(self, entry: PeriodicEntry) -> tuple[bool, float] | None:
        """``(due, seconds to look again)``: due when the latest instant the entry fell due at is
        one this scheduler has not handled, is at most the allowed lateness ago, and this
        scheduler leads. ``None`` for a schedule that cannot name its instants."""
        now = self.now()
        latest = self.latest(entry, now)
        if latest is None:
            return None
        instant, next_in = latest
        if not self.is_leader():
            # a follower looks again every loop, so that a take-over finds the entry due
            return False, min(next_in, self.settings.loop_interval)
        if instant is None or instant <= self._handled.get(entry.name, -math.inf) + entry.schedule.slack:
            return False, next_in
        late = now - instant
        if late > self.settings.allowed_lateness:
            self._missed(entry, instant, late)
            return False, next_in
        retry_in = self._retry_at.get(entry.name, -math.inf) - self.clock.monotonic()
        if retry_in > 0:  # its claim or publish just failed: try again soon, not at the next slot
            return False, retry_in
        return True, next_in

    def _try_again(self, entry: PeriodicEntry) -> None:
        """A claim or publish failed (Redis, the broker): look at the entry again in a second
        (while the slot is within the allowed lateness) instead of at its next slot."""
        self._retry_at[entry.name] = self.clock.monotonic() + min(1.0, self.settings.loop_interval)
        if self._on_retry is not None:
            self._on_retry()

    def _missed(self, entry: PeriodicEntry, instant: float, late: float) -> None:
        """Log a slot found beyond the catch-up window. It is counted in ``missed_slots`` (with any
        others since the entry's last handled slot) when the entry's next slot is published: the
        slot record tells how many fell due meanwhile."""
        if instant > self._handled.get(entry.name, -math.inf) + entry.schedule.slack:
            self.log.warning(
                "%s %s: %s slot %s fell due %.1fs ago, beyond the catch-up window (%gs); not published",
                self.role,
                self.id,
                entry.name,
                entry.schedule.slot_id(instant),
                late,
                self.settings.allowed_lateness,
            )
            self._handled[entry.name] = instant

    # -- claim, publish, confirm ----------------------------------------------------------------------
    def publish(
        self,
        entry: PeriodicEntry,
        send: Callable[[PeriodicEntry, Slot], Any] | None = None,
        before: Callable[[float | None], None] | None = None,
    ) -> Any:
        """Claim the entry's due slot, publish it with ``send`` (default: the adapter's
        :meth:`~ScheduleAdapter.publish`), confirm it. Returns what ``send`` returned, or ``None``
        when nothing was published (not the leader; the slot handled, missed, or claimed meanwhile;
        an outage or a failed publish, then tried again within a second). ``before(instant)`` is
        called once this scheduler is known to lead (the adapter moves its entry on). Never raises
        for an outage, a lost lease or a failed publish (logged and counted in :attr:`stats`)."""
        now = self.now()
        latest = self.latest(entry, now)
        instant: float | None = float(round(now)) if latest is None else latest[0]
        leader = self.leader()
        if leader is None:
            # not ours to publish, nor to move on: a schedule shared through Redis would
            # otherwise look already run to the leader
            self.log.debug("%s %s is not the leader; %s left to the leader", self.role, self.id, entry.name)
            return None
        if before is not None:
            before(instant)
        sched = entry.schedule
        if instant is None or instant <= self._handled.get(entry.name, -math.inf) + sched.slack:
            return None
        if now - instant > self.settings.allowed_lateness:
            self._missed(entry, instant, now - instant)
            return None
        slot = sched.slot_id(instant)
        try:
            cur = read_record(self.locks, self.leader_key, entry.name)
            if cur.raw is not None and abs(cur.instant - instant) <= sched.slack:
                instant = cur.instant  # the recorded instant names the slot
                slot = sched.slot_id(instant)
            if cur.raw is None and instant < self.started:
                # never run anywhere (no record): the first run is the first slot after the start
                self._handled[entry.name] = instant
                return None
            if cur.instant > instant or (cur.instant == instant and cur.state == PUBLISHED):
                self._handled[entry.name] = max(cur.instant, instant)
                return None
            if cur.raw is not None and cur.instant < instant:
                skipped = sched.count_between(cur.instant, instant)
                if skipped:
                    self.log.warning(
                        "%s %s: %d earlier slot(s) of %s fell due since its last handled one and were not "
                        "published (a hand-over publishes only the latest slot within the catch-up window, "
                        "%gs); publishing the latest, %s",
                        self.role,
                        self.id,
                        skipped,
                        entry.name,
                        self.settings.allowed_lateness,
                        slot,
                    )
                    self.stats["missed_slots"] += skipped
            if cur.instant == instant and self._unreplicated.get(entry.name) == instant and cur.by == self.id:
                pass  # this scheduler's own claim, not acknowledged by the replicas: never published
            elif cur.instant == instant:
                self.log.warning(
                    "%s %s: %s slot %s was claimed (leader fence %s) but not confirmed published; "
                    "publishing it again (the worker runs a slot once)",
                    self.role,
                    self.id,
                    entry.name,
                    slot,
                    cur.fence,
                )
                self.stats["republished_slots"] += 1
            claimed = claim(leader, entry.name, instant, self.id, cur)
            if claimed is None:
                return None  # the record changed under us (another call of this scheduler): look again next tick
        except LeaseLost as e:
            self.log.warning(
                "%s %s: lost the leader lease before claiming %s slot %s (%s)", self.role, self.id, entry.name, slot, e
            )
            return None
        except Unreplicated as e:  # Redis answered: no outage, but not published on a claim a failover may lose
            self.log.warning(
                "%s %s: the claim of %s slot %s was not acknowledged by the replicas in time; not publishing "
                "it yet (tried again in a second): %s",
                self.role,
                self.id,
                entry.name,
                slot,
                e,
            )
            self.stats["unreplicated"] += 1
            self._unreplicated[entry.name] = instant
            self._try_again(entry)
            return None
        except LeaseBackendError as e:
            self._note_outage(e)
            self._try_again(entry)
            return None
        claimed_slot = Slot(
            entry=entry.name,
            id=slot,
            instant=instant,
            keep=sched.keep,
            leader_key=self.leader_key,
            leader_fence=leader.fencing_token,
            options=entry.options,
        )
        self.log.info(
            "%s %s: publishing %s slot %s (%.1fs after it fell due)",
            self.role,
            self.id,
            entry.name,
            slot,
            now - instant,
        )
        try:
            if send is None:
                if self.adapter is None:
                    raise RuntimeError("PeriodicScheduler.publish needs send= or an adapter")
                send = self.adapter.publish
            result = send(entry, claimed_slot)
        except Exception as e:
            self.log.error(
                "%s %s: slot %s of %s claimed but not published (tried again in a second): %s",
                self.role,
                self.id,
                slot,
                entry.name,
                e,
            )
            self.stats["unpublished_slots"] += 1
            self._try_again(entry)
            return None
        self.stats["published"] += 1
        self._unreplicated.pop(entry.name, None)
        self._handled[entry.name] = instant
        self._retry_at.pop(entry.name, None)
        try:
            confirm(leader, entry.name, instant, self.id, claimed)
        except (LeaseLost, LeaseBackendError) as e:
            # the next leader publishes it again; the worker runs the slot once
            self.log.warning(
                "%s %s: %s slot %s published but not confirmed: %s", self.role, self.id, entry.name, slot, e
            )
        return result

    # -- a whole loop, for adapters without one of their own ----------------------------------------------
    def tick(self) -> float:
        """One loop over the adapter's entries: read the clock, seek leadership, publish every due
        slot. Returns the seconds to sleep before the next tick (at most the loop interval)."""
        assert self.adapter is not None, "PeriodicScheduler.tick needs an adapter"
        self.refresh()
        self.leader()
        delay = self.settings.loop_interval
        for entry in self.adapter.entries():
            due = self.due(entry)
            if due is None:
                continue  # a schedule that cannot name its instants is never published by the core
            is_due, next_in = due
            if is_due:
                self.publish(entry)
                again = self.due(entry)
                next_in = next_in if again is None else again[1]
            delay = min(delay, next_in)
        return max(delay, 0.0)

    def close(self) -> None:
        """Release the leader lease (a standby takes over at once). Never raises for an outage."""
        lease, self.lease = self.lease, None
        if lease is not None:
            try:
                lease.release()
            except LeaseBackendError:
                pass
