"""RQ adapter for taskguard: job functions whose body runs under fenced Redis leases.

    from taskguard_rq import guarded_job

    @guarded_job(ttl=60, key="sync:{customer_id}")
    def sync_customer(customer_id): ...

Run workers as ``rq worker -w taskguard_rq.GuardedWorker`` so a killed work-horse's lease is
settled at once (see :mod:`taskguard_rq.worker`).
"""

from taskguard import Skipped, TaskSkipped, is_skipped, metrics as _metrics
from taskguard.context import current_lease

from .config import locks_for, use_locks
from .job import META_KEY, ON_SKIP, guarded_job, load_handle, skip_count
from .unique import enqueue_unique
from .worker import GuardedWorker, settle_killed_job

if _metrics.enabled_by_env():  # work-horses are forked from here: they inherit the listener
    _metrics.install()

__all__ = [
    "GuardedWorker",
    "META_KEY",
    "ON_SKIP",
    "Skipped",
    "TaskSkipped",
    "current_lease",
    "enqueue_unique",
    "guarded_job",
    "is_skipped",
    "load_handle",
    "locks_for",
    "settle_killed_job",
    "skip_count",
    "use_locks",
]
