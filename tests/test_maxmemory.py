"""Redis at maxmemory with ``noeviction`` (what the README asks for): every script a holder needs
goes on working, a new acquisition fails closed and says why. A suite-owned redis-server (never
the shared one): its maxmemory is set just under what it uses, so Redis refuses writes."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis

from taskguard import LeaseBackendError, RedisLocks
from taskguard.once import decode_record

from .servers import RedisServer, fill_to_maxmemory, free_maxmemory


@pytest.fixture
def private():
    srv = RedisServer().start()
    yield srv
    srv.close()


@pytest.fixture
def oom(private):
    """(locks, client) on the private server; ``full()`` brings it to maxmemory."""
    client = redis.Redis(port=private.port)
    locks = RedisLocks.from_url(
        private.url, prefix=f"tgtest-{uuid.uuid4().hex[:8]}", socket_timeout=2, renew_fraction=0.25
    )

    class Box:
        pass

    box = Box()
    box.locks, box.client = locks, client
    box.full = lambda: fill_to_maxmemory(client)
    yield box
    free_maxmemory(client)
    locks.close(timeout=2)
    client.close()


def _refused(client: redis.Redis) -> bool:
    try:
        client.set("probe", "x", ex=60)
    except redis.exceptions.OutOfMemoryError:
        return True
    return False


def test_new_acquisition_at_maxmemory_fails_closed_and_says_why(oom):
    oom.full()
    with pytest.raises(LeaseBackendError) as err:
        oom.locks.acquire("new", ttl=5)
    assert err.value.operation == "acquire"
    assert "maxmemory (OOM)" in str(err.value) and "no new lease" in str(err.value)
    with pytest.raises(LeaseBackendError):
        oom.locks.with_lease("new", lambda lease: "never", ttl=5)  # never a Skipped, never run
    assert _refused(oom.client)


def test_renew_claim_record_and_reads_of_a_holder_at_maxmemory(oom):
    locks = oom.locks
    lease = locks.acquire("k", ttl=3).lease
    kept = locks.acquire("kept", ttl=3).lease
    oom.full()
    # RENEW: extends, as before the limit
    assert lease.renew(20)
    info = locks.holder("k")
    assert info is not None and info.ttl > 15 and info.fencing_token == lease.fencing_token
    # lease records (beat's slot claims): written while held
    assert lease.put_record("slot", "claimed 1", if_absent=True)
    assert lease.put_record("slot", "published 1", if_value="claimed 1")
    assert locks.get_lease_record("k", "slot") == "published 1"
    # CLAIM of a persisted handle (a retry's): same fence, fresh owner token
    acq = locks.claim("kept", kept.owner_token, ttl=10, run_id="run-kept")
    assert acq.acquired and acq.lease.fencing_token == kept.fencing_token
    assert locks.holder("kept").ttl > 8
    # reads
    lease.ensure_held(verify=True)
    assert [h.fencing_token for h in locks.holders("k")] == [lease.fencing_token]
    # RELEASE by the holder, and without a token (release_run of a dead run)
    assert lease.release()
    assert locks.holder("k") is None
    assert locks.release_run("kept", "run-kept")
    assert locks.holder("kept") is None
    assert _refused(oom.client)


def test_heartbeat_keeps_leases_at_maxmemory(oom):
    """The heartbeat's pipelined RENEW: ttl 1.2 s, renewed every 0.3 s, for 4 s at maxmemory."""
    events = []
    oom.locks.add_listener(events.append)
    leases = [oom.locks.acquire(f"hb{i}", ttl=1.2, renew=True).lease for i in range(3)]
    oom.full()
    time.sleep(4.0)
    assert _refused(oom.client)
    assert not [e for e in events if e.kind == "renew" and e.status == "error"]
    for lease in leases:
        assert not lease.lost
        assert oom.locks.holder(lease.key).ttl > 0.5
        assert lease.release()


def test_noscript_at_maxmemory_falls_back_to_eval(oom):
    """After SCRIPT FLUSH (a restart, a failover) the EVAL fallback caches the script again at
    maxmemory: the renewal goes through."""
    lease = oom.locks.acquire("k", ttl=3).lease
    oom.full()
    oom.client.script_flush()
    assert lease.renew(10)
    assert oom.locks.holder("k").ttl > 8
    assert lease.release()


def test_release_writes_its_finished_marker_at_maxmemory(oom):
    """A finishing run's marker is written at maxmemory, held or not: refusing it would let a
    redelivered copy of a run that finished run again."""
    locks = oom.locks
    held = locks.acquire("a", ttl=5, run_id="run-a").lease
    lapsed = locks.acquire("b", ttl=0.3, run_id="run-b").lease
    oom.full()
    time.sleep(0.5)  # b's lease expires
    assert held.release(finished=True, finished_ttl=60)
    assert not lapsed.release(finished=True, finished_ttl=60)
    for key, run in (("a", "run-a"), ("b", "run-b")):
        assert 0 < oom.client.pttl(locks.backend.done_key(key, run)) <= 60000
    assert _refused(oom.client)


