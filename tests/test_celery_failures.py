"""Where Celery deployments break: redelivery, crashes, time limits, revoke, outages, pauses.

Real ``celery worker`` processes on real Redis, with the Redis broker and with RabbitMQ. Each
scenario prints what it injected and what it observed (``pytest -s`` shows it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import pytest
import redis
from celery.result import AsyncResult

from taskguard import LeaseBackendError, LeaseLost, RedisLocks, is_skipped

from .celery_app import make_app
from .celery_support import WorkerProcess, body_log, delete_amqp_queue, embedded_worker
from .servers import RedisServer

# Redis broker: unacked messages come back after 3 s; kombu sweeps for them every second
# (kombu/transport/redis.py: unacked_restore_interval x unacked_restore_throttle, default 100 s)
REDIS_REDELIVERY = {"visibility_timeout": 3, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
AMQP_URL = os.environ.get("TASKGUARD_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def say(*parts):
    print("   ", *parts, flush=True)


def require_rabbitmq() -> str:
    """``AMQP_URL`` when its RabbitMQ answers; otherwise fail when ``TASKGUARD_REQUIRE_RABBITMQ=1``
    (CI sets it, so CI always runs these scenarios on RabbitMQ), else skip saying why."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(AMQP_URL)
    where = f"{parts.hostname or '127.0.0.1'}:{parts.port or 5672}"
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=1):
            return AMQP_URL
    except OSError:
        pass
    if os.environ.get("TASKGUARD_REQUIRE_RABBITMQ") == "1":
        pytest.fail(f"RabbitMQ is required (TASKGUARD_REQUIRE_RABBITMQ=1) but {where} is not answering")
    pytest.skip(
        f"RabbitMQ not answering at {where} (TASKGUARD_AMQP_URL; set TASKGUARD_REQUIRE_RABBITMQ=1 "
        "to make this a failure)"
    )


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request):
    if request.param == "rabbitmq":
        return require_rabbitmq()
    return None  # the shared Redis


@pytest.fixture
def env(redis_url, prefix, broker):
    """(app, queue, prefix, broker) for one test; the queue is removed afterwards."""
    queue = f"q-{prefix}"
    conf = {"broker_transport_options": REDIS_REDELIVERY} if broker is None else {}
    app = make_app(queue, prefix, broker=broker, **conf)
    yield app, queue, prefix, broker, conf
    redis.Redis.from_url(redis_url).delete(app.tg_log, queue)
    if broker:
        delete_amqp_queue(app, queue)


