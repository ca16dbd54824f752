"""Singleton periodic jobs for RQ: ``taskguard rq-cron CONFIG``, several schedulers, each slot enqueued once.

RQ's ``rq cron CONFIG`` keeps each job's next run time in the process's memory: two of them enqueue
every run twice, and an interval job is enqueued at every start. ``taskguard rq-cron CONFIG`` reads
the same configuration (the ``rq.cron.register(func, queue_name=..., interval=... | cron="...",
job_timeout=..., ttl=..., meta=...)`` calls of a module or file, loaded as ``rq cron`` loads it) and
runs it on the framework-free periodic-schedule core (:mod:`taskguard.schedule`):

* **One leader.** Any number of schedulers may run; the one holding the leader lease
  (``rq-cron-leader:<name>``) enqueues, the others wait and say once who leads; a standby takes
  over within the leader TTL plus one loop when the leader dies, and enqueues the slot that fell
  due meanwhile (within the catch-up window) — never twice.
* **Slots.** An ``interval`` entry is due at window starts aligned to the epoch
  (``floor(now / interval) * interval``), never "at start"; a ``cron`` entry at the instants its
  expression names in one configured time zone (``--timezone``, default UTC; Vixie cron's rules at
  daylight-saving changes). Every scheduler computes the slot from the Redis server's clock. The
  first run of an entry that never ran anywhere is its first slot after the scheduler started.
* **One job per slot.** Each slot's job gets a deterministic id (:func:`slot_job_id`: the
  scheduler name, the entry and the slot) and is enqueued with RQ's own ``unique=True`` (RQ >=
  2.8; not for rate-limited jobs): a slot enqueued again (a leader that died between claiming and
  confirming it) makes no second job while RQ keeps the first (its ``result_ttl`` /
  ``failure_ttl``). A ``Retry`` of that job id still runs, as for any RQ job.
* **The job** carries its slot in ``job.meta["taskguard_cron"]``
  (:data:`taskguard_rq.cron_runs.CRON_META_KEY`).
* **Per-entry guard options** go in ``meta={"taskguard": {"key": ..., "ttl": ..., "limit": ...,
  "rate": ..., "rate_key": ..., "overlap": ...}}`` (RQ's ``register`` takes no other keywords) of a
  ``@guarded_job`` function: checked at start, removed from the job's meta, carried in the slot
  header and laid over the function's own options by the worker (:mod:`taskguard_rq.cron_runs`).
* **RQ's bookkeeping** stays as ``rq cron`` keeps it: the scheduler registry (birth, heartbeat,
  death), each cron job's history of spawned job ids and the cron job registry.
* **Checked at start** (a :class:`~taskguard.ConfigError`, exit status 78): the settings, every
  registration (an unknown keyword with "did you mean", an entry without or with both of
  ``interval`` / ``cron``, a bad cron expression, an unknown guard option, two entries of one name),
  and the time zone, which must agree with the other schedulers of the same name (kept beside the
  leader lease while any of them runs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any

from taskguard import ConfigError, LeaseBackendError, Locks
from taskguard.clock import Clock
from taskguard.config import EX_CONFIG
from taskguard.policy import OPTION_NAMES, check_option_names
from taskguard.schedule.cron import parse_cron
from taskguard.schedule.options import ENTRY_OPTIONS, check_entry_options
from taskguard.schedule.periodic import PeriodicEntry, PeriodicScheduler, Slot
from taskguard.schedule.settings import ScheduleSettings, SettingNames, schedule_settings
from taskguard.schedule.slots import Cron, Interval, Schedule
from taskguard.validate import check_seconds

from .cron_runs import CRON_META_KEY
from .job import RQ_ELSEWHERE

__all__ = [
    "CRON_META_KEY",
    "CronEntry",
    "DEFAULT_NAME",
    "DEFAULT_TIMEZONE",
    "ENTRY_OPTION",
    "EX_CONFIG",
    "LOOP_INTERVAL",
    "RQCronScheduler",
    "cron_settings",
    "load_registrations",
    "slot_job_id",
]

#: Key of the per-entry guard options inside a registration's ``meta``.
ENTRY_OPTION = "taskguard"
#: Names the leader lease (``rq-cron-leader:<name>``), the holder and the logger (``taskguard.rq-cron``).
ROLE = "rq-cron"
#: The scheduler name when none is given (``--name``).
DEFAULT_NAME = "default"
#: The zone cron expressions are read in when none is given (``--timezone``).
DEFAULT_TIMEZONE = "UTC"
#: Seconds between two looks at the schedule, at most.
LOOP_INTERVAL = 1.0
#: Record of the leader key holding the schedulers' time zone.
ZONE_RECORD = "cron-timezone"
#: The keywords ``rq.cron.register`` takes (RQ 3.0).
REGISTER_KEYWORDS = (
    "func",
    "queue_name",
    "args",
    "kwargs",
    "interval",
    "cron",
    "job_timeout",
    "result_ttl",
    "ttl",
    "failure_ttl",
    "meta",
    "webhooks",
    "name",
)
#: How the settings are spelt on the command line (for error messages).
SETTING_NAMES = SettingNames(
    leader_ttl="--leader-ttl", catch_up="--catch-up", name="--name", loop="--loop-interval", role="rq-cron scheduler"
)

log = logging.getLogger(f"taskguard.{ROLE}")


def cron_settings(
    *, leader_ttl: Any = None, catch_up: Any = None, name: Any = None, loop_interval: float = LOOP_INTERVAL
) -> ScheduleSettings:
    """The scheduler's settings, checked by :func:`taskguard.schedule.schedule_settings`: leader
    TTL (seconds, default 30), catch-up window (seconds, default leader TTL + loop + 2; 0 = none),
    ``name`` (default :data:`DEFAULT_NAME`), ``loop_interval`` (seconds > 0). Raises ConfigError
    naming the command-line option."""
    loop = check_seconds("--loop-interval", loop_interval)
    return schedule_settings(
        SETTING_NAMES,
        leader_ttl=leader_ttl,
        catch_up=catch_up,
        name=name,
        default_name=DEFAULT_NAME,
        loop_interval=loop,
    )


def check_timezone(value: Any) -> tuple[str, tzinfo]:
    """``(name, zone)`` of an IANA time zone name (``None``: :data:`DEFAULT_TIMEZONE`). Raises ConfigError."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    name = DEFAULT_TIMEZONE if value is None else value
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"--timezone must be an IANA time zone name such as 'Europe/Berlin', got {value!r}")
    try:
        return name, ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"--timezone: unknown time zone {name!r} (an IANA name such as 'Europe/Berlin' or 'UTC')"
        ) from None


