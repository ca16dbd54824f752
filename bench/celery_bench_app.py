"""The Celery app of ``bench/bench_celery.py``: a no-op task, unguarded, guarded by taskguard,
and, for comparison, with the two round trips any Redis lock costs (``2x PING``) and guarded by
hand with redis-py's ``Lock``.

Both the benchmark (which enqueues) and its ``celery -A celery_bench_app worker`` subprocess
(which runs the tasks) import this module. Configuration, from the environment:

* ``TASKGUARD_REDIS_URL``  broker, result backend and leases (default ``redis://127.0.0.1:6379/0``)
* ``TGBENCH_QUEUE``         the queue this run's worker consumes (unique per run)
* ``TGBENCH_PREFIX``        the lease key prefix (unique per run)

The guarded task is configured the way the README tells users to: ``taskguard_redis_url`` plus
``taskguard_prefix`` (so the locks object is ``RedisLocks.from_url``, built once per process),
``GuardedTask`` with its defaults (``ttl=60``, ``renew=True``, ``wait=0``) and a key per call.
"""

from __future__ import annotations

import os

import redis
from celery import Celery, Task

from taskguard_celery import GuardedTask

REDIS_URL = os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("TGBENCH_QUEUE", "tgbench")
PREFIX = os.environ.get("TGBENCH_PREFIX", "tgbench")

app = Celery("tgbench", broker=REDIS_URL, backend=REDIS_URL, set_as_current=False)
app.conf.update(
    task_default_queue=QUEUE,
    taskguard_redis_url=REDIS_URL,
    taskguard_prefix=PREFIX,
    # the benchmark deletes its results itself; this is the safety net. Longer than the redelivery
    # window (visibility timeout + 60 s), as Celery's default (1 day) is: the result backend then tells
    # finished runs and no finished marker is written (identity.py, _stores_outcome)
    result_expires=7200,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

NOOP = "tgbench.noop"
TWO_PINGS_NOOP = "tgbench.two_pings_noop"
REDISPY_LOCK_NOOP = "tgbench.redispy_lock_noop"
GUARDED_NOOP = "tgbench.guarded_noop"
PASSTHROUGH_NOOP = "tgbench.passthrough_noop"


@app.task(name=NOOP, shared=False)
def noop(i: int) -> int:
    return i


@app.task(name=GUARDED_NOOP, base=GuardedTask, shared=False, key="noop:{i}")
def guarded_noop(i: int) -> int:
    return i


_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    """One plain redis-py client per process (made after the pool forks)."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS_URL)
    return _client


@app.task(name=TWO_PINGS_NOOP, shared=False)
def two_pings_noop(i: int) -> int:
    """The floor of any Redis lease guard: two round trips (acquire, release) on redis-py."""
    c = _redis()
    c.ping()
    c.ping()
    return i


@app.task(name=REDISPY_LOCK_NOOP, shared=False)
def redispy_lock_noop(i: int) -> int:
    """The same body under redis-py's ``Lock`` taken by hand (no fencing, no retry hand-over,
    no skip reporting, no renewal): what users write today."""
    lock = _redis().lock(f"{PREFIX}:rplock:{i}", timeout=60)
    if not lock.acquire(blocking=False):
        raise RuntimeError("redis-py lock unexpectedly held")
    try:
        return i
    finally:
        lock.release()


class PassThroughTask(Task):
    """A task class whose ``__call__`` only calls Celery's (diagnostic, in the benchmark's own
    process): Celery's tracer calls ``task.run`` directly unless the class overrides ``__call__``,
    so any such class, ``GuardedTask`` included, also pays for ``Task.__call__`` (a request pushed
    and popped per call)."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


@app.task(name=PASSTHROUGH_NOOP, base=PassThroughTask, shared=False)
def passthrough_noop(i: int) -> int:
    return i
