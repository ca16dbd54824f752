"""RQ jobs guarded by taskguard: a per-customer sync that must not run twice at once.

Leases come from ``taskguard.from_env()`` (TASKGUARD_REDIS_URL, TASKGUARD_PREFIX). Run workers as
``rq worker -w taskguard_rq.GuardedWorker --with-scheduler QUEUE``.
"""

from __future__ import annotations

import os
import time

import redis

from taskguard_rq import current_lease, guarded_job

REDIS_URL = os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")


def fences_key(customer_id: int) -> str:
    """Where each attempt records the fencing token it ran with (for the demo's summary)."""
    return f"rq-demo:{os.environ.get('TASKGUARD_PREFIX', '')}:fences:{customer_id}"


@guarded_job(ttl=10, key="customer-sync:{customer_id}")
def sync_customer(customer_id: int, seconds: float = 1.0, fail_first: bool = False) -> dict:
    """Pull one customer's records from a partner API (simulated), at most one sync per customer."""
    r = redis.Redis.from_url(REDIS_URL)
    attempts_key = f"rq-demo:{os.environ.get('TASKGUARD_PREFIX', '')}:attempts:{customer_id}"
    attempt = r.incr(attempts_key)
    r.expire(attempts_key, 600)
    fence = current_lease().fencing_token
    r.rpush(fences_key(customer_id), fence)
    r.expire(fences_key(customer_id), 600)
    if fail_first and attempt == 1:
        raise ConnectionError("partner API timed out")  # RQ retries the job (same job id)
    time.sleep(seconds)
    return {"customer": customer_id, "fence": fence, "attempt": attempt}
