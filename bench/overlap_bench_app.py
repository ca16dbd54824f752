"""The Celery app of ``bench/bench_overlap.py``: tasks to time the publish of a debounced call and
the start of a coalesced follow-up beside plain ``apply_async``. Imported by the benchmark (which
publishes) and by its ``celery -A overlap_bench_app worker`` subprocess. Configuration from the
environment: ``TASKGUARD_REDIS_URL`` (broker, results, leases), ``TGBENCH_QUEUE``,
``TGBENCH_PREFIX`` (unique per run)."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from taskguard_celery import GuardedTask

REDIS_URL = os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("TGBENCH_QUEUE", "tgbench")
PREFIX = os.environ.get("TGBENCH_PREFIX", "tgbench")

app = Celery("tgbench-overlap", broker=REDIS_URL, backend=REDIS_URL, set_as_current=False)
app.conf.update(
    task_default_queue=QUEUE,
    taskguard_redis_url=REDIS_URL,
    taskguard_prefix=PREFIX,
    result_expires=7200,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_client: redis.Redis | None = None


def _mark(what: str, i: int) -> None:
    """``"<what> <i> <time>"`` on the run's list (the benchmark reads the times)."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS_URL)
    key = f"{PREFIX}:marks"
    _client.pipeline().rpush(key, f"{what} {i} {time.time():.6f}").expire(key, 3600).execute()


@app.task(name="tgbench.plain", shared=False)
def plain(i: int) -> int:
    _mark("start", i)
    return i


@app.task(name="tgbench.guarded", base=GuardedTask, shared=False, key="g:{i}")
def guarded(i: int) -> int:
    return i


@app.task(name="tgbench.guarded_mark", base=GuardedTask, shared=False, key="gm:{i}")
def guarded_mark(i: int) -> int:
    _mark("start", i)
    return i


@app.task(name="tgbench.coalesced", base=GuardedTask, shared=False, key="c:{lane}", ttl=10, overlap="coalesce")
def coalesced(lane: str, i: int, hold: float = 0.0) -> int:
    _mark("start", i)
    time.sleep(hold)
    _mark("end", i)
    return i


@app.task(
    name="tgbench.debounced", base=GuardedTask, shared=False, key="d:{lane}", debounce=3600.0, debounce_max=3600.0
)
def debounced(lane: str, i: int) -> int:
    return i
