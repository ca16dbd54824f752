"""The per-guard ``replica_timeout`` checked where ``WAIT`` is sent: a Celery task whose
guard asks for a ``replica_timeout`` at or above the socket timeout of the app's locks."""

from __future__ import annotations

import pytest
import redis

from taskguard import RedisLocks
from taskguard_celery import GuardedTask

from .celery_app import make_app
from .celery_support import embedded_worker


@pytest.fixture
def app(redis_url, prefix):
    client = redis.Redis.from_url(redis_url, socket_timeout=1)
    a = make_app(f"q-{prefix}", prefix, taskguard_locks=RedisLocks(client, prefix=prefix))
    yield a
    redis.Redis.from_url(redis_url).delete(a.tg_log, f"q-{prefix}")
    client.close()


def test_a_guard_replica_timeout_above_the_socket_timeout_fails_each_run_and_leaves_nothing(app, redis_url):
    """What the worker does with such a guard: each run fails with the ConfigError (raised by the
    acquisition, before anything was sent), the unique mark is cleared, no lease is left."""

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.brk_replica_timeout",
        ttl=10,
        key="rt:{n}",
        unique=True,
        replicas=1,
        replica_timeout=2.0,
        acks_late=True,
    )
    def durable(self, n):
        return n

    locks = app.conf.taskguard_locks
    with embedded_worker(app):
        res = durable.delay(1)
        with pytest.raises(Exception) as info:
            res.get(timeout=20)
        again = durable.delay(1)  # the key is not blocked by a mark or a lease
        assert again.id != res.id
        with pytest.raises(Exception) as again_info:  # noqa: B017 (the result backend rebuilds its own class)
            again.get(timeout=20)
        assert type(again_info.value).__name__ == "ConfigError"
    assert type(info.value).__name__ == "ConfigError" and "below the client's socket_timeout" in str(info.value)
    assert locks.holders("rt:1") == []
    assert redis.Redis.from_url(redis_url).llen(app.conf.task_default_queue) == 0
