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


def test_a_guard_replica_timeout_above_the_socket_timeout_stops_the_worker_or_fails_each_run_leaving_nothing(
    app, redis_url, prefix
):
    """With the app's locks known at worker start, the worker refuses to start, naming the task.
    Locks swapped afterwards (``use_locks``) meet the check at each run instead: it fails with the
    ConfigError (raised by the acquisition, before anything was sent), the unique mark is cleared,
    no lease is left."""
    from taskguard_celery.config import use_locks
    from taskguard_celery.pools import check_settings

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
    with pytest.raises(SystemExit, match="task 'tg.brk_replica_timeout': replica_timeout"):
        check_settings(app)  # (what the worker's start, worker_init, runs)
    use_locks(app, RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix))  # (a 5 s socket timeout)
    with embedded_worker(app):
        use_locks(app, locks)  # after the start
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