def test_once_record_written_at_maxmemory(oom):
    """The completion record of a once run that completes while Redis is at maxmemory is stored
    (its size is bounded by once_max_bytes): refusing it would run the completed work again."""
    locks = oom.locks
    calls = []

    def body(lease):
        calls.append(lease.fencing_token)
        oom.full()  # Redis reaches maxmemory while the work runs
        return {"paid": 42}

    assert locks.once("pay:1", body, ttl=5) == {"paid": 42}
    assert _refused(oom.client)
    assert decode_record(locks.completions.get("pay:1"))["fp"] is not None
    assert locks.once("pay:1", body, ttl=5) == {"paid": 42}  # the stored value, without the body
    assert len(calls) == 1


def test_once_record_of_a_lapsed_lease_written_at_maxmemory(oom):
    """RELEASE_STORING when the lease had lapsed: the run did complete, the record is stored."""
    locks = oom.locks

    def body(lease):
        oom.full()
        time.sleep(0.6)  # ttl 0.3 and no renewal: the lease lapses while the body runs
        return "done"

    from taskguard.once import OncePolicy, fingerprint_of
    from taskguard.run import GuardedRun

    run = GuardedRun(
        locks, "pay:2", ttl=0.3, renew=False, on_lost="warn", once=OncePolicy(fingerprint_of(None), ttl=60)
    )
    assert run.call(body) == "done"
    assert _refused(oom.client)
    assert locks.completions.get("pay:2") is not None


def test_waiting_acquire_at_maxmemory_answers_held_not_oom(oom):
    """With wait > 0 the waiter mark is refused at maxmemory: the acquire still answers held /
    wait_timeout (the waiter polls), never the OOM error."""
    locks = oom.locks
    lease = locks.acquire("k", ttl=5, renew=True).lease
    oom.full()
    started = time.monotonic()
    acq = locks.acquire("k", ttl=5, wait=1.0)
    assert not acq.acquired and acq.reason == "wait_timeout" and acq.holder_ttl > 0
    assert 0.9 < time.monotonic() - started < 3.0
    assert locks.acquire("k", ttl=5, wait=0).reason == "held"
    # a waiter that outlives the holder: the release (its signal) goes through at maxmemory;
    # the waiter then finds the lease free and its acquisition is refused, saying why
    result: list = []

    def waiter():
        try:
            result.append(locks.acquire("k", ttl=5, wait=3.0))
        except LeaseBackendError as e:
            result.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.5)
    assert lease.release()
    t.join(5)
    assert len(result) == 1 and isinstance(result[0], LeaseBackendError) and "OOM" in str(result[0])
    free_maxmemory(oom.client)
    again = locks.acquire("k", ttl=5)
    assert again.acquired and again.lease.fencing_token > lease.fencing_token
    assert again.lease.release()


# -- real processes ---------------------------------------------------------------------------------


def test_celery_holder_keeps_its_lease_through_maxmemory(redis_url, prefix, private):
    """Run A (ttl 3, an 11 s body) on a real prefork worker holds its lease while the lease Redis
    sits at maxmemory for 6 s: A ends SUCCESS with its lease never lost; B of the same key is
    skipped ``held`` (wait=0) or ``wait_timeout`` (wait=1.5), never an OOM error; the two bodies
    never overlap. The broker and the log are on the shared Redis."""
    from taskguard import as_skipped, is_skipped

    from .celery_app import make_app
    from .celery_support import WorkerProcess, body_log

    queue = f"q-{prefix}"
    lease_conf = {"taskguard_locks": None, "taskguard_redis_url": private.url, "taskguard_prefix": prefix}
    app = make_app(queue, prefix, **lease_conf)
    client = redis.Redis(port=private.port)
    worker = WorkerProcess(queue, prefix, concurrency=3, conf=lease_conf)
    try:
        with worker:
            # an expiring log: a parallel suite's session end deletes keys without a TTL under tgtest-*
            shared = redis.Redis.from_url(redis_url)
            shared.rpush(app.tg_log, "begin")
            shared.expire(app.tg_log, 600)
            a = app.tasks["tg.hold3"].delay("a", seconds=11.0)
            deadline = time.monotonic() + 30
            while not any(e.startswith("hold3:a:start") for e in body_log(app)):
                assert time.monotonic() < deadline, worker.output()
                time.sleep(0.1)
            fill_to_maxmemory(client)
            full_at = time.monotonic()
            b = app.tasks["tg.hold3"].delay("b", seconds=0).get(timeout=20)
            c = app.tasks["tg.hold3_wait"].delay("c").get(timeout=20)
            assert _refused(client)  # still at maxmemory
            time.sleep(max(0.0, 6.0 - (time.monotonic() - full_at)))
            assert _refused(client)
            free_maxmemory(client)
            out = a.get(timeout=30)
            assert a.status == "SUCCESS" and out["lost"] is False, worker.output()
            assert is_skipped(b) and as_skipped(b).reason == "held", b
            assert is_skipped(c) and as_skipped(c).reason == "wait_timeout", c
            log = body_log(app)[1:]
            assert [e.split(":")[1:3] for e in log] == [["a", "start"], ["a", "end"]], log
            assert "LeaseLost" not in worker.output()
    finally:
        redis.Redis.from_url(redis_url).delete(queue, app.tg_log)
        client.close()


