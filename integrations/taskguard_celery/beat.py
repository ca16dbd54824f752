"""Singleton periodic tasks: several ``celery beat`` processes, each due run published once.

``celery beat -S taskguard`` (the ``celery.beat_schedulers`` entry point) runs
:class:`TaskguardScheduler`, a ``PersistentScheduler`` with :class:`SingletonBeatMixin`; mix the
latter into any other scheduler class (``class MyScheduler(SingletonBeatMixin, RedBeatScheduler)``).

How it works:

* **Leader lease.** Only the beat holding the leader lease (key ``beat-leader:<app name>``,
  ``app.conf.taskguard_beat_leader_ttl`` seconds, default 30, renewed by the heartbeat thread while
  beat sleeps) publishes. The others keep trying on every tick and take over within one leader
  TTL when the leader dies. Every published message carries the leader's fencing token in a
  ``taskguard_beat`` header; a :class:`~taskguard_celery.GuardedTask` drops (and reports as
  skipped, reason ``"stale_leader"``) a message whose leader fence is older than the current
  leader's. Plain (unguarded) tasks get only the publish-side checks.
* **Slots.** A due run is identified by its entry and its scheduled instant: for interval
  entries the epoch-aligned window ``floor(now / interval)`` (entries fire at window starts, so
  beats started at different moments, or with clocks skewed by less than half the interval,
  name the same slot); for crontab and other schedules the scheduled instant in UTC (to the
  second). Before publishing, the leader claims the slot with a once-marker; a slot already
  claimed is not published again. A slot claimed but never published (a crash or a broker error
  between the two) is logged and counted (``scheduler.taskguard_stats``).
* **Per-entry options.** ``beat_schedule[name]["options"]["taskguard"] = {"key": ..., "ttl": ...}``
  gives the run of that entry its own lease key (a template over the task's arguments) and TTL;
  the scheduler removes it from the publish options and passes it in the ``taskguard_beat`` header.
* **Outages.** A Redis outage or a lost leader lease never crashes beat: it stops publishing, says
  so in its log, and resumes when it can (the slots that fell due meanwhile are not replayed).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import time
import uuid
from datetime import timezone
from typing import Any

from celery.beat import PersistentScheduler
from celery.schedules import schedule

from taskguard import ConfigError, LeaseBackendError, Lease, Locks
from taskguard.keys import KeyTemplate
from taskguard.validate import check_ttl

from .config import locks_for
from .headers import BEAT_HEADER

__all__ = ["SingletonBeatMixin", "TaskguardScheduler", "slot_of", "BEAT_HEADER", "ENTRY_OPTION", "entry_guard",
           "published_by_stale_leader"]

log = logging.getLogger("taskguard.beat")

#: Key of the per-entry guard options inside ``beat_schedule[name]["options"]``.
ENTRY_OPTION = "taskguard"
ENTRY_OPTION_KEYS = ("key", "ttl")
#: Name of the record that marks a schedule slot claimed, then published (under the slot's key).
SLOT_RECORD = "slot"
#: Seconds after which a slot claimed but not marked published is reported.
UNPUBLISHED_GRACE = 5.0


def _is_interval(sched: Any) -> bool:
    """An every-N-seconds entry (``celery.schedules.schedule``; crontab and solar are not)."""
    return isinstance(sched, schedule)


def slot_of(entry: Any, now_ts: float | None = None) -> tuple[str, float]:
    """``(slot id, seconds to keep its marker)`` of the run of ``entry`` due now."""
    sched = entry.schedule
    now_ts = time.time() if now_ts is None else now_ts
    if _is_interval(sched):
        secs = max(sched.run_every.total_seconds(), 0.001)
        return f"every{secs:g}s:{math.floor(now_ts / secs)}", max(2 * secs, 300.0)
    rem = sched.remaining_estimate(entry.last_run_at)
    now = sched.maybe_make_aware(sched.now())
    instant = (now + rem).astimezone(timezone.utc)
    return f"at:{int(round(instant.timestamp()))}", 90000.0


def validate_entry_options(name: str, options: Any) -> dict:
    if not isinstance(options, dict) or set(options) - set(ENTRY_OPTION_KEYS):
        raise ConfigError(f"beat entry {name!r}: options[{ENTRY_OPTION!r}] must be a dict with keys "
                          f"{ENTRY_OPTION_KEYS}, got {options!r}")
    if options.get("ttl") is not None:
        try:
            check_ttl(options["ttl"])
        except ConfigError as e:
            raise ConfigError(f"beat entry {name!r}: {e}") from None
    key = options.get("key")
    if key is not None and (not isinstance(key, str) or not key):
        raise ConfigError(f"beat entry {name!r}: key must be a non-empty template str, got {key!r}")
    return dict(options)


class _WithOptions:
    """The entry as published: the same entry with other publish options (entries of other
    schedulers, e.g. RedBeat's, do not survive ``copy.copy``)."""

    def __init__(self, entry: Any, options: dict) -> None:
        self._entry, self.options = entry, options

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entry, name)


