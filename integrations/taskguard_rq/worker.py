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

import functools
import inspect
import logging
import os
from typing import Any

from rq import Worker

from taskguard import ConfigError
from taskguard.config import EX_CONFIG, read_env
from taskguard.handle_records import Settled, settle_dead

from .config import has_default, locks_for
from .cron_runs import entry_guard
from .job import handle_record, mirror_meta
from .unique import clear_mark

__all__ = ["GuardedWorker", "settle_killed_job", "settle_canceled_jobs"]

# a child of RQ's worker logger: `rq worker`'s own logging (INFO by default) shows these lines
log = logging.getLogger("rq.worker.taskguard")


def settle_killed_job(job: Any, retry: bool = True, why: str = "work-horse killed") -> str | None:
    """Settle the lease of ``job`` whose work-horse died (:func:`taskguard.handle_records.settle_dead`):
    kept for its retry when ``retry`` and it has retries left, else released; its stored handle is
    deleted with the release. Returns ``"kept"``, ``"released"`` or ``None`` (the job held no lease,
    or the lease is held by a work-horse of it that may still run: a job whose worker was killed
    leaves its work-horse running the body, in a process group of its own — that lease is left to
    it and its TTL, which it renews while it lives)."""
    func: Any = getattr(job, "func", None)
    opts = getattr(func, "taskguard_options", None)
    if opts is None:
        return None

    def lease_keys() -> list[str]:  # (only for a work-horse that died before saving its handle)
        guard = entry_guard(job, func, func.taskguard_name, opts)  # a cron slot's own key
        args, kwargs = tuple(job.args or ()), dict(job.kwargs or {})
        total = guard.total_of(args, kwargs)
        return [guard.key.render(args, kwargs), *(() if total is None else (total[0],))]

    retry_in = job.get_retry_interval() if retry and job.retries_left else None
    locks = locks_for(getattr(func, "taskguard_locks", None))
    dead = settle_dead(locks, handle_record(job.id), job.id, ttl=opts.ttl, retry_in=retry_in, lease_keys=lease_keys)
    if dead.how == Settled.HELD:
        holder = dead.holder or {}
        log.warning(
            "job %s: %s, but its lease %r is held by a work-horse of it that may still run (%s, pid %s); "
            "left to that holder and its TTL",
            job.id,
            why,
            dead.key,
            holder.get("host"),
            holder.get("pid"),
        )
    elif dead.how == Settled.KEPT:
        log.warning("job %s: work-horse killed; lease %r kept %.0fs for its retry", job.id, dead.key, dead.seconds)
        mirror_meta(job, refresh=True, outcome="retrying")
    elif dead.how == Settled.RELEASED:
        before = " before its handle was saved" if dead.unsaved else ""
        log.warning("job %s: %s%s; lease %r released", job.id, why, before, dead.key)
        mirror_meta(job, refresh=True, outcome="ended", ended=why)
    return dead.how.value if dead.how in (Settled.KEPT, Settled.RELEASED) else None


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

    def unsubscribe(self) -> None:
        """RQ's own unsubscribe, with its pubsub thread's stop bounded as RQ bounds its join of
        that thread (1 s). From redis-py 8.2 ``PubSubWorkerThread.stop()`` joins the thread
        (redis/client.py), and a thread that read the unsubscribe reply before the stop waits for
        a new subscription for RQ's ``sleep_time`` of 60 s (rq/worker/base.py ``subscribe``): the
        worker's exit (a burst's end, a warm shutdown) waited up to a minute for it. The thread
        is a daemon, so nothing waits for it at exit; redis-py before 8.2 never joined there."""
        thread = self.pubsub_thread
        if thread is not None and "timeout" in inspect.signature(thread.stop).parameters:
            thread.stop = functools.partial(thread.stop, timeout=1.0)  # (this instance only)
        super().unsubscribe()

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
