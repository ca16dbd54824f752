"""Defects found by trying to break the core, each pinned by a test."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis

from taskguard import ConfigError, MemoryLocks, RedisLocks, scripts
from taskguard.backend import AcquireRequest, AcquireStatus
from taskguard.handoff import persist
from taskguard.heartbeat import get_heartbeat
from taskguard.urls import redact_url

from .servers import RedisServer


def lease_key(locks, key):
    return "{" + locks.prefix + ":" + key + "}"


def test_scripts_are_idempotent_under_client_retries(client, prefix):
    """redis-py re-sends a command after a timeout although the server ran it: a second run of
    the same acquire / claim / release must give the same answer, never orphan a lease."""
    locks = RedisLocks(client, prefix=prefix)
    lk = locks.backend.lease_key("idem")
    args = ("owner-1", 5000, "{}", 60000, 0, "", "0", "")
    first = scripts.ACQUIRE(client, (lk,), args)
    again = scripts.ACQUIRE(client, (lk,), args)
    assert int(first[0]) == 1 and int(again[0]) == 1 and int(first[1]) == int(again[1])
    claim_args = ("owner-1", "owner-2", 5000, "{}", "run", 60000)
    assert int(scripts.CLAIM(client, (lk,), claim_args)[0]) == 1
    assert int(scripts.CLAIM(client, (lk,), claim_args)[0]) == 1  # re-sent: still claimed
    assert int(scripts.RELEASE(client, (lk,), ("owner-2", 60000, 0, "call-1", ""))) == 1
    assert int(scripts.RELEASE(client, (lk,), ("owner-2", 60000, 0, "call-1", ""))) == 1  # re-sent: released
    assert int(scripts.RELEASE(client, (lk,), ("owner-2", 60000, 0, "call-2", ""))) == 0  # a new call: no
    assert int(scripts.RELEASE(client, (lk,), ("someone-else", 60000, 0, "call-1", ""))) == 0
    assert locks.holder("idem") is None


def test_release_with_a_done_marker_is_idempotent(client, prefix):
    """A finishing release names the run in the lease hash and, asked for one, writes its
    finished marker atomically: a re-sent release still answers 1, a new call answers 0, and
    neither the hash nor the marker keeps the owner token."""
    locks = RedisLocks(client, prefix=prefix)
    lease = locks.acquire("done", ttl=5, run_id="task-1").lease
    lk, done_k = locks.backend.lease_key("done"), locks.backend.done_key("done", "task-1")
    args = (lease.owner_token, 60000, 60000, "nonce-1", "task-1")
    assert int(scripts.RELEASE(client, (lk, done_k), args)) == 1
    assert int(scripts.RELEASE(client, (lk, done_k), args)) == 1  # re-sent after it ran: released
    assert int(scripts.RELEASE(client, (lk, done_k), args[:3] + ("nonce-2", "task-1"))) == 0  # a new call: no
    assert client.exists(done_k) == 1 and 0 < client.pttl(done_k) <= 60000
    # a redelivered copy of the finished run is refused; a new run of the id is not
    assert locks.acquire("done", ttl=5, run_id="task-1", refuse_finished=True).reason == "duplicate"
    assert client.hget(lk, "l") == b"task-1"  # the hash names the key's last finished run
    assert lease.owner_token.encode() not in client.get(done_k)  # no owner token kept anywhere
    assert all(lease.owner_token.encode() not in v for v in client.hvals(lk))


def test_renew_never_shortens_a_stretched_lease(client, prefix):
    locks = RedisLocks(client, prefix=prefix)
    lease = locks.acquire("stretch", ttl=1, renew=True).lease
    handle = persist(lease, 30)
    assert handle is not None and len(get_heartbeat()) >= 0
    assert lease.renew(1) is True  # a late heartbeat-style renewal with the short TTL
    assert client.pttl(lease_key(locks, "stretch")) > 25_000
    time.sleep(0.8)  # the heartbeat no longer renews it (persist took it off)
    assert client.pttl(lease_key(locks, "stretch")) > 25_000
    assert lease.release()


def test_huge_durations_are_refused_and_leave_nothing(client, prefix):
    locks = RedisLocks(client, prefix=prefix)
    for bad in (1e16, 1e308, 10**400):
        with pytest.raises(ConfigError):
            locks.acquire("huge", ttl=bad)
        with pytest.raises(ConfigError):
            locks.acquire("huge", ttl=1, wait=bad)
    assert locks.holder("huge") is None
    assert locks.acquire("huge", ttl=1).acquired


def test_lone_surrogates_are_refused_early(client, prefix):
    locks = RedisLocks(client, prefix=prefix)
    bad = "report:\udcff"
    with pytest.raises(ConfigError, match="surrogate"):
        locks.acquire(bad, ttl=1)
    with pytest.raises(ConfigError):
        locks.restore(bad, "token", ttl=1, renew=True)
    with pytest.raises(ConfigError):
        locks.restore("fine", "tok\udcff", ttl=1, renew=True)
    with pytest.raises(ConfigError):
        locks.acquire("fine", ttl=1, run_id="\udcff")


def test_url_passwords_in_the_query_string_are_masked():
    shown = redact_url("redis://cache:6379/0?password=s3cr3tQ&db=1")
    assert "s3cr3tQ" not in shown and "password=***" in shown
    with pytest.raises(ConfigError) as err:
        RedisLocks.from_url("redis://cache:6379/x?password=s3cr3tQ")
    assert "s3cr3tQ" not in str(err.value)
    assert ":0/" in redact_url("redis://u:pw@host:0/1") or "pw" not in redact_url("redis://u:pw@host:0/1")


def test_blocking_waits_are_sliced_even_when_the_client_hides_its_socket_timeout(redis_url, prefix):
    """A client made without a socket timeout: redis-py 8's connections still apply their default
    (5 s) without naming it in the pool's settings; a blocking wait must return well before it."""
    client = redis.Redis.from_url(redis_url)
    pool = client.connection_pool
    applied = pool.connection_class(**pool.connection_kwargs).socket_timeout  # what a connection uses
    locks = RedisLocks(client, prefix=prefix, poll_interval=8)
    assert locks.backend.slice <= (applied / 2 if applied else 1.0)
    explicit = RedisLocks(redis.Redis.from_url(redis_url, socket_timeout=0.4), prefix=prefix, poll_interval=8)
    assert explicit.backend.slice <= 0.2


