"""``@guarded_job``: RQ job functions whose body runs under a fenced lease.

RQ has no per-enqueue identity (one hash per job id, overwritten by each enqueue), so every
execution of a job is a run: a returned or raised ``Retry``, ``job.requeue()``, an ``enqueue``
with a reused ``job_id``, a scheduled job and abandoned-job recovery all run the body again. The
only duplicate is an execution of a job id while an earlier execution of the same id still holds
the lease: it waits for that one (each step bounded by the holder's TTL, so a dead holder is
outlived) and then runs; it never finishes as ``Skipped``, which would fire the job's success
callbacks and dependents.

RQ keeps one job id across retries, so the lease handle of a job that will be retried is kept in
a record under ``rq-job:<job id>`` (:meth:`taskguard.Locks.put_record`), not in ``job.meta``: a
worker whose work-horse was killed saves its stale in-memory job, meta included, over what the
horse saved (rq/worker: ``handle_job_failure`` runs in the parent with the parent's copy of the
job). ``job.meta["taskguard"]`` mirrors key, fencing token and outcome for people, never the owner
token.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any, cast

from rq import Retry, get_current_job

from taskguard import ConfigError, LeaseBackendError, Locks, RateLimited, Skipped, TaskSkipped
from taskguard.keys import KeyTemplate
from taskguard.pacing import Pace, back_off, charging, pace, parse_state, shadow_reason
from taskguard.policy import OPTION_NAMES, GuardOptions, check_option_names
from taskguard.run import GuardedRun

from .config import locks_for
from .cron_runs import entry_guard
from .handles import drop_handle, load_handle, save_handle
from .unique import clear_mark

__all__ = ["guarded_job", "skip_count", "META_KEY", "RATE_META_KEY", "ON_SKIP"]

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


def mirror_meta(job: Any, refresh: bool = False, **fields: Any) -> None:
    """Record the guard's view in ``job.meta["taskguard"]`` (merged with the user's meta; with
    ``refresh``, with the meta stored now, e.g. from the worker's main process, whose copy of
    the job predates what its work-horse wrote)."""
    if job is None:
        return
    try:
        if refresh:
            job.meta = job.get_meta(refresh=True)
        job.meta.setdefault(META_KEY, {}).update(fields)
        job.save_meta()
    except Exception as e:  # visibility only: never fail the job over it
        log.warning("job %s: could not save meta: %s", job.id, e)


#: Where the guard options ``@guarded_job`` does not take live for RQ.
RQ_ELSEWHERE = {
    "unique": "RQ has no publish hook; enqueue with fn.enqueue_unique(queue, ...) or "
              "taskguard_rq.enqueue_unique(queue, fn, args, kwargs, unique_ttl=...)",
    "unique_ttl": "it is an argument of taskguard_rq.enqueue_unique(queue, fn, args, kwargs, unique_ttl=...)",
    "continue_on_skip": "RQ has no chains or link callbacks for a skip to stop; a skipped job ends FINISHED, so "
                        "jobs that depend on it (depends_on) run; use on_skip='raise' to fail it instead",
}
#: The guard options ``@guarded_job`` takes: every one but the publish-time and chain options.
RQ_OPTIONS = tuple(n for n in OPTION_NAMES if n not in RQ_ELSEWHERE)


def guarded_job(func: Callable[..., Any] | None = None, *, name: str | None = None, locks: Locks | None = None,
                **options: Any) -> Any:
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
    holding the lease waits for it (up to the job's ``job_timeout``) and then runs; if that one
    is still running then, it fails with ``TaskSkipped(reason="running")``.

    ``limit=N`` lets N jobs of one key run at once (a run finding every slot held is skipped,
    reason ``"limit"``); ``guarded.rate_limit_for(*args, **kwargs)`` gives RQ 3's own
    ``RateLimit`` for the same key and limit, so RQ parks jobs over it instead. ``rate=`` (with
    ``rate_key``, ``rate_burst``, ``rate_max_wait``, ``cost``) defers a job over the rate to its booked turn
    through RQ's scheduler (see :func:`_pace`), or skips it past ``rate_max_wait`` (reason
    ``"rate_limited"``).
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        label = name or f"{fn.__module__}.{fn.__qualname__}"
        check_option_names(label, options, supported=RQ_OPTIONS, elsewhere=RQ_ELSEWHERE)
        opts = GuardOptions.build(fn, name=label, allowed_on_skip=ON_SKIP, **options)

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
            return RateLimit(f"taskguard:{opts.key.render(args, kwargs)}",
                             opts.limit_of(args, kwargs))

        guarded.taskguard_options = opts  # type: ignore[attr-defined]
        guarded.taskguard_locks = locks  # type: ignore[attr-defined]
        guarded.taskguard_name = label  # type: ignore[attr-defined]
        def enqueue_unique(queue: Any, *args: Any, **kwargs: Any) -> Any:
            """``taskguard_rq.enqueue_unique(queue, this job, args, kwargs)``: enqueue unless a job of
            this key is queued or running (then that job is returned). RQ has no publish hook, so a
            plain ``queue.enqueue`` is never stopped: enqueue through this."""
            from .unique import enqueue_unique as unique

            return unique(queue, guarded, args, kwargs)

        guarded.rate_limit_for = rate_limit_for  # type: ignore[attr-defined]
        guarded.enqueue_unique = enqueue_unique  # type: ignore[attr-defined]
        return guarded

    return decorate(func) if func is not None else decorate


#: The job whose execution this context is performing through :func:`_perform`. RQ's
#: ``get_current_job()`` gives that job to everything its function calls, so a guarded function
#: called directly from inside it (recursion, another guarded job called as a function) sees it
#: too: it is a direct call, judged by its own call, not that job's execution.
_performing: contextvars.ContextVar[Any] = contextvars.ContextVar("taskguard_rq_performing", default=None)


def _job_timeout(job: Any) -> float:
    timeout = getattr(job, "timeout", None)
    return float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else DEFAULT_JOB_TIMEOUT


def _perform(fn: Callable[..., Any], name: str, opts: GuardOptions, locks: Locks | None, args: tuple,
             kwargs: dict) -> Any:
    job = get_current_job()
    if job is None or _performing.get() is job:
        return _run(fn, name, opts, locks, args, kwargs, None)  # a direct call
    token = _performing.set(job)
    try:
        return _run(fn, name, opts, locks, args, kwargs, job)
    finally:
        _performing.reset(token)


def _run(fn: Callable[..., Any], name: str, opts: GuardOptions, given: Locks | None, args: tuple, kwargs: dict,
         job: Any) -> Any:
    """One guarded run: ``job``'s execution, or a direct call (``job`` ``None``). The arguments
    are bound first: a caller's wrong arguments raise their ``TypeError`` even where no Redis is
    configured."""
    if job is not None:  # a job enqueued by `taskguard rq-cron`: its entry's guard options
        opts = entry_guard(job, fn, name, opts)
    key = opts.key.render(args, kwargs)
    locks = locks_for(given)
    run_id = job.id if job is not None else None
    charge = None
    try:
        if opts.rate is not None:
            deferred = _pace(job, locks, name, opts, key, args, kwargs)
            if isinstance(deferred, charging):
                charge = deferred
            else:
                if not isinstance(deferred, Retry):  # skipped past rate_max_wait: it will not run
                    clear_mark(locks, job)
                return deferred  # (a Retry: deferred to its turn, still queued)
        once = opts.once_policy(args, kwargs, *_result_codec(job)) if opts.once else None
        run = GuardedRun(locks, key, ttl=opts.ttl, wait=opts.wait, renew=opts.renew,
                         holder={"job": name, "job_id": run_id}, max_hold=opts.max_hold, run_id=run_id, task=name,
                         on_lost=opts.on_lost, limit=opts.limit_of(args, kwargs), once=once, enforce=opts.enforce)
        handle = load_handle(locks, run_id) if run_id is not None else None
        if handle is not None and handle.get("running"):
            # the handle of an execution that may still be running (an orphaned work-horse): never
            # take its lease over; wait for it like any earlier execution of this job id
            handle = None
        began = run.begin(handle=handle, same_run="wait", same_run_wait=_job_timeout(job))
    except BaseException:
        clear_mark(locks, job)  # it will not run: no longer queued
        raise
    clear_mark(locks, job)  # it started, or will not run: no longer queued
    if not began:
        if run.reason == "once":
            value = run.stored_value()
            log.info("%s: %r already completed; returning the stored value", name, key)
            mirror_meta(job, key=key, outcome="once")
            return value
        return _skip(job, locks, name, opts, run)
    if not opts.enforce and run.reason is not None:
        log.info("%s: shadow mode: would have been skipped (%s, lease %r); running it", name, run.reason, key)
        mirror_meta(job, key=key, shadow=run.reason)
    lease = run.lease
    if lease is None:  # shadow mode without the lease: the body runs unguarded
        with run, (charge if charge is not None else contextlib.nullcontext()):
            try:
                result = fn(*args, **kwargs)
            except RateLimited as exc:
                _back_off(job, locks, name, opts, key, args, kwargs, exc)
                raise
        return result
    saved = None
    if run_id is not None:  # for GuardedWorker, should the work-horse be killed
        try:
            saved = save_handle(locks, run_id, {"key": key, "owner": lease.owner_token, "fence": lease.fencing_token,
                                                "expires": lease.expires_at, "running": True},
                                ttl=_job_timeout(job) + opts.ttl)
        except BaseException:
            run.hand_back()  # the body never ran: nothing is left locked
            raise
    mirror_meta(job, key=key, fence=lease.fencing_token, slot=lease.slot, outcome="running")
    with run, (charge if charge is not None else contextlib.nullcontext()):
        try:
            result = fn(*args, **kwargs)
        except RateLimited as exc:
            if opts.enforce:
                run.hand_back()  # it runs again after the pause
                if job is not None:
                    _quietly(drop_handle, locks, job.id, saved)
                deferred = _back_off(job, locks, name, opts, key, args, kwargs, exc)
                if deferred is not None:
                    return deferred
                raise
            retry_in = job.get_retry_interval() if job is not None and job.retries_left else None
            _end(job, locks, run, retry_in, "failed", saved)
            _back_off(job, locks, name, opts, key, args, kwargs, exc)
            raise
        except BaseException:
            retry_in = job.get_retry_interval() if job is not None and job.retries_left else None
            _end(job, locks, run, retry_in, "failed", saved)
            raise
    if isinstance(result, Retry):  # RQ >= 2.1 runs the job again for a returned Retry
        retries = (job.number_of_retries or 0) if job is not None else 0
        retry_in = Retry.get_interval(retries, result.intervals) if retries < result.max else None
        _end(job, locks, run, retry_in, "ran", saved)
        return result
    try:
        run.finish(result)
    finally:
        if job is not None:
            _quietly(drop_handle, locks, job.id, saved)
    mirror_meta(job, outcome="ran")
    return result


def _end(job: Any, locks: Locks, run: GuardedRun, retry_in: float | None, outcome: str, saved: str | None) -> None:
    """The execution ends without finishing the job's work for good. If RQ runs it again
    (``retry_in`` seconds from now), keep the lease for that execution; else release it. Never
    raises (the body's own exception must win)."""
    try:
        if retry_in is not None:
            handle = run.keep(retry_in + run.ttl)
            if handle is not None:
                save_handle(locks, job.id, handle, ttl=retry_in + run.ttl)
                mirror_meta(job, outcome="retrying")
                return
        else:
            run.fail()
        if job is not None:
            drop_handle(locks, job.id, saved)
        mirror_meta(job, outcome=outcome)
    except LeaseBackendError as e:
        log.warning("lease %r: could not hand over or release after the body ended: %s", run.key, e)


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except LeaseBackendError as e:
        log.warning("could not drop a stored lease handle: %s", e)


def _pace(job: Any, locks: Locks, name: str, opts: GuardOptions, key: str, args: tuple, kwargs: dict) -> Any:
    """The job's ``rate`` (:func:`taskguard.pacing.pace`): a ``charging`` context for the body
    (the rate key and the cost it was admitted at, for :func:`taskguard.settle_cost`) when it runs
    now; else what the job function returns instead — a ``Retry`` that RQ's scheduler runs at the
    booked turn, or the ``Skipped`` (reason ``"rate_limited"`` or ``"backoff"``) past
    ``rate_max_wait``. A deferral consumes neither the job's own ``Retry`` (``retries_left``) nor
    its returned-``Retry`` count (``number_of_retries``, which RQ bumps for the returned ``Retry``;
    it is set back first). It needs a worker running RQ's scheduler (``rq worker
    --with-scheduler``). A direct call waits for its turn here."""
    state = _rate_state(job)
    rate_key = cast(KeyTemplate, opts.rate_key).render(args, kwargs)  # (a guard with a rate has its key)
    rate = cast("tuple[int, float]", opts.rate)
    cost = opts.cost_of(args, kwargs)
    if not opts.enforce:  # shadow mode: checked, not consumed; reported; the job runs
        reason = shadow_reason(locks, rate_key, rate=rate, burst=opts.rate_burst, max_wait=opts.rate_max_wait,
                               max_countdown=RATE_MAX_COUNTDOWN, task=name, cost=cost)
        if reason is not None:
            log.info("%s: shadow mode: would have been %s (%r); running it", name,
                     "rate-limited" if reason == "rate_limited" else "backing off", rate_key)
        return charging(locks, rate_key, rate, cost, shadow=True)
    while True:
        p = pace(locks, rate_key, rate=rate, burst=opts.rate_burst, max_wait=opts.rate_max_wait,
                 max_countdown=RATE_MAX_COUNTDOWN, state=state, cost=cost)
        if p.go:
            if p.countdown > 0:
                time.sleep(p.countdown)  # RQ's scheduler counts whole seconds: wait for the booked turn
                continue  # (and re-check it against a back-off pause)
            if job is not None and RATE_META_KEY in job.meta:
                job.meta.pop(RATE_META_KEY)
                _quietly_save_meta(job)
            return charging(locks, rate_key, rate, cost)
        if p.skip:
            if job is not None:
                _release_kept(locks, job)
            skipped = Skipped(key=rate_key, reason=p.reason, task=name)
            return _report_skip(job, locks, name, opts, skipped)
        if job is None:
            time.sleep(p.countdown)
            state = p.state
            continue
        return _defer(job, locks, name, key, rate_key, p)


def _rate_state(job: Any) -> dict | None:
    if job is None:
        return None
    try:
        return parse_state(job.meta.get(RATE_META_KEY))
    except ValueError as e:
        log.error("job %s: ignoring a malformed meta[%r] (%s); pacing it afresh", job.id, RATE_META_KEY, e)
        return None


def _defer(job: Any, locks: Locks, name: str, key: str, rate_key: str, p: Pace) -> Retry:
    """The ``Retry`` that brings ``job`` back in ``p.countdown`` seconds without consuming its
    own retries (see :func:`_pace`); the deferral reported (reason ``p.reason``)."""
    _release_kept(locks, job)  # a failed job's kept lease is not held through a rate wait
    job.meta[RATE_META_KEY] = p.state  # saved by mirror_meta below
    locks.report_skip(Skipped(key=rate_key, reason=p.reason, task=name))
    booked = p.state is not None and p.state.get("turn") is not None
    what = "rate-limited" if p.reason == "rate_limited" else "backoff (upstream rate limit)"
    log.info("job %s: %s; %s in %.2fs", job.id, what, "its turn is booked" if booked else "it asks again",
             p.countdown)
    mirror_meta(job, key=key, outcome=p.reason)
    job.number_of_retries = (job.number_of_retries or 0) - 1  # RQ adds one back for this Retry
    # whole seconds (RQ's Retry); rounded down, and the job waits out the rest of its turn on
    # arrival, so the scheduler's rounding never bunches booked turns together
    return Retry(max=10**9, interval=[int(p.countdown)])


def _back_off(job: Any, locks: Locks, name: str, opts: GuardOptions, key: str, args: tuple, kwargs: dict,
              exc: RateLimited) -> Any:
    """The body raised :class:`taskguard.RateLimited` (its run handed back): pause the rate key
    cluster-wide (:func:`taskguard.pacing.back_off`; the job's own key when it has no rate) and
    return what the job function returns instead: a ``Retry`` past the pause (reason
    ``"backoff"``; the job's own ``Retry`` untouched), or the ``Skipped`` past
    ``rate_max_wait``. ``None`` for a direct call and in shadow mode (the caller re-raises)."""
    rate_key = exc.key if exc.key is not None else (
        cast(KeyTemplate, opts.rate_key).render(args, kwargs) if opts.rate is not None else key)
    p = back_off(locks, rate_key, exc.retry_after, max_wait=opts.rate_max_wait, max_countdown=RATE_MAX_COUNTDOWN,
                 state=_rate_state(job), shadow=not opts.enforce)
    if not opts.enforce:
        locks.report_skip(Skipped(key=rate_key, reason="backoff", task=name), shadow=True)
        log.info("%s: shadow mode: would have backed off %r for %.2fs", name, rate_key, p.countdown)
        return None
    if job is None:
        return None
    if p.skip:
        return _report_skip(job, locks, name, opts, Skipped(key=rate_key, reason="backoff", task=name))
    # (countdown rounded up: RQ's scheduler counts whole seconds and the pause must be over)
    return _defer(job, locks, name, key, rate_key, Pace(False, countdown=float(math.ceil(p.countdown)),
                                                        state=p.state, reason="backoff"))


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


def _release_kept(locks: Locks, job: Any) -> None:
    """Release the lease a failed execution of ``job`` kept for its retry, if any."""
    try:
        handle = load_handle(locks, job.id)
        if handle is not None and not handle.get("running"):
            locks.restore(handle["key"], handle["owner"], ttl=1.0).release()
            drop_handle(locks, job.id)
    except (LeaseBackendError, ConfigError) as e:
        log.warning("job %s: could not release its kept lease before a rate wait: %s", job.id, e)


def _quietly_save_meta(job: Any) -> None:
    try:
        job.save_meta()
    except Exception as e:
        log.warning("job %s: could not save meta: %s", job.id, e)


def _skip(job: Any, locks: Locks, name: str, opts: GuardOptions, run: GuardedRun) -> Any:
    if run.reason == "running":  # an earlier execution of this job id outlasted the wait
        raise TaskSkipped(run.key, "running", name, run.holder_ttl)
    return _report_skip(job, locks, name, opts, run.skip(report=False))


def _report_skip(job: Any, locks: Locks, name: str, opts: GuardOptions, skipped: Skipped) -> Any:
    locks.report_skip(skipped)
    record_skip(locks, name)
    log.info("%s", skipped.describe())
    mirror_meta(job, key=skipped.key, outcome="skipped", reason=skipped.reason, holder_ttl=skipped.holder_ttl)
    if opts.on_skip == "raise":
        raise TaskSkipped(skipped.key, skipped.reason, name, skipped.holder_ttl)
    return skipped
