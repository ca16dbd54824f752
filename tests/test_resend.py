"""Scripts re-sent by the client after they ran (issue 22, input 4).

redis-py re-sends a command after a timeout or a dropped connection although the server may have
run it (redis-py 6+ with a retry policy: the caller sees the second answer), or raises after it
ran once (redis-py 5.x: the call's writes stay while the caller sees an error). Every script of
:mod:`taskguard.scripts` must answer a re-send as it answered the first send, and a publish that
raised must leave no queued mark. THROTTLE is the exception (a re-send counts twice).

The stalls are made on a redis-server of the test's own (a busy Lua script run from another
connection: ``DEBUG SLEEP`` is disabled on Redis 7), never on the shared one."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import redis

from taskguard import LeaseBackendError, RedisLocks, scripts

from .servers import RedisServer

#: Busy for ARGV[1] µs by the server's clock: every other client waits for it.
BUSY = """
local t = redis.call('TIME')
local start = tonumber(t[1]) * 1000000 + tonumber(t[2])
while true do
  local n = redis.call('TIME')
  if tonumber(n[1]) * 1000000 + tonumber(n[2]) - start > tonumber(ARGV[1]) then
    return 1
  end
end
"""


@pytest.fixture
def private_redis():
    srv = RedisServer().start()
    yield srv
    srv.close()


@contextmanager
def stalled(srv: RedisServer, seconds: float):
    """The server runs a busy script for ``seconds`` (started before the block's body)."""
    staller = redis.Redis(port=srv.port, socket_timeout=seconds + 10)
    thread = threading.Thread(target=staller.eval, args=(BUSY, 0, int(seconds * 1e6)))
    thread.start()
    time.sleep(0.1)  # the busy script is running
    try:
        yield
    finally:
        thread.join()
        staller.close()


def flaky_locks(srv: RedisServer, prefix: str) -> RedisLocks:
    """The issue's client: a 1 s socket timeout and one retry."""
    return RedisLocks.from_url(srv.url, prefix=prefix, socket_timeout=1, retries=1)


def warm(locks: RedisLocks) -> None:
    """Every script cached on the server (as on a server that has served a while), so a send
    during the stall is an EVALSHA that runs, not a NOSCRIPT."""
    for s in (
        scripts.ACQUIRE,
        scripts.RENEW,
        scripts.RELEASE,
        scripts.RELEASE_STORING,
        scripts.QUEUE,
        scripts.UNQUEUE,
        scripts.SIGNAL,
        scripts.CLAIM,
        scripts.RELEASE_WITHOUT_TOKEN,
        scripts.HOLDERS,
        scripts.OWNS,
        scripts.PUT_RECORD,
        scripts.DELETE_RECORD,
        scripts.PUT_LEASE_RECORD,
        scripts.THROTTLE,
    ):
        locks.client.script_load(s.source)


def no_mark(raw: bytes | None) -> bool:
    """A queued-mark field that names no run: absent, or a cleared mark ("~<nonce>")."""
    return raw is None or raw.startswith(b"~")


def test_a_unique_mark_during_a_latency_spike_is_published_or_leaves_no_mark(private_redis, prefix):
    """The issue's input, in the core: ``mark_queued`` during a 1.6 s stall with a 1 s socket
    timeout. Before the fix, redis-py 8 re-sent the QUEUE script, whose second run found the
    first run's mark and answered "already queued" (naming the caller's own run): nothing was
    published and the key stayed blocked; redis-py 5 raised and left the mark."""
    locks = flaky_locks(private_redis, prefix)
    warm(locks)
    try:
        with stalled(private_redis, 1.6):
            marked, found = locks.mark_queued("k", "run-1", ttl=3600, task="t")
    except LeaseBackendError:
        assert no_mark(locks.client.hget(locks.backend.lease_key("k"), "q:t"))  # raised: no mark left
    else:
        assert (marked, found) == (True, "run-1")  # answered: publish it
        assert locks.client.hget(locks.backend.lease_key("k"), "q:t").startswith(b"run-1 ")
    # either way the key is not blocked by a run that was never published, and a second publish
    # of the same key is still refused while the first is queued
    locks.client.hdel(locks.backend.lease_key("k"), "q:t")
    assert locks.mark_queued("k", "run-2", ttl=3600, task="t") == (True, "run-2")
    assert locks.mark_queued("k", "run-3", ttl=3600, task="t") == (False, "run-2")
    locks.close()


def test_a_release_during_a_latency_spike_is_not_taken_for_lost_when_the_next_holder_came_first(private_redis, prefix):
    """Through redis-py's own retry: the release runs, a waiter's acquire sent during the stall
    runs next and takes the key, then the re-send runs. Before the fix the re-send found the new
    holder and answered 0: ``release()`` returned ``False`` and the handle was marked lost."""
    locks = flaky_locks(private_redis, prefix)
    warm(locks)
    other = RedisLocks(redis.Redis(port=private_redis.port, socket_timeout=10), prefix=prefix)
    lease = locks.acquire("k", ttl=30).lease
    taken: list = []

    def next_holder():
        time.sleep(0.4)  # after the release was sent, before its re-send
        taken.append(other.acquire("k", ttl=30))

    with stalled(private_redis, 1.6):
        thread = threading.Thread(target=next_holder)
        thread.start()
        try:
            released = lease.release()
        except LeaseBackendError:  # redis-py 5: it ran once and raised
            released = None
        thread.join()
    assert taken[0].acquired  # the key was free for the next holder: the release did run
    assert released in (True, None) and not lease.lost
    assert locks.holder("k").fencing_token == taken[0].lease.fencing_token
    taken[0].lease.release()
    other.client.close()
    locks.close()


def _state(client, prefix):
    """Every key of the prefix with its value (hash fields, strings), for before/after checks."""
    out = {}
    for k in sorted(client.scan_iter(match="{" + prefix + ":*")):
        kind = client.type(k)
        out[k] = (
            client.hgetall(k) if kind == b"hash" else client.get(k) if kind == b"string" else client.lrange(k, 0, -1)
        )
    return out


def _resend(client, script, keys, args):
    """The first send, its state, and a second send of the very same call (what redis-py re-sends)."""
    first = script(client, keys, args)
    after_first = _state(client, keys[0][1:].split(":")[0])
    second = script(client, keys, args)
    return first, after_first, second


@pytest.mark.parametrize("waiting", [False, True])
def test_a_resent_release_answers_as_it_did_also_after_the_next_holder_took_the_key(client, prefix, waiting):
    """A release re-sent after it ran answers 1 (or 2 when someone waited: the caller then wakes
    the waiter), also when another holder acquired the key in between (before, the re-send
    answered 1 instead of 2, and 0 once the key was taken: the caller took its lease for lost)."""
    locks = RedisLocks(client, prefix=prefix)
    lease = locks.acquire("r", ttl=30).lease
    if waiting:
        assert not locks.acquire("r", ttl=30, wait=0.01)  # leaves the waiting mark
    lk = locks.backend.lease_key("r")
    args = (lease.owner_token, 60000, 60000, "n0nce001", "run-1")
    first = int(scripts.RELEASE(client, (lk,), args))
    assert first == (2 if waiting else 1)
    assert int(scripts.RELEASE(client, (lk,), args)) == first
    other = locks.acquire("r", ttl=30).lease  # the next holder, before the re-send arrives
    assert int(scripts.RELEASE(client, (lk,), args)) == first
    assert locks.holder("r").fencing_token == other.fencing_token  # the re-send took nothing from it
    assert int(scripts.RELEASE(client, (lk,), args[:3] + ("n0nce002", "run-1"))) == 0  # a new call
    assert all(lease.owner_token.encode() not in v for v in client.hvals(lk))
    other.release()


def test_a_resent_storing_release_answers_as_it_did(client, prefix):
    locks = RedisLocks(client, prefix=prefix)
    lease = locks.acquire("s", ttl=30).lease
    assert not locks.acquire("s", ttl=30, wait=0.01)
    keys = (locks.backend.lease_key("s"), locks.backend.completion_key("s"))
    args = (lease.owner_token, "", 60000, "n0nce001", "run-1", "the record", 60000)
    assert int(scripts.RELEASE_STORING(client, keys, args)) == 2
    other = locks.acquire("s", ttl=30).lease
    assert int(scripts.RELEASE_STORING(client, keys, args)) == 2
    assert client.get(keys[1]) == b"the record" and locks.holder("s").fencing_token == other.fencing_token
    other.release()


@pytest.mark.parametrize("run_id", ["job-1", ""])
def test_a_resent_release_without_token_answers_as_it_did(client, prefix, run_id):
    """``release_run`` (a supervisor's release for a dead child) and ``force_release``: a
    re-send answers as the first send (before: 0, a lease was there but the caller is told not)."""
    locks = RedisLocks(client, prefix=prefix)
    locks.acquire("w", ttl=30, run_id="job-1")
    assert not locks.acquire("w", ttl=30, wait=0.01)
    lk = locks.backend.lease_key("w")
    args = (run_id, "n0nce001")
    assert int(scripts.RELEASE_WITHOUT_TOKEN(client, (lk,), args)) == 2
    assert int(scripts.RELEASE_WITHOUT_TOKEN(client, (lk,), args)) == 2
    other = locks.acquire("w", ttl=30, run_id="job-1").lease  # a new run took it in between
    assert int(scripts.RELEASE_WITHOUT_TOKEN(client, (lk,), args)) == 2
    assert locks.holder("w").fencing_token == other.fencing_token
    assert int(scripts.RELEASE_WITHOUT_TOKEN(client, (lk,), (run_id, "n0nce002"))) == 1  # a new call releases
    assert locks.holder("w") is None


def test_a_resent_queue_mark_answers_marked_and_a_new_call_of_the_same_run_is_refused(client, prefix):
    locks = RedisLocks(client, prefix=prefix)
    lk = locks.backend.lease_key("q")
    args = ("run-1", 60000, 60000, "t", "n0nce001")
    first, state, second = _resend(client, scripts.QUEUE, (lk,), args)
    assert [int(first[0]), first[1]] == [int(second[0]), second[1]] == [1, b"run-1"]
    assert _state(client, prefix) == state  # the re-send wrote nothing
    # a new call naming the same run id (an explicit task id published twice): that run is queued
    assert [int(x) if i == 0 else x for i, x in enumerate(scripts.QUEUE(client, (lk,), args[:4] + ("n0nce002",)))] == [
        0,
        b"run-1",
    ]
    # cleared by its run: a re-send of that clear answers 1 too, and a new mark goes in
    clear = ("run-1", "t", "n0nce003")
    assert int(scripts.UNQUEUE(client, (lk,), clear)) == 1
    assert int(scripts.UNQUEUE(client, (lk,), clear)) == 1
    assert int(scripts.UNQUEUE(client, (lk,), ("run-1", "t", "n0nce004"))) == 0  # a new call: nothing to clear
    assert locks.mark_queued("q", "run-2", ttl=60, task="t") == (True, "run-2")


def test_a_mark_of_an_older_version_is_still_read(client, prefix):
    """Marks written before the nonce ("<run id> <expiry ms>") block and are cleared as before."""
    locks = RedisLocks(client, prefix=prefix)
    lk = locks.backend.lease_key("old")
    client.hset(lk, "q:t", "run 0 " + str(int(time.time() * 1000) + 60000))
    client.pexpire(lk, 60000)
    assert locks.mark_queued("old", "new", ttl=60, task="t") == (False, "run 0")
    assert locks.clear_queued("old", "run 0", "t") is True
    assert locks.mark_queued("old", "new", ttl=60, task="t") == (True, "new")


def test_the_other_scripts_answer_a_resend_as_they_did(client, prefix):
    """The rest of the kind, each with its own call nonce: ACQUIRE (the owner token, also under
    a limit), RENEW and OWNS (the token; a renewal only extends), CLAIM (the new token),
    PUT_LEASE_RECORD (the value: beat's slot claim and confirm), SIGNAL (always 1; one element
    to pop) and HOLDERS (reads only). (PUT_RECORD and DELETE_RECORD, plain string records, and
    THROTTLE are the documented exceptions: see taskguard/scripts.py.)"""
    locks = RedisLocks(client, prefix=prefix)
    lk = locks.backend.lease_key("o")
    acquire = ("tok-1", 30000, "{}", 60000, 0, "run-1", "0", "", 1)
    first, state, second = _resend(client, scripts.ACQUIRE, (lk,), acquire)
    same = lambda a, b: (a[0], a[1], a[3]) == (b[0], b[1], b[3])  # noqa: E731 (ms left moves on)
    assert same(first, second) and int(first[0]) == 1
    assert _state(client, prefix) == state
    limited = ("tok-2", 30000, "{}", 60000, 0, "run-2", "0", "", 3)
    first, _, second = _resend(client, scripts.ACQUIRE, (lk,), limited)
    assert int(first[0]) == 1 and int(first[3]) == 1 and same(first, second)
    assert [h.run_id for h in locks.holders("o")] == ["run-1", "run-2"]
    assert int(scripts.RENEW(client, (lk,), ("tok-1", 30000, 60000))) == 1
    assert int(scripts.RENEW(client, (lk,), ("tok-1", 30000, 60000))) == 1
    assert int(scripts.OWNS(client, (lk,), ("tok-1",))) > 0
    claim = ("tok-1", "tok-3", 30000, "{}", "run-1", 60000)
    first, state, second = _resend(client, scripts.CLAIM, (lk,), claim)
    assert first == second and int(first[0]) == 1
    assert _state(client, prefix) == state
    # beat's slot claim (absent) and confirm (eq): each value names the slot, the fence and the beat
    claim_v, confirm_v = "1.0 claimed 7 beat-a", "1.0 published 7 beat-a"
    for cond, value, expect in (("absent", claim_v, ""), ("eq", confirm_v, claim_v)):
        args = ("tok-3", "d:slot", value, cond, expect)
        first, state, second = _resend(client, scripts.PUT_LEASE_RECORD, (lk,), args)
        assert int(first) == int(second) == 1 and _state(client, prefix) == state
    sk = locks.backend.signal_key("o")
    assert int(scripts.SIGNAL(client, (sk,), (10000,))) == int(scripts.SIGNAL(client, (sk,), (10000,))) == 1
    assert client.llen(sk) == 1
    without_ms_left = lambda flat: [x for i, x in enumerate(flat) if i % 6 != 3]  # noqa: E731
    assert without_ms_left(scripts.HOLDERS(client, (lk,), ())) == without_ms_left(scripts.HOLDERS(client, (lk,), ()))
    locks.close(timeout=0)


# -- the publish paths: Celery's unique=True and RQ's enqueue_unique -----------------------------------


def test_a_unique_celery_publish_during_a_latency_spike_goes_out_or_raises_leaving_no_mark(
    private_redis, redis_url, prefix
):
    """The issue's input: before the fix the publish returned an AsyncResult naming its own task id,
    published nothing, and the key stayed blocked for ``unique_ttl``."""
    from .celery_app import make_app
    from .celery_support import embedded_worker

    locks = flaky_locks(private_redis, prefix)
    warm(locks)
    app = make_app(f"q-{prefix}", prefix, taskguard_locks=locks)
    task = app.tasks["tg.unique_slow"]
    broker = redis.Redis.from_url(redis_url)
    try:
        try:
            with stalled(private_redis, 1.6):
                result = task.delay("a", seconds=0)
        except LeaseBackendError:
            result = None
        mark = locks.client.hget(locks.backend.lease_key("u:a"), "q:tg.unique_slow")
        if result is None:  # raised (redis-py 5): nothing published, no mark
            assert broker.llen(f"q-{prefix}") == 0 and no_mark(mark)
        else:  # answered (redis-py 8 re-sent it): published, and the mark names it
            assert broker.llen(f"q-{prefix}") == 1 and mark.startswith(result.id.encode() + b" ")
        with embedded_worker(app):
            if result is not None:
                assert result.get(timeout=20) == result.id
            again = task.delay("a", seconds=0)  # the key is not blocked
            assert again.id != getattr(result, "id", None) and again.get(timeout=20) == again.id
    finally:
        broker.delete(app.tg_log, f"q-{prefix}")
        broker.close()
        locks.close()


def test_a_unique_rq_enqueue_during_a_latency_spike_goes_out_or_raises_leaving_no_mark(private_redis, rq_env, prefix):
    import taskguard_rq
    from taskguard_rq import enqueue_unique

    from . import rq_jobs

    locks = flaky_locks(private_redis, prefix)
    warm(locks)
    taskguard_rq.use_locks(locks)  # (rq_env puts the default back afterwards)
    try:
        try:
            with stalled(private_redis, 1.6):
                job = enqueue_unique(rq_env, rq_jobs.unique_job, ("a",), ttl=3600)
        except LeaseBackendError:
            job = None
        mark = locks.client.hget(locks.backend.lease_key("uq:a"), "q:" + rq_jobs.unique_job.taskguard_name)
        if job is None:
            assert rq_env.count == 0 and no_mark(mark)
        else:
            assert rq_env.job_ids == [job.id] and mark.startswith(job.id.encode() + b" ")
    finally:
        locks.close()
