"""The backend beneath the policies: both implementations speak the protocol, with typed replies,
and a failing Redis surfaces as LeaseBackendError from the one conversion in the Redis backend."""

from __future__ import annotations

import inspect
import socket

import pytest
import redis

from taskguard import LeaseBackendError, MemoryLocks, RedisLocks
from taskguard.backend import (
    AcquireReply,
    AcquireRequest,
    AcquireStatus,
    Backend,
    ClaimReply,
    ClaimRequest,
    LeaseWrite,
    QueueReply,
    RateReply,
    RateVerdict,
    RecordCondition,
)
from taskguard.memory_backend import MemoryBackend
from taskguard.redis_backend import RedisBackend
from taskguard.redis_client import client_from_url

PROTOCOL_METHODS = sorted(n for n, f in vars(Backend).items() if callable(f) and not n.startswith("_"))


@pytest.mark.parametrize("impl", [RedisBackend, MemoryBackend])
def test_each_backend_implements_every_protocol_method_with_its_parameters(impl):
    assert len(PROTOCOL_METHODS) >= 20
    for name in PROTOCOL_METHODS:
        want = list(inspect.signature(getattr(Backend, name)).parameters)
        got = list(inspect.signature(getattr(impl, name)).parameters)
        assert got == want, (impl.__name__, name)


@pytest.fixture(params=["redis", "memory"])
def backend(request, redis_url, prefix):
    if request.param == "memory":
        yield MemoryLocks(prefix=prefix).backend
    else:
        locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
        yield locks.backend
        locks.client.close()


def test_replies_are_typed_values(backend):
    first = backend.acquire(AcquireRequest("k", "owner-1", 5.0, "{}", run_id="r1"), 0.0)
    assert isinstance(first, AcquireReply) and first.status is AcquireStatus.ACQUIRED
    assert isinstance(first.fencing_token, int) and first.slot == 0
    held = backend.acquire(AcquireRequest("k", "owner-2", 5.0, "{}"), 0.0)
    assert held.status is AcquireStatus.HELD and held.holder_run == "r1" and 0 < held.holder_ttl <= 5.0
    assert held.fencing_token is None

    claimed = backend.claim(ClaimRequest("k", "owner-1", "owner-3", 5.0, "{}", "r1"))
    assert isinstance(claimed, ClaimReply) and claimed.claimed and claimed.fencing_token == first.fencing_token
    stale = backend.claim(ClaimRequest("k", "owner-1", "owner-4", 5.0, "{}"))
    assert not stale.claimed and not stale.expired and 0 < stale.holder_ttl <= 5.0
    assert backend.put_lease_record("k", "owner-3", "n", "v", RecordCondition.ANY, "") is LeaseWrite.WRITTEN
    assert backend.put_lease_record("k", "owner-3", "n", "w", RecordCondition.ABSENT, "") is LeaseWrite.REFUSED
    assert backend.put_lease_record("k", "owner-1", "n", "w", RecordCondition.ANY, "") is LeaseWrite.NOT_HELD
    assert backend.release("k", "owner-3", "r1")
    assert (
        backend.acquire(AcquireRequest("k", "o5", 5.0, "{}", "r1", refuse_finished=True), 0.0).status
        is AcquireStatus.FINISHED
    )
    gone = backend.claim(ClaimRequest("k", "owner-3", "owner-6", 5.0, "{}"))
    assert not gone.claimed and gone.expired and gone.holder_ttl is None

    mark = backend.mark_queued("q", "run-1", 5.0, "t")
    assert isinstance(mark, QueueReply) and mark == (True, "run-1")
    assert backend.mark_queued("q", "run-2", 5.0, "t") == QueueReply(False, "run-1")

    rates = [backend.throttle("r", 1_000_000, 0, 0, True, False) for _ in range(2)]
    assert all(isinstance(r, RateReply) for r in rates)
    assert [r.verdict for r in rates] == [RateVerdict.ALLOWED, RateVerdict.DENIED] and rates[1].wait_us > 0
    assert backend.throttle("r", 1_000_000, 0, 5_000_000, True, False).verdict is RateVerdict.BOOKED


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_redis_is_a_lease_backend_error_on_every_path(prefix):
    backend = RedisLocks(
        client_from_url(f"redis://127.0.0.1:{_closed_port()}/0", connect_timeout=0.2, socket_timeout=0.2, retries=0),
        prefix=prefix,
    ).backend
    calls = [
        lambda: backend.acquire(AcquireRequest("k", "o", 5.0, "{}"), 0.0),
        lambda: backend.wait_signal("k", 0.05),
        lambda: backend.renew("k", "o", 5.0),
        lambda: backend.release("k", "o"),
        lambda: backend.claim(ClaimRequest("k", "o", "p", 5.0, "{}")),
        lambda: backend.holders("k"),
        lambda: backend.get_record("k", "n"),
        lambda: backend.count_record("k", "n", 1, None),
        lambda: backend.get_lease_record("k", "n"),
        lambda: backend.get_completion("k"),
        lambda: backend.mark_queued("k", "r", 5.0, "t"),
        lambda: backend.throttle("k", 1000, 0, 0, True, False),
        lambda: backend.server_time(),
        lambda: backend.scan_holders("*", 10),
    ]
    for call in calls:
        with pytest.raises(LeaseBackendError) as info:
            call()
        assert isinstance(info.value.__cause__, redis.RedisError)
    outcomes = backend.renew_many([("k", "o", 5.0), ("j", "o", 5.0)])
    assert len(outcomes) == 2 and all(isinstance(o, LeaseBackendError) for o in outcomes)
    assert not backend.check_health()


def test_a_client_from_a_url_takes_db_over_the_urls_own(redis_url):
    client = client_from_url("redis://:s3cret@127.0.0.1:6379/1", db=3)
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["db"] == 3 and kwargs["password"] == "s3cret" and kwargs["socket_timeout"] == 5.0