class SingletonBeatMixin:
    """Mix into a ``celery.beat.Scheduler`` subclass (before it in the bases) to publish each due
    run of each entry at most once across all beat processes. See the module docstring."""

    #: Beat wakes at least this often (seconds), so interval entries fire near window starts.
    max_interval = 1.0

    def setup_schedule(self) -> None:
        super().setup_schedule()  # type: ignore[misc]
        conf = self.app.conf  # type: ignore[attr-defined]
        self.taskguard_locks = locks_for(self.app)  # type: ignore[attr-defined]
        self.taskguard_leader_ttl = float(conf.get("taskguard_beat_leader_ttl") or 30.0)
        self.taskguard_leader_key = f"beat-leader:{conf.get('taskguard_beat_name') or self.app.main or 'celery'}"  # type: ignore[attr-defined]
        self.taskguard_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.taskguard_stats: collections.Counter = collections.Counter()
        self._tg_leader: Lease | None = None
        self._tg_windows: dict[str, int] = {}
        self._tg_outage = False
        for name, entry in self.schedule.items():  # type: ignore[attr-defined]
            opts = entry.options.get(ENTRY_OPTION)
            if opts is not None:
                validate_entry_options(name, opts)

    # -- leadership -------------------------------------------------------------------------------
    def taskguard_leader(self) -> Lease | None:
        """The leader lease if this beat holds it (acquiring it when free), else ``None``."""
        lease = self._tg_leader
        if lease is not None and not lease.lost and not lease.released:
            return lease
        if lease is not None:
            log.warning("beat %s lost the leader lease (%s); not publishing until it is back",
                        self.taskguard_id, lease.lost_reason)
            self.taskguard_stats["leadership_lost"] += 1
            self._tg_leader = None
        try:
            acq = self.taskguard_locks.acquire(self.taskguard_leader_key, ttl=self.taskguard_leader_ttl, renew=True,
                                               holder={"beat": self.taskguard_id})
        except LeaseBackendError as e:
            self._note_outage(e)
            return None
        self._note_recovered()
        if not acq.acquired:
            return None
        self._tg_leader = acq.lease
        log.warning("beat %s is the leader (fencing token %s)", self.taskguard_id, acq.lease.fencing_token)
        return acq.lease

    def _note_outage(self, error: Exception) -> None:
        if not self._tg_outage:
            log.error("beat %s: Redis unreachable, not publishing until it is back: %s", self.taskguard_id, error)
        self._tg_outage = True
        self.taskguard_stats["redis_errors"] += 1

    def _note_recovered(self) -> None:
        if self._tg_outage:
            log.warning("beat %s: Redis is back", self.taskguard_id)
        self._tg_outage = False

    # -- when entries are due -----------------------------------------------------------------------
    def is_due(self, entry: Any) -> Any:
        """Interval entries fire at epoch-aligned window starts (once per window per beat)."""
        sched = entry.schedule
        if not _is_interval(sched):
            return super().is_due(entry)  # type: ignore[misc]
        secs = max(sched.run_every.total_seconds(), 0.001)
        now = time.time()
        window = math.floor(now / secs)
        next_in = (window + 1) * secs - now
        return (window > self._tg_windows.get(entry.name, -1), next_in)

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Celery's ``Scheduler.tick`` path (the entry is already reserved)."""
        self._tg_publish(entry, producer, advance=False)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        """Schedulers that publish without ``apply_entry`` (RedBeat's ``maybe_due``) come here."""
        if getattr(self, "_tg_inside", False):  # our own publish, already checked
            return super().apply_async(entry, producer, advance, **kwargs)  # type: ignore[misc]
        return self._tg_publish(entry, producer, advance=advance, **kwargs)

    def _tg_publish(self, entry: Any, producer: Any, advance: bool, **kwargs: Any) -> Any:
        slot, keep = slot_of(entry)
        if _is_interval(entry.schedule):
            self._tg_windows[entry.name] = int(slot.rsplit(":", 1)[1])
        leader = self.taskguard_leader()
        if leader is None:
            # not ours to publish, nor to move on: a schedule shared through Redis (RedBeat)
            # would otherwise look already run to the leader
            log.debug("beat %s is not the leader; %s slot %s left to the leader", self.taskguard_id, entry.name, slot)
            return None
        if advance:  # as Scheduler.apply_async does: move the entry on whatever happens below
            self.reserve(entry)  # type: ignore[attr-defined]
        slot_key = f"beat-slot:{entry.name}:{slot}"
        try:
            claimed = self.taskguard_locks.put_record(slot_key, SLOT_RECORD,
                                                      f"claimed {self.taskguard_id} {time.time():.3f}", ttl=keep,
                                                      if_absent=True)
            if not claimed:
                self._report_if_unpublished(entry, slot, slot_key)
                return None
            leader.ensure_held()
        except LeaseBackendError as e:
            self._note_outage(e)
            return None
        except Exception as e:  # LeaseLost between the claim and the publish
            log.error("beat %s: slot %s of %s claimed but not published: %s", self.taskguard_id, slot, entry.name, e)
            self.taskguard_stats["unpublished_slots"] += 1
            return None
        options = dict(entry.options)
        guard = options.pop(ENTRY_OPTION, None)
        header = {"leader_key": self.taskguard_leader_key, "leader_fence": leader.fencing_token,
                  "entry": entry.name, "slot": slot}
        if guard:
            header.update(guard)
        options["headers"] = {**(options.get("headers") or {}), BEAT_HEADER: header}
        publish = _WithOptions(entry, options)
        log.info("beat %s: publishing %s slot %s", self.taskguard_id, entry.name, slot)
        self._tg_inside = True
        try:
            result = super().apply_async(publish, producer, False, **kwargs)  # type: ignore[misc]
        except Exception as e:
            log.error("beat %s: slot %s of %s claimed but not published: %s", self.taskguard_id, slot, entry.name, e)
            self.taskguard_stats["unpublished_slots"] += 1
            return None
        finally:
            self._tg_inside = False
        self.taskguard_stats["published"] += 1
        try:
            self.taskguard_locks.put_record(slot_key, SLOT_RECORD, f"published {getattr(result, 'id', '')}", ttl=keep)
        except LeaseBackendError as e:
            self._note_outage(e)
        return result

    def _report_if_unpublished(self, entry: Any, slot: str, slot_key: str) -> None:
        mark = self.taskguard_locks.get_record(slot_key, SLOT_RECORD) or ""
        parts = mark.split()
        if len(parts) == 3 and parts[0] == "claimed" and time.time() - float(parts[2]) > UNPUBLISHED_GRACE:
            if parts[1] != self.taskguard_id:
                log.error("beat %s: slot %s of %s was claimed by beat %s but never published", self.taskguard_id,
                          slot, entry.name, parts[1])
                self.taskguard_stats["unpublished_slots"] += 1
                self.taskguard_locks.put_record(slot_key, SLOT_RECORD, f"reported {mark}", ttl=300)

    def close(self) -> None:
        lease, self._tg_leader = self._tg_leader, None
        if lease is not None:
            try:
                lease.release()
            except LeaseBackendError:
                pass
        super().close()  # type: ignore[misc]


