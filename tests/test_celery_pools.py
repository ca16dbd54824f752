"""Worker pools (prefork subprocess, threads, solo, gevent; eventlet refused) and task protocol 1."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import redis

from taskguard import is_skipped

from .celery_app import make_app
from .celery_support import WorkerProcess, body_log, embedded_worker, wait_for_body


@pytest.fixture
def app(redis_url, prefix):
    a = make_app(f"q-{prefix}", prefix)
    yield a
    redis.Redis.from_url(redis_url).delete(a.tg_log, f"q-{prefix}")


def test_prefork_worker_process_guards_skips_and_restores(app, prefix):
    with WorkerProcess(f"q-{prefix}", prefix, pool="prefork", concurrency=3) as worker:
        first = app.tasks["tg.slow"].delay(1, seconds=3.0)
        wait_for_body(app, "slow:1:start")
        second = app.tasks["tg.slow"].delay(1, seconds=0)
        retried = app.tasks["tg.retrying"].delay("p", fail_times=2, countdown=0.3)
        renewed = app.tasks["tg.short_ttl"].delay(seconds=2.0)  # ttl 0.6: a child's heartbeat renews it
        time.sleep(1.4)
        assert is_skipped(app.tasks["tg.short_ttl"].delay(seconds=0).get(timeout=10))
        assert isinstance(renewed.get(timeout=10), int)
        skipped = second.get(timeout=10)
        ran = first.get(timeout=10)
        fence = retried.get(timeout=20)
        output = worker.output()
    assert is_skipped(skipped) and skipped["reason"] == "held", output
    assert ran["n"] == 1 and ran["same"]
    runs = [e for e in body_log(app) if e.startswith("retrying:p:")]
    assert len(runs) == 3 and {int(e.split(":")[3]) for e in runs} == {fence}
    locks = app.conf.taskguard_locks
    assert locks.holder("slow:1") is None and locks.holder("retry:p") is None
    assert "Traceback" not in output


def test_solo_pool(app):
    with embedded_worker(app, pool="solo", concurrency=1):
        held = app.conf.taskguard_locks.acquire("slow:2", ttl=10).lease
        assert is_skipped(app.tasks["tg.slow"].delay(2, seconds=0).get(timeout=5))
        held.release()
        assert app.tasks["tg.slow"].delay(2, seconds=0).get(timeout=5)["n"] == 2


def test_eventlet_is_refused_only_for_apps_with_guarded_tasks(app):
    with pytest.raises(SystemExit, match="'eventlet' worker pool is not supported"):
        app.WorkController(
            pool_cls="eventlet", concurrency=1, without_heartbeat=True, without_mingle=True, without_gossip=True
        )
    # an app without guarded tasks, in a fresh process (this one has shared guarded tasks that
    # every app gets): importing taskguard_celery changes nothing for it
    script = """
from types import SimpleNamespace
from celery import Celery
import taskguard_celery
from taskguard_celery.pools import check_pool

plain = Celery("plain", broker="memory://", set_as_current=False)

@plain.task(name="plain.add")
def add(a, b):
    return a + b

check_pool(sender=SimpleNamespace(app=plain, pool_cls="eventlet"))
print("not refused")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "not refused" in out.stdout, out.stderr[-2000:]


def test_gevent_pool_renews_while_the_body_yields(redis_url, prefix):
    """``celery worker -P gevent -c 10``: a 12 s body with ttl=4 keeps its lease (the heartbeat
    is a greenlet under gevent's monkey-patching), the calls made meanwhile are skipped, and it
    returns its value. Before, the worker refused to start."""
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    with WorkerProcess(queue, prefix, pool="gevent", concurrency=10) as worker:
        long = app.tasks["tg.hold4"].delay(seconds=12.0)
        locks = app.conf.taskguard_locks
        deadline = time.monotonic() + 10
        while locks.holder("hold4") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        skipped = []
        for _ in range(3):
            time.sleep(3.0)
            skipped.append(app.tasks["tg.hold4"].delay(seconds=0).get(timeout=10))
        out = long.get(timeout=30)
        output = worker.output()
    print(
        f"    observed: -P gevent -c 10, a 12 s body with ttl=4: {out}; calls meanwhile: "
        f"{[s['reason'] for s in skipped]}"
    )
    assert out["pool_patched"] is True and out["lost"] is False, output[-3000:]
    assert all(is_skipped(s) and s["reason"] == "held" for s in skipped)


