"""taskguard: fenced Redis leases for Celery and RQ tasks.

The core is framework-free; the Celery and RQ adapters are ``taskguard_celery`` and
``taskguard_rq``. Units are seconds (float) everywhere; times are Unix epoch seconds.
"""

from .config import from_env
from .errors import (
    ConfigError,
    IdempotencyConflict,
    LeaseBackendError,
    LeaseLost,
    RateLimited,
    TaskguardError,
    TaskSkipped,
    Unreplicated,
)
from .events import LeaseEvent, add_listener, remove_listener
from .lease import Acquisition, HolderInfo, Lease
from .locks import Health, Locks
from .memory_locks import MemoryLocks
from .pacing import settle_cost
from .redis_locks import RedisLocks
from .skipped import Skipped, as_skipped, is_skipped
from .throttle import Throttle

__version__ = "0.1.0"

__all__ = [
    "Acquisition",
    "ConfigError",
    "Health",
    "HolderInfo",
    "IdempotencyConflict",
    "Lease",
    "LeaseBackendError",
    "Unreplicated",
    "LeaseEvent",
    "LeaseLost",
    "Locks",
    "MemoryLocks",
    "RateLimited",
    "RedisLocks",
    "Skipped",
    "TaskSkipped",
    "TaskguardError",
    "Throttle",
    "add_listener",
    "from_env",
    "is_skipped",
    "as_skipped",
    "remove_listener",
    "settle_cost",
]
