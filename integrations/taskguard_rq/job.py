"""``@guarded_job``: RQ job functions whose body runs under a fenced lease.

RQ has no per-enqueue identity (one hash per job id, overwritten by each enqueue), so every
execution of a job is a run: a returned or raised ``Retry``, ``job.requeue()``, an ``enqueue``
with a reused ``job_id``, a scheduled job and abandoned-job recovery all run the body again. The
only duplicate is an execution of a job id while an earlier execution of the same id still holds
the lease: it waits for that one (each step bounded by the holder's TTL, so a dead holder is
outlived) and then runs; it never finishes as ``Skipped``, which would fire the job's success
callbacks and dependents.

RQ keeps one job id across retries, so the lease handle of a job that will be retried is kept in
a record under ``rq-job:<job id>`` (:mod:`taskguard.handle_records`), not in ``job.meta``: a
worker whose work-horse was killed saves its stale in-memory job, meta included, over what the
horse saved (rq/worker: ``handle_job_failure`` runs in the parent with the parent's copy of the
job). ``job.meta["taskguard"]`` mirrors key, fencing token and outcome for people, never the owner
token.
"""

from __future__ import annotations

import base64
import contextvars
import datetime
import functools
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from rq import Retry, get_current_job
from rq.command import send_stop_job_command
from rq.exceptions import NoSuchJobError

try:
    from rq.exceptions import DuplicateJobError
except ImportError:  # RQ < 2.8: no unique= of its own
    DuplicateJobError = None  # type: ignore[misc,assignment]  # noqa: N806
from rq.job import Job, JobStatus
from rq.registry import ScheduledJobRegistry

from taskguard import ConfigError, LeaseBackendError, Locks, Skipped, TaskSkipped, handle_records
from taskguard.context import running
from taskguard.debounce import Window, closing, due as window_due, publish_call, refused
from taskguard.handoff import release_handle
from taskguard.overlap import Pending
from taskguard.pipeline import Execution, Pend, Run, Skip, Stored, decide, perform, shadow_line
from taskguard.policy import OPTION_NAMES, GuardOptions, check_option_names
from taskguard.run import GuardedRun, nested_in
from taskguard.settlement import settle
from taskguard.values import Ending, Reason, plain

from . import unique
from .config import locks_for
from .cron_runs import entry_guard
from .unique import clear_mark, mark_of

__all__ = ["guarded_job", "skip_count", "load_handle", "handle_record", "META_KEY", "RATE_META_KEY", "ON_SKIP"]

# a child of RQ's worker logger: `rq worker`'s own logging (INFO by default) shows these lines
log = logging.getLogger("rq.worker.taskguard")

META_KEY = "taskguard"
#: ``job.meta`` entry of a job deferred by its ``rate``: ``{"since", "turn"}`` (:mod:`taskguard.pacing`).
RATE_META_KEY = "taskguard_rate"
#: The longest one rate deferral lasts, seconds. RQ's scheduler holds a scheduled job in Redis (no
#: broker timeout applies), so this only bounds how far ahead a turn is booked; a longer wait
#: asks again.
RATE_MAX_COUNTDOWN = 3600.0
#: RQ's JobStatus is a closed enum and RQ has no "ignore this run" outcome, so an RQ skip either
#: finishes the job with a ``Skipped`` value or fails it with ``TaskSkipped``.
ON_SKIP = ("result", "raise")
#: RQ's default ``job_timeout``, seconds (rq/defaults.py); bounds the wait for an earlier
#: execution of the same job id when the job sets none.
DEFAULT_JOB_TIMEOUT = 180.0
#: How long the handle record of a running job without a time limit (``job_timeout=-1``: RQ runs
#: it for as long as it takes; rq/rq#872, #1085. Another negative value is no such thing: RQ's
#: worker kills the work-horse once it ran the timeout plus 60 s) lasts should nothing drop it,
#: seconds.
#: (Bounded by the 180 s default instead, a job running longer lost its record: a work-horse
#: killed after that had its lease released, not kept for its retry.)
UNLIMITED_JOB_RECORD_TTL = 7 * 86400.0
#: A function's skip counter goes this many seconds after its last skip (it is a gauge for people,
#: the Prometheus counter is the durable one).
SKIP_COUNT_TTL = 7 * 86400.0
#: The lease key whose records hold the skip counters, one record per job function.
SKIP_RECORD_KEY = "rq-skips"


