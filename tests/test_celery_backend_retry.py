"""The lease store fails before the body runs: ``autoretry_for`` covering ``LeaseBackendError``
retries the run with the task's backoff (the lease is taken in ``GuardedTask.__call__``, outside
the ``run`` that Celery's autoretry wraps), never runs the body unguarded, counts against
``max_retries``; nothing else raised before the body is retried. A real Celery worker on the
shared broker; the lease store is a suite-owned redis-server that is stopped and started."""

from __future__ import annotations

import time

import pytest
import redis
from celery.signals import task_prerun

from taskguard import IdempotencyConflict, LeaseBackendError, RedisLocks, TaskSkipped
from taskguard.errors import ConfigError

from .celery_app import make_app
from .celery_support import body_log, embedded_worker
from .servers import RedisServer


@pytest.fixture
def outage(redis_url, prefix):
    """(app, server, starts): an app whose leases live on a private server (stop/start it), its
    queue on the shared broker; ``starts`` lists (monotonic time, task name, retries) of every
    execution the in-process worker began."""
    server = RedisServer(appendonly=True).start()
    queue = f"q-{prefix}"
    locks = RedisLocks.from_url(server.url, prefix=prefix, connect_timeout=0.3, socket_timeout=0.3, retries=0)
    app = make_app(queue, prefix, taskguard_locks=locks)
    starts: list[tuple[float, str, int]] = []

    def on_prerun(sender=None, task=None, **_):
        if getattr(task, "app", None) is app:
            starts.append((time.monotonic(), task.name, task.request.retries))

    # the log expires: a parallel suite's session end deletes keys without a TTL under tgtest-*
    shared = redis.Redis.from_url(redis_url)
    shared.rpush(app.tg_log, "begin")
    shared.expire(app.tg_log, 600)
    task_prerun.connect(on_prerun, weak=False)
    try:
        yield app, server, starts
    finally:
        task_prerun.disconnect(on_prerun)
        server.close()
        redis.Redis.from_url(redis_url).delete(queue, app.tg_log)


def _log(app):
    return [e for e in body_log(app) if e != "begin"]


def _runs(starts, name):
    return [(t, r) for t, n, r in starts if n == name]


