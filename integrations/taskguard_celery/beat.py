"""Singleton periodic tasks: several ``celery beat`` processes, each due run published once.

``celery beat -S taskguard`` (the ``celery.beat_schedulers`` entry point) runs
:class:`TaskguardScheduler`, a ``PersistentScheduler`` with :class:`SingletonBeatMixin`; mix the
latter into any other scheduler class (``class MyScheduler(SingletonBeatMixin, RedBeatScheduler)``).

How it works:

* **Leader lease.** Only the beat holding the leader lease (key ``beat-leader:<name>``,
  ``app.conf.taskguard_beat_leader_ttl`` seconds, default 30, renewed by the heartbeat thread
  while beat sleeps) publishes. Every beat seeks it on every tick, so a standby takes over within
  one leader TTL plus one loop after the leader dies. A follower says at INFO level that it waits
  and which beat leads.
* **Slots.** A due run is named by its entry and its scheduled instant, which the mixin computes
  itself from the schedule and the clock, never from a beat's local ``last_run_at`` (a follower's
  or an old schedule file's would be wrong): for interval entries the epoch-aligned window start
  ``floor(now / interval) * interval`` (beats started at different moments name the same slot);
  for crontab and solar entries the latest scheduled instant, in UTC to the second. An interval
  entry first fires at the first window start after beat starts.
* **Claims fenced by the leader lease.** Per entry, the leader keeps the latest slot it handled as
  a *lease record* of its leader lease (:meth:`taskguard.Lease.put_record`: one single-key script
  that writes only while that lease is held). It claims a slot (``claimed``), publishes, then
  confirms it (``published``). A beat that lost the lease cannot claim, so no second beat
  publishes a slot; a message a valid leader published is never dropped later. A slot claimed
  but not confirmed (a crash or a broker error between the two) is published again by the next
  tick or the next leader; the worker runs each slot at most once (the message names its slot,
  and a guarded task refuses a slot whose run is live or finished: see :mod:`taskguard_celery.task`).
* **Catch-up.** A slot is published while it is at most the catch-up window late
  (``app.conf.taskguard_beat_catch_up``; default leader TTL + loop interval + 2 s; ``0`` = none,
  which still allows one loop + 2 s): a new leader publishes the most recent slot that fell due
  during the hand-over; older ones are logged and counted as missed.
* **Per-entry options.** ``beat_schedule[name]["options"]["taskguard"] = {"key": ..., "ttl": ...}``
  gives the run of that entry its own lease key (a template over the task's arguments) and TTL,
  and may also set ``limit``, ``rate`` and ``rate_key`` (see :class:`taskguard.policy.GuardOptions`);
  the scheduler validates them at start, removes them from the publish options and passes them in
  the ``taskguard_beat`` header.
* **Clocks.** Slot instants and lateness are read on the Redis server's clock (``TIME``, read
  once per tick and advanced by the monotonic clock in between), never on the beat host's wall
  clock, and the leader lease is presumed held by the monotonic clock: a beat host whose clock
  steps forward or back neither publishes a slot early or twice nor stops publishing. The time
  source is :attr:`SingletonBeatMixin.taskguard_clock` (a :class:`taskguard.clock.Clock`; pass
  ``taskguard_clock=`` to the scheduler's constructor to inject another, e.g. a simulated one).
* **Outages.** A Redis outage or a lost leader lease never crashes beat: it stops publishing, says
  so in its log, and resumes when it can (catching up the latest slot within the window).

Settings are checked when the scheduler is set up (:func:`taskguard_celery.config.beat_settings`).
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import os
import socket
import sys
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from celery.beat import PersistentScheduler, event_t
from celery.schedules import schedule, solar
from celery.utils.log import LoggingProxy

from taskguard import ConfigError, Lease, LeaseBackendError, LeaseLost
from taskguard.clock import Clock
from taskguard.keys import KeyTemplate
from taskguard.validate import check_limit, check_rate, check_ttl

from .config import beat_settings, locks_for
from .headers import BEAT_HEADER

#: Exit status of a beat refused at start for its configuration (sysexits.h ``EX_CONFIG``).
EX_CONFIG = 78

__all__ = ["SingletonBeatMixin", "TaskguardScheduler", "latest_due", "slot_id", "BEAT_HEADER", "ENTRY_OPTION",
           "entry_guard", "beat_run"]

log = logging.getLogger("taskguard.beat")

#: Key of the per-entry guard options inside ``beat_schedule[name]["options"]``.
ENTRY_OPTION = "taskguard"
ENTRY_OPTION_KEYS = ("key", "ttl", "limit", "rate", "rate_key")
#: Lease record (on the leader lease) of an entry's latest handled slot: ``slot:<entry name>``.
SLOT_RECORD = "slot:"
#: Most schedule instants walked to find the latest due one (a week of an every-minute crontab).
MAX_WALK = 20000
#: Seconds within which two instants of a solar entry name one slot (see :func:`slot_slack`).
SEARCH_SLACK = 60.0
#: Seconds a finished slot's run is remembered by the worker, at least (see :func:`beat_run`).
SLOT_KEEP_MIN = 300.0


def _is_interval(sched: Any) -> bool:
    """An every-N-seconds entry (``celery.schedules.schedule``; crontab and solar are not)."""
    return isinstance(sched, schedule)


#: How far (hours) a zone's UTC offset may move at one change: the margin of the local-time walk.
MAX_SHIFT_HOURS = 4
#: Days searched for a crontab's next instant (a crontab that never fires, e.g. 31 February).
CRON_SEARCH_DAYS = 5 * 366


def _zone(sched: Any) -> Any:
    """The zone a non-interval schedule reads its fields in: its own clock's (``nowfun`` or the
    app's ``timezone``)."""
    return sched.maybe_make_aware(sched.now()).tzinfo


