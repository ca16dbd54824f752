"""``@guarded_job``: RQ job functions whose body runs under a fenced lease.

RQ keeps one job id across retries, so the lease handle of a job that will be retried is kept in
a Redis record keyed by job id (``locks.save_handle``), not in ``job.meta``: a worker whose
work-horse was killed saves its stale in-memory job, meta included, over what the horse saved
(rq/worker: ``handle_job_failure`` runs in the parent with the parent's copy of the job).
``job.meta["taskguard"]`` mirrors key, fencing token and outcome for people, never the owner token.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any, Callable

from rq import get_current_job

import taskguard
from taskguard import ConfigError, LeaseBackendError, LeaseLost, Locks, RedisLocks, Skipped, TaskSkipped
from taskguard.context import running
from taskguard.handoff import persist, resume
from taskguard.policy import GuardOptions

__all__ = ["guarded_job", "locks_for", "skip_counts", "META_KEY", "ON_SKIP"]

log = logging.getLogger("taskguard.rq")

META_KEY = "taskguard"
#: RQ's JobStatus is a closed enum and RQ has no "ignore this run" outcome, so an RQ skip either
#: finishes the job with a ``Skipped`` value or fails it with ``TaskSkipped``.
ON_SKIP = ("result", "raise")

_default: Locks | None = None
_default_lock = threading.Lock()


def locks_for(explicit: Locks | None = None) -> Locks:
    """The job's ``locks=`` option, else one :func:`taskguard.from_env` per process."""
    global _default
    if explicit is not None:
        return explicit
    with _default_lock:
        if _default is None:
            _default = taskguard.from_env()
        return _default


def _skips_key(locks: RedisLocks) -> str:
    return "{" + locks.prefix + ":rq:skips}"


def skip_counts(locks: Locks | None = None) -> dict[str, int]:
    """Skips counted so far per job function name (a Redis hash under the locks' prefix)."""
    lk = locks_for(locks)
    if not isinstance(lk, RedisLocks):
        return {}
    raw = lk.client.hgetall(_skips_key(lk))
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


@dataclasses.dataclass
class _Run:
    name: str
    key: str
    lease: taskguard.Lease


def _mirror(job: Any, **fields: Any) -> None:
    """Record the guard's view in ``job.meta["taskguard"]`` (merged with the user's meta)."""
    if job is None:
        return
    try:
        job.meta.setdefault(META_KEY, {}).update(fields)
        job.save_meta()
    except Exception as e:  # visibility only: never fail the job over it
        log.warning("job %s: could not save meta: %s", job.id, e)