def wait_for(pred, timeout=20.0, step=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    return pred()


def entries(app, prefix_):
    return [e for e in body_log(app) if e.startswith(prefix_)]


# 1. the same task id published again while it runs: it runs after the first, never beside it ---------


def test_same_task_id_published_while_running_runs_after_it(env):
    """A message that was not redelivered is a publish (``apply_async`` with an existing id):
    it waits (deferred) until the run holding its task id's lease ends, then runs. It writes
    no result while it waits."""
    app, queue, prefix, broker, conf = env
    task_id = str(uuid.uuid4())
    with WorkerProcess(queue, prefix, broker=broker, concurrency=2, conf=conf):
        app.tasks["tg.sleeper"].apply_async(("dup",), {"seconds": 2.5}, task_id=task_id)
        time.sleep(0.7)
        say("injected: the same task id published again while the first runs")
        app.tasks["tg.sleeper"].apply_async(("dup",), {"seconds": 0.5}, task_id=task_id)
        time.sleep(0.5)
        assert AsyncResult(task_id, app=app).state in ("PENDING", "STARTED")  # nothing written by the copy
        fence = AsyncResult(task_id, app=app).get(timeout=20)
        assert wait_for(lambda: len(entries(app, "sleeper:dup:end")) == 2, timeout=30)
    log = entries(app, "sleeper:dup:")
    say(f"observed: {log}, result {fence}")
    assert [e.split(":")[2] for e in log] == ["start", "write", "end", "start", "write", "end"]  # one after the other
    assert app.conf.taskguard_locks.holder("sleeper:dup") is None


def _queued(app, queue: str, broker: str | None) -> int:
    if broker is None:
        return redis.Redis.from_url(app.conf.broker_url).llen(queue)
    with app.connection_for_write() as conn:
        return conn.default_channel.queue_declare(queue, passive=True).message_count


@pytest.mark.parametrize("comes_back", ["while-the-first-runs", "after-the-first-finished"])
def test_a_publish_whose_deferred_copy_the_broker_delivers_again_still_runs(env, redis_url, comes_back):
    """The same task id published while its first run runs: the publish is deferred (a copy looks
    again later). The worker holding that copy dies, and the broker delivers the copy again
    (Redis: its visibility timeout; RabbitMQ: the closed connection), flagged ``redelivered``.
    That delivery's run never ran, so it runs once after the first. Both moments the copy can come
    back: while the first run still runs (it defers again) and after it finished. (It used to be
    taken for a duplicate of the finished run — the result backend's SUCCESS is the *first*
    delivery's, written after this one was published — and the publish was lost.) Results are
    kept longer than the broker's redelivery window, so the backend is where finished runs are
    told (with shorter-lived results taskguard's per-delivery finished markers tell them)."""
    _, queue, prefix, broker, conf = env
    conf = {**conf, "result_expires": 86400}
    app = make_app(queue, prefix, broker=broker, **conf)
    other = f"{queue}-b"  # the publish goes to a worker of its own, the one that dies
    task_id = str(uuid.uuid4())
    r = redis.Redis.from_url(redis_url)
    records = lambda: list(r.scan_iter(match="{" + prefix + ":sleeper:dup}:r:defer:*"))  # noqa: E731
    first_seconds = 9.0 if comes_back == "while-the-first-runs" else 3.0
    try:
        with WorkerProcess(queue, prefix, broker=broker, concurrency=1, conf=conf):
            dying = WorkerProcess(other, prefix, broker=broker, concurrency=1, conf=conf).start()
            try:
                app.tasks["tg.sleeper"].apply_async(("dup",), {"seconds": first_seconds}, task_id=task_id)
                assert wait_for(lambda: entries(app, "sleeper:dup:start"), timeout=20)
                app.tasks["tg.sleeper"].apply_async(("dup",), {"seconds": 0.5}, task_id=task_id, queue=other)
                # the publish was deferred, and the dying worker holds its copy (nothing queued)
                assert wait_for(lambda: records() and _queued(app, other, broker) == 0, timeout=10)
                dying.signal_all(signal.SIGKILL)
                say(f"injected: the worker holding the deferred copy SIGKILLed; it comes back {comes_back}")
            finally:
                dying.stop()
            if comes_back == "after-the-first-finished":
                assert wait_for(lambda: entries(app, "sleeper:dup:end"), timeout=20)
            with WorkerProcess(other, prefix, broker=broker, concurrency=1, conf=conf):
                assert wait_for(lambda: len(entries(app, "sleeper:dup:end")) == 2, timeout=40), entries(
                    app, "sleeper:dup:"
                )
                time.sleep(1.0)  # nothing runs a third time
        log = entries(app, "sleeper:dup:")
        say(f"observed: {log}")
        assert [e.split(":")[2] for e in log] == ["start", "write", "end", "start", "write", "end"]
        assert app.conf.taskguard_locks.holder("sleeper:dup") is None
    finally:
        r.delete(other)
        if broker:
            delete_amqp_queue(app, other)


def test_redis_visibility_timeout_redelivery_does_not_run_twice(redis_url, prefix):
    """acks_late + a 2 s visibility timeout with a 5 s body: Redis hands the unacked message to
    the other worker while the first still runs it."""
    queue = f"q-{prefix}"
    conf = {"broker_transport_options": {**REDIS_REDELIVERY, "visibility_timeout": 2}}
    app = make_app(queue, prefix, **conf)
    try:
        with (
            WorkerProcess(queue, prefix, concurrency=1, conf=conf),
            WorkerProcess(queue, prefix, concurrency=1, conf=conf),
        ):
            res = app.tasks["tg.sleeper"].delay("vis", seconds=5.0)
            fence = res.get(timeout=30)
            time.sleep(4.0)
        starts = entries(app, "sleeper:vis:start")
        say(f"injected: visibility_timeout=2 s, body 5 s; observed {len(starts)} body run(s), result {fence}")
        assert len(starts) == 1 and res.get(timeout=1) == fence
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, queue)