def _cron_wildcard_hour(sched: Any) -> bool:
    """Is the crontab's hour field a wildcard (``"*"``, ``"*/2"``)? Such an entry runs at every
    real instant whose local time matches, also twice in a repeated hour; an entry for fixed hours
    runs a repeated local time once and a skipped one at the end of the gap (see :func:`_cron_fires`)."""
    return str(getattr(sched, "_orig_hour", "*")).strip().startswith("*")


def _offset(tz: Any, ts: float) -> timedelta:
    return datetime.fromtimestamp(ts, tz).utcoffset() or timedelta(0)


def _gap_end(tz: Any, before: float, after: float) -> float:
    """The first second (Unix) of the new offset, for a change between ``before`` (old offset)
    and ``after`` (new offset)."""
    lo, hi = math.floor(before), math.ceil(after)
    new = _offset(tz, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _offset(tz, mid) == new:
            hi = mid
        else:
            lo = mid
    return float(hi)


def _cron_fires(tz: Any, wall: datetime, wild: bool) -> list[float]:
    """The UTC instants (Unix seconds, ascending) at which the local time ``wall`` (naive) of
    ``tz`` is due, by Vixie cron's rules for daylight-saving changes: a local time that occurs
    once fires once; a repeated one (autumn) fires at both instants for a wildcard-hour entry and
    at the first only for a fixed-hour one; a skipped one (the spring gap) does not fire for a
    wildcard-hour entry, and fires at the first instant after the gap for a fixed-hour one."""
    first = wall.replace(tzinfo=tz, fold=0).timestamp()
    second = wall.replace(tzinfo=tz, fold=1).timestamp()
    if first == second:
        return [first]
    if datetime.fromtimestamp(first, tz).replace(tzinfo=None) == wall:  # repeated: fold 0 is the earlier
        return [first, second] if wild else [first]
    return [] if wild else [_gap_end(tz, second, first)]  # skipped (in a gap fold 1 is the earlier)


def _cron_walls(sched: Any, start: datetime, days: int) -> Any:
    """The local times (naive, ascending, whole minutes) at or after ``start`` that match the
    crontab's fields, over at most ``days`` days (day of week, of month and month all match, as
    Celery's crontab requires)."""
    hours, minutes = sorted(sched.hour), sorted(sched.minute)
    day = start.date()
    for _ in range(days):
        if day.month in sched.month_of_year and day.day in sched.day_of_month and \
                day.isoweekday() % 7 in sched.day_of_week:
            for h in hours:
                for m in minutes:
                    wall = datetime(day.year, day.month, day.day, h, m)
                    if wall >= start:
                        yield wall
        day += timedelta(days=1)


def _naive_utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc).replace(tzinfo=None)


