"""Publish-time uniqueness (``unique=True``) with real workers: one message per key while a run is
queued or running, no mark left by a failed publish, a lost message blocking its key no longer
than ``unique_ttl``, marks cleared by revocation and by a killed worker's lease."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis
from kombu.exceptions import OperationalError
from prometheus_client import CollectorRegistry

from taskguard import ConfigError
from taskguard.metrics import Metrics
from taskguard_celery import GuardedTask

from .celery_app import make_app
from .celery_support import WorkerProcess, body_log, embedded_worker


@pytest.fixture
def app(redis_url, prefix):
    a = make_app(f"q-{prefix}", prefix)
    yield a
    redis.Redis.from_url(redis_url).delete(a.tg_log, f"q-{prefix}")


def _queued(app, key, task="tg.unique_slow"):
    """The task's queued mark on ``key``, as the lease hash holds it (or None)."""
    locks = app.conf.taskguard_locks
    raw = locks.client.hget(locks.backend.lease_key(key), "q:" + task)
    return raw.decode() if raw and not raw.startswith(b"~") else None  # "~<nonce>": a cleared mark


def test_ten_concurrent_publishes_of_one_key_make_one_message_and_one_run(app, redis_url, prefix):
    registry = CollectorRegistry()
    remove = app.conf.taskguard_locks.add_listener(Metrics(registry))
    task = app.tasks["tg.unique_slow"]
    handles: list = []
    barrier = threading.Barrier(10)

    def publish():
        barrier.wait()
        handles.append(task.delay("a"))

    try:
        threads = [threading.Thread(target=publish) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert redis.Redis.from_url(redis_url).llen(f"q-{prefix}") == 1  # one message on the queue
        with embedded_worker(app):
            assert len({h.id for h in handles}) == 1
            assert {h.get(timeout=10) for h in handles} == {handles[0].id}
            again = task.delay("a")  # the run ended: a new publish goes out
            assert again.id != handles[0].id and again.get(timeout=10) == again.id
    finally:
        remove()
    assert [e for e in body_log(app) if e.startswith("unique:a:")] == [
        f"unique:a:{handles[0].id}",
        f"unique:a:{again.id}",
    ]
    assert registry.get_sample_value("taskguard_publishes_suppressed_total", {"task": "tg.unique_slow"}) == 9
    assert _queued(app, "u:a") is None


def test_a_publish_while_the_run_is_running_returns_the_running_one(app):
    task = app.tasks["tg.unique_slow"]
    with embedded_worker(app):
        first = task.delay("b", seconds=1.0)
        deadline = time.monotonic() + 10  # running: its lease is held and its mark is gone
        while (
            app.conf.taskguard_locks.holder("u:b") is None or _queued(app, "u:b") is not None
        ) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert app.conf.taskguard_locks.holder("u:b") is not None
        assert _queued(app, "u:b") is None
        assert task.delay("b").id == first.id
        assert task.apply_async(("b",), unique=False).get(timeout=10) != first.id  # per call: off
        first.get(timeout=10)


def test_per_call_unique_on_a_task_without_it(app):
    task = app.tasks["tg.slow"]  # key "slow:{n}", unique not set
    first = task.apply_async((7,), unique=True)
    assert task.apply_async((7,), unique=True).id == first.id
    assert task.apply_async((7,)).id != first.id  # a plain publish is not stopped


def test_per_call_unique_ttl_and_misspelt_per_call_options(app, redis_url, prefix):
    """``apply_async`` takes the guard options ``unique`` and ``unique_ttl`` per call. A name close to
    them (``uniqe=True``) was published as a message property and ignored (celery/celery#9305:
    Celery drops unknown publish options silently), so the duplicate it should have stopped went
    out; a task option (``ttl=``) the same. Both are now a ConfigError and nothing is published;
    other unknown names (a message property of the user's) still pass."""
    task = app.tasks["tg.slow"]  # key "slow:{n}", unique not set
    queue = redis.Redis.from_url(redis_url)
    for bad, match in (
        ({"uniqe": True}, "unknown option 'uniqe'; did you mean 'unique'"),
        ({"unique": True, "uniqe_ttl": 5}, "unknown option 'uniqe_ttl'; did you mean 'unique_ttl'"),
        ({"unigue": True}, "did you mean 'unique'"),
        ({"ttl": 5}, "option 'ttl' is not supported here: it is an option of the task"),
        ({"unique_ttl": 5}, "unique_ttl= given to apply_async needs unique=True"),
        ({"unique": True, "unique_ttl": 0}, "unique_ttl"),
    ):
        with pytest.raises(ConfigError, match=match):
            task.apply_async((8,), **bad)
    assert queue.llen(f"q-{prefix}") == 0  # nothing went out
    assert task.apply_async((8,), x_trace="t-1").id  # a property of the user's, far from every option
    # per call unique_ttl: a lost message blocks its key for that long, not the task's (none: 1 hour)
    lost = task.apply_async((9,), unique=True, unique_ttl=1)
    queue.delete(f"q-{prefix}")
    assert task.apply_async((9,), unique=True, unique_ttl=1).id == lost.id
    time.sleep(1.2)
    assert task.apply_async((9,), unique=True).id != lost.id


@pytest.mark.parametrize("stamp", ["key", "rate", "unique", "uniq", "trace_id"])
def test_a_stamp_named_like_a_guard_option_is_published_as_a_stamp(app, redis_url, prefix, stamp):
    """Celery passes a stamped signature's stamps to ``apply_async`` as options of their own names
    (``stamped_headers`` lists them): one named ``key`` or ``rate`` was refused as a task option
    given per call, one named ``unique`` taken for ``unique=`` (and Celery then failed looking for
    it). A stamp is published as a stamp, whatever its name, and stays in the message."""
    import json

    from celery.canvas import StampingVisitor

    class Stamp(StampingVisitor):
        def on_signature(self, sig, **headers):
            return {stamp: "v"}

    sig = app.tasks["tg.slow"].s(11)
    sig.stamp(visitor=Stamp())
    first, second = sig.apply_async(), sig.clone().apply_async()
    assert first.id != second.id  # no uniqueness switched on by a stamp
    queued = [json.loads(m) for m in redis.Redis.from_url(redis_url).lrange(f"q-{prefix}", 0, -1)]
    assert len(queued) == 2 and all(m["headers"]["stamps"].get(stamp) == "v" for m in queued), queued


def test_a_revoked_run_waiting_for_its_countdown_no_longer_holds_its_key(app):
    """celery-singleton#29: a unique run published with a countdown, then revoked, kept its queued
    mark until it was due (30 s here; hours for a daily job): every publish meanwhile got the
    revoked run's result and nothing ran. The worker writes REVOKED when it gets the revoke, and a
    publish that finds the mark of a revoked run clears it and goes out."""
    task = app.tasks["tg.unique_slow"]
    with embedded_worker(app):
        later = task.apply_async(("r",), countdown=30)
        app.control.revoke(later.id)
        deadline = time.monotonic() + 10  # the worker writes REVOKED when it gets the revoke
        while later.state != "REVOKED" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert later.state == "REVOKED"
        again = task.delay("r")
        assert again.id != later.id
        assert again.get(timeout=10) == again.id


def test_a_publish_that_fails_leaves_no_mark(redis_url, prefix):
    from .servers import free_port

    broken = make_app(
        f"q-{prefix}",
        prefix,
        broker=f"redis://127.0.0.1:{free_port()}/0",
        broker_connection_retry=False,
        broker_connection_max_retries=0,
        task_publish_retry=False,
    )
    with pytest.raises(OperationalError):  # kombu: the broker refused the connection
        broken.tasks["tg.unique_slow"].delay("c")
    assert _queued(broken, "u:c") is None


def test_a_lost_message_blocks_its_key_no_longer_than_unique_ttl(app, redis_url, prefix):
    task = app.tasks["tg.unique_short"]  # unique_ttl=1
    lost = task.delay("d")
    redis.Redis.from_url(redis_url).delete(f"q-{prefix}")  # the message is lost
    assert task.delay("d").id == lost.id
    time.sleep(1.2)
    fresh = task.delay("d")
    assert fresh.id != lost.id
    with embedded_worker(app):
        assert fresh.get(timeout=10) == "d"


def test_an_expired_message_clears_its_mark_when_the_worker_drops_it(app):
    task = app.tasks["tg.unique_slow"]  # unique_ttl=60: only the revocation clears it soon
    stale = task.apply_async(("e",), expires=0.5)
    time.sleep(1.0)
    assert task.delay("e").id == stale.id  # still marked: nothing consumed it yet
    with embedded_worker(app):
        deadline = time.monotonic() + 10
        while _queued(app, "u:e") is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _queued(app, "u:e") is None and stale.state == "REVOKED"
        fresh = task.delay("e")
        assert fresh.id != stale.id and fresh.get(timeout=10) == fresh.id


def test_a_message_a_worker_cannot_run_for_an_unknown_task_name_clears_its_mark(app, prefix):
    """A worker of an older deploy (or after a rename) does not know the task: Celery rejects the
    message and stores ``NotRegistered`` (``task_unknown``); its mark blocked the key for
    ``unique_ttl`` (60 s here), now the next publish goes out."""
    task = app.tasks["tg.unique_slow"]
    lost = task.delay("x")
    assert _queued(app, "u:x") is not None and task.delay("x").id == lost.id
    older = make_app(f"q-{prefix}", prefix)
    older.tasks.unregister("tg.unique_slow")
    with embedded_worker(older):
        deadline = time.monotonic() + 10
        while _queued(app, "u:x") is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _queued(app, "u:x") is None and lost.state == "FAILURE"
    fresh = task.delay("x")
    assert fresh.id != lost.id
    with embedded_worker(app):
        assert fresh.get(timeout=10) == fresh.id


def test_countdown_keeps_the_mark_until_the_run_is_due(app):
    task = app.tasks["tg.unique_short"]  # unique_ttl=1, countdown 2: marked for 3 s
    later = task.apply_async(("f",), countdown=2)
    time.sleep(1.5)
    assert task.delay("f").id == later.id
    with embedded_worker(app):
        assert later.get(timeout=10) == "f"


def test_a_sigkilled_worker_releases_the_key_with_its_lease_ttl(app, prefix):
    task = app.tasks["tg.unique_slow"]  # ttl 2
    with WorkerProcess(f"q-{prefix}", prefix, concurrency=1) as worker:
        running = task.delay("g", seconds=30)
        deadline = time.monotonic() + 20
        while app.conf.taskguard_locks.holder("u:g") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert task.delay("g").id == running.id  # running: suppressed
        worker.signal_all(signal.SIGKILL)
    time.sleep(2.5)  # the lease's TTL
    assert task.delay("g").id != running.id


def test_a_run_killed_by_its_hard_time_limit_leaves_the_key_free_to_publish(app, prefix):
    """celery-singleton#40: a task killed by its hard time limit left its lock, and every later
    publish was refused as a duplicate of the dead task until the lock expired. Here the run's
    mark went with its acquisition and the worker's main process releases the lease of the
    killed child: the next publish (ttl 30, unique_ttl 60) is a new message at once, and runs."""
    task = app.tasks["tg.unique_limited"]
    locks = app.conf.taskguard_locks
    with WorkerProcess(f"q-{prefix}", prefix, concurrency=1):
        first = task.delay("h")
        deadline = time.monotonic() + 20
        while locks.holder("ul:h") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert locks.holder("ul:h") is not None and _queued(app, "ul:h", "tg.unique_limited") is None
        assert task.delay("h").id == first.id  # running: suppressed
        with pytest.raises(Exception) as err:
            first.get(timeout=15)
        assert "TimeLimitExceeded" in type(err.value).__name__
        deadline = time.monotonic() + 5
        while locks.holder("ul:h") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        second = task.delay("h", seconds=0)
        assert second.id != first.id
        assert second.get(timeout=15) == second.id


def test_steps_of_a_chain_or_group_are_never_suppressed(app):
    from celery import chain, group

    task = app.tasks["tg.unique_slow"]
    queued = task.apply_async(("h",), countdown=3)  # marked queued for a while
    assert _queued(app, "u:h") is not None
    with embedded_worker(app, concurrency=4):
        chained = chain(task.s("h", seconds=0), app.tasks["tg.noop"].si()).apply_async()
        grouped = group(task.s("i", seconds=0), task.s("i", seconds=0.5)).apply_async()
        assert chained.get(timeout=15) is not None  # published despite the mark: the canvas completes
        assert chained.parent.id != queued.id
        assert len(grouped.get(timeout=15)) == 2  # both members published (one skipped by the lease)
        assert queued.get(timeout=15) == queued.id


def test_uniqueness_is_per_task_on_a_shared_key(any_locks):
    assert any_locks.mark_queued("site:1", "r1", ttl=5, task="reindex") == (True, "r1")
    assert any_locks.mark_queued("site:1", "b1", ttl=5, task="rebuild") == (True, "b1")
    assert any_locks.mark_queued("site:1", "r2", ttl=5, task="reindex") == (False, "r1")
    lease = any_locks.acquire("site:1", ttl=5, holder={"task": "rebuild", "task_id": "b1"}).lease
    assert any_locks.clear_queued("site:1", "r1", "reindex") and any_locks.clear_queued("site:1", "b1", "rebuild")
    assert any_locks.mark_queued("site:1", "r3", ttl=5, task="reindex") == (True, "r3")  # rebuild runs: not reindex
    assert any_locks.mark_queued("site:1", "b2", ttl=5, task="rebuild") == (False, "b1")
    assert any_locks.mark_queued("site:1", "x y", ttl=5, task="spaced") == (True, "x y")  # ids may hold spaces
    lease.release()


def test_a_key_made_only_for_a_mark_goes_with_it(redis_url, prefix):
    from taskguard import RedisLocks

    locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    assert locks.mark_queued("only-marked", "r1", ttl=5, task="t")[0]
    assert 0 < locks.client.pttl(locks.backend.lease_key("only-marked")) <= 5000  # not the 7-day idle TTL of a fence
    lease = locks.acquire("only-marked", ttl=1).lease  # an acquisition gives it a fence's idle TTL
    assert locks.client.pttl(locks.backend.lease_key("only-marked")) > 86400 * 1000
    lease.release()


def test_app_conf_taskguard_metrics_counts_suppressions_in_a_publishing_process(redis_url, prefix):
    """``app.conf.taskguard_metrics = True`` enables the metrics in a process that only
    publishes, as ``TASKGUARD_METRICS=1`` does (no worker runs here: the second publish is
    suppressed by the first one's queued mark)."""
    import os
    import subprocess
    import sys

    code = f"""
from prometheus_client import REGISTRY
from tests.celery_app import make_app
app = make_app("q-{prefix}", "{prefix}", taskguard_metrics=True)
task = app.tasks["tg.unique_slow"]
first, second = task.delay("m"), task.delay("m")
assert first.id == second.id
print(REGISTRY.get_sample_value("taskguard_publishes_suppressed_total", {{"task": "tg.unique_slow"}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TASKGUARD_METRICS"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == "1.0"
    finally:
        r = redis.Redis.from_url(redis_url)
        r.delete(f"q-{prefix}", f"{prefix}:log")
        for k in r.scan_iter(match=f"{prefix}*"):
            r.delete(k)


def test_a_unique_run_waiting_in_the_worker_for_a_place_in_the_total_suppresses_a_second_publish(
    app, redis_url, prefix
):
    """The run of key ``ut:a`` took its key's slot (deleting its queued mark with the
    acquisition), found the total full, gave the slot back and now waits for a place, blocking
    its worker slot. It has not started: a second ``delay`` of the same key must return the first
    run's ``AsyncResult`` (as it did when the mark was cleared only once the run had begun). It
    published a second message when the acquisition deleted the mark before the total had a
    place, and the key ran twice."""
    r = redis.Redis.from_url(redis_url)
    ran = f"{prefix}:brk-ran"

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.brk_unique_total",
        ttl=10,
        key="ut:{tenant}",
        unique=True,
        unique_ttl=60,
        limit_total=1,
        limit_total_key="ut-total",
        wait=20,
        blocking_wait=True,
    )
    def unique_total(self, tenant):
        r.pipeline().rpush(ran, self.request.id).expire(ran, 600).execute()
        return self.request.id

    locks = app.conf.taskguard_locks
    blocker = locks.acquire("ut-total", ttl=30, limit=1)  # the total is full
    assert blocker.acquired
    gave_back = threading.Event()
    remove = locks.add_listener(lambda e: gave_back.set() if e.kind == "release" and e.key == "ut:a" else None)
    try:
        first = unique_total.delay("a")
        with embedded_worker(app):
            assert gave_back.wait(20), "the run never took its key's slot"
            second = unique_total.delay("a")  # the first run is still waiting in the worker
            blocker.lease.release()
            assert first.get(timeout=20) == first.id
            if second.id != first.id:
                second.get(timeout=20)
    finally:
        remove()
        if not blocker.lease.released:
            blocker.lease.release()
    runs = [x.decode() for x in r.lrange(ran, 0, -1)]
    assert second.id == first.id and runs == [first.id], f"second publish went out; runs of ut:a: {runs}"