# 2. a whole worker killed mid-body ------------------------------------------------------------------


def test_whole_worker_sigkilled_mid_body(env):
    app, queue, prefix, broker, conf = env
    locks = app.conf.taskguard_locks
    a = WorkerProcess(queue, prefix, broker=broker, concurrency=1, conf=conf).start()
    try:
        res = app.tasks["tg.sleeper"].delay("crash", seconds=6.0)
        first = wait_for(lambda: entries(app, "sleeper:crash:start"))
        first_fence = int(first[0].split(":")[3])
        say(f"injected: SIGKILL to the whole worker (main + children) while it runs fence {first_fence}")
        a.signal_all(signal.SIGKILL)
    finally:
        a.stop()
    # one at a time: RabbitMQ requeues the killed run's message as soon as its connection drops, so
    # it can arrive together with `other`; two pool children would then run them side by side, and
    # whichever took the lease first would skip the other ("held": another run holds the key)
    with WorkerProcess(queue, prefix, broker=broker, concurrency=1, conf=conf):
        other = app.tasks["tg.sleeper"].delay("crash", seconds=0)
        out = other.get(timeout=30)  # (it may wait for the redelivered run's 6 s)
        say(f"observed: another run of the key while the dead holder's TTL lasts: {out!r}")
        fence = res.get(timeout=30)  # the broker redelivers the killed run's message
    say(f"observed: the redelivered run finished with fence {fence} > {first_fence}")
    assert fence > first_fence
    assert is_skipped(out) or out > first_fence  # skipped while held; never run beside the holder
    assert locks.holder("sleeper:crash") is None


# 3. hard time limit, terminate, lost child: the main process releases ------------------------------


#: A run published for a beat slot (its message's ``taskguard_beat`` header, as the scheduler
#: sends it): its lease is named by the slot, not by its task id; with ``key`` the entry's own key.
def slot_header(**entry):
    return {"taskguard_beat": {"entry": "e1", "slot": f"s-{uuid.uuid4().hex[:8]}", "keep": 60, **entry}}


@pytest.mark.parametrize("published", ["plain", "beat_slot"])
def test_hard_time_limit_is_released_by_the_main_process(env, published):
    """Celery sends ``task_failure`` for a hard time limit without the request (celery/worker/
    request.py ``on_timeout``): the lease is found by the execution's task id on the task's key,
    a beat slot's run (named by its slot) included."""
    app, queue, prefix, broker, conf = env
    locks = app.conf.taskguard_locks
    headers = slot_header() if published == "beat_slot" else None
    with WorkerProcess(queue, prefix, broker=broker, concurrency=1, conf=conf):
        res = app.tasks["tg.limited"].apply_async(headers=headers)
        with pytest.raises(Exception) as err:
            res.get(timeout=15)
        assert "TimeLimitExceeded" in type(err.value).__name__
        released = wait_for(lambda: locks.holder("limited") is None, timeout=3)
    say(f"injected: time_limit=1 on a 10 s body (ttl 30, {published}); observed lease released promptly: {released}")
    assert released