def test_autoretry_for_lease_backend_error_retries_with_the_tasks_backoff(outage):
    """retry_backoff=1, retry_backoff_max=2, retry_jitter=False: countdowns 1, 2, 2... s (Celery's
    get_exponential_backoff_interval); the body runs once, after the store is back."""
    app, server, starts = outage
    with embedded_worker(app):
        server.stop()
        res = app.tasks["tg.lease_autoretry"].delay("x")
        deadline = time.monotonic() + 20
        while len(_runs(starts, "tg.lease_autoretry")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(e.startswith("lar:") for e in _log(app))  # never unguarded
        server.start()
        retries = res.get(timeout=20)
    runs = _runs(starts, "tg.lease_autoretry")
    assert [r for _, r in runs] == list(range(retries + 1)) and retries >= 3, runs
    gaps = [b[0] - a[0] for a, b in zip(runs, runs[1:], strict=False)]
    assert 0.9 < gaps[0] < 3.0 and 1.9 < gaps[1] < 4.0 and 1.9 < gaps[2] < 4.0, gaps  # 1 s, 2 s, 2 s (max)
    assert [e.split(":")[:3] for e in _log(app)] == [["lar", "x", str(retries)]]
    assert res.status == "SUCCESS"


def test_lease_backend_error_retries_count_against_max_retries(outage):
    """retry_kwargs={"countdown": 0.2, "max_retries": 2}: three executions, then the task fails
    with the LeaseBackendError; the body never ran."""
    app, server, starts = outage
    with embedded_worker(app):
        server.stop()
        res = app.tasks["tg.lease_autoretry_short"].delay("y")
        with pytest.raises(LeaseBackendError):
            res.get(timeout=20)
    assert [r for _, r in _runs(starts, "tg.lease_autoretry_short")] == [0, 1, 2]
    assert not _log(app)
    assert res.status == "FAILURE"


def test_without_autoretry_for_a_backend_error_fails_at_once(outage):
    app, server, starts = outage
    with embedded_worker(app):
        server.stop()
        with pytest.raises(LeaseBackendError):
            app.tasks["tg.slow"].delay(1, seconds=0).get(timeout=10)
    assert [r for _, r in _runs(starts, "tg.slow")] == [0]


def test_autoretry_for_exception_retries_only_backend_errors_before_the_body(outage):
    """autoretry_for=(Exception,): TaskSkipped (on_skip="raise"), IdempotencyConflict (once, another
    fingerprint) and ConfigError (a key that does not render) raised before the body fail at once;
    a LeaseBackendError before the body is retried."""
    app, server, starts = outage
    task = app.tasks["tg.any_autoretry"]
    locks = app.conf.taskguard_locks
    with embedded_worker(app):
        held = locks.acquire("aar:held", ttl=30).lease
        with pytest.raises(TaskSkipped):
            task.delay("held").get(timeout=10)
        held.release()
        assert task.delay("paid", 1).get(timeout=10)["retries"] == 0
        with pytest.raises(IdempotencyConflict):
            task.delay("paid", 2).get(timeout=10)
        with pytest.raises(ConfigError):
            task.delay("bad").get(timeout=10)
        server.stop()
        res = task.delay("down")
        deadline = time.monotonic() + 20
        while len([1 for _, n, _r in starts if n == task.name]) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.start()
        assert res.get(timeout=20)["retries"] >= 1
    per_call = [r for _, n, r in starts if n == task.name]
    # held, paid 1, paid 2, bad: one execution each (retries 0); then "down": 0, 1, ...
    assert per_call[:4] == [0, 0, 0, 0] and per_call[4:] == list(range(len(per_call) - 4)), per_call
    assert [e for e in _log(app) if e.startswith("aar:")] == ["aar:paid:0", f"aar:down:{per_call[-1]}"]


def test_a_rate_check_that_fails_is_retried_too(outage):
    """The rate (THROTTLE) is asked before the lease: its backend error is retried the same way."""
    app, server, starts = outage
    with embedded_worker(app):
        server.stop()
        res = app.tasks["tg.rated_autoretry"].delay("r")
        deadline = time.monotonic() + 20
        while len(_runs(starts, "tg.rated_autoretry")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.start()
        retries = res.get(timeout=20)
    assert retries >= 1 and _log(app) == [f"rar:r:{retries}"]


def test_a_retry_whose_claim_fails_is_retried_and_claims_the_kept_lease(outage):
    """The body retries (its lease kept, stretched over the countdown); the store goes down before
    the retry claims it: the claim's backend error is retried, the handle travels on, and the
    run that finally begins claims the same lease (same fence)."""
    app, server, starts = outage
    with embedded_worker(app):
        res = app.tasks["tg.retry_then_claim"].delay("c")
        deadline = time.monotonic() + 20
        locks = app.conf.taskguard_locks
        while not ((h := locks.holder("rtc:c")) and h.ttl > 5.0) and time.monotonic() < deadline:
            time.sleep(0.02)  # the retry is out with the kept lease (stretched to 1 s + ttl 5 s)
        server.stop()  # AOF: the kept lease (5 s + 1 s countdown) survives the restart
        while len(_runs(starts, "tg.retry_then_claim")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.start()
        fence = res.get(timeout=20)
    log = _log(app)
    assert len(log) == 2 and log[0].startswith("rtc:c:0:"), log
    assert int(log[0].split(":")[3]) == fence and int(log[1].split(":")[3]) == fence
    assert len(_runs(starts, "tg.retry_then_claim")) >= 3


def test_acks_late_when_the_broker_is_the_lease_redis_that_is_down(redis_url, prefix):
    """The broker and the lease store are one Redis, down when the run asks for its lease: the
    retry cannot be published. With acks_late the message is not lost: it stays unacknowledged
    (the reject cannot reach the broker either) and comes back when the broker does; the run then
    takes its lease and the body runs once. (The documented fallback; the Redis transport brings
    unacked messages back after its visibility_timeout, 3 s here.)"""
    from .celery_support import WorkerProcess
    from .test_celery_failures import REDIS_REDELIVERY

    server = RedisServer(appendonly=True).start()
    queue = f"q-{prefix}"
    conf = {
        "taskguard_locks": None,
        "taskguard_redis_url": server.url,
        "taskguard_prefix": prefix,
        "broker_transport_options": REDIS_REDELIVERY,
    }
    app = make_app(queue, prefix, broker=server.url, **conf)
    shared = redis.Redis.from_url(redis_url)
    shared.rpush(app.tg_log, "begin")
    shared.expire(app.tg_log, 600)
    worker = WorkerProcess(queue, prefix, broker=server.url, conf=conf)
    res = None
    try:
        with worker:
            res = app.tasks["tg.late_lease"].delay("a")
            deadline = time.monotonic() + 30
            while not shared.get(f"{prefix}:attempt:ll:{res.id}") and time.monotonic() < deadline:
                time.sleep(0.05)
            server.stop()  # during the first execution's pause, before its guard
            time.sleep(6.0)
            server.start()
            # Celery 5.x's main process may die of its own broker connection loss (kombu's restore
            # of unacked messages on a dead connection); a supervisor starts it again: so do we
            with WorkerProcess(queue, prefix, broker=server.url, conf=conf) as again:
                assert res.get(timeout=60) == "a", worker.output() + again.output()
        assert "reject requeue=True" in worker.output()
        log = [x.decode() for x in shared.lrange(app.tg_log, 0, -1) if x != b"begin"]  # (not the broker's Redis)
        assert len(log) == 1 and log[0].startswith("ll:a:"), log
        assert int(shared.get(f"{prefix}:attempt:ll:{res.id}")) >= 2
    finally:
        shared.delete(app.tg_log, *([f"{prefix}:attempt:ll:{res.id}"] if res is not None else []))
        server.close()
