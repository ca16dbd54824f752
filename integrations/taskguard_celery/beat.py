"""Singleton periodic tasks: several ``celery beat`` processes, each due run published once.

``celery beat -S taskguard`` (the ``celery.beat_schedulers`` entry point) runs
:class:`TaskguardScheduler`, a ``PersistentScheduler`` with :class:`SingletonBeatMixin`; mix the
latter into any other scheduler class (``class MyScheduler(SingletonBeatMixin, RedBeatScheduler)``).

The protocol — leader lease (``beat-leader:<name>``), slots, claims fenced by the leader lease,
confirm/republish, catch-up, clocks, outages — is the framework-free core's
(:mod:`taskguard.schedule`); this module adapts Celery's entries to it: each entry's schedule
becomes a slot schedule (:mod:`taskguard_celery.schedules`), Celery's heap and ``is_due`` follow
the core's decisions, and a claimed slot is published through the scheduler below the mixin with
the ``taskguard_beat`` header. The worker reads that header in ``GuardedTask`` without importing this module.

* **Per-entry options.** ``beat_schedule[name]["options"]["taskguard"] = {"key": ..., "ttl": ...}``
  gives the run of that entry its own lease key (a template over the task's arguments) and TTL,
  and may also set ``limit``, ``rate``, ``rate_key`` and ``overlap`` (``skip``, ``coalesce``,
  ``replace``, ``allow``: what a slot's run does while the previous one still runs;
  :mod:`taskguard.schedule.options`); the
  scheduler checks them at start, removes them from the publish options and passes them in the
  ``taskguard_beat`` header.
* **Settings** are checked when the scheduler is set up (:func:`taskguard_celery.config.beat_settings`).
* **Clocks.** The time source is :attr:`SingletonBeatMixin.taskguard_clock` (a
  :class:`taskguard.clock.Clock`; default the Redis server's; pass ``taskguard_clock=`` to the
  scheduler's constructor to inject another, e.g. a simulated one).
"""

from __future__ import annotations

import heapq
import logging
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from celery.beat import PersistentScheduler, event_t
from celery.utils.log import LoggingProxy

from taskguard import ConfigError, Lease
from taskguard.clock import Clock
from taskguard.config import EX_CONFIG
from taskguard.schedule.options import check_entry_options
from taskguard.schedule.periodic import PeriodicEntry, PeriodicScheduler, Slot

from .config import beat_settings, locks_for
from .headers import BEAT_HEADER
from .schedules import latest_due, slot_id, slot_schedule

#: Key of the per-entry guard options inside ``beat_schedule[name]["options"]``.
ENTRY_OPTION = "taskguard"

__all__ = [
    "SingletonBeatMixin",
    "TaskguardScheduler",
    "latest_due",
    "slot_id",
    "BEAT_HEADER",
    "ENTRY_OPTION",
    "validate_entry_options",
]

log = logging.getLogger("taskguard.beat")


def validate_entry_options(name: str, options: Any, task: Any = None) -> dict:
    """Check one entry's ``options["taskguard"]`` when the scheduler is set up; with the entry's
    ``task`` (a guarded task this process knows), its ``key`` / ``rate_key`` templates are bound to
    the task's signature and its ``overlap`` checked against the task's options here too. Raises
    ConfigError naming the entry (with "did you mean" for a misspelt option or overlap value)."""
    guard = getattr(task, "taskguard_options", None) if task is not None else None
    if task is not None and guard is None:
        raise ConfigError(
            f"beat entry {name!r}: options[{ENTRY_OPTION!r}] given, but its task {getattr(task, 'name', task)!r} "
            "is not a GuardedTask: nothing would apply them"
        )
    fn = task.run if guard is not None else None
    return check_entry_options(f"beat entry {name!r}", options, fn, container=f"options[{ENTRY_OPTION!r}]", guard=guard)


class _WithOptions:
    """The entry as published: the same entry with other publish options (entries of other
    schedulers, e.g. RedBeat's, do not survive ``copy.copy``)."""

    def __init__(self, entry: Any, options: dict) -> None:
        self._entry, self.options = entry, options

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entry, name)


class _Adapter:
    """The scheduler as the core's :class:`~taskguard.schedule.ScheduleAdapter` (apart from it, so
    that no name of the core's interface lands on a third-party scheduler class)."""

    def __init__(self, scheduler: SingletonBeatMixin) -> None:
        self._scheduler = scheduler

    def entries(self) -> Iterator[PeriodicEntry]:
        for entry in list(self._scheduler.schedule.values()):  # type: ignore[attr-defined]
            yield self._scheduler.taskguard_entry(entry)

    def publish(self, entry: PeriodicEntry, slot: Slot) -> Any:
        return self._scheduler._tg_send(entry, slot)