def cron_instants(sched: Any, after: float, until: float, tz: Any = None) -> list[float]:
    """The UTC instants (Unix seconds, ascending) in ``(after, until]`` at which the crontab
    ``sched`` is due in its zone (``tz``, default :func:`_zone`), by :func:`_cron_fires`."""
    tz = _zone(sched) if tz is None else tz
    if until <= after:
        return []
    offs = (_offset(tz, after), _offset(tz, until))
    lo = _naive_utc(after) + min(offs) - timedelta(minutes=1)
    hi = _naive_utc(until) + max(offs)
    out: set[float]
    wild, out = _cron_wildcard_hour(sched), set()
    for wall in _cron_walls(sched, lo.replace(second=0, microsecond=0), (hi.date() - lo.date()).days + 1):
        if wall > hi:
            break
        out.update(t for t in _cron_fires(tz, wall, wild) if after < t <= until)
    return sorted(out)


def cron_next(sched: Any, after: float, tz: Any = None) -> float | None:
    """The first UTC instant (Unix seconds) after ``after`` at which the crontab ``sched`` is due
    (:func:`cron_instants`' rules), or ``None`` when it is not due within :data:`CRON_SEARCH_DAYS`."""
    tz = _zone(sched) if tz is None else tz
    lo = _naive_utc(after) + min(_offset(tz, after), _offset(tz, after + 86400.0)) - timedelta(minutes=1)
    wild, best = _cron_wildcard_hour(sched), None
    for wall in _cron_walls(sched, lo.replace(second=0, microsecond=0), CRON_SEARCH_DAYS):
        fires = _cron_fires(tz, wall, wild)
        if best is not None and fires and fires[0] > best:
            break  # the first instant of a later local time only grows: nothing earlier follows
        for t in fires:
            if t > after and (best is None or t < best):
                best = t
    return best


def _is_crontab(sched: Any) -> bool:
    return all(hasattr(sched, f) for f in ("hour", "minute", "day_of_week", "day_of_month", "month_of_year"))