def record_skip(locks: Locks, name: str) -> None:
    """Count one skip of the job function ``name`` (read by :func:`skip_count`); a Redis error
    is logged, never raised over the job's outcome."""
    try:
        locks.count_record(SKIP_RECORD_KEY, name, ttl=SKIP_COUNT_TTL)
    except LeaseBackendError as e:
        log.warning("could not count a skip of %s: %s", name, e)


def skip_count(name: str, locks: Locks | None = None) -> int:
    """Skips counted so far for the job function labelled ``name`` (``guarded.taskguard_name``)."""
    raw = locks_for(locks).get_record(SKIP_RECORD_KEY, name)
    return int(raw) if raw else 0


def handle_record(job_id: str) -> str:
    """The record key a job's lease handle is kept under (:mod:`taskguard.handle_records`)."""
    return "rq-job:" + job_id


def load_handle(locks: Locks, job_id: str) -> dict | None:
    """The lease handle kept for ``job_id`` (a running job's or a retry's, with ``"running"``), or
    ``None`` (:func:`taskguard.handle_records.load`). Raises LeaseBackendError."""
    return handle_records.load(locks, handle_record(job_id))


def mirror_meta(job: Any, refresh: bool = False, **fields: Any) -> None:
    """Record the guard's view in ``job.meta["taskguard"]`` (merged with the user's meta; with
    ``refresh``, with the meta stored now, e.g. from the worker's main process, whose copy of
    the job predates what its work-horse wrote)."""
    if job is None:
        return
    if refresh:
        _refresh_meta(job)
    try:
        job.meta.setdefault(META_KEY, {}).update(fields)
        job.save_meta()
    except Exception as e:  # visibility only: never fail the job over it
        log.warning("job %s: could not save meta: %s", job.id, e)


def _refresh_meta(job: Any) -> None:
    """Read ``job.meta`` as stored now (one HGET); a Redis error keeps the copy in hand."""
    try:
        job.meta = job.get_meta(refresh=True)
    except Exception as e:
        log.warning("job %s: could not read its meta: %s", job.id, e)


#: Where the guard options ``@guarded_job`` does not take live for RQ.
RQ_ELSEWHERE = {
    "unique": "RQ has no publish hook; enqueue with fn.enqueue_unique(queue, ...) or "
    "taskguard_rq.enqueue_unique(queue, fn, args, kwargs, unique_ttl=...)",
    "unique_ttl": "it is an argument of taskguard_rq.enqueue_unique(queue, fn, args, kwargs, unique_ttl=...)",
    "continue_on_skip": "RQ has no chains or link callbacks for a skip to stop; a skipped job ends FINISHED, so "
    "jobs that depend on it (depends_on) run; use on_skip='raise' to fail it instead",
    **dict.fromkeys(
        ("skip_retry_delay", "skip_max_retries"),
        "it tunes on_skip='retry', which RQ jobs do not have (on_skip is 'result' or 'raise'); to run after "
        "the holder instead of being skipped, wait for it (wait=, blocking_wait=True) or enqueue the job again",
    ),
}
#: The guard options ``@guarded_job`` takes: every one but the publish-time, chain and skip-retry options.
RQ_OPTIONS = tuple(n for n in OPTION_NAMES if n not in RQ_ELSEWHERE)