def test_a_main_process_release_without_the_request_finds_a_beat_slots_lease_by_its_task_id(redis_url, prefix):
    """The hard-time-limit path of the main process (``task_failure`` without the request; billiard
    sends SIGTERM 0.1 s before SIGKILL, so the child usually hands its lease back itself — above):
    the lease of the execution's task id is released although a beat slot's run names it by its
    slot, once the child is dead; another execution's lease of the same key is not."""
    from celery.exceptions import TimeLimitExceeded
    from celery.signals import task_failure

    app = make_app(f"q-{prefix}", prefix)
    task, locks = app.tasks["tg.limited"], app.conf.taskguard_locks
    slot_run = f"beat:e1:s-{uuid.uuid4().hex[:8]}"
    locks.acquire("limited", ttl=30, run_id=slot_run, holder={"task": task.name, "task_id": "other"})
    task_failure.send(sender=task, task_id="t-1", exception=TimeLimitExceeded(1), args=(), kwargs={})
    assert locks.holder("limited").holder["task_id"] == "other"  # not this execution's: kept
    locks.release_run("limited", slot_run)
    # a copy of the same message (same task id) running on a worker of another host: not this one's
    locks.acquire("limited", ttl=30, run_id=slot_run, holder={"task_id": "t-1", "host": "elsewhere"})
    task_failure.send(sender=task, task_id="t-1", exception=TimeLimitExceeded(1), args=(), kwargs={})
    assert locks.holder("limited").holder["host"] == "elsewhere"
    locks.release_run("limited", slot_run)
    # this execution's, its child already dead: released at once
    dead = subprocess.Popen(["true"])
    dead.wait()
    locks.acquire("limited", ttl=30, run_id=slot_run, holder={"task": task.name, "task_id": "t-1", "pid": dead.pid})
    task_failure.send(sender=task, task_id="t-1", exception=TimeLimitExceeded(1), args=(), kwargs={})
    assert locks.holder("limited") is None
    # its child still alive (billiard runs the timeout callback before it kills the child:
    # billiard/pool.py on_hard_timeout): released once the child is dead, not before
    child = subprocess.Popen(["sleep", "30"])
    try:
        locks.acquire("limited", ttl=30, run_id=slot_run, holder={"task_id": "t-1", "pid": child.pid})
        task_failure.send(sender=task, task_id="t-1", exception=TimeLimitExceeded(1), args=(), kwargs={})
        time.sleep(0.5)
        assert locks.holder("limited") is not None  # the child lives: its lease stays
        child.kill()
        child.wait()
        assert wait_for(lambda: locks.holder("limited") is None, timeout=3)
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("published", ["plain", "beat_slot"])
def test_revoke_terminate_is_released_by_the_main_process(env, published):
    """A beat slot's run with its entry's own key: the main process releases that key's lease,
    named by the slot (it released by task id on the task's key: the entry's key stayed held to
    its TTL, and the next slots were skipped)."""
    app, queue, prefix, broker, conf = env
    locks = app.conf.taskguard_locks
    key, headers = ("long", None) if published == "plain" else ("long-entry", slot_header(key="long-entry"))
    with WorkerProcess(queue, prefix, broker=broker, concurrency=1, conf=conf):
        res = app.tasks["tg.long_holder"].apply_async(kwargs={"seconds": 20}, headers=headers)
        assert wait_for(lambda: entries(app, "long:start"))
        assert locks.holder(key) is not None
        app.control.revoke(res.id, terminate=True, signal="SIGKILL")
        released = wait_for(lambda: locks.holder(key) is None, timeout=5)
    say(
        f"injected: revoke(terminate=True) of a 20 s body (ttl 30, {published}); observed released promptly: {released}"
    )
    assert released


@pytest.mark.parametrize("how", ["SIGUSR1", "SIGINT"])
def test_revoke_terminate_with_a_signal_the_child_survives_never_releases_under_its_body(env, how):
    """celery/celery#7529, #6043: ``Request.terminate`` sends the signal and announces the task
    revoked at once, without waiting for the child (celery/worker/request.py). With SIGUSR1
    (Celery's soft cancel: the body gets ``SoftTimeLimitExceeded`` and cleans up) or SIGINT (which
    prefork children ignore: celery/concurrency/prefork.py ``WORKER_SIGIGNORE``) the child goes on
    running the body; the main process released its lease at the announcement, and a second call
    ran beside the first. The main process now releases only once the child is dead: the body keeps
    its lease to its end (and releases it itself), and a call meanwhile is skipped."""
    app, queue, prefix, broker, conf = env
    locks = app.conf.taskguard_locks
    task = app.tasks["tg.long_cleanup"]
    seconds = 20.0 if how == "SIGUSR1" else 4.0
    with WorkerProcess(queue, prefix, broker=broker, concurrency=2, conf=conf) as worker:
        res = task.apply_async(kwargs={"seconds": seconds, "cleanup": 3.0})
        assert wait_for(lambda: entries(app, "long:start"))
        fence = locks.holder("long").fencing_token
        app.control.revoke(res.id, terminate=True, signal=how)
        time.sleep(1.0)  # the main process has announced the revoke by now (it did so at once)
        held = locks.holder("long")
        second = task.apply_async(kwargs={"seconds": 0, "cleanup": 0})
        second_value = second.get(timeout=15)
        last = "long:cleaned" if how == "SIGUSR1" else "long:end"  # the body's last entry
        ended = wait_for(lambda: entries(app, last), timeout=30)
        released = wait_for(lambda: locks.holder("long") is None, timeout=5)
        output = worker.output()
    log = body_log(app)
    say(
        f"injected: revoke(terminate=True, signal={how}) of a running body; observed held after 1 s: "
        f"{held is not None}, second call: {second_value!r}, body went on to its end: {bool(ended)}"
    )
    assert ended, (log, output)  # the child survived the signal and ran its body on
    assert held is not None and held.fencing_token == fence, output  # not released under the running body
    assert is_skipped(second_value), (second_value, log)
    assert released  # by the body itself, at its end