def test_close_stops_renewing_what_it_could_not_release(client, prefix):
    locks = RedisLocks(client, prefix=prefix, renew_fraction=0.25)
    leases = [locks.acquire(f"c{i}", ttl=0.4, renew=True).lease for i in range(3)]
    locks.close(timeout=0)  # no time to release anything
    time.sleep(1.0)
    assert all(locks.holder(f"c{i}") is None for i in range(3))  # expired by their TTL
    assert all(lease.lost for lease in leases)


def test_memory_locks_waiter_never_misses_a_release_between_try_and_wait():
    locks = MemoryLocks()
    holder = locks.acquire("k", ttl=30).lease
    reply = locks.backend.acquire(AcquireRequest("k", "w", 5, "{}"), 0.0)  # the waiter's failed try
    assert reply.status is AcquireStatus.HELD
    holder.release()  # lands before the waiter sleeps
    started = time.monotonic()
    locks.backend.wait_signal("k", 3.0)
    assert time.monotonic() - started < 1.5  # a missed signal would sleep the full 3 s


def test_a_stalled_redis_does_not_stop_renewals_on_another(redis_url, prefix):
    stalled = RedisServer().start()
    try:
        slow = RedisLocks.from_url(
            stalled.url, prefix=prefix, socket_timeout=2, connect_timeout=1, retries=0, renew_fraction=0.25
        )
        healthy = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix, renew_fraction=0.25)
        slow.acquire("a", ttl=0.8, renew=True)
        lease = healthy.acquire("b", ttl=0.8, renew=True).lease
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(2.5)  # three TTLs of the healthy lease while the other Redis hangs
            assert healthy.holder("b") is not None and not lease.lost
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        assert lease.release()
    finally:
        stalled.close()


def test_heartbeat_keeps_serving_after_a_poisoned_round(client, prefix):
    locks = RedisLocks(client, prefix=prefix, renew_fraction=0.25)
    good = locks.acquire("good", ttl=0.6, renew=True).lease
    bad = locks.restore("nokey", "tok", ttl=0.6, renew=True)  # never held: found lost
    time.sleep(1.5)
    assert bad.lost and not good.lost and locks.holder("good") is not None
    assert threading.active_count() > 1 and get_heartbeat().alive
    assert good.release()