def guarded_job(
    func: Callable[..., Any] | None = None, *, name: str | None = None, locks: Locks | None = None, **options: Any
) -> Any:
    """Decorate an RQ job function so that its body runs under a fenced lease.

    ``@guarded_job(ttl=60, key="sync:{customer_id}", wait=0, on_skip="result")``. Options are
    those of :meth:`taskguard.policy.GuardOptions.build` with ``on_skip`` limited to
    :data:`ON_SKIP`; ``name`` labels holders, skips and metrics (default: the function's
    qualified name); ``locks`` is a :class:`taskguard.Locks` (default: :func:`taskguard.from_env`).
    Options are validated here; a bad one raises :class:`taskguard.ConfigError`.

    The decorated function runs guarded when a worker performs the job and when called directly.
    A run that finds another job holding the lease returns a :class:`taskguard.Skipped` (job
    status FINISHED, ``job.return_value()`` is the ``Skipped``,
    ``job.meta["taskguard"]["outcome"] == "skipped"``) or, with ``on_skip="raise"``, fails with
    :class:`taskguard.TaskSkipped`. An execution that finds an earlier execution of its own job id
    holding the lease waits for it (up to the job's ``job_timeout``; 180 s for a job with none or
    with ``job_timeout=-1``) and then runs; if that one is still running then, it fails with
    ``TaskSkipped(reason="running")``.

    ``limit=N`` lets N jobs of one key run at once (a run finding every slot held is skipped,
    reason ``"limit"``); ``guarded.rate_limit_for(*args, **kwargs)`` gives RQ 3's own
    ``RateLimit`` for the same key and limit, so RQ parks jobs over it instead. ``rate=`` (with
    ``rate_key``, ``rate_burst``, ``rate_max_wait``, ``cost``) defers a job over the rate to its booked turn
    through RQ's scheduler (:mod:`taskguard.pipeline`), or skips it past ``rate_max_wait`` (reason
    ``"rate_limited"``). ``limit_total=M`` (with ``limit_total_key``) also caps the jobs of every
    key together: a job needs a place in both, gives its key's slot back when the total is full
    and is skipped with reason ``"limit_total"``. :func:`current_lease` is then the lease on the
    job's key (the key's fencing token) and ``current_lease().total`` its place in the total (its
    own fencing token); the job's handle record nests the total's handle, so a retry and
    :class:`GuardedWorker` settle both. ``rate_limit_for`` parks by the key's ``limit`` only.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        label = name or f"{fn.__module__}.{fn.__qualname__}"
        check_option_names(label, options, supported=RQ_OPTIONS, elsewhere=RQ_ELSEWHERE, noun="job")
        opts = GuardOptions.build(fn, name=label, allowed_on_skip=ON_SKIP, noun="job", locks=locks, **options)

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            return _perform(fn, label, opts, locks, args, kwargs)

        def rate_limit_for(*args: Any, **kwargs: Any) -> Any:
            """RQ's own ``RateLimit`` (RQ >= 3.0) for a call with these arguments: its lease key
            (prefixed ``taskguard:``) with ``concurrency`` = this job's ``limit``. Enqueue with
            ``rate_limit=fn.rate_limit_for(...)`` and RQ parks jobs over the limit (status
            ``rate_limited``) and enqueues them when a slot frees, instead of delivering them to
            be skipped; the lease slots still fence the runs. Raises ConfigError on RQ 2.x."""
            try:
                from rq import RateLimit
            except ImportError:
                raise ConfigError("rate_limit_for needs RQ >= 3.0 (rq.RateLimit)") from None
            return RateLimit(f"taskguard:{opts.key.render(args, kwargs)}", opts.limit_of(args, kwargs))

        guarded.taskguard_options = opts  # type: ignore[attr-defined]
        guarded.taskguard_locks = locks  # type: ignore[attr-defined]
        guarded.taskguard_name = label  # type: ignore[attr-defined]

        def enqueue_unique(queue: Any, *args: Any, **kwargs: Any) -> Any:
            """``taskguard_rq.enqueue_unique(queue, this job, args, kwargs)``: enqueue unless a job of
            this key is queued or running (then that job is returned). RQ has no publish hook, so a
            plain ``queue.enqueue`` is never stopped: enqueue through this."""
            return unique.enqueue_unique(queue, guarded, args, kwargs)

        guarded.rate_limit_for = rate_limit_for  # type: ignore[attr-defined]

        def enqueue_debounced(queue: Any, *args: Any, **kwargs: Any) -> Any:
            """Enqueue a call of this job through its ``debounce`` window: the first call of a
            window enqueues one job ``debounce`` seconds ahead (RQ's ``enqueue_in``: workers need
            ``--with-scheduler``); later calls enqueue nothing, update the window's arguments and
            return that job (``rq.job.Job``), which runs once with the last call's arguments.
            ``kwargs`` are the function's own (RQ enqueue options cannot be passed here). Raises
            ConfigError without ``debounce=``, what rendering the key raises for these arguments,
            LeaseBackendError when Redis fails (nothing enqueued)."""
            return _enqueue_debounced(queue, guarded, opts, label, locks, args, kwargs)

        guarded.enqueue_unique = enqueue_unique  # type: ignore[attr-defined]
        guarded.enqueue_debounced = enqueue_debounced  # type: ignore[attr-defined]
        return guarded

    return decorate(func) if func is not None else decorate


#: The job whose execution this context is performing through :func:`_perform`. RQ's
#: ``get_current_job()`` gives that job to everything its function calls, so a guarded function
#: called directly from inside it (recursion, another guarded job called as a function) sees it
#: too: it is a direct call, judged by its own call, not that job's execution.
_performing: contextvars.ContextVar[Any] = contextvars.ContextVar("taskguard_rq_performing", default=None)


def _in_work_horse(job: Any) -> bool:
    """Whether ``job`` runs in a work-horse its worker can kill (RQ's stop-job command), not in the
    worker's own process (``SimpleWorker``, whose ``kill_horse`` does nothing: rq/worker/base.py).
    A work-horse leads a process group of its own (rq/worker/worker_classes.py), so a process
    that does not is none; one that does (a worker started in a session of its own) is told by
    the worker's pid (its ``rq:worker:<name>`` hash) against its own; unknown counts as a
    work-horse. At most one HGET, for ``replace_terminate`` jobs only."""
    from rq.worker import Worker

    if not _by_worker(job):
        return False  # performed by its caller (Queue(is_async=False), job.perform()): no worker
    if os.getpgrp() != os.getpid():
        return False  # every work-horse leads a process group (os.setpgrp, posix_spawn setpgroup=0)
    try:
        pid = job.connection.hget(Worker.redis_worker_namespace_prefix + job.worker_name, "pid")
    except Exception:  # (a Redis error: the acquire that follows reports it)
        return True
    return pid is None or int(pid) != os.getpid()


#: The worker name RQ gives a job its caller performs with ``Queue(is_async=False)``
#: (rq/queue.py ``Queue.run_sync``: ``job.prepare_for_execution('sync', ...)``).
SYNC_WORKER_NAME = "sync"


def _by_worker(job: Any) -> bool:
    """Is ``job`` performed by an RQ worker, not by its caller (``Queue(is_async=False)``, named
    :data:`SYNC_WORKER_NAME`; ``job.perform()``, no worker name)? Only a worker runs a job again
    when it asks for a retry (rq/worker ``handle_job_failure`` / ``handle_job_retry``): a job its
    caller performs ends there, retries left or not, so its lease is never kept for a retry."""
    return job is not None and bool(job.worker_name) and job.worker_name != SYNC_WORKER_NAME


def _job_timeout(job: Any) -> float:
    timeout = getattr(job, "timeout", None)
    return float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else DEFAULT_JOB_TIMEOUT


def _perform(
    fn: Callable[..., Any],
    name: str,
    opts: GuardOptions,
    locks: Locks | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    job = get_current_job()
    if job is None or _performing.get() is job:
        return _run(fn, name, opts, locks, args, kwargs, None)  # a direct call
    token = _performing.set(job)
    try:
        return _run(fn, name, opts, locks, args, kwargs, job)
    finally:
        _performing.reset(token)


def _run(
    fn: Callable[..., Any],
    name: str,
    opts: GuardOptions,
    given: Locks | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    job: Any,
) -> Any:
    """One guarded run: ``job``'s execution, or a direct call (``job`` ``None``). The arguments
    are bound first: a caller's wrong arguments raise their ``TypeError`` even where no Redis is
    configured."""
    if job is not None:  # a job enqueued by `taskguard rq-cron`: its entry's guard options
        opts = entry_guard(job, fn, name, opts)
    key = opts.key.render(args, kwargs)
    locks = locks_for(given)
    nested = nested_in(key, locks) if job is None else None
    if nested is not None:  # a direct call inside a run of the same key in this thread (recursion)
        with running(nested):
            return fn(*args, **kwargs)
    run_id = job.id if job is not None else None
    window = None  # a debounce window's job that closed it: the window's stored call
    entry = job.meta.get(DEBOUNCE_META_KEY) if job is not None and opts.debounce is not None else None
    if isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("call"), str):
        # a closed window's run, back (a retry, a requeue, its rate turn...): its call, kept in the
        # meta — which RQ's worker never overwrites with its own older copy of the job, as it does
        # the arguments after a killed work-horse
        args, kwargs = _decode_call(job, entry["call"])
    elif entry == key:
        state, value = window_due(locks, key, job.id, again=True)  # (a job killed after closing it: its call)
        if state == "wait":  # arrived early (RQ's scheduler counts whole seconds): the rest of the window
            return _come_back(job, max(1, math.ceil(value)))
        if state == "gone":  # a copy of a window that ran already
            return _settle(job, locks, name, opts, Skip(Skipped(key=key, reason=Reason.DEBOUNCED, task=name)))
        args, kwargs, window = *_decode_call(job, value), value  # the window closed: the latest call's arguments
    with closing(locks, key, run_id, window is not None):
        return _execute(fn, name, opts, locks, key, job, args, kwargs, window)


def _execute(
    fn: Callable[..., Any],
    name: str,
    opts: GuardOptions,
    locks: Locks,
    key: str,
    job: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    window: Any,
) -> Any:
    run_id = job.id if job is not None else None
    ex = Execution(
        task=name,
        run_id=run_id,
        holder={"job": name, "job_id": run_id},
        stoppable=not opts.replace_terminate or job is None or _in_work_horse(job),
        # performed by its caller (a direct call; Queue(is_async=False), job.perform()): no worker
        # runs it again, so it waits for a rate turn here and a 429 is raised, as a direct call's
        local=not _by_worker(job),
        same_run="wait",
        same_run_wait=_job_timeout(job),
    )
    hooks = _Hooks(locks, job, name, opts.replace_terminate)
    decision = decide(opts, key, args, kwargs, ex, hooks, locks)
    if window is not None:
        decision = _window_decision(job, locks, opts, key, window, decision, args, kwargs)
        if isinstance(decision, Retry):
            return decision
    if not isinstance(decision, Run):
        return _outcome(job, locks, name, opts, key, decision)
    run = decision.run
    lease = run.lease
    where = handle_record(run_id) if run_id is not None else None
    unlimited = getattr(job, "timeout", None) == -1
    with handle_records.while_running(
        locks, where, run, ttl=UNLIMITED_JOB_RECORD_TTL if unlimited else _job_timeout(job) + opts.ttl
    ):
        if lease is not None:
            mirror_meta(job, key=key, fence=lease.fencing_token, slot=lease.slot, outcome="running")
        done = perform(decision, lambda: fn(*args, **kwargs), opts, key, args, kwargs, ex, hooks, locks)
    # after the body: the meta as stored now (what the body or another process saved meanwhile,
    # e.g. a progress entry through another Job instance), never this execution's older copy
    if done.instead is not None:
        return _outcome(job, locks, name, opts, key, done.instead, after_body=True)
    if lease is not None and not (isinstance(done.value, Retry) and _by_worker(job)):  # (mirrored when kept)
        mirror_meta(job, refresh=True, outcome="ran")
    return done.value


class _Hooks:
    """:class:`taskguard.pipeline.Hooks` for one execution of a job (``job`` ``None``: a direct call)."""

    __slots__ = ("locks", "job", "name", "terminate")

    def __init__(self, locks: Locks, job: Any, name: str, terminate: bool = False) -> None:
        self.locks, self.job, self.name, self.terminate = locks, job, name, terminate

    # -- how the body ended -----------------------------------------------------------------------
    def failed(self, exc: BaseException) -> bool:
        return isinstance(exc, Exception)

    def settle(self, run: GuardedRun, exc: BaseException) -> None:
        """The body raised: if RQ runs the job again (its ``Retry``: ``retries_left``), keep the
        lease for that execution; else release it."""
        job = self.job
        if run.lease is None:  # shadow mode without the lease: nothing to keep or release
            return
        retry_in = job.get_retry_interval() if _by_worker(job) and job.retries_left else None
        _end(job, self.locks, run, retry_in, "failed")

    def returned(self, run: GuardedRun, value: Any) -> bool:
        """A returned ``Retry`` (RQ >= 2.1 runs the job again): keep the lease for that execution."""
        if run.lease is None or not isinstance(value, Retry) or not _by_worker(self.job):
            return False
        job = self.job
        retries = (job.number_of_retries or 0) if job is not None else 0
        retry_in = Retry.get_interval(retries, value.intervals) if retries < value.max else None
        _end(job, self.locks, run, retry_in, "ran")
        return True

    def persisted_handle(self) -> dict[str, Any] | None:
        handle = load_handle(self.locks, self.job.id) if self.job is not None else None
        # the handle of an execution that may still be running (an orphaned work-horse): never
        # take its lease over; wait for it like any earlier execution of this job id
        return None if handle is not None and handle.get("running") else handle

    def release_handle(self, handle: Any) -> None:
        """Release the lease a failed execution of the job kept for its retry."""
        try:
            release_handle(self.locks, handle)  # (and its place in the total, if any)
            handle_records.drop(self.locks, handle_record(self.job.id))
        except (LeaseBackendError, ConfigError) as e:
            log.warning("job %s: could not release its kept lease before a rate wait: %s", self.job.id, e)

    def finished(self) -> bool:
        return False  # every execution of a job is a run (RQ has no per-enqueue identity)

    def clear_mark(self) -> None:
        clear_mark(self.locks, self.job)

    def queued_mark(self) -> tuple[str, str, str] | None:
        return mark_of(self.job)

    def result_codec(self) -> Any:
        return _result_codec(self.job)

    def rate_state(self) -> Any:
        return self.job.meta.get(RATE_META_KEY) if self.job is not None else None

    def rate_bound(self) -> float:
        return RATE_MAX_COUNTDOWN

    def rate_go(self) -> None:
        job = self.job
        if job is not None and RATE_META_KEY in job.meta:
            job.meta.pop(RATE_META_KEY)
            _quietly_save_meta(job)

    def shadow(self, key: str, reason: str, holder_ttl: float | None, leased: bool, rate: bool) -> None:
        log.info("%s: %s", self.name, shadow_line(key, reason, rate))
        fields: dict[str, Any] = (
            {"shadow": reason} if rate else {"shadow": reason, "key": key}
        )  # (a rate key is no lease key)
        mirror_meta(self.job, **fields)

    def lost(self, run: GuardedRun, reason: str) -> None:
        pass

    # -- overlap="coalesce": the pending job waits in RQ's ScheduledJobRegistry --------------------
    def pending_message(self) -> Any:
        return None  # the job id is enough: RQ keeps the job's arguments

    def wake(self, p: Pending) -> None:
        _run_now(self.job.connection, p.run_id)

    def supersede(self, prev: Pending, skipped: Skipped) -> None:
        """Mark ``prev``'s job as coalesced into this one and run it now, to end ``skipped``."""
        try:
            job = Job.fetch(prev.run_id, connection=self.job.connection)
            job.meta = job.get_meta(refresh=True)
            job.meta.setdefault(META_KEY, {})["coalesced_into"] = skipped.follow_up
            job.save_meta()
            _run_now(self.job.connection, prev.run_id, job)
        except Exception as e:  # it ends when its own backstop runs it
            log.warning("job %s: could not mark it coalesced into %s: %s", prev.run_id, skipped.follow_up, e)

    def coalesced_into(self) -> str | None:
        job = self.job
        if job is None:
            return None
        into = (job.get_meta(refresh=True).get(META_KEY) or {}).get("coalesced_into")
        return into if isinstance(into, str) else None

    def replaced(self, holder: Any) -> None:
        """``replace_terminate=True``: end the replaced job as ``Skipped(reason="replaced")`` —
        its skip reported (core event, Prometheus, the job function's skip count) and its meta
        marked (``outcome="skipped"``, ``reason``, ``replaced_by``) — then stop it (RQ's stop-job
        command: its worker kills the work-horse and the job ends STOPPED; RQ stores no value for
        a stopped job)."""
        if not self.terminate or holder.run_id is None:
            return
        if self.job is None:  # a direct call has no RQ connection to send the stop-job command on
            log.warning(
                "%s: took the lease %r over from job %s, which a direct call cannot stop (no RQ connection); "
                "it goes on without its lease and ends Skipped('replaced')",
                self.name,
                holder.key,
                holder.run_id,
            )
            return
        try:
            old = Job.fetch(holder.run_id, connection=self.job.connection)
            if old.get_status(refresh=False) != JobStatus.STARTED:
                # (a retry waiting with its kept lease: nothing runs to stop; the retry ends
                # Skipped("replaced") itself when it comes, reported then, once)
                return
        except NoSuchJobError:
            return
        name = (holder.holder or {}).get("job") or self.name
        skipped = Skipped(key=holder.key, reason=Reason.REPLACED, task=name, follow_up=self.job.id)
        try:
            self.locks.report_skip(skipped)
            record_skip(self.locks, name)
            mirror_meta(old, refresh=True, outcome="skipped", reason=Reason.REPLACED.value, replaced_by=self.job.id)
        except Exception as e:  # (reporting only: the stop goes on)
            log.warning("job %s: could not report the replaced job %s: %s", self.job.id, holder.run_id, e)
        try:
            send_stop_job_command(self.job.connection, holder.run_id)
            log.info("job %s: stopped the replaced job %s", self.job.id, holder.run_id)
        except Exception as e:
            log.warning("job %s: could not stop the replaced job %s: %s", self.job.id, holder.run_id, e)


#: ``job.meta`` entry of a ``debounce`` window's job: its lease key; once the window closed,
#: ``{"key", "call"}``: the window's call, which every later execution of the job runs.
DEBOUNCE_META_KEY = "taskguard_debounce"


def _enqueue_debounced(
    queue: Any,
    guarded: Any,
    opts: GuardOptions,
    name: str,
    given: Locks | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if opts.debounce is None or opts.debounce_max is None:
        raise ConfigError(f"job {name!r}: enqueue_debounced needs debounce= on @guarded_job")
    key = opts.key.render(args, kwargs)

    def send(w: Window) -> Any:
        # the function's own arguments as args= / kwargs=: none of them is taken for an RQ option
        # (a parameter named ttl or meta); unique=True (RQ >= 2.8): a publisher that stalled past
        # its claim while another call published the window's job never overwrites that job
        options = {"job_id": w.run_id, "meta": {DEBOUNCE_META_KEY: key}}
        due = datetime.timedelta(seconds=w.countdown)
        if DuplicateJobError is None:
            return queue.enqueue_in(due, guarded, args=args, kwargs=kwargs, **options)
        try:
            return queue.enqueue_in(due, guarded, args=args, kwargs=kwargs, unique=True, **options)
        except DuplicateJobError:
            log.info("job %s: the debounce window of %r was published meanwhile", w.run_id, key)
            return Job.fetch(w.run_id, connection=queue.connection, serializer=queue.serializer)

    fetched: dict[str, Any] = {}

    def over(run_id: str) -> bool:  # the window's job, fetched once for joined() too
        try:
            job = fetched[run_id] = Job.fetch(run_id, connection=queue.connection, serializer=queue.serializer)
        except NoSuchJobError:  # deleted (the window is marked published: its job was written)
            return True
        return job.get_status(refresh=False) in unique.OVER  # cancelled, failed before its body...

    def joined(run_id: str) -> Any:
        job = fetched.get(run_id)
        return job if job is not None else Job.fetch(run_id, connection=queue.connection, serializer=queue.serializer)

    return publish_call(
        locks_for(given),
        key,
        str(uuid.uuid4()),
        base64.b64encode(queue.serializer.dumps((list(args), kwargs))).decode(),
        debounce=opts.debounce,
        debounce_max=opts.debounce_max,
        task=name,
        send=send,
        joined=joined,
        over=over,
    )


def _window_decision(
    job: Any, locks: Locks, opts: GuardOptions, key: str, window: Any, decision: Any, args: Any, kwargs: Any
) -> Any:
    """The job closed its debounce window. Refused because the key is busy (its lease held: the
    previous window's run still going), the window is put back and the job comes back to look
    again (a ``Retry``: :func:`taskguard.debounce.refused`), or — a newer window open meanwhile,
    whose calls win — ends ``Skipped("debounced")``. Any other decision: from here the job is a
    plain job of the window's call (saved as its arguments and as its window entry), so that
    whatever brings it back — a retry, a requeue, its rate turn, its wake as a pending follow-up —
    runs it."""
    if isinstance(decision, Skip):
        back = refused(
            locks, key, job.id, window, decision.skipped, debounce=opts.debounce or 0.0, bound=RATE_MAX_COUNTDOWN
        )
        if isinstance(back, float):
            log.info("job %s: lease %r held; debounce window put back for %ss", job.id, key, math.ceil(back))
            mirror_meta(job, key=key, outcome="pending")
            return _come_back(job, math.ceil(back))
        if back is not None:
            return Skip(back)
    job.args, job.kwargs = list(args), dict(kwargs)
    job.meta[DEBOUNCE_META_KEY] = {"key": key, "call": window}
    try:
        job.save()
    except Exception as e:  # the run goes on; only a later execution would find its window gone
        log.warning("job %s: could not save the debounce window's arguments as its own: %s", job.id, e)
    return decision


def _decode_call(job: Any, body: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = job.serializer.loads(base64.b64decode(body))
    return tuple(args), dict(kwargs)


def _run_now(connection: Any, job_id: str, job: Any = None) -> bool:
    """Move the scheduled job ``job_id`` to now (RQ's scheduler enqueues it within about a second);
    only a job still in the ScheduledJobRegistry (``ZADD XX``): a job already queued or running is
    never added again. Returns ``True`` when moved."""
    job = job if job is not None else Job.fetch(job_id, connection=connection)
    registry = ScheduledJobRegistry(job.origin, connection=connection)
    return bool(connection.zadd(registry.key, {job_id: int(time.time())}, xx=True, ch=True))


def _outcome(job: Any, locks: Locks, name: str, opts: GuardOptions, key: str, d: Any, after_body: bool = False) -> Any:
    """What a decision other than ``Run`` means for a job (RQ never sees a ``Duplicate``: no copy
    of a job is refused as finished)."""
    if isinstance(d, (Skip, Stored)):
        return _settle(job, locks, name, opts, d, after_body)
    if isinstance(d, Pend):
        # the key's pending follow-up: RQ's scheduler holds the job (rq worker --with-scheduler)
        # until the run that holds the lease ends and moves it to now, or the backstop time
        countdown = 0 if d.woken else math.ceil(d.countdown)
        log.info("job %s: lease %r held; pending follow-up (backstop in %ss)", job.id, key, countdown)
        mirror_meta(job, refresh=True, key=key, outcome="pending")
        return _come_back(job, countdown)
    if d.why == Reason.RUNNING:  # an earlier execution of this job id outlasted the wait
        raise TaskSkipped(key, Reason.RUNNING.value, name, d.run.holder_ttl)
    # deferred to its rate turn: RQ's scheduler runs it again, consuming neither the job's own
    # Retry (retries_left) nor its returned-Retry count (_come_back)
    if after_body:  # (a back-off the body's RateLimited asked for: the meta as stored now)
        _refresh_meta(job)
    job.meta[RATE_META_KEY] = d.state  # saved by mirror_meta below
    log.info("job %s: %s", job.id, d.describe())
    mirror_meta(job, key=key, outcome=plain(d.why))
    # whole seconds (RQ's Retry): a turn rounded down (the job waits out the rest of its turn on
    # arrival, so the scheduler's rounding never bunches booked turns together); a back-off pause
    # rounded up (asking again inside the pause would only defer once more)
    return _come_back(job, math.ceil(d.countdown) if d.why == Reason.BACKOFF else int(d.countdown))


def _come_back(job: Any, seconds: int) -> Retry:
    """The job comes back in ``seconds`` (whole: RQ's ``Retry``) through RQ's scheduler (``rq worker
    --with-scheduler``), consuming none of its own retries: RQ counts a returned ``Retry`` in
    ``number_of_retries`` (rq/job.py), which is set back first."""
    job.number_of_retries = (job.number_of_retries or 0) - 1
    return Retry(max=10**9, interval=[seconds])


def _end(job: Any, locks: Locks, run: GuardedRun, retry_in: float | None, outcome: str) -> None:
    """The execution ends without finishing the job's work for good: the lease is kept for the
    execution RQ runs ``retry_in`` seconds from now (its handle saved over the running
    execution's), else released (:func:`taskguard.handle_records.keep_for_retry`). Never raises
    (the body's own exception must win)."""
    try:
        kept = handle_records.keep_for_retry(locks, handle_record(job.id), run, retry_in)
        mirror_meta(job, refresh=True, outcome="retrying" if kept else outcome)  # (after the body)
    except (LeaseBackendError, ConfigError) as e:
        log.warning("lease %r: could not hand over or release after the body ended: %s", run.key, e)


def _result_codec(job: Any) -> tuple[Any, Any]:
    """``(dumps, loads)`` storing a ``once`` value as RQ stores the job's results: the job's
    serializer (RQ's default: pickle; rq/serializers.py ``resolve_serializer``)."""
    from rq.serializers import resolve_serializer

    serializer = resolve_serializer(getattr(job, "serializer", None))

    def dumps(value: Any) -> tuple[str, str, Any]:
        return "application/x-rq-serializer", "binary", serializer.dumps(value)

    def loads(data: Any, content_type: str, encoding: str) -> Any:
        return serializer.loads(data)

    return dumps, loads


def _quietly_save_meta(job: Any) -> None:
    try:
        job.save_meta()
    except Exception as e:
        log.warning("job %s: could not save meta: %s", job.id, e)


def _settle(job: Any, locks: Locks, name: str, opts: GuardOptions, d: Skip | Stored, after_body: bool = False) -> Any:
    """A skip or a stored value, as the core settles it (:func:`taskguard.settlement.settle`; RQ
    never retries a skip): the job's value, or ``TaskSkipped``."""
    s = settle(opts, d, locks, name)
    if isinstance(d, Stored):
        log.info("%s: %r already completed; returning the stored value", name, d.key)
        mirror_meta(job, refresh=after_body, key=d.key, outcome="once")
        return s.value
    skipped = s.skipped
    record_skip(locks, name)
    log.info("%s", skipped.describe())
    mirror_meta(
        job,
        refresh=after_body,
        key=skipped.key,
        outcome="skipped",
        reason=skipped.reason,
        holder_ttl=skipped.holder_ttl,
    )
    if s.ending == Ending.RAISE:
        raise s.error()
    return s.value