def test_gevent_revoke_terminate_releases_the_lease_when_the_greenlet_is_killed(redis_url, prefix):
    """``revoke(terminate=True)`` on ``-P gevent``: the pool kills the body's greenlet
    (celery/concurrency/gevent.py ``terminate_job``). The holder's process is the worker's own,
    which the main process's release waits for in vain (it releases only a dead process's lease):
    the killed greenlet hands its lease back itself (``GreenletExit`` through the guard), at once,
    and the next call runs."""
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    locks = app.conf.taskguard_locks
    with WorkerProcess(queue, prefix, pool="gevent", concurrency=4) as worker:
        long = app.tasks["tg.long_cleanup"].delay(seconds=20.0, cleanup=0)
        wait_for_body(app, "long:start")
        app.control.revoke(long.id, terminate=True)
        released = time.monotonic()
        deadline = released + 10
        while locks.holder("long") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        released = time.monotonic() - released
        after = app.tasks["tg.long_cleanup"].delay(seconds=0, cleanup=0).get(timeout=10)
        output = worker.output()
    print(
        f"    observed: -P gevent, revoke(terminate=True) of a 20 s body: released after {released:.2f}s; "
        f"next call {after!r}"
    )
    assert locks.holder("long") is None and released < 5, output[-3000:]
    assert after == "ran", output[-3000:]
    ends = [e for e in body_log(app) if e.startswith("long:end")]
    assert len(ends) == 1  # the next call's: the killed body never reached its end


def test_task_protocol_1_reads_headers_from_request_headers(redis_url, prefix):
    app = make_app(f"q-{prefix}", prefix, task_protocol=1)
    try:
        with embedded_worker(app):
            first = app.tasks["tg.slow"].delay(3, seconds=3.0)
            wait_for_body(app, "slow:3:start")
            assert is_skipped(app.tasks["tg.slow"].delay(3, seconds=0).get(timeout=5))
            first.get(timeout=5)
            fence = (
                app.tasks["tg.retrying"]
                .apply_async(("v1",), {"fail_times": 2, "countdown": 0.3}, headers={"tenant": "acme"})
                .get(timeout=15)
            )
        runs = [e for e in body_log(app) if e.startswith("retrying:v1:")]
        assert len(runs) == 3 and {int(e.split(":")[3]) for e in runs} == {fence}
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, f"q-{prefix}")


@pytest.mark.parametrize(
    "conf, name",
    [
        ({"taskguard_redis_url": "redis//host:6379"}, "app.conf.taskguard_redis_url"),
        ({"taskguard_redis_url": "redis://:s3cr3t@host:6379/0?bogus=1"}, "app.conf.taskguard_redis_url"),
        (
            {"taskguard_redis_url": "redis://127.0.0.1:6379/0", "taskguard_prefix": "bad prefix!"},
            "app.conf.taskguard_prefix",
        ),
        ({"taskguard_locks": "not a locks object"}, "app.conf.taskguard_locks"),
    ],
)
def test_a_bad_redis_setting_stops_the_worker_at_start_naming_it(redis_url, prefix, conf, name):
    """A bad ``taskguard_redis_url`` (or prefix, or locks object) is reported when the worker
    starts (``worker_init``), naming the setting and never the password; before, the first task run
    failed with an error that did not say which setting."""
    app = make_app(f"q-{prefix}", prefix, **{"taskguard_locks": None, **conf})
    with pytest.raises(SystemExit, match=name) as err:
        app.WorkController(
            pool_cls="solo", concurrency=1, without_heartbeat=True, without_mingle=True, without_gossip=True
        )
    assert "s3cr3t" not in str(err.value)