def slot_job_id(scheduler: str, entry: str, slot: str) -> str:
    """The RQ job id of ``entry``'s run for ``slot`` under the scheduler name ``scheduler``: the
    same on every scheduler, made of the characters RQ allows (letters, digits, ``_``, ``-``)."""
    digest = hashlib.sha256(f"{scheduler}\n{entry}".encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", entry)[-48:]
    return f"cron-{slug}-{digest}-{re.sub(r'[^A-Za-z0-9_-]+', '-', slot)}"


@dataclasses.dataclass
class CronEntry:
    """One checked registration: what is enqueued for each of its slots."""

    name: str
    func: Callable[..., Any]
    queue_name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    schedule: Schedule
    job_options: dict[str, Any]  # RQ's enqueue options, meta without the guard options
    options: dict[str, Any]  # the entry's guard options (JSON-safe), for the slot header
    register: dict[str, Any]  # the registration for RQ's own CronJob (monitoring), guard options removed
    cron_job: Any = None


#: Where the guard options an entry cannot set live.
_ELSEWHERE = {
    n: RQ_ELSEWHERE.get(n, "set it on the @guarded_job function") for n in OPTION_NAMES if n not in ENTRY_OPTIONS
}


def _label(data: Mapping[str, Any]) -> str:
    func = data.get("func")
    default = f"{getattr(func, '__module__', '?')}.{getattr(func, '__name__', repr(func))}"
    return str(data.get("name") or default)


def check_registration(data: Mapping[str, Any], zone: tzinfo) -> CronEntry:
    """Check one ``rq.cron.register(...)`` call's arguments (``data``) and build its entry. Raises
    ConfigError naming the entry."""
    name = _label(data)
    where = f"rq cron entry {name!r}"
    func = data.get("func")
    if not callable(func):
        raise ConfigError(f"{where}: func must be a function, got {func!r}")
    queue = data.get("queue_name")
    if not isinstance(queue, str) or not queue:
        raise ConfigError(f"{where}: queue_name must be a non-empty str, got {queue!r}")
    interval, cron = data.get("interval"), data.get("cron")
    if interval and cron:
        raise ConfigError(f"{where}: give interval or cron, not both")
    schedule: Schedule
    if cron:
        try:
            schedule = Cron(parse_cron(cron), zone)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    elif interval:
        try:
            schedule = Interval(check_seconds("interval", interval))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    else:
        raise ConfigError(f"{where}: give interval=seconds or cron='expression'")
    meta = data.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise ConfigError(f"{where}: meta must be a dict, got {type(meta).__name__}")
    meta = dict(meta or {})
    guard = meta.pop(ENTRY_OPTION, None)
    options: dict[str, Any] = {}
    if guard is not None:
        if not isinstance(guard, dict):
            raise ConfigError(f"{where}: meta[{ENTRY_OPTION!r}] must be a dict of guard options, got {guard!r}")
        try:
            check_option_names(name, guard, supported=ENTRY_OPTIONS, elsewhere=_ELSEWHERE)
        except ConfigError as e:
            raise ConfigError(f"{where}: meta[{ENTRY_OPTION!r}]: {str(e).split(': ', 1)[-1]}") from None
        if getattr(func, "taskguard_options", None) is None:
            raise ConfigError(
                f"{where}: meta[{ENTRY_OPTION!r}] gives guard options, but {name} is not a "
                "@guarded_job function: nothing would apply them"
            )
        options = check_entry_options(
            where, guard, func, container=f"meta[{ENTRY_OPTION!r}]", guard=func.taskguard_options
        )
    args, kwargs = data.get("args") or (), data.get("kwargs") or {}
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise ConfigError(f"{where}: args must be a tuple and kwargs a dict")
    skip = {"func", "queue_name", "args", "kwargs", "interval", "cron", "name", "meta"}
    job_options = {k: v for k, v in data.items() if k not in skip and v is not None}
    if meta:
        job_options["meta"] = meta
    register = {k: v for k, v in data.items() if k != "meta"}
    register["meta"] = meta or None
    return CronEntry(name, func, queue, tuple(args), dict(kwargs), schedule, job_options, options, register)


def _unexpected_keyword(error: BaseException) -> str | None:
    """The keyword a ``register(...)`` call did not take, from its TypeError (in the cause chain)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, TypeError):
            found = re.search(r"unexpected keyword argument '([^']+)'", str(seen))
            if found:
                return found.group(1)
        seen = seen.__cause__ or seen.__context__
    return None


def load_registrations(config_path: str, connection: Any) -> tuple[Any, list[dict[str, Any]]]:
    """Load the ``rq cron`` configuration ``config_path`` (a dotted module path or a file path)
    as ``rq cron`` loads it (``CronScheduler.load_config_from_file``), and return ``(the RQ
    scheduler, the arguments of each register call)``; the RQ scheduler registers none of them
    yet. Raises ConfigError when RQ has no cron (RQ < 2.4), when the configuration cannot be
    loaded, or when a register call takes a keyword it does not know (with "did you mean")."""
    try:
        from rq.cron import CronScheduler
    except ImportError:
        raise ConfigError("taskguard rq-cron needs RQ >= 2.4 (rq.cron)") from None

    calls: list[dict[str, Any]] = []

    class _Collecting(CronScheduler):
        collecting = True

        def register(self, *args: Any, **kwargs: Any) -> Any:
            if not self.collecting:
                return super().register(*args, **kwargs)
            calls.append(dict(zip(REGISTER_KEYWORDS, args, strict=False), **kwargs))
            return None

    scheduler = _Collecting(connection=connection, logging_level=logging.WARNING)
    try:
        scheduler.load_config_from_file(config_path)
    except Exception as e:
        word = _unexpected_keyword(e)
        if word is not None:
            check_option_names(
                config_path, [word], supported=REGISTER_KEYWORDS, noun="rq.cron.register in", listing="its keywords"
            )
        raise ConfigError(f"cannot load the rq cron configuration {config_path!r}: {e}") from None
    scheduler.collecting = False
    return scheduler, calls


class _Adapter:
    """The RQ scheduler as the core's :class:`~taskguard.schedule.ScheduleAdapter`."""

    def __init__(self, owner: RQCronScheduler) -> None:
        self._owner = owner

    def entries(self) -> Iterator[PeriodicEntry]:
        return iter(self._owner.periodic_entries)

    def publish(self, entry: PeriodicEntry, slot: Slot) -> Any:
        return self._owner.enqueue(entry, slot)


class RQCronScheduler:
    """One ``taskguard rq-cron`` process (module docstring).

    Args:
        connection: RQ's Redis client (queues, jobs, RQ's cron bookkeeping).
        locks: the lease backend (leader lease, slot claims, the time-zone record).
        config_path: the ``rq cron`` configuration (dotted module path or file path).
        leader_ttl, catch_up, name, loop_interval: settings (:func:`cron_settings`).
        timezone: the IANA zone cron expressions are read in (default UTC); every scheduler of one
            ``name`` must use the same.
        clock: time source (default: the Redis server's clock).

    Raises ConfigError for a bad setting or registration (see :func:`check_registration`).
    """

    def __init__(
        self,
        connection: Any,
        locks: Locks,
        config_path: str,
        *,
        leader_ttl: Any = None,
        catch_up: Any = None,
        name: Any = None,
        timezone: Any = None,
        loop_interval: float = LOOP_INTERVAL,
        clock: Clock | None = None,
    ) -> None:
        self.settings = cron_settings(leader_ttl=leader_ttl, catch_up=catch_up, name=name, loop_interval=loop_interval)
        self.zone_name, self.zone = check_timezone(timezone)
        self.connection, self.locks, self.config_path = connection, locks, config_path
        self.rq, calls = load_registrations(config_path, connection)
        self.rq.config_file = config_path
        self.entries: list[CronEntry] = []
        seen: dict[str, CronEntry] = {}
        for data in calls:
            entry = check_registration(data, self.zone)
            if entry.name in seen:
                raise ConfigError(
                    f"two rq cron entries are named {entry.name!r}: give each register(...) call "
                    "its own name= (each entry's slots are named after it)"
                )
            seen[entry.name] = entry
            self.entries.append(entry)
        for entry in self.entries:  # RQ's own CronJob, for `rq cron`'s monitoring (registry, history)
            try:
                entry.cron_job = self.rq.register(**entry.register)
            except Exception as e:
                raise ConfigError(f"rq cron entry {entry.name!r}: RQ refuses it: {e}") from None
        self.periodic_entries = [PeriodicEntry(e.name, e.schedule, e.options, e) for e in self.entries]
        self.core = PeriodicScheduler(locks, self.settings, adapter=_Adapter(self), clock=clock, role=ROLE)
        self.stats = self.core.stats
        self.log = self.core.log
        self.zone_ttl = max(3 * self.settings.leader_ttl, 10.0)
        self._zone_due = 0.0
        self._zone_conflict = False
        try:
            from rq.exceptions import DuplicateJobError
        except ImportError:  # RQ < 2.8: no unique= of its own
            DuplicateJobError = None  # type: ignore[misc,assignment]  # noqa: N806
        self._duplicate = DuplicateJobError

    # -- the time zone, agreed across schedulers ----------------------------------------------------------
    def check_zone(self) -> None:
        """Record this scheduler's time zone beside the leader lease, or find the one recorded by
        the schedulers already running under this name. Raises ConfigError when it differs,
        LeaseBackendError when Redis fails."""
        key = self.core.leader_key
        for _ in range(3):
            if self.locks.put_record(key, ZONE_RECORD, self.zone_name, ttl=self.zone_ttl, if_absent=True):
                self._zone_due = time.monotonic() + self.zone_ttl / 3
                return
            current = self.locks.get_record(key, ZONE_RECORD)
            if current == self.zone_name:
                self._keep_zone()
                return
            if current is not None:
                raise ConfigError(
                    f"--timezone: this scheduler reads cron expressions in {self.zone_name!r}, but the rq-cron "
                    f"schedulers named {self.settings.name!r} already running read them in {current!r}; give "
                    f"every scheduler of one --name the same --timezone (the recorded zone goes "
                    f"{self.zone_ttl:g} s after the last of them stops)"
                )
        raise ConfigError("--timezone: the recorded time zone kept changing; try again")

    def _keep_zone(self) -> None:
        """Refresh the time-zone record (a third of its TTL at most); never raises."""
        now = time.monotonic()
        if now < self._zone_due:
            return
        try:
            kept = self.locks.put_record(
                self.core.leader_key,
                ZONE_RECORD,
                self.zone_name,
                ttl=self.zone_ttl,
                if_value=self.zone_name,
                if_absent=True,
            )
        except LeaseBackendError as e:
            self.log.warning("%s %s: could not refresh the time-zone record: %s", ROLE, self.core.id, e)
            return
        if not kept and not self._zone_conflict:
            self.log.error(
                "%s %s: another scheduler named %r recorded another time zone (%r) meanwhile",
                ROLE,
                self.core.id,
                self.settings.name,
                self.locks.get_record(self.core.leader_key, ZONE_RECORD),
            )
        self._zone_conflict = not kept
        self._zone_due = now + self.zone_ttl / 3

    # -- enqueue one slot -----------------------------------------------------------------------------
    def enqueue(self, entry: PeriodicEntry, slot: Slot) -> Any:
        """Enqueue ``entry``'s job for the claimed ``slot``: its deterministic id
        (:func:`slot_job_id`), ``meta["taskguard_cron"]`` = the slot header, RQ's ``unique=True``
        where RQ has it; then record it in RQ's cron history and registry. Returns the job (the
        existing one when the slot's job is already there). Raises what RQ raises when nothing was
        enqueued."""
        from rq import Queue
        from rq.job import Job

        e: CronEntry = entry.target
        queue = Queue(e.queue_name, connection=self.connection)
        options = dict(e.job_options)
        meta = {**(options.pop("meta", None) or {}), CRON_META_KEY: slot.header()}
        job_id = slot_job_id(self.settings.name, e.name, slot.id)
        unique = self._duplicate is not None and not options.get("rate_limit")
        if unique:
            options["unique"] = True
        elif self.connection.exists(Job.key_for(job_id)):  # RQ < 2.8: a look first (the claim fences the rest)
            self._already(e, slot, job_id)
            return Job(job_id, connection=self.connection)
        try:
            job = queue.enqueue(e.func, args=e.args, kwargs=e.kwargs, job_id=job_id, meta=meta, **options)
        except Exception as err:
            if self._duplicate is not None and isinstance(err, self._duplicate):
                self._already(e, slot, job_id)
                return Job(job_id, connection=self.connection)
            raise
        self._bookkeep(e, job, slot)
        return job

    def _already(self, e: CronEntry, slot: Slot, job_id: str) -> None:
        self.stats["already_enqueued"] += 1
        self.log.warning(
            "%s %s: %s slot %s: its job %s is already there; not enqueued again",
            ROLE,
            self.core.id,
            e.name,
            slot.id,
            job_id,
        )

    def _bookkeep(self, e: CronEntry, job: Any, slot: Slot) -> None:
        """RQ's cron bookkeeping, as ``CronJob.enqueue`` keeps it: the cron job's history of job ids
        and the cron job registry; and the times the RQ scheduler's record shows. Never raises."""
        enqueued = job.enqueued_at or datetime.now(timezone.utc)
        ts = enqueued.timestamp()
        cron_job = e.cron_job
        try:
            with self.connection.pipeline() as pipe:
                history = getattr(cron_job, "job_history_key", None)
                if history is not None:
                    from rq.defaults import DEFAULT_CRON_JOB_HISTORY_LIMIT, DEFAULT_CRON_JOB_HISTORY_TTL

                    pipe.zadd(history, {job.id: ts})
                    pipe.zremrangebyrank(history, 0, -(DEFAULT_CRON_JOB_HISTORY_LIMIT + 1))
                    pipe.expire(history, DEFAULT_CRON_JOB_HISTORY_TTL)
                registry: Any
                try:
                    from rq import cron_job_registry as registry
                except ImportError:  # an RQ without the cron job registry
                    registry = None
                if registry is not None and hasattr(registry, "add"):
                    registry.add(e.name, pipe, enqueue_timestamp=ts)
                pipe.execute()
            if cron_job is not None:
                cron_job.latest_enqueue_time = enqueued
                nxt = e.schedule.latest(slot.instant, 0.0)[1]
                cron_job.next_enqueue_time = datetime.fromtimestamp(slot.instant, timezone.utc) + timedelta(
                    seconds=nxt if nxt > 0 else getattr(e.schedule, "seconds", 60.0)
                )
                self.rq.save()
        except Exception as err:  # the job is enqueued: its bookkeeping is for people
            self.log.warning(
                "%s %s: %s: could not record job %s in RQ's cron history: %s", ROLE, self.core.id, e.name, job.id, err
            )

    # -- the process ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        """Check the time zone, register with RQ's scheduler registry, then tick until ``stop`` is
        set (SIGTERM / SIGINT set it when this runs in the main thread); release the leader lease
        and register the death on the way out. Raises ConfigError (time zone), LeaseBackendError
        (Redis unreachable at start)."""
        stop = stop or threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        self.check_zone()
        self.log.info(
            "%s %s: %d %s from %s, cron time zone %s, leader lease %s (ttl %gs)",
            ROLE,
            self.core.id,
            len(self.entries),
            "entry" if len(self.entries) == 1 else "entries",
            self.config_path,
            self.zone_name,
            self.core.leader_key,
            self.settings.leader_ttl,
        )
        self._rq_call(self.rq.register_birth)
        try:
            while not stop.is_set():
                try:
                    delay = self.core.tick()
                except Exception:  # never stop scheduling over one bad tick
                    self.log.exception("%s %s: tick failed", ROLE, self.core.id)
                    delay = self.settings.loop_interval
                self._keep_zone()
                self._rq_call(self.rq.heartbeat)
                stop.wait(min(max(delay, 0.02), self.settings.loop_interval))
        finally:
            self.close()

    def _rq_call(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # RQ's registry is for people: never stop scheduling over it
            self.log.warning("%s %s: RQ's scheduler registry: %s", ROLE, self.core.id, e)

    def close(self) -> None:
        """Release the leader lease (a standby takes over at once) and register the death. Never raises."""
        self.core.close()
        self._rq_call(self.rq.register_death)