def test_rq_holder_keeps_its_lease_through_maxmemory(private, monkeypatch):
    """The same with real ``rq worker -w taskguard_rq.GuardedWorker`` processes: A (ttl 3, 11 s)
    holds through 6 s at maxmemory and finishes; B (wait=0) returns Skipped ``held``, C (wait=1.5)
    ``wait_timeout``; never two bodies at once. The queue and the log on a second private server."""
    from rq import Queue
    from rq.job import JobStatus

    import taskguard_rq
    from taskguard import as_skipped, is_skipped

    from . import rq_jobs
    from .test_rq import RQWorker, wait_done

    other = RedisServer().start()
    prefix = f"tgtest-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("TASKGUARD_REDIS_URL", private.url)
    monkeypatch.setenv("TASKGUARD_PREFIX", prefix)
    monkeypatch.setenv("TG_TEST_LOG_URL", other.url)
    monkeypatch.setattr(taskguard_rq.config, "_default", None)
    conn, client = redis.Redis(port=other.port), redis.Redis(port=private.port)
    queue = Queue(f"q-{prefix}", connection=conn)
    logkey = "{" + prefix + ":log}"
    try:
        with RQWorker(queue, url=other.url) as w1, RQWorker(queue, url=other.url) as w2:
            a = queue.enqueue(rq_jobs.hold3, "a", 11.0, job_timeout=60)
            deadline = time.monotonic() + 30
            while not conn.lrange(logkey, 0, -1):
                assert time.monotonic() < deadline, w1.output() + w2.output()
                time.sleep(0.1)
            fill_to_maxmemory(client)
            full_at = time.monotonic()
            b = queue.enqueue(rq_jobs.hold3, "b", 0.0)
            assert wait_done(b, timeout=20) == JobStatus.FINISHED, w1.output() + w2.output()
            c = queue.enqueue(rq_jobs.hold3_wait, "c")
            assert wait_done(c, timeout=20) == JobStatus.FINISHED, w1.output() + w2.output()
            time.sleep(max(0.0, 6.0 - (time.monotonic() - full_at)))
            assert _refused(client)
            free_maxmemory(client)
            assert wait_done(a, timeout=30) == JobStatus.FINISHED, w1.output() + w2.output()
        assert a.return_value()["lost"] is False
        assert is_skipped(b.return_value()) and as_skipped(b.return_value()).reason == "held"
        assert is_skipped(c.return_value()) and as_skipped(c.return_value()).reason == "wait_timeout"
        log = [x.decode() for x in conn.lrange(logkey, 0, -1)]
        assert [e.split(":")[1:3] for e in log] == [["a", "start"], ["a", "end"]], log
    finally:
        conn.close()
        client.close()
        other.close()


def test_beat_leader_keeps_publishing_through_maxmemory(redis_url, prefix, private, tmp_path):
    """Two ``celery beat -S taskguard`` (leader TTL 3 s, an entry every second) with their leases on
    a private Redis that sits at maxmemory for 6 s: the leader keeps its lease (renewals) and
    claims and confirms its slots (lease records), so publishing goes on with no gap and no hand-over;
    each slot runs once."""
    import json

    from .celery_app import make_app
    from .celery_support import BeatProcess, WorkerProcess
    from .test_celery_beat import check_once_per_slot, ticks

    queue = f"q-{prefix}"
    lease_conf = {"taskguard_locks": None, "taskguard_redis_url": private.url, "taskguard_prefix": prefix}
    app = make_app(queue, prefix)
    client = redis.Redis(port=private.port)
    shared = redis.Redis.from_url(redis_url)
    shared.rpush(app.tg_log, "begin")  # expiring: a parallel suite's session end deletes keys without a TTL
    shared.expire(app.tg_log, 600)
    env = {"TG_TEST_CONF": json.dumps({**lease_conf, "taskguard_beat_leader_ttl": 3})}
    try:
        with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
            beats = [BeatProcess(queue, prefix, tmp_path, n, env=env).start() for n in ("a", "b")]
            deadline = time.monotonic() + 30
            while len(ticks(app)) < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            fill_to_maxmemory(client)
            full_from = time.time()
            time.sleep(6.0)
            assert _refused(client)
            full_until = time.time()
            free_maxmemory(client)
            time.sleep(2.0)
            stopped = time.time()
            for b in beats:
                b.stop()
        runs = ticks(app)
        during = [r for r in runs if full_from <= r[2] <= full_until]
        assert len(during) >= 4, (runs, [b.output() for b in beats])
        times = [r[2] for r in runs if r[2] <= stopped]
        assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 2.5, runs
        assert len({r[1] for r in runs}) == 1  # one leader throughout: no hand-over
        check_once_per_slot(runs, runs[0][2], stopped)
    finally:
        shared.delete(queue, app.tg_log)
        client.close()
