"""The exceptions in taskguard.errors survive pickling (and so a Celery result backend's exception
round trip): equal ``args`` and ``str``, rebuilt by ``type(e)(*e.args)``, all TaskguardErrors.
Real errors raised by real operations (an unreachable Redis, a lease lost mid-body) too, and none
of them carries an owner token."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle

import pytest
from hypothesis import given, settings, strategies as st

import taskguard.errors as errors_module
from taskguard import (
    ConfigError,
    IdempotencyConflict,
    LeaseBackendError,
    LeaseLost,
    MemoryLocks,
    RateLimited,
    RedisLocks,
    Skipped,
    TaskguardError,
    TaskSkipped,
    Unreplicated,
)

from .servers import free_port

EXAMPLES = [
    TaskguardError("something went wrong"),
    TaskguardError(),
    ConfigError("ttl must be a finite number of seconds > 0, got 0"),
    LeaseBackendError("acquire", "nightly-report", "ConnectionError: Error 111 connecting to 127.0.0.1:6379."),
    LeaseBackendError("renew", None, "TimeoutError: Timeout reading from socket"),
    Unreplicated("record", "beat-leader:default", "lease record 'slot:e' acknowledged by 0 of the 1 replicas"),
    LeaseLost("nightly-report", "renewal found another owner or no lease"),
    LeaseLost("nightly-report"),
    TaskSkipped("nightly-report", "held", "reports.nightly", 12.5),
    TaskSkipped("nightly-report", "wait_timeout"),
    TaskSkipped("k", "retry_exhausted", None, 0.0),
    IdempotencyConflict("charge:inv-7", "billing.charge"),
    IdempotencyConflict("charge:inv-8"),
    RateLimited(30.0),
    RateLimited(1.5, "openai"),
]


def _pickle_round_trip(e: BaseException, protocol: int) -> BaseException:
    return pickle.loads(pickle.dumps(e, protocol=protocol))


def test_the_module_exports_exactly_these_exceptions():
    """A new exception class must be added to EXAMPLES (and so to these round-trip tests)."""
    classes = {
        name
        for name, obj in inspect.getmembers(errors_module, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors_module.__name__
    }
    assert classes == set(errors_module.__all__) == {type(e).__name__ for e in EXAMPLES}


@pytest.mark.parametrize("e", EXAMPLES, ids=repr)
@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickle_round_trip_keeps_type_args_and_message(e, protocol):
    back = _pickle_round_trip(e, protocol)
    assert type(back) is type(e)
    assert back.args == e.args
    assert str(back) == str(e)
    assert repr(back) == repr(e)


@pytest.mark.parametrize("e", EXAMPLES, ids=repr)
def test_rebuilds_from_its_args_and_copies(e):
    rebuilt = type(e)(*e.args)
    assert type(rebuilt) is type(e) and rebuilt.args == e.args and str(rebuilt) == str(e)
    for c in (copy.copy(e), copy.deepcopy(e)):
        assert type(c) is type(e) and c.args == e.args and str(c) == str(e)


@pytest.mark.parametrize("e", EXAMPLES, ids=repr)
def test_every_error_is_a_taskguard_error(e):
    assert isinstance(e, TaskguardError) and isinstance(e, Exception)
    with pytest.raises(TaskguardError):
        raise e


def test_config_error_is_also_a_value_error():
    assert issubclass(ConfigError, ValueError)
    assert not issubclass(LeaseBackendError, ValueError)  # never mistaken for a bad argument


def test_attributes_follow_args():
    e = LeaseBackendError("claim", "k1", "ResponseError: boom")
    assert (e.operation, e.key) == ("claim", "k1")
    assert str(e) == "Redis failed during claim of lease 'k1': ResponseError: boom"
    assert str(LeaseBackendError("renew", None, "x")) == "Redis failed during renew: x"
    lost = LeaseLost("k2", "expired without renewal")
    assert (lost.key, lost.reason) == ("k2", "expired without renewal")
    assert str(lost) == "lease 'k2' lost: expired without renewal"
    assert LeaseLost("k3").reason == "lease no longer held"
    skipped = TaskSkipped("k4", "held", "app.task", 3.25)
    assert (skipped.key, skipped.reason) == ("k4", "held")
    assert str(skipped) == "app.task skipped: lease 'k4' held, holder's lease has 3.2s left"
    assert str(TaskSkipped("k5", "wait_timeout")) == "skipped: lease 'k5' wait_timeout"


@pytest.mark.parametrize(
    "args",
    [
        ("k", "held", "t.name", 1.5),
        ("k", "wait_timeout", None, None),
        ("k", "retry_exhausted", "t", 0.0),
        ("k", "coalesced", "t", None, "id-of-the-follow-up"),
    ],
)
def test_task_skipped_gives_an_equal_valued_skipped(args):
    e = TaskSkipped(*args)
    assert len(e.args) == len(args)  # four values unless a follow-up is named, as earlier releases stored it
    for err in (e, _pickle_round_trip(e, pickle.HIGHEST_PROTOCOL)):
        s = err.skipped
        assert isinstance(s, Skipped)
        assert (s.key, s.reason, s.task, s.holder_ttl, s.follow_up) == (*args, None)[:5]
        assert not s  # a Skipped is falsy
        fields = {f.name for f in dataclasses.fields(Skipped)}
        assert fields - {"key", "reason", "task", "holder_ttl", "follow_up"} == {"at"}


# -- property: any plain values survive ----------------------------------------------------------

text = st.text(max_size=40)
maybe_text = st.none() | text
maybe_ttl = st.none() | st.floats(0, 1e6, allow_nan=False)

ERROR_STRATEGIES = st.one_of(
    st.builds(TaskguardError, text),
    st.builds(ConfigError, text),
    st.builds(
        LeaseBackendError,
        st.sampled_from(["acquire", "renew", "release", "claim", "holder", "health"]),
        maybe_text,
        text,
    ),
    st.builds(LeaseLost, text, text),
    st.builds(TaskSkipped, text, text, maybe_text, maybe_ttl),
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(ERROR_STRATEGIES)
def test_property_any_values_round_trip(e):
    back = _pickle_round_trip(e, pickle.HIGHEST_PROTOCOL)
    assert type(back) is type(e) and back.args == e.args and str(back) == str(e)
    rebuilt = type(e)(*e.args)
    assert rebuilt.args == e.args and str(rebuilt) == str(e)


# -- real errors from real operations ---------------------------------------------------------------


def test_a_real_backend_error_round_trips_without_its_redis_cause():
    port = free_port()  # nothing listens there
    locks = RedisLocks.from_url(f"redis://127.0.0.1:{port}/0", connect_timeout=0.5, socket_timeout=0.5, retries=0)
    try:
        with pytest.raises(LeaseBackendError) as info:
            locks.acquire("unreachable", ttl=5)
    finally:
        locks.close()
    e = info.value
    assert e.operation == "acquire" and e.key == "unreachable"
    assert e.__cause__ is not None  # the redis-py error, kept locally
    back = _pickle_round_trip(e, pickle.HIGHEST_PROTOCOL)
    assert type(back) is LeaseBackendError and back.args == e.args and str(back) == str(e)
    assert back.__cause__ is None  # documented: the cause does not survive pickling
    assert "Connection" in str(back)


def test_a_real_lease_lost_round_trips_and_carries_no_owner_token(redis_url, prefix):
    import redis

    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix)
    tokens = []

    def body(lease):
        tokens.append(lease.owner_token)
        client.delete("{" + prefix + ":job}")  # the lease vanishes mid-body (evicted, flushed...)
        taken = locks.acquire("job", ttl=5).lease  # ... and another owner takes it
        tokens.append(taken.owner_token)
        return "value"

    try:
        with pytest.raises(LeaseLost) as info:
            locks.with_lease("job", body, ttl=5, renew=False)
    finally:
        locks.close()
        client.close()
    e = info.value
    assert e.key == "job"
    back = _pickle_round_trip(e, pickle.HIGHEST_PROTOCOL)
    assert type(back) is LeaseLost and back.args == e.args and str(back) == str(e)
    dumped = pickle.dumps(e)
    for token in tokens:
        assert token not in str(e) and token not in repr(e.args)
        assert token.encode() not in dumped


def test_a_real_config_error_round_trips():
    with pytest.raises(ConfigError) as info:
        MemoryLocks().acquire("k", ttl=-1)
    back = _pickle_round_trip(info.value, pickle.HIGHEST_PROTOCOL)
    assert type(back) is ConfigError and back.args == info.value.args and "ttl" in str(back)
