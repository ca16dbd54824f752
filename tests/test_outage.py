"""Redis unreachable: a suite-owned redis-server (with persistence) stopped and restarted."""

from __future__ import annotations

import time

import pytest

from taskguard import LeaseBackendError, RedisLocks, Skipped
from taskguard.heartbeat import get_heartbeat

from .servers import free_port


def test_acquire_on_unreachable_redis_raises_backend_error_quickly():
    locks = RedisLocks.from_url(
        f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.5, socket_timeout=0.5, retries=1
    )
    started = time.monotonic()
    with pytest.raises(LeaseBackendError) as err:
        locks.acquire("k", ttl=5)
    assert time.monotonic() - started < 2.0
    assert err.value.operation == "acquire"
    assert "ConnectionError" in str(err.value)
    with pytest.raises(LeaseBackendError):
        locks.with_lease("k", lambda lease: "never", ttl=5)  # never a Skipped
    health = locks.check_health()
    assert not health.ok and "ConnectionError" in health.detail


def test_redis_stopped_mid_lease_then_back(redis_server):
    events = []
    locks = RedisLocks.from_url(
        redis_server.url,
        connect_timeout=0.3,
        socket_timeout=0.3,
        retries=0,
        renew_fraction=0.2,
        listeners=[events.append],
    )
    lease = locks.acquire("held", ttl=4, renew=True).lease
    assert locks.check_health().ok

    redis_server.stop()
    started = time.monotonic()
    with pytest.raises(LeaseBackendError):
        locks.acquire("other", ttl=5)
    assert time.monotonic() - started < 1.5  # bounded by the client's timeouts, no hang
    assert not locks.check_health().ok
    time.sleep(1.2)  # renewals fail meanwhile
    assert any(e.kind == "renew" and e.status == "error" for e in events)
    assert get_heartbeat().alive
    assert not lease.lost  # its TTL has not run out: still presumed held

    redis_server.start()  # same port and directory: the AOF brings the lease back
    time.sleep(1.5)
    assert get_heartbeat().alive
    assert not lease.lost
    assert any(e.kind == "renew" and e.status == "renewed" and e.at > started + 1.2 for e in events)
    info = locks.holder("held")
    assert info is not None and info.fencing_token == lease.fencing_token and info.ttl > 2
    assert locks.check_health().ok
    other = locks.acquire("other", ttl=5)
    assert other.acquired
    assert other.lease.release() and lease.release()
    locks.close()


def test_lease_presumed_lost_when_outage_outlasts_ttl(redis_server):
    locks = RedisLocks.from_url(
        redis_server.url, connect_timeout=0.2, socket_timeout=0.2, retries=0, renew_fraction=0.25
    )
    lost = []
    lease = locks.acquire("short", ttl=0.8, renew=True).lease
    lease.on_lost(lambda lease, reason: lost.append(reason))
    redis_server.stop()
    time.sleep(1.5)
    assert lease.lost and lost and "expired" in lost[0]
    redis_server.start()
    fresh = locks.acquire("short", ttl=5)
    assert fresh.acquired and fresh.lease.fencing_token > lease.fencing_token
    fresh.lease.release()
    locks.close()


def test_body_exception_wins_over_redis_outage(redis_server):
    locks = RedisLocks.from_url(redis_server.url, connect_timeout=0.2, socket_timeout=0.2, retries=0)

    class Boom(Exception):
        pass

    def body(lease):
        redis_server.stop()
        raise Boom("the body's own error")

    with pytest.raises(Boom):
        locks.with_lease("k", body, ttl=5)
    redis_server.start()
    out = locks.with_lease("k", lambda lease: "ok", ttl=5)
    # the AOF kept the lease of the failed run (its release could not reach Redis): skipped
    # until it expires, never run beside it
    assert isinstance(out, Skipped) and out.reason == "held"
    locks.close()
