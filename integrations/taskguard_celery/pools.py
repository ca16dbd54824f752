"""Refuse worker pools the guard does not support, and settings it cannot use, at worker start.

The heartbeat that renews leases is an OS thread. Under the ``gevent`` and ``eventlet`` pools a
task body that blocks the event loop would also stall lease renewal, and greenlet-local request
state is not what the guard tracks, so those pools are refused with a clear error instead of
being half supported. ``prefork``, ``threads`` and ``solo`` are supported.
"""

from __future__ import annotations

from typing import Any

from celery.signals import worker_init

__all__ = ["UNSUPPORTED_POOLS", "check_pool", "check_settings"]

UNSUPPORTED_POOLS = ("gevent", "eventlet")


def pool_name(pool_cls: Any) -> str:
    if isinstance(pool_cls, str):
        return pool_cls.split(":")[0].rsplit(".", 1)[-1].lower()
    return f"{getattr(pool_cls, '__module__', '')}".rsplit(".", 1)[-1].lower()


@worker_init.connect(weak=False)
def check_pool(sender: Any = None, **_: Any) -> None:
    """``worker_init`` handler (celery/worker/worker.py sends it before the pool is built).

    Raises SystemExit for an unsupported pool: Celery's signal dispatch logs and swallows
    ordinary exceptions, which would let the worker start half working."""
    name = pool_name(getattr(sender, "pool_cls", None) or "")
    if name in UNSUPPORTED_POOLS:
        msg = (f"taskguard: the {name!r} worker pool is not supported (lease renewal runs in an OS "
               "thread); start the worker with -P prefork, -P threads or -P solo")
        raise SystemExit(msg)
    app = getattr(sender, "app", None)
    if app is not None:
        check_settings(app)


def check_settings(app: Any) -> None:
    """Validate the settings the guard uses — which Redis (``taskguard_redis_url``,
    ``taskguard_prefix``, ``taskguard_locks``) and the broker's redelivery timeout — at worker
    start, for an app with guarded tasks. Raises SystemExit naming the bad setting (no round trip
    is made: an unreachable Redis is reported by the runs, which never run unguarded)."""
    from taskguard import ConfigError

    from .config import locks_for
    from .identity import redelivery_timeout
    from .task import GuardedTask

    guarded = [t for t in list(app.tasks.values()) if isinstance(t, GuardedTask)]
    if not guarded:
        return
    try:
        redelivery_timeout(app)
        if any(getattr(t, "locks", None) is None for t in guarded):  # some task uses the app's Redis
            locks_for(app)
    except ConfigError as e:
        raise SystemExit(f"taskguard: {e}") from None