@pytest.mark.parametrize("published", ["plain", "beat_slot"])
def test_lost_child_is_released_by_the_main_process(env, published):
    app, queue, prefix, broker, conf = env
    locks = app.conf.taskguard_locks
    key, headers = ("long", None) if published == "plain" else ("long-entry", slot_header(key="long-entry"))
    with WorkerProcess(queue, prefix, broker=broker, concurrency=1, conf=conf):
        res = app.tasks["tg.long_holder"].apply_async(kwargs={"seconds": 20}, headers=headers)
        assert wait_for(lambda: locks.holder(key))
        pid = locks.holder(key).holder["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(Exception) as err:
            res.get(timeout=15)
        released = wait_for(lambda: locks.holder(key) is None, timeout=5)
    say(
        f"injected: SIGKILL to the pool child {pid} ({published}); "
        f"observed {type(err.value).__name__}, released: {released}"
    )
    assert "WorkerLost" in type(err.value).__name__ and released


def test_lost_child_with_requeue_runs_again_with_a_larger_fence(env):
    """acks_late + task_reject_on_worker_lost: the message is requeued and Celery sends no
    failure; the redelivered copy finds its own task id holding the lease of a dead process."""
    app, queue, prefix, broker, conf = env
    locks = app.conf.taskguard_locks
    with WorkerProcess(queue, prefix, broker=broker, concurrency=1, conf=conf):
        res = app.tasks["tg.sleeper"].delay("requeue", seconds=3.0, fenced=False)
        # (its body has started, not only taken its lease: the start is noted one step later)
        assert wait_for(lambda: locks.holder("sleeper:requeue") and entries(app, "sleeper:requeue:start"))
        info = locks.holder("sleeper:requeue")
        os.kill(info.holder["pid"], signal.SIGKILL)
        fence = res.get(timeout=30)
    say(f"injected: SIGKILL to the child holding fence {info.fencing_token}; observed rerun with fence {fence}")
    assert fence > info.fencing_token
    assert len(entries(app, "sleeper:requeue:start")) == 2


# 4. a retry message that is revoked releases its kept lease ----------------------------------------


def test_revoked_retry_releases_its_kept_lease(env):
    app, queue, prefix, broker, conf = env
    locks = app.conf.taskguard_locks
    with WorkerProcess(queue, prefix, broker=broker, concurrency=1, conf=conf):
        res = app.tasks["tg.retrying"].apply_async(("rv",), {"fail_times": 1, "countdown": 2.0})
        assert wait_for(lambda: entries(app, "retrying:rv:0"))
        time.sleep(0.3)
        kept = locks.holder("retry:rv")
        app.control.revoke(res.id)
        released = wait_for(lambda: locks.holder("retry:rv") is None, timeout=6)
    say(f"injected: revoke of a retry waiting 2 s (lease kept {kept and kept.ttl:.1f}s); released: {released}")
    assert kept is not None and released
    assert len(entries(app, "retrying:rv:")) == 1  # the retry never ran


# 5. Redis (the lease store) unreachable ------------------------------------------------------------


def test_lease_store_outage_fails_tasks_never_runs_them_unguarded(redis_url, prefix):
    server = RedisServer(appendonly=True).start()
    queue = f"q-{prefix}"
    try:
        locks = RedisLocks.from_url(server.url, prefix=prefix, connect_timeout=0.3, socket_timeout=0.3, retries=0)
        app = make_app(queue, prefix, taskguard_locks=locks)
        with embedded_worker(app):
            server.stop()
            res = app.tasks["tg.slow"].delay(1, seconds=0)
            with pytest.raises(LeaseBackendError):
                res.get(timeout=10)
            say("injected: lease store stopped; observed FAILURE with LeaseBackendError, body not run")
            assert not entries(app, "slow:1")
            server.start()
            out = app.tasks["tg.slow"].delay(1, seconds=0).get(timeout=10)
            say(f"observed after restart, same worker: ran with fence {out['fence']}")
            assert out["n"] == 1
            # lost mid-body: the store goes away for longer than the TTL (3 s)
            res = app.tasks["tg.sleeper"].delay("outage", seconds=4.5, fenced=False)
            assert wait_for(lambda: entries(app, "sleeper:outage:start"), timeout=30), "the task never started"
            server.stop()
            time.sleep(4.0)
            server.start()
            with pytest.raises(LeaseLost):
                res.get(timeout=10)
            say("injected: store down 4 s under a 3 s TTL mid-body; observed LeaseLost (on_lost='raise')")
    finally:
        server.close()
        redis.Redis.from_url(redis_url).delete(queue, f"{{{prefix}:log}}", f"{prefix}:log")


# 6. the broker connection drops while a guarded task runs -------------------------------------------


def test_rabbitmq_connection_drop_mid_body(redis_url, prefix):
    require_rabbitmq()
    import subprocess

    queue = f"q-{prefix}"
    app = make_app(queue, prefix, broker=AMQP_URL)
    try:
        with WorkerProcess(queue, prefix, broker=AMQP_URL, concurrency=2) as worker:
            res = app.tasks["tg.sleeper"].delay("drop", seconds=3.0)
            assert wait_for(lambda: entries(app, "sleeper:drop:start"))
            out = subprocess.run(
                ["rabbitmqctl", "close_all_connections", "taskguard test"], capture_output=True, text=True, timeout=30
            )
            say(f"injected: rabbitmqctl close_all_connections (rc {out.returncode})")
            assert out.returncode == 0, out.stderr
            fence = res.get(timeout=40)
            time.sleep(4.0)
            log = worker.output()
        starts = entries(app, "sleeper:drop:start")
        say(f"observed: {len(starts)} body run(s), result fence {fence}")
        assert len(starts) == 1
        assert app.conf.taskguard_locks.holder("sleeper:drop") is None
        assert "Traceback" not in log or "ConnectionReset" in log or "Connection" in log
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log)
        try:
            with app.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
        except Exception:
            pass