def guarded_job(func: Callable[..., Any] | None = None, *, name: str | None = None, locks: Locks | None = None,
                **options: Any) -> Any:
    """Decorate an RQ job function so that its body runs under a fenced lease.

    ``@guarded_job(ttl=60, key="sync:{customer_id}", wait=0, on_skip="result")``. Options are
    those of :meth:`taskguard.policy.GuardOptions.build` with ``on_skip`` limited to
    :data:`ON_SKIP`; ``name`` labels holders, skips and metrics (default: the function's
    qualified name); ``locks`` is a :class:`taskguard.Locks` (default: :func:`taskguard.from_env`).
    Options are validated here; a bad one raises :class:`taskguard.ConfigError`.

    The decorated function runs guarded when a worker performs the job and when called directly.
    A skipped run returns a :class:`taskguard.Skipped` (job status FINISHED, ``job.return_value()``
    is the ``Skipped``, ``job.meta["taskguard"]["outcome"] == "skipped"``) or, with
    ``on_skip="raise"``, fails with :class:`taskguard.TaskSkipped`.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        label = name or f"{fn.__module__}.{fn.__qualname__}"
        opts = GuardOptions.build(fn, name=label, allowed_on_skip=ON_SKIP, **options)

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            return _perform(fn, label, opts, locks_for(locks), args, kwargs)

        guarded.taskguard_options = opts  # type: ignore[attr-defined]
        guarded.taskguard_locks = locks  # type: ignore[attr-defined]
        guarded.taskguard_name = label  # type: ignore[attr-defined]
        return guarded

    return decorate(func) if func is not None else decorate


def _perform(fn: Callable[..., Any], name: str, opts: GuardOptions, locks: Locks, args: tuple, kwargs: dict) -> Any:
    job = get_current_job()
    key = opts.key.render(args, kwargs)
    run_id = job.id if job is not None else None
    holder = {"job": name, "job_id": run_id}
    acq = None
    if run_id is not None:
        handle = locks.load_handle(run_id)
        if handle is not None:
            try:
                acq = resume(locks, handle, key=key, ttl=opts.ttl, holder=holder, renew=opts.renew,
                             max_hold=opts.max_hold, run_id=run_id)
            except ConfigError as e:
                log.error("job %s: ignoring its stored lease handle: %s", run_id, e)
    if acq is None:
        acq = locks.acquire(key, ttl=opts.ttl, wait=opts.wait, holder=holder, renew=opts.renew,
                            max_hold=opts.max_hold, run_id=run_id)
    if not acq.acquired:
        duplicate = acq.reason == "done" or (run_id is not None and _held_by(locks, key, run_id))
        return _skip(job, locks, name, opts, key, "duplicate" if duplicate else (acq.reason or "held"),
                     acq.holder_ttl)
    lease = acq.lease
    if run_id is not None:
        locks.save_handle(run_id, {"key": key, "owner": lease.owner_token, "fence": lease.fencing_token,
                                   "expires": lease.expires_at}, ttl=locks.done_ttl)
    _mirror(job, key=key, fence=lease.fencing_token, outcome="running")
    try:
        with running(_Run(name, key, lease)):
            result = fn(*args, **kwargs)
    except BaseException:
        _after_failure(job, locks, opts, lease)
        raise
    _after_success(job, locks, opts, name, key, lease)
    return result


def _held_by(locks: Locks, key: str, run_id: str) -> bool:
    info = locks.holder(key)
    return info is not None and info.holder.get("job_id") == run_id


def _skip(job: Any, locks: Locks, name: str, opts: GuardOptions, key: str, reason: str,
          holder_ttl: float | None) -> Any:
    skipped = Skipped(key=key, reason=reason, task=name, holder_ttl=holder_ttl)
    locks.report_skip(skipped)
    if isinstance(locks, RedisLocks):
        try:
            locks.client.hincrby(_skips_key(locks), name, 1)
        except Exception as e:
            log.warning("could not count a skip of %s: %s", name, e)
    log.info("%s", skipped.describe())
    _mirror(job, key=key, outcome="skipped", reason=reason, holder_ttl=holder_ttl)
    if opts.on_skip == "raise" and reason != "duplicate":
        raise TaskSkipped(key, reason, name, holder_ttl)
    return skipped


def _after_failure(job: Any, locks: Locks, opts: GuardOptions, lease: taskguard.Lease) -> None:
    """The body raised. If RQ will retry the job (``Retry``), keep the lease for the retry:
    stretch it over the retry interval and store the handle; else release it."""
    try:
        if job is not None and job.retries_left:
            handle = persist(lease, job.get_retry_interval() + opts.ttl)
            if handle is not None:
                locks.save_handle(job.id, handle, ttl=locks.done_ttl)
                _mirror(job, outcome="retrying")
                return
        lease.release(mark_done=True)
        if job is not None:
            locks.delete_handle(job.id)
        _mirror(job, outcome="failed")
    except LeaseBackendError as e:  # the body's own exception must win
        log.warning("lease %r: could not hand over or release after the body failed: %s", lease.key, e)


def _after_success(job: Any, locks: Locks, opts: GuardOptions, name: str, key: str, lease: taskguard.Lease) -> None:
    was_lost = lease.lost
    try:
        released = lease.release(mark_done=True)
    except LeaseBackendError as e:
        log.warning("lease %r: could not release: %s", key, e)
        released = not lease.lost
    if job is not None:
        locks.delete_handle(job.id)
    if was_lost or not released:
        reason = lease.lost_reason or "lost while the body ran"
        _mirror(job, outcome="lost", reason=reason)
        if opts.on_lost == "raise":
            raise LeaseLost(key, reason)
        log.warning("%s: lease %r was lost while the body ran (%s)", name, key, reason)
        return
    _mirror(job, outcome="ran")