class TaskguardScheduler(SingletonBeatMixin, PersistentScheduler):
    """``PersistentScheduler`` (the default, with its ``-s`` schedule file) made singleton."""


# -- the worker's side of a beat message ------------------------------------------------------------
_entry_keys: dict[tuple[Any, str], KeyTemplate] = {}


def entry_guard(task: Any, opts: Any, header: dict) -> Any:
    """The guard options of a run published for a beat entry: the task's own, with the entry's
    ``key`` / ``ttl`` (``options["taskguard"]`` in the schedule) when it gives them. A bad entry
    option is logged and the task's own options are used."""
    changes: dict[str, Any] = {}
    spec, ttl = header.get("key"), header.get("ttl")
    try:
        if isinstance(spec, str) and spec:
            template = _entry_keys.get((type(task), spec))
            if template is None:
                template = _entry_keys[(type(task), spec)] = KeyTemplate(spec, task.run)
            changes["key"] = template
        if ttl is not None:
            changes["ttl"] = check_ttl(ttl)
    except ConfigError as e:
        log.error("task %s: ignoring the beat entry's guard options: %s", task.name, e)
        return opts
    import dataclasses

    return dataclasses.replace(opts, **changes) if changes else opts


def published_by_stale_leader(locks: Locks, header: dict) -> bool:
    """Was this message published by a beat that is no longer the leader?"""
    fence, leader_key = header.get("leader_fence"), header.get("leader_key")
    if not isinstance(fence, int) or isinstance(fence, bool) or not isinstance(leader_key, str) or not leader_key:
        return False
    current = locks.holder(leader_key)
    return current is not None and current.fencing_token is not None and fence < current.fencing_token
