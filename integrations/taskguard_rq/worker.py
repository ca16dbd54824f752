"""``GuardedWorker``: an RQ worker that settles the lease of a job whose work-horse was killed.

A SIGKILLed (or OOM-killed) work-horse runs no ``finally``, so the job's lease would stay until
its TTL runs out. The worker's main process notices the dead horse
(``BaseWorker.handle_work_horse_killed``, rq/worker/base.py) before it records the failure and,
with this class, settles the lease at once:

* the job has retries left (``Retry``): the lease is stretched over the retry interval plus its
  TTL and its handle kept, so the retry claims the same lease (same fencing token);
* otherwise: the lease is released (and the job marked done), so the next job of the key runs.

With a plain ``rq worker`` (or a whole worker killed) the TTL bounds the lease instead, and a
retry that arrives after it expired acquires afresh (a larger fencing token).

Use: ``rq worker -w taskguard_rq.GuardedWorker`` (with ``--with-scheduler`` for retry intervals).
"""

from __future__ import annotations

import logging
from typing import Any

from rq import Worker

from taskguard import ConfigError, LeaseBackendError
from .handles import drop_handle, load_handle, save_handle
from .config import locks_for

__all__ = ["GuardedWorker", "settle_killed_job"]

log = logging.getLogger("taskguard.rq")


def settle_killed_job(job: Any) -> str | None:
    """Settle the lease of ``job`` whose work-horse died. Returns ``"kept"``, ``"released"`` or
    ``None`` (the job held no lease)."""
    func = getattr(job, "func", None)
    opts = getattr(func, "taskguard_options", None)
    if opts is None:
        return None
    locks = locks_for(getattr(func, "taskguard_locks", None))
    handle = load_handle(locks, job.id)
    if handle is None:
        return None
    lease = locks.restore(handle["key"], handle["owner"], ttl=opts.ttl, fencing_token=handle["fence"])
    lease.run_id = job.id
    if job.retries_left:
        stretch = job.get_retry_interval() + opts.ttl
        if lease.renew(stretch):
            save_handle(locks, job.id, {**handle, "expires": lease.expires_at, "running": False}, ttl=stretch)
            log.warning("job %s: work-horse killed; lease %r kept %.0fs for its retry", job.id, handle["key"], stretch)
            return "kept"
    lease.release()
    drop_handle(locks, job.id)
    log.warning("job %s: work-horse killed; lease %r released", job.id, handle["key"])
    return "released"


class GuardedWorker(Worker):
    """An RQ ``Worker`` that settles guarded jobs' leases when their work-horse is killed."""

    def handle_work_horse_killed(self, job: Any, retpid: int, ret_val: int, rusage: Any) -> None:
        super().handle_work_horse_killed(job, retpid, ret_val, rusage)
        try:
            settle_killed_job(job)
        except (LeaseBackendError, ConfigError) as e:
            log.warning("job %s: could not settle its lease (its TTL bounds it): %s", job.id, e)