class SingletonBeatMixin:
    """Mix into a ``celery.beat.Scheduler`` subclass (before it in the bases) to publish each due
    run of each entry at most once across all beat processes. See the module docstring; the
    core object is :attr:`taskguard_periodic` (a :class:`taskguard.schedule.PeriodicScheduler`)."""

    #: Beat wakes at least this often (seconds) unless ``beat_max_loop_interval`` says otherwise.
    max_interval = 1.0

    #: The time source (:class:`taskguard.clock.Clock`): ``time()`` gives slot instants and
    #: lateness, ``monotonic()`` retry delays; ``refresh()`` is called once per tick. ``None``
    #: (default): the lease backend's :meth:`taskguard.Locks.server_clock` (for Redis, the
    #: server's clock, read once per tick).
    taskguard_clock: Clock | None = None
    taskguard_periodic: PeriodicScheduler
    _heap: list[Any] | None  # Celery's heap of due entries (None: rebuilt at the next tick)

    def __init__(self, *args: Any, taskguard_clock: Clock | None = None, **kwargs: Any) -> None:
        if taskguard_clock is not None:
            self.taskguard_clock = taskguard_clock
        super().__init__(*args, **kwargs)

    def setup_schedule(self) -> None:
        """Validate every taskguard setting and entry option, then set up Celery's schedule.

        Raises ConfigError naming the setting or entry. Under ``celery beat`` (stderr redirected
        to the logger, where Celery would print the traceback one character per log line) the
        error is logged once at CRITICAL and the process exits with status 78 (``EX_CONFIG``)."""
        try:
            self._tg_setup()
        except ConfigError as e:
            log.critical("taskguard beat cannot start: %s", e)
            if isinstance(sys.stderr, LoggingProxy):  # a celery beat process: a clean exit, no traceback
                raise SystemExit(EX_CONFIG) from None
            raise

    def _tg_setup(self) -> None:
        settings = beat_settings(self.app, float(self.max_interval))  # type: ignore[attr-defined]
        super().setup_schedule()  # type: ignore[misc]
        self.taskguard_settings = settings
        self.taskguard_locks = locks_for(self.app)  # type: ignore[attr-defined]
        core = PeriodicScheduler(
            self.taskguard_locks,
            settings,
            adapter=_Adapter(self),
            clock=self.taskguard_clock,
            role="beat",
            on_lead=self._tg_rebuild_heap,
            on_retry=self._tg_rebuild_heap,
        )
        self.taskguard_periodic, self.taskguard_clock = core, core.clock
        self.taskguard_leader_ttl, self.taskguard_leader_key, self.taskguard_id = (
            settings.leader_ttl,
            core.leader_key,
            core.id,
        )
        self.taskguard_stats = core.stats
        for name, entry in self.schedule.items():  # type: ignore[attr-defined]
            opts = entry.options.get(ENTRY_OPTION)
            if opts is not None:
                validate_entry_options(name, opts, self.app.tasks.get(entry.task))  # type: ignore[attr-defined]

    def _tg_rebuild_heap(self) -> None:
        """Every entry is looked at again (a new leader catches up; a failed claim or publish is
        tried again in a second): Celery re-heaped entries at their next slots."""
        if getattr(self, "_heap", None) is not None:
            self._heap = None

    # -- what the core asks of the scheduler -----------------------------------------------------------
    def taskguard_entry(self, entry: Any) -> PeriodicEntry:
        """A Celery entry as the core sees it (its schedule as of now)."""
        return PeriodicEntry(entry.name, slot_schedule(entry.schedule), entry.options.get(ENTRY_OPTION) or {}, entry)

    def _tg_send(self, entry: PeriodicEntry, slot: Slot, producer: Any = None, **kwargs: Any) -> Any:
        """Publish the Celery entry's run for ``slot`` through the scheduler below the mixin,
        without its guard options and with the ``taskguard_beat`` header."""
        options = dict(entry.target.options)
        options.pop(ENTRY_OPTION, None)
        options["headers"] = {**(options.get("headers") or {}), BEAT_HEADER: slot.header()}
        self._tg_inside = True
        try:
            publish = _WithOptions(entry.target, options)
            return super().apply_async(publish, producer, False, **kwargs)  # type: ignore[misc]
        finally:
            self._tg_inside = False

    # -- Celery's scheduler hooks --------------------------------------------------------------------
    def tick(self, *args: Any, **kwargs: Any) -> Any:
        """Read the server clock, seek (or check) leadership on every tick, then run the
        scheduler's own tick."""
        self.taskguard_periodic.refresh()
        self.taskguard_periodic.leader()
        return super().tick(*args, **kwargs)  # type: ignore[misc]

    def taskguard_leader(self) -> Lease | None:
        """The leader lease if this beat holds it (acquiring it when free), else ``None``."""
        return self.taskguard_periodic.leader()

    def _when(self, entry: Any, next_time_to_run: Any, *args: Any, **kwargs: Any) -> float:
        """Celery's heap key: when the entry is next due, on :attr:`taskguard_clock` (Celery's
        own reads the local wall clock, so a clock step between two pushes misorders the heap)."""
        return self.taskguard_periodic.now() + (self.adjust(next_time_to_run) or 0)  # type: ignore[attr-defined]

    def is_due(self, entry: Any) -> Any:
        """The core's decision (:meth:`taskguard.schedule.PeriodicScheduler.due`); Celery's own
        for a schedule that cannot name its instants."""
        due = self.taskguard_periodic.due(self.taskguard_entry(entry))
        return super().is_due(entry) if due is None else due  # type: ignore[misc]

    def populate_heap(self, event_t: Any = event_t, heapify: Any = heapq.heapify) -> None:
        """Celery's heap, ordered by this mixin's ``is_due`` (not the entries' own)."""
        self._heap = []
        for entry in self.schedule.values():  # type: ignore[attr-defined]
            try:
                due, delay = self.is_due(entry)
            except Exception:
                due, delay = self._is_due_failed(entry)  # type: ignore[attr-defined]
            self._heap.append(event_t(self._when(entry, 0 if due else delay) or 0, 5, entry))
        heapify(self._heap)

    def maybe_due(self, entry: Any, **kwargs: Any) -> Any:
        """RedBeat's per-entry step (redbeat/schedulers.py ``maybe_due`` asks the entry's own
        ``is_due``, from its ``last_run_at``): decided by this mixin's :meth:`is_due` instead."""
        due, next_in = self.is_due(entry)
        if due:
            try:
                self.apply_async(entry, **kwargs)
            except Exception:
                log.exception("beat %s: publishing %s failed", self.taskguard_id, entry.name)
        return next_in

    def _tg_reserve(self, entry: Any, instant: float | None) -> None:
        """Move the entry on. RedBeat entries (kept in Redis, with ``reschedule``) record the
        slot's instant as their ``last_run_at``, so that RedBeat's own due time (``last_run_at``
        + interval) stays on the window starts instead of drifting by each publish's delay."""
        if instant is not None and hasattr(entry, "reschedule") and hasattr(entry, "_next_instance"):
            entry._next_instance(last_run_at=datetime.fromtimestamp(instant, timezone.utc))
        else:
            self.reserve(entry)  # type: ignore[attr-defined]

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Celery's ``Scheduler.tick`` path (the entry is already reserved)."""
        self._tg_publish(entry, producer, advance=False)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        """Schedulers that publish without ``apply_entry`` (RedBeat's ``maybe_due``) come here."""
        if getattr(self, "_tg_inside", False):  # our own publish, already checked
            return super().apply_async(entry, producer, advance, **kwargs)  # type: ignore[misc]
        return self._tg_publish(entry, producer, advance=advance, **kwargs)

    def _tg_publish(self, entry: Any, producer: Any, advance: bool, **kwargs: Any) -> Any:
        """Claim, publish (:meth:`_tg_send`), confirm: :meth:`taskguard.schedule.PeriodicScheduler.publish`."""

        def send(target: PeriodicEntry, slot: Slot) -> Any:
            return self._tg_send(target, slot, producer, **kwargs)

        def before(instant: float | None) -> None:  # as Scheduler.apply_async does: move the entry on
            self._tg_reserve(entry, instant)

        return self.taskguard_periodic.publish(self.taskguard_entry(entry), send, before if advance else None)

    def close(self) -> None:
        core = getattr(self, "taskguard_periodic", None)
        if core is not None:
            core.close()
        super().close()  # type: ignore[misc]


class TaskguardScheduler(SingletonBeatMixin, PersistentScheduler):
    """``PersistentScheduler`` (the default, with its ``-s`` schedule file) made singleton."""