def latest_due(entry: Any, lookback: float, now_ts: float | None = None) -> tuple[float | None, float]:
    """``(instant, next_in)``: the latest instant (Unix seconds) at which ``entry`` fell due, at
    most ``lookback`` seconds before ``now_ts`` (``None`` when none did), and the seconds until its
    next one.

    ``now_ts`` is the current instant (Unix seconds); beat passes its ``taskguard_clock`` (the
    Redis server's clock); default: the schedule's own clock (``schedule.now()``: the app's
    ``now`` or the entry's ``nowfun``). Interval entries:
    epoch-aligned window starts. Crontab entries: their local times in their zone, mapped to UTC
    instants by Vixie cron's rules at daylight-saving changes (:func:`_cron_fires`): a
    wildcard-hour entry runs at every real instant its fields match (also through a repeated
    hour), a fixed-hour entry runs a repeated local time once and a skipped one right after the
    gap. Other schedules (solar) walk their own ``remaining_estimate``, UTC instants throughout.
    Raises what the schedule raises (``NotImplementedError`` for a schedule without
    ``remaining_estimate``)."""
    sched = entry.schedule
    if now_ts is None:
        now_ts = sched.maybe_make_aware(sched.now()).timestamp()
    if _is_interval(sched):
        secs = max(sched.run_every.total_seconds(), 0.001)
        window = math.floor(now_ts / secs)
        instant = window * secs
        return (instant if now_ts - instant <= lookback else None), (window + 1) * secs - now_ts
    if _is_crontab(sched):
        tz = _zone(sched)
        due = cron_instants(sched, now_ts - lookback, now_ts, tz)
        nxt = cron_next(sched, now_ts, tz)
        return (due[-1] if due else None), (3600.0 if nxt is None else nxt - now_ts)
    base = sched.maybe_make_aware(sched.now())  # remaining_estimate counts from the schedule's clock
    # in UTC seconds: an aware local datetime plus a timedelta is wall-clock arithmetic, an hour off
    # across a DST change; whole seconds: remaining_estimate reads the clock again, so ``base +
    # remaining`` drifts by microseconds from call to call; instants compared or recorded must not
    base_ts = base.timestamp()
    t_ts, latest, nxt_ts = now_ts - lookback, None, None
    for _ in range(MAX_WALK):
        t = datetime.fromtimestamp(t_ts, timezone.utc).astimezone(base.tzinfo)  # the schedule's own zone
        nxt_ts = float(round(base_ts + sched.remaining_estimate(t).total_seconds()))
        if nxt_ts > now_ts or nxt_ts <= t_ts:
            break
        latest, t_ts = nxt_ts, nxt_ts
    next_in = max(nxt_ts - now_ts, 0.0) if nxt_ts is not None and nxt_ts > now_ts else 1.0
    return latest, next_in


def slot_id(entry: Any, instant: float) -> str:
    """The slot name of ``entry``'s run due at ``instant`` (Unix seconds)."""
    sched = entry.schedule
    if _is_interval(sched):
        secs = max(sched.run_every.total_seconds(), 0.001)
        return f"every{secs:g}s:{round(instant / secs)}"
    return f"at:{int(round(instant))}"


def instants_between(entry: Any, after: float, before: float, cap: int = 10000) -> int:
    """How many instants ``entry`` fell due at strictly between ``after`` and ``before`` (Unix
    seconds), at most ``cap``."""
    sched = entry.schedule
    if before <= after:
        return 0
    if _is_interval(sched):
        secs = max(sched.run_every.total_seconds(), 0.001)
        return max(min(round((before - after) / secs) - 1, cap), 0)
    if _is_crontab(sched):
        return min(len(cron_instants(sched, after, before - 0.5)), cap)
    base = sched.maybe_make_aware(sched.now())
    base_ts = base.timestamp()
    t_ts, n = after, 0
    while n < cap:
        t = datetime.fromtimestamp(t_ts, timezone.utc).astimezone(base.tzinfo)
        nxt_ts = float(round(base_ts + sched.remaining_estimate(t).total_seconds()))
        if nxt_ts <= t_ts or nxt_ts >= before - 0.5:
            break
        n, t_ts = n + 1, nxt_ts
    return n


def slot_slack(entry: Any) -> float:
    """Seconds within which two instants of ``entry`` name the same slot: :data:`SEARCH_SLACK`
    for solar entries, whose instants come from a numeric search (ephem) that answers a second
    apart from different starts; 0 for others (exact instants)."""
    return SEARCH_SLACK if isinstance(entry.schedule, solar) else 0.0


def _slot_keep(entry: Any) -> float:
    sched = entry.schedule
    if _is_interval(sched):
        return max(2 * sched.run_every.total_seconds(), SLOT_KEEP_MIN)
    return 90000.0


