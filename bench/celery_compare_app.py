"""The Celery app of ``bench/bench_celery_compare.py``: ``bench/celery_bench_app.py``'s app and
tasks (unguarded, GuardedTask, redis-py ``Lock`` by hand) plus the same no-op under celery-once
(``QueueOnce``) and under celery-singleton (``Singleton``), both of which take their lock when the
task is published and release it in the worker after the body.

Both libraries come from ``bench/requirements-compare.txt``. When one cannot be imported its task
is ``None`` and the reason is in ``IMPORT_ERRORS``. Their locks expire after 60 s, as
GuardedTask's ``ttl=60`` does; their keys are under the run's prefix (celery-once puts the task
name in its key, so the task names carry the prefix; celery-singleton gets ``singleton_key_prefix``).
"""

from __future__ import annotations

from typing import Any

from celery_bench_app import (  # noqa: F401  (the worker registers these tasks through this import)
    PREFIX,
    REDIS_URL,
    app,
    guarded_noop,
    noop,
    redispy_lock_noop,
    two_pings_noop,
)

ONCE_NOOP = f"{PREFIX}.once_noop"  # celery-once's key: qo_<task name>_i-<i>
SINGLETON_NOOP = f"{PREFIX}.singleton_noop"

app.conf.update(
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": REDIS_URL, "default_timeout": 60}},
    singleton_backend_url=REDIS_URL,
    singleton_key_prefix=f"{PREFIX}:singleton:",
    singleton_lock_expiry=60,
)

IMPORT_ERRORS: dict[str, str] = {}
once_noop: Any = None
singleton_noop: Any = None

try:
    from celery_once import QueueOnce

    @app.task(name=ONCE_NOOP, base=QueueOnce, shared=False)
    def once_noop(i: int) -> int:
        return i

except Exception as e:  # reported by the benchmark
    IMPORT_ERRORS["celery-once"] = f"{type(e).__name__}: {e}"

try:
    from celery_singleton import Singleton

    @app.task(name=SINGLETON_NOOP, base=Singleton, shared=False)
    def singleton_noop(i: int) -> int:
        return i

except Exception as e:  # reported by the benchmark
    IMPORT_ERRORS["celery-singleton"] = f"{type(e).__name__}: {e}"
