"""The Celery example app for ``limit=`` and ``rate=``: per-tenant exports of which at most two
run at once, and calls to a partner API that allows a few calls a second across the whole cluster.

* ``limits.export``: ``limit=2`` on ``export:{tenant}``. Each run holds a fenced lease in one of
  the key's two slots (``self.lease.slot``; fencing tokens grow per slot). A third run of a
  tenant finds both slots taken and, with ``on_skip="retry"``, is re-published 0.5 s later
  until a slot is free (``skip_max_retries`` bounds that; it does not consume ``max_retries``).
* ``limits.call_api``: ``rate="2/s"`` with a burst of 2 under one rate key, ``partner-api``,
  shared by every worker. A call over the rate is re-published for its booked turn (state
  RETRY): with ``max_retries=0`` this shows that being throttled never consumes a retry. One that
  would wait past ``rate_max_wait`` is skipped with reason ``"rate_limited"``.

* ``limits.summarize``: an LLM-style API metered in *tokens*: ``rate="6000/m"`` tokens with
  ``cost=`` the call's estimated tokens (a callable of the task's arguments), so a long text
  takes more of the rate than a short one. The body settles the real count the API reports
  (``taskguard.settle_cost``), and when the API answers 429 it raises
  ``taskguard.RateLimited(retry_after=...)``: every worker stops calling the API for that long
  (on the Redis clock) and this run comes back after the pause, without consuming a retry
  (also with ``autoretry_for=(Exception,)``).

Every body appends what it did to a Redis list, which the demo reads back.

Configuration: ``TASKGUARD_REDIS_URL`` (broker, results and leases), ``LIMITS_QUEUE`` (queue
name), ``LIMITS_PREFIX`` (key prefix of the leases, the rate and the lists).
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from taskguard import RateLimited, settle_cost
from taskguard_celery import guarded_task

REDIS_URL = os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("LIMITS_PREFIX", "limits-demo")
#: the exports' entry/exit records: "<in|out> <time> <tenant> <slot> <fence> <pid>"
LEDGER = f"{PREFIX}:ledger"
#: the API calls' records: "<time> <n>"
CALLS = f"{PREFIX}:calls"

#: the summaries' records: "<time> <n> <estimated tokens> <tokens used>"
SUMMARIES = f"{PREFIX}:summaries"

EXPORT_LIMIT = 2
API_RATE = (2, 1.0)  # 2 calls a second ...
API_BURST = 2  # ... and 2 may pass at once

app = Celery("limits", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=os.environ.get("LIMITS_QUEUE", "limits"),
    taskguard_redis_url=REDIS_URL,
    taskguard_prefix=PREFIX,
    result_expires=3600,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_redis: redis.Redis | None = None


def store() -> redis.Redis:
    """One client per process (a prefork child makes its own on first use)."""
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(REDIS_URL)
    return _redis


@guarded_task(
    name="limits.export",
    bind=True,
    ttl=10,
    key="export:{tenant}",
    limit=EXPORT_LIMIT,
    on_skip="retry",
    skip_retry_delay=0.5,
    skip_max_retries=40,
)
def export(self, tenant: str, rows: int, seconds: float = 0.5) -> dict:
    """Export a tenant's rows; at most two exports of one tenant run at a time."""
    lease = self.lease
    record = f"{tenant} {lease.slot} {lease.fencing_token} {os.getpid()}"
    store().rpush(LEDGER, f"in {time.time():.6f} {record}")
    time.sleep(seconds)  # the export itself
    store().rpush(LEDGER, f"out {time.time():.6f} {record}")
    return {"tenant": tenant, "rows": rows, "slot": lease.slot, "fence": lease.fencing_token}


@guarded_task(
    name="limits.call_api",
    bind=True,
    ttl=10,
    key="partner-api-call:{n}",
    rate=API_RATE,
    rate_key="partner-api",
    rate_burst=API_BURST,
    rate_max_wait=30,
    max_retries=0,
)
def call_api(self, n: int) -> int:
    """One call to the partner API, paced cluster-wide (the lease key is per call: only the rate
    is shared)."""
    store().rpush(CALLS, f"{time.time():.6f} {n}")
    return n


TOKENS_RATE = "6000/m"  # what the API allows, in tokens (100 a second)
TOKENS_BURST = 1000  # tokens that may go at once; also the largest call


def estimate_tokens(text: str) -> int:
    """A rough estimate (about 4 characters a token), capped at the burst."""
    return max(1, min(len(text) // 4, TOKENS_BURST))


class TooManyRequests(Exception):
    """What an HTTP client raises for a 429 (``retry_after``: the response's Retry-After)."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(retry_after)
        self.retry_after = retry_after


def fake_llm(text: str) -> tuple[str, int]:
    """Stands in for the provider: answers 429 the first time it is asked after the key
    ``<prefix>:upstream-429`` is set, and reports the tokens it used."""
    if store().delete(f"{PREFIX}:upstream-429"):
        raise TooManyRequests(retry_after=2.0)
    return text[:20], estimate_tokens(text) + len(text) % 7  # the real count differs a little


@guarded_task(
    name="limits.summarize",
    bind=True,
    ttl=30,
    key="summarize:{n}",
    rate=TOKENS_RATE,
    rate_key="llm-api",
    cost=lambda text, **_: estimate_tokens(text),
    rate_burst=TOKENS_BURST,
    autoretry_for=(Exception,),
    max_retries=0,
)
def summarize(self, n: int, text: str) -> str:
    """One call to the LLM API, paced in tokens cluster-wide; a 429 pauses every worker."""
    try:
        summary, used = fake_llm(text)
    except TooManyRequests as e:
        raise RateLimited(retry_after=e.retry_after) from e
    settle_cost(used)  # the real count: later calls are paced by what was actually used
    store().rpush(SUMMARIES, f"{time.time():.6f} {n} {estimate_tokens(text)} {used}")
    return summary