def validate_entry_options(name: str, options: Any, task: Any = None) -> dict:
    """Check one entry's ``options["taskguard"]`` when the scheduler is set up; with the entry's
    ``task`` (a guarded task this process knows), its ``key`` / ``rate_key`` templates are bound to
    the task's signature here too. Raises ConfigError naming the entry."""
    if not isinstance(options, dict) or set(options) - set(ENTRY_OPTION_KEYS):
        raise ConfigError(f"beat entry {name!r}: options[{ENTRY_OPTION!r}] must be a dict with keys "
                          f"{ENTRY_OPTION_KEYS}, got {options!r}")
    try:
        if options.get("ttl") is not None:
            check_ttl(options["ttl"])
        if options.get("limit") is not None:
            check_limit(options["limit"])
        if options.get("rate") is not None:
            check_rate(options["rate"])
    except ConfigError as e:
        raise ConfigError(f"beat entry {name!r}: {e}") from None
    for field in ("key", "rate_key"):
        value = options.get(field)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"beat entry {name!r}: {field} must be a non-empty template str, got {value!r}")
    if options.get("rate_key") is not None and options.get("rate") is None:
        raise ConfigError(f"beat entry {name!r}: rate_key needs rate")
    if task is not None and getattr(task, "_taskguard", None) is not None:
        for field in ("key", "rate_key"):
            if options.get(field) is not None:
                try:
                    KeyTemplate(options[field], task.run)
                except ConfigError as e:
                    raise ConfigError(f"beat entry {name!r}: {field}: {e}") from None
    rate = options.get("rate")
    out = dict(options)
    if isinstance(rate, tuple):
        out["rate"] = list(rate)  # JSON-safe in the message header
    return out


class _WithOptions:
    """The entry as published: the same entry with other publish options (entries of other
    schedulers, e.g. RedBeat's, do not survive ``copy.copy``)."""

    def __init__(self, entry: Any, options: dict) -> None:
        self._entry, self.options = entry, options

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entry, name)


class _SlotState:
    """An entry's slot record: ``"<instant> <claimed|published> <leader fence> <beat id>"``."""

    __slots__ = ("instant", "state", "fence", "raw")

    def __init__(self, raw: str | None) -> None:
        self.raw, self.instant, self.state, self.fence = raw, -math.inf, "", 0
        parts = (raw or "").split(" ")
        if len(parts) >= 3:
            try:
                self.instant, self.state, self.fence = float(parts[0]), parts[1], int(parts[2])
            except ValueError:
                self.instant = -math.inf


