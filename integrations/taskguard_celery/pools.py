"""Check the worker pool and the settings the guard uses, at worker start.

Supported pools: ``prefork``, ``threads``, ``solo`` and ``gevent``. Under ``-P gevent`` Celery
monkey-patches the process before anything else runs (celery/__main__.py,
``maybe_patch_concurrency``), so the heartbeat's thread, its condition and its Redis sockets are
greenlets and cooperative sockets: renewals run whenever the task bodies yield (any I/O or
``time.sleep``). A body that never yields (a CPU loop) starves every greenlet, the heartbeat
too: its lease can expire, which ``on_lost`` reports. ``eventlet`` (deprecated by its own
maintainers) is refused, and only for an app that has guarded tasks: importing
``taskguard_celery`` changes nothing for apps that do not use it.
"""

from __future__ import annotations

from typing import Any

from celery.concurrency import get_implementation
from celery.concurrency.base import BasePool
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.signals import worker_init

from taskguard import ConfigError

from .config import locks_for
from .identity import redelivery_timeout
from .setup import receiver
from .task import GuardedTask

__all__ = ["UNSUPPORTED_POOLS", "check_pool", "check_settings", "can_terminate"]

UNSUPPORTED_POOLS = ("eventlet",)


def pool_name(pool_cls: Any) -> str:
    if isinstance(pool_cls, str):
        return pool_cls.split(":")[0].rsplit(".", 1)[-1].lower()
    return f"{getattr(pool_cls, '__module__', '')}".rsplit(".", 1)[-1].lower()


@receiver(worker_init)
def check_pool(sender: Any = None, **_: Any) -> None:
    """``worker_init`` handler (celery/worker/worker.py sends it before the pool is built).

    Raises SystemExit for an unsupported pool: Celery's signal dispatch logs and swallows
    ordinary exceptions, which would let the worker start half working."""
    app = getattr(sender, "app", None)
    if app is None or not _guarded_tasks(app):
        return
    name = pool_name(getattr(sender, "pool_cls", None) or "")
    if name in UNSUPPORTED_POOLS:
        msg = (
            f"taskguard: the {name!r} worker pool is not supported for guarded tasks; start the worker "
            "with -P prefork, -P threads, -P solo or -P gevent"
        )
        raise SystemExit(msg)
    if not can_terminate(getattr(sender, "pool_cls", None)):
        terminating = sorted(
            t.name for t in _guarded_tasks(app) if getattr(t.taskguard_options, "replace_terminate", False)
        )
        if terminating:
            raise SystemExit(
                f"taskguard: ConfigError: replace_terminate=True ({', '.join(terminating)}) needs a pool "
                f"that can terminate a running task; the {name!r} pool cannot "
                "(celery/concurrency/base.py): use -P prefork or -P gevent, or replace_terminate=False"
            )
    check_settings(app)


def can_terminate(pool_cls: Any) -> bool:
    """Can a worker on this pool (``-P`` name, ``module:Class`` or class) terminate a running task
    (``revoke(terminate=True)``)? A pool that does not implement ``terminate_job`` cannot: the
    base pool's raises ``NotImplementedError`` (celery/concurrency/base.py; ``threads`` and
    ``solo``, celery/celery#8147, #5929, and any custom pool built on them). Prefork sets it per
    pool when it starts (celery/concurrency/prefork.py ``on_start``); gevent kills the greenlet.
    A pool that cannot be loaded here is left to Celery, which reports it next."""
    try:
        cls = pool_cls if isinstance(pool_cls, type) else get_implementation(pool_cls)
    except Exception:
        return True
    if not isinstance(cls, type):
        return True
    return issubclass(cls, PreforkPool) or getattr(cls, "terminate_job", None) is not BasePool.terminate_job


def _guarded_tasks(app: Any) -> list:
    return [t for t in list(app.tasks.values()) if isinstance(t, GuardedTask)]


def check_settings(app: Any) -> None:
    """Validate the settings the guard uses — which Redis (``taskguard_redis_url``,
    ``taskguard_prefix``, ``taskguard_locks``), the broker's redelivery timeout, and each guarded
    task's durability option (``replicas``, ``replica_timeout``) on the Redis it uses — at worker
    start, for an app with guarded tasks. Raises SystemExit naming the bad setting (no round trip
    is made: an unreachable Redis is reported by the runs, which never run unguarded)."""
    guarded = _guarded_tasks(app)
    if not guarded:
        return
    try:
        redelivery_timeout(app)
        for t in guarded:  # each task's durability option on the Redis it uses (the app's, or its locks=)
            locks, opts = locks_for(app, t.locks), t.taskguard_options
            try:
                locks.check_durability(opts.replicas, opts.replica_timeout)
            except ConfigError as e:
                raise ConfigError(f"task {t.name!r}: {e}") from None
    except ConfigError as e:
        raise SystemExit(f"taskguard: {e}") from None
