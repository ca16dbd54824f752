"""``GuardedWorker``: an RQ worker that settles the lease of a job whose work-horse was killed.

A SIGKILLed (or OOM-killed) work-horse runs no ``finally``, so the job's lease would stay until
its TTL runs out and its stored handle (which holds the owner token) until its own expiry. The
worker's main process sees every way a horse is killed, and with this class settles the lease
and deletes the handle at once:

* a horse that died (SIGKILL, OOM, ``send_kill_horse_command``; ``handle_work_horse_killed``,
  rq/worker/base.py): with retries left (``Retry``) the lease is stretched over the retry
  interval plus its TTL and its handle kept, so the retry claims the same lease (same fencing
  token); otherwise the lease is released and the handle deleted;
* ``send_stop_job_command`` (the job ends STOPPED and is never retried, rq/worker/base.py
  ``handle_job_failure``): released, handle deleted;
* a cold shutdown (a second SIGTERM/SIGINT: ``request_force_stop`` kills the horse and exits;
  the job is failed later by the abandoned-job cleanup): released, handle deleted — a retry, if
  RQ makes one, acquires afresh;
* the abandoned-job cleanup (a worker died: another worker's maintenance finds the job in its
  ``StartedJobRegistry`` and fails or retries it, calling the worker's exception handlers with
  ``AbandonedJobError``, rq/registry.py): released and handle deleted when the work-horse is
  known dead (on this host); a work-horse that lives on (it has a process group of its own, so
  it can outlive its worker) still runs the body, which keeps its lease;
* a job cancelled (``job.cancel()``, ``rq cancel``) while it waits for a retry that kept its
  lease: the next maintenance of a ``GuardedWorker`` (``clean_registries``, every
  ``maintenance_interval``) finds it in the queue's ``CanceledJobRegistry`` and releases the lease
  (a job cancelled while its body runs keeps its lease until the body ends).
  A job *deleted* meanwhile leaves no trace to find: its kept lease and handle last until the
  retry stretch (interval + TTL) ends.

A work-horse that ended in the one round trip between taking its lease and saving its handle left
no handle: on each of these paths its lease is found by the job id on the job's key (and its place
in the total) and released when the holder process is known dead on this host (never a retry's
lease of the same job id, whose process lives).

Every other end is settled by the job itself, in the horse: success, an exception, ``Retry``,
``job_timeout`` (raised inside the body, so its ``finally`` runs), a warm shutdown (the job runs
to its end). A job cancelled or deleted while it waits for a retry keeps its stretched lease
until the stretch ends (RQ has no hook for those).

With a plain ``rq worker`` (or a whole worker killed) the TTL bounds the lease instead, and a
retry that arrives after it expired acquires afresh (a larger fencing token).

Use: ``rq worker -w taskguard_rq.GuardedWorker`` (with ``--with-scheduler`` for retry intervals).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rq import Worker

from taskguard import ConfigError
from taskguard.config import EX_CONFIG, read_env
from taskguard.handoff import handle_of, restore_handle
from taskguard.liveness import holder_is_dead

from .config import has_default, locks_for
from .cron_runs import entry_guard
from .handles import drop_handle, load_handle, save_handle
from .job import mirror_meta
from .unique import clear_mark

__all__ = ["GuardedWorker", "settle_killed_job", "settle_canceled_jobs"]

# a child of RQ's worker logger: `rq worker`'s own logging (INFO by default) shows these lines
log = logging.getLogger("rq.worker.taskguard")


def settle_killed_job(job: Any, retry: bool = True, why: str = "work-horse killed") -> str | None:
    """Settle the lease of ``job`` whose work-horse died: kept for its retry when ``retry`` and
    it has retries left, else released; its stored handle is deleted with the release. Returns
    ``"kept"``, ``"released"`` or ``None`` (the job held no lease, or the lease is another
    execution's that lives on).

    The stored handle of an execution marked running is settled only when the process holding
    that lease is known dead on this host. The work-horse that just died is not always that
    process: a job whose worker was killed leaves its work-horse running the body (it has a
    process group of its own), and a later execution of the same job (RQ's retry of the
    abandoned job) waits for that lease without a handle of its own; killing or stopping the
    waiting execution must not release, nor keep for a retry, the lease a live body holds.
    Otherwise the lease is left to its TTL, which its work-horse renews while it lives."""
    func = getattr(job, "func", None)
    opts = getattr(func, "taskguard_options", None)
    if opts is None:
        return None
    locks = locks_for(getattr(func, "taskguard_locks", None))
    handle = load_handle(locks, job.id)
    if handle is None:
        return _release_unsaved(job, func, opts, locks, why)
    if handle.get("running"):
        info = _holder(locks, handle["key"], job.id, handle.get("fence"))
        if info is not None and not holder_is_dead(info.holder):
            log.warning(
                "job %s: %s, but its lease %r is held by a work-horse of it that may still run (%s, pid %s); "
                "left to that holder and its TTL",
                job.id,
                why,
                handle["key"],
                info.holder.get("host"),
                info.holder.get("pid"),
            )
            return None
    lease = restore_handle(locks, handle, ttl=opts.ttl)  # (with its place in the total, if any)
    lease.run_id = job.id
    total = lease.total
    if retry and job.retries_left:
        stretch = job.get_retry_interval() + opts.ttl
        if lease.renew(stretch) and (total is None or total.renew(stretch)):
            save_handle(locks, job.id, {**handle_of(lease), "running": False}, ttl=stretch)
            log.warning("job %s: work-horse killed; lease %r kept %.0fs for its retry", job.id, handle["key"], stretch)
            mirror_meta(job, refresh=True, outcome="retrying")
            return "kept"
    released = lease.release()
    if total is not None:
        total.release()
    drop_handle(locks, job.id)
    if not released:  # the stored handle's lease is not the one this execution held (a retry's
        # horse that claimed a kept lease, or took a fresh one, and died before saving its handle)
        return _release_unsaved(job, func, opts, locks, why)
    log.warning("job %s: %s; lease %r released", job.id, why, handle["key"])
    mirror_meta(job, refresh=True, outcome="ended", ended=why)
    return "released"


def _release_unsaved(job: Any, func: Any, opts: Any, locks: Any, why: str) -> str | None:
    """``job`` has no stored handle: it held no lease, or its work-horse died in the one round
    trip between taking its lease and saving its handle. The lease its job id holds on its key
    (and its place in the total) is released by run id (:meth:`taskguard.Locks.release_run`: no
    owner token needed) when its holder process is known dead on this host — never a later
    execution's of the same job id (a retry), whose process lives. Returns ``"released"`` or
    ``None``."""
    opts = entry_guard(job, func, func.taskguard_name, opts)  # a cron slot's own key
    args, kwargs = tuple(job.args or ()), dict(job.kwargs or {})
    key = opts.key.render(args, kwargs)
    total = opts.total_of(args, kwargs)
    released = False
    # the key's lease, and apart from it the place in the total (held alone for a moment by a run
    # that waited for a place: it takes the place, then its key): each released only as the very
    # lease seen held by a dead process (its fencing token), never one a live execution of the job
    # id took meanwhile
    for k in (key,) if total is None else (key, total[0]):
        info = _holder(locks, k, job.id)
        if info is not None and holder_is_dead(info.holder):
            released = locks.release_run(k, job.id, fencing_token=info.fencing_token) or released
    if not released:
        return None
    log.warning("job %s: %s before its handle was saved; lease %r released", job.id, why, key)
    mirror_meta(job, refresh=True, outcome="ended", ended=why)
    return "released"


def _holder(locks: Any, key: str, run_id: str, fence: int | None = None) -> Any:
    """The holder of ``key`` with ``run_id`` (and, when given, ``fence``), or ``None``."""
    return next(
        (i for i in locks.holders(key) if i.run_id == run_id and (fence is None or i.fencing_token == fence)), None
    )


class GuardedWorker(Worker):
    """An RQ ``Worker`` that settles guarded jobs' leases when their work-horse is killed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.push_exc_handler(_settle_abandoned)

    def work(self, *args: Any, **kwargs: Any) -> bool:
        """RQ's work loop, once the leases' configuration is checked: guarded jobs without
        ``locks=`` take their leases from :func:`taskguard.from_env` (``TASKGUARD_REDIS_URL``...).
        A malformed setting is logged and the worker exits 78 (``EX_CONFIG``) before taking a job.
        Without ``TASKGUARD_REDIS_URL`` it starts (its jobs may all bring their own ``locks=``)
        and says at start that jobs without them will fail (every other ``TASKGUARD_*`` variable is
        checked all the same: a malformed or misspelt one exits 78)."""
        url_set = "TASKGUARD_REDIS_URL" in os.environ  # (an empty one is malformed, not unset)
        try:
            if url_set or has_default():  # (has_default: use_locks() was called)
                locks_for()
            else:
                read_env()
        except ConfigError as e:
            log.critical("GuardedWorker cannot start: %s", e)
            raise SystemExit(EX_CONFIG) from None
        if not url_set and not has_default():
            log.warning(
                "GuardedWorker: TASKGUARD_REDIS_URL is not set: guarded jobs declared without locks= will fail "
                "(set it to the leases' Redis)"
            )
        return bool(super().work(*args, **kwargs))

    def clean_registries(self) -> None:
        """RQ's maintenance, after settling the kept leases of jobs cancelled while they waited
        for a retry (before the cleanup can drop them from the ``CanceledJobRegistry``)."""
        for queue in self.queues:
            try:
                settle_canceled_jobs(queue)
            except Exception as e:  # maintenance must go on
                log.warning("could not settle the leases of cancelled jobs of %s: %s", queue.name, e)
        super().clean_registries()

    def handle_work_horse_killed(self, job: Any, retpid: int, ret_val: int, rusage: Any) -> None:
        super().handle_work_horse_killed(job, retpid, ret_val, rusage)
        _settle(job)

    def handle_job_failure(self, job: Any, *args: Any, **kwargs: Any) -> None:
        # a job stopped on request (``send_stop_job_command``): its horse was killed, it ends
        # STOPPED and is never retried. ``_stopped_job_id`` is set only in this main process.
        stopped = job is not None and getattr(self, "_stopped_job_id", None) == job.id
        super().handle_job_failure(job, *args, **kwargs)
        if stopped:
            _settle(job, retry=False, why="stopped (send_stop_job_command)")

    def request_force_stop(self, signum: int, frame: Any) -> None:
        job = None
        if self.horse_pid:
            try:
                job = self.get_current_job()
            except Exception as e:  # the cold shutdown must go on
                log.warning("could not read the current job before a cold shutdown: %s", e)
        try:
            super().request_force_stop(signum, frame)
        except SystemExit:  # the horse was taken down with the worker
            if job is not None:
                _settle(job, retry=False, why="cold shutdown of its worker")
            raise


def settle_canceled_jobs(queue: Any) -> int:
    """Release the kept leases (and delete the handles) of ``queue``'s cancelled jobs. Returns how
    many were settled."""
    from rq.job import JobStatus
    from rq.registry import CanceledJobRegistry

    settled = 0
    for job_id in CanceledJobRegistry(queue=queue).get_job_ids():
        try:
            job = queue.fetch_job(job_id)
        except Exception:
            job = None
        try:
            # (RQ leaves an id in the registry when a job of that id is enqueued again: only a job
            # that is cancelled now is settled, never the live execution of a reused id)
            if job is None or job.get_status(refresh=False) != JobStatus.CANCELED:
                continue
            clear_mark(locks_for(getattr(getattr(job, "func", None), "taskguard_locks", None)), job)
            if settle_killed_job(job, retry=False, why="cancelled") == "released":
                settled += 1
        except Exception as e:  # one job's trouble (an unimportable function...) must not stop the others
            log.warning("job %s: could not settle its lease (its TTL bounds it): %s", job_id, e)
    return settled


def _settle_abandoned(job: Any, exc_type: Any, exc_value: Any, traceback: Any) -> None:
    """Exception handler: a job the abandoned-job cleanup found (its worker died). Other
    exceptions (raised by job bodies in the work-horse) were settled by the job itself."""
    if exc_type is not None and exc_type.__name__ == "AbandonedJobError" and job is not None:
        _settle(job, retry=False, why="abandoned (its worker died)")
    return None  # the next handler runs too


def _settle(job: Any, retry: bool = True, why: str = "work-horse killed") -> None:
    """Settle, never raising into RQ's worker loop: a job whose function cannot be imported, a
    Redis error... are logged, and the lease's TTL bounds it."""
    try:
        settle_killed_job(job, retry=retry, why=why)
    except Exception as e:
        log.warning("job %s: could not settle its lease (its TTL bounds it): %s", getattr(job, "id", "?"), e)