class SingletonBeatMixin:
    """Mix into a ``celery.beat.Scheduler`` subclass (before it in the bases) to publish each due
    run of each entry at most once across all beat processes. See the module docstring."""

    #: Beat wakes at least this often (seconds) unless ``beat_max_loop_interval`` says otherwise.
    max_interval = 1.0

    #: The time source (:class:`taskguard.clock.Clock`): ``time()`` gives slot instants and
    #: lateness, ``monotonic()`` retry delays; ``refresh()`` is called once per tick. ``None``
    #: (default): the lease backend's :meth:`taskguard.Locks.server_clock` (for Redis, the
    #: server's clock, read once per tick).
    taskguard_clock: Clock | None = None

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
        if self.taskguard_clock is None:
            self.taskguard_clock = self.taskguard_locks.server_clock()
        self.taskguard_leader_ttl = settings.leader_ttl
        self.taskguard_leader_key = f"beat-leader:{settings.name}"
        self.taskguard_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.taskguard_stats: collections.Counter = collections.Counter()
        self._tg_leader: Lease | None = None
        self._tg_leader_seen: str | None = None
        self._tg_handled: dict[str, float] = {}  # entry name -> latest slot instant known handled
        self._tg_started = self._tg_now()
        self._tg_retry_at: dict[str, float] = {}  # entry name -> when (monotonic) a failed claim/publish is retried
        self._tg_outage = False
        for name, entry in self.schedule.items():  # type: ignore[attr-defined]
            opts = entry.options.get(ENTRY_OPTION)
            if opts is not None:
                validate_entry_options(name, opts, self.app.tasks.get(entry.task))  # type: ignore[attr-defined]

    # -- leadership -------------------------------------------------------------------------------
    def tick(self, *args: Any, **kwargs: Any) -> Any:
        """Read the server clock, seek (or check) leadership on every tick, then run the
        scheduler's own tick."""
        self.taskguard_clock.refresh()  # type: ignore[union-attr]
        self.taskguard_leader()
        return super().tick(*args, **kwargs)  # type: ignore[misc]

    def _tg_is_leader(self) -> bool:
        lease = self._tg_leader
        return lease is not None and not lease.lost and not lease.released

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
            self._tg_give_up(lease)
        try:
            acq = self.taskguard_locks.acquire(self.taskguard_leader_key, ttl=self.taskguard_leader_ttl, renew=True,
                                               holder={"beat": self.taskguard_id}, run_id=self.taskguard_id)
        except LeaseBackendError as e:
            self._note_outage(e)
            return None
        self._note_recovered()
        if not acq.acquired:
            leader = acq.holder_run or "unknown"
            if leader != self._tg_leader_seen:
                log.info("beat %s is waiting: beat %s leads (%s); it takes over within %gs if that one stops",
                         self.taskguard_id, leader, self.taskguard_leader_key,
                         self.taskguard_leader_ttl + self.max_interval)
                self._tg_leader_seen = leader
            return None
        self._tg_leader, self._tg_leader_seen = acq.lease, self.taskguard_id
        log.warning("beat %s is the leader (fencing token %s)", self.taskguard_id, cast(Lease, acq.lease).fencing_token)
        if getattr(self, "_heap", None) is not None:
            self._heap = None  # every entry is looked at again now: catch-up of the hand-over
        return acq.lease

    def _tg_give_up(self, lease: Lease) -> None:
        """Release a leader lease this beat no longer counts on (it stops renewing it either way):
        were it still held in Redis, keeping it would make the next acquire — this beat's or a
        standby's — wait for its TTL. A release of a lease already gone does nothing."""
        if lease.released:
            return
        try:
            lease.release()
        except LeaseBackendError as e:  # it expires by its TTL (the heartbeat no longer renews it)
            log.warning("beat %s could not release the leader lease it gave up: %s", self.taskguard_id, e)

    def _tg_now(self) -> float:
        """The current instant, Unix seconds (float), on :attr:`taskguard_clock` (the Redis
        server's clock by default)."""
        return self.taskguard_clock.time()  # type: ignore[union-attr]

    def _when(self, entry: Any, next_time_to_run: Any, *args: Any, **kwargs: Any) -> float:
        """Celery's heap key: when the entry is next due, on :attr:`taskguard_clock` (Celery's
        own reads the local wall clock, so a clock step between two pushes misorders the heap)."""
        return self._tg_now() + (self.adjust(next_time_to_run) or 0)  # type: ignore[attr-defined]

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
    def _tg_due(self, entry: Any, now: float) -> tuple[float | None, float] | None:
        """``(latest due instant within the allowed lateness, seconds to the next)`` at ``now``
        (Unix seconds), or ``None`` for a schedule that cannot say (then Celery's own ``is_due``
        decides)."""
        try:
            return latest_due(entry, self.taskguard_settings.allowed_lateness + self.max_interval,
                              now)
        except NotImplementedError:
            return None

    def is_due(self, entry: Any) -> Any:
        """Due when the latest instant the entry fell due at is one this beat has not handled,
        is at most the allowed lateness ago, and this beat leads."""
        now = self._tg_now()
        due = self._tg_due(entry, now)
        if due is None:
            return super().is_due(entry)  # type: ignore[misc]
        instant, next_in = due
        if not self._tg_is_leader():
            # a follower looks again every loop, so that a take-over finds the entry due
            return False, min(next_in, self.max_interval)
        if instant is None or instant <= self._tg_handled.get(entry.name, -math.inf) + slot_slack(entry):
            return False, next_in
        late = now - instant
        if late > self.taskguard_settings.allowed_lateness:
            self._tg_missed(entry, instant, late)
            return False, next_in
        retry_in = self._tg_retry_at.get(entry.name, -math.inf) - self.taskguard_clock.monotonic()  # type: ignore[union-attr]
        if retry_in > 0:  # its claim or publish just failed: try again soon, not at the next slot
            return False, retry_in
        return True, next_in

    def _tg_try_again(self, entry: Any) -> None:
        """A claim or publish failed (Redis, the broker): look at the entry again in a second
        (while the slot is within the allowed lateness) instead of at its next slot."""
        self._tg_retry_at[entry.name] = (self.taskguard_clock.monotonic()  # type: ignore[union-attr]
                                         + min(1.0, float(self.max_interval)))
        if getattr(self, "_heap", None) is not None:
            self._heap = None  # Celery re-heaped the entry at its next slot: rebuild with is_due

    def _tg_missed(self, entry: Any, instant: float, late: float) -> None:
        """Log a slot found beyond the catch-up window. It is counted in ``missed_slots`` (with
        any others since the entry's last handled slot) when the entry's next slot is published:
        the slot record tells how many fell due meanwhile."""
        if instant > self._tg_handled.get(entry.name, -math.inf) + slot_slack(entry):
            log.warning("beat %s: %s slot %s fell due %.1fs ago, beyond the catch-up window (%gs); not published",
                        self.taskguard_id, entry.name, slot_id(entry, instant), late,
                        self.taskguard_settings.allowed_lateness)
            self._tg_handled[entry.name] = instant

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

    # -- claim, publish, confirm ----------------------------------------------------------------------
    def _tg_publish(self, entry: Any, producer: Any, advance: bool, **kwargs: Any) -> Any:
        now = self._tg_now()
        due = self._tg_due(entry, now)
        if due is None:
            instant: float | None = float(round(now))  # a schedule that cannot name its instants
        else:
            instant = due[0]
        leader = self.taskguard_leader()
        if leader is None:
            # not ours to publish, nor to move on: a schedule shared through Redis (RedBeat)
            # would otherwise look already run to the leader
            log.debug("beat %s is not the leader; %s left to the leader", self.taskguard_id, entry.name)
            return None
        if advance:  # as Scheduler.apply_async does: move the entry on whatever happens below
            self._tg_reserve(entry, instant)
        if instant is None or instant <= self._tg_handled.get(entry.name, -math.inf) + slot_slack(entry):
            return None
        if now - instant > self.taskguard_settings.allowed_lateness:
            self._tg_missed(entry, instant, now - instant)
            return None
        slot = slot_id(entry, instant)
        record = SLOT_RECORD + entry.name
        locks = self.taskguard_locks
        try:
            cur = _SlotState(locks.get_lease_record(self.taskguard_leader_key, record))
            if cur.raw is not None and abs(cur.instant - instant) <= slot_slack(entry):
                instant = cur.instant  # the recorded instant names the slot
                slot = slot_id(entry, instant)
            if cur.raw is None and instant < self._tg_started:
                # never run anywhere (no record): the first run is the first slot after beat started
                self._tg_handled[entry.name] = instant
                return None
            if cur.instant > instant or (cur.instant == instant and cur.state == "published"):
                self._tg_handled[entry.name] = max(cur.instant, instant)
                return None
            if cur.raw is not None and cur.instant < instant:
                skipped = instants_between(entry, cur.instant, instant)
                if skipped:
                    log.warning("beat %s: %d slot(s) of %s fell due after its last handled one and are beyond the "
                                "catch-up window (%gs): not published; publishing the latest, %s",
                                self.taskguard_id, skipped, entry.name, self.taskguard_settings.allowed_lateness,
                                slot)
                    self.taskguard_stats["missed_slots"] += skipped
            if cur.instant == instant:
                log.warning("beat %s: %s slot %s was claimed (leader fence %s) but not confirmed published; "
                            "publishing it again (the worker runs a slot once)", self.taskguard_id, entry.name,
                            slot, cur.fence)
                self.taskguard_stats["republished_slots"] += 1
            claim = f"{instant!r} claimed {leader.fencing_token} {self.taskguard_id}"
            if not leader.put_record(record, claim, if_value=cur.raw, if_absent=cur.raw is None):
                return None  # the record changed under us (another call of this beat): look again next tick
        except LeaseLost as e:
            log.warning("beat %s: lost the leader lease before claiming %s slot %s (%s)", self.taskguard_id,
                        entry.name, slot, e)
            return None
        except LeaseBackendError as e:
            self._note_outage(e)
            self._tg_try_again(entry)
            return None
        options = dict(entry.options)
        guard = options.pop(ENTRY_OPTION, None)
        header = {"leader_key": self.taskguard_leader_key, "leader_fence": leader.fencing_token,
                  "entry": entry.name, "slot": slot, "keep": _slot_keep(entry)}
        if guard:
            header.update(guard)
        options["headers"] = {**(options.get("headers") or {}), BEAT_HEADER: header}
        publish = _WithOptions(entry, options)
        log.info("beat %s: publishing %s slot %s (%.1fs after it fell due)", self.taskguard_id, entry.name, slot,
                 now - instant)
        self._tg_inside = True
        try:
            result = super().apply_async(publish, producer, False, **kwargs)  # type: ignore[misc]
        except Exception as e:
            log.error("beat %s: slot %s of %s claimed but not published (tried again in a second): %s",
                      self.taskguard_id, slot, entry.name, e)
            self.taskguard_stats["unpublished_slots"] += 1
            self._tg_try_again(entry)
            return None
        finally:
            self._tg_inside = False
        self.taskguard_stats["published"] += 1
        self._tg_handled[entry.name] = instant
        self._tg_retry_at.pop(entry.name, None)
        try:
            leader.put_record(record, f"{instant!r} published {leader.fencing_token} {self.taskguard_id}",
                              if_value=claim)
        except (LeaseLost, LeaseBackendError) as e:
            # the next leader publishes it again; the worker runs the slot once
            log.warning("beat %s: %s slot %s published but not confirmed: %s", self.taskguard_id, entry.name, slot, e)
        return result

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
    ``key`` / ``ttl`` / ``limit`` / ``rate`` / ``rate_key`` (``options["taskguard"]`` in the
    schedule) when it gives them. A bad entry option is logged and the task's own options are used."""
    changes: dict[str, Any] = {}

    def template(value: str) -> KeyTemplate:
        found = _entry_keys.get((type(task), value))
        if found is None:
            found = _entry_keys[(type(task), value)] = KeyTemplate(value, task.run)
        return found

    def rate(value: Any) -> Any:
        return check_rate(tuple(value) if isinstance(value, list) else value)

    # each field on its own: a bad one (logged) never drops the entry's other options
    for field, check in (("key", template), ("rate_key", template), ("ttl", check_ttl), ("limit", check_limit),
                         ("rate", rate)):
        value = header.get(field)
        if value is None or (field in ("key", "rate_key") and not (isinstance(value, str) and value)):
            continue
        try:
            changes[field] = check(value)
        except ConfigError as e:
            log.error("task %s: ignoring the beat entry's %s option: %s", task.name, field, e)
    if "rate" in changes and "rate_key" not in changes and opts.rate_key is None:
        changes["rate_key"] = template(task.name)
    if "rate_key" in changes and "rate" not in changes and opts.rate is None:
        log.error("task %s: ignoring the beat entry's rate_key option: it needs rate", task.name)
        del changes["rate_key"]
    import dataclasses

    return dataclasses.replace(opts, **changes) if changes else opts


def beat_run(header: dict) -> tuple[str, float] | None:
    """``(run id, seconds to remember it finished)`` of a beat message's slot, or ``None`` when
    the header does not name one: every message published for one slot has the same run id, so a
    slot published twice (claimed, then published again by the next leader) runs once."""
    entry, slot, keep = header.get("entry"), header.get("slot"), header.get("keep")
    if not isinstance(entry, str) or not entry or not isinstance(slot, str) or not slot:
        return None
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not math.isfinite(keep) or keep <= 0:
        keep = SLOT_KEEP_MIN
    return f"beat:{entry}:{slot}", float(keep)
