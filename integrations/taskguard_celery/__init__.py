"""Celery adapter for taskguard: task bodies that run under fenced Redis leases.

    from taskguard_celery import guarded_task

    @guarded_task(ttl=60, key="report:{customer_id}")
    def build_report(customer_id): ...

See :class:`GuardedTask` for the options and :mod:`taskguard_celery.config` for which Redis
is used. Importing this package registers ``Skipped`` with kombu's JSON serializer and connects
no Celery signal: the first ``GuardedTask`` bound to an app (or :func:`install`) connects the
worker-pool check, the worker metrics and the main-process lease release, once per process
(:mod:`taskguard_celery.setup`).
"""

from taskguard import Skipped, TaskSkipped, is_skipped

# the modules that declare signal receivers, connected by install()
from . import (
    metrics as _metrics,  # noqa: F401  (Prometheus in worker processes, when enabled)
    pools as _pools,  # noqa: F401  (the worker_init check)
    supervision as _supervision,  # noqa: F401  (main-process lease release)
)
from .config import use_locks
from .serialization import MARKER
from .setup import install
from .task import HEADER, GuardedTask, current_lease, guarded_task, release_retry_handle

__all__ = [
    "GuardedTask",
    "HEADER",
    "MARKER",
    "Skipped",
    "TaskSkipped",
    "current_lease",
    "guarded_task",
    "install",
    "is_skipped",
    "release_retry_handle",
    "use_locks",
]