# 7. a paused worker comes back after its TTL ----------------------------------------------------------


def test_paused_worker_resumes_after_ttl_its_fenced_write_is_rejected(env):
    app, queue, prefix, broker, conf = env
    a = WorkerProcess(queue, prefix, broker=broker, concurrency=1, conf=conf).start()
    try:
        with WorkerProcess(f"{queue}-b", prefix, broker=broker, concurrency=1, conf=conf):
            paused = app.tasks["tg.sleeper"].delay("pause", seconds=2.0)
            start = wait_for(lambda: entries(app, "sleeper:pause:start"))
            old_fence = int(start[0].split(":")[3])
            a.signal_all(signal.SIGSTOP)
            say(f"injected: SIGSTOP to the worker holding fence {old_fence} for 4.5 s (ttl 3)")
            time.sleep(3.5)
            newer = app.tasks["tg.sleeper"].apply_async(("pause",), {"seconds": 0}, queue=f"{queue}-b")
            new_fence = newer.get(timeout=10)
            a.signal_all(signal.SIGCONT)
            with pytest.raises(LeaseLost):
                paused.get(timeout=15)
    finally:
        a.stop()
    writes = entries(app, "sleeper:pause:write")
    say(f"observed: new holder fence {new_fence}; writes {writes}")
    assert new_fence > old_fence
    assert f"sleeper:pause:write:{new_fence}:accepted" in writes
    assert f"sleeper:pause:write:{old_fence}:rejected" in writes
