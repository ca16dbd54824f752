"""The records API (put/get/delete/count under a lease key's hash tag): the same answers from Redis
(standalone and Cluster) and from MemoryLocks, conditions checked atomically, TTLs kept."""

from __future__ import annotations

import time

import pytest
import redis

from taskguard import ConfigError, RedisLocks


def test_conditions(any_locks):
    lk = any_locks
    assert lk.put_record("k", "r", "a", ttl=5, if_absent=True)
    assert not lk.put_record("k", "r", "b", ttl=5, if_absent=True)  # a record exists
    assert not lk.put_record("k", "r", "a", ttl=5, if_absent=True)  # even with the same value
    assert not lk.put_record("k", "r", "b", ttl=5, if_value="x")  # it does not hold "x"
    assert lk.put_record("k", "r", "b", ttl=5, if_value="a")  # compare and swap
    assert lk.put_record("k", "r", "c", ttl=5, if_absent=True, if_value="b")  # absent or "b"
    assert lk.get_record("k", "r") == "c"
    assert not lk.delete_record("k", "r", if_value="b")
    assert lk.delete_record("k", "r", if_value="c")
    assert lk.get_record("k", "r") is None
    assert lk.put_record("k", "r", "d", ttl=5, if_absent=True, if_value="zz")  # absent now
    assert lk.put_record("k", "r", "e", ttl=5)  # unconditional
    assert lk.delete_record("k", "r") and not lk.delete_record("k", "r")


def test_ttls_and_counters(any_locks):
    lk = any_locks
    lk.put_record("t", "r", "v", ttl=0.2)
    assert lk.count_record("t", "n") == 1 and lk.count_record("t", "n", by=4, ttl=0.2) == 5
    time.sleep(0.35)
    assert lk.get_record("t", "r") is None and lk.count_record("t", "n") == 1  # both expired


def test_bad_arguments_are_config_errors(any_locks):
    with pytest.raises(ConfigError, match="record name"):
        any_locks.put_record("k", "", "v", ttl=5)
    with pytest.raises(ConfigError, match="record value"):
        any_locks.put_record("k", "r", 5, ttl=5)
    with pytest.raises(ConfigError, match="ttl"):
        any_locks.put_record("k", "r", "v", ttl=0)
    with pytest.raises(ConfigError, match="by must be an int"):
        any_locks.count_record("k", "n", by=1.5)


def test_counting_a_text_record_is_a_usage_error_not_an_outage(any_locks):
    """count_record on a record put_record wrote (text), or past the 64-bit range, is a
    ConfigError naming the record, never a LeaseBackendError (which reads as Redis being down);
    the record is left as it was."""
    any_locks.put_record("k", "txt", "hello", ttl=5)
    with pytest.raises(ConfigError, match="record 'txt' of key 'k' does not hold an integer"):
        any_locks.count_record("k", "txt", ttl=5)
    assert any_locks.get_record("k", "txt") == "hello"
    any_locks.count_record("k", "big", by=2**63 - 1, ttl=5)
    with pytest.raises(ConfigError, match="record 'big'"):
        any_locks.count_record("k", "big")
    assert any_locks.count_record("k", "big", by=-1) == 2**63 - 2


def test_lease_records_are_written_only_by_the_holder(any_locks):
    """A lease record is fenced by its lease: the holder writes it (conditions as for records), a
    handle whose lease expired or was taken over cannot, and the record outlives releases."""
    from taskguard import LeaseLost

    lk = any_locks
    first = lk.acquire("L", ttl=0.3).lease
    assert lk.get_lease_record("L", "slot") is None
    assert first.put_record("slot", "a", if_absent=True)
    assert first.put_record("slot", "a", if_absent=True)  # already holds it: a retried call
    assert not first.put_record("slot", "b", if_absent=True)
    assert not first.put_record("slot", "b", if_value="x")
    assert first.put_record("slot", "b", if_value="a")
    time.sleep(0.45)  # first's lease expires
    second = lk.acquire("L", ttl=5).lease
    assert second.fencing_token > first.fencing_token
    with pytest.raises(LeaseLost):
        first.put_record("slot", "stale")  # the old holder cannot write any more
    assert first.lost
    assert lk.get_lease_record("L", "slot") == "b"
    assert second.put_record("slot", "c", if_value="b")
    assert second.release()
    with pytest.raises(LeaseLost):
        second.put_record("slot", "after-release")
    assert lk.get_lease_record("L", "slot") == "c"  # kept across leases, like the fence
    third = lk.acquire("L", ttl=5).lease
    assert third.put_record("slot", "d", if_value="c") and third.release()
    with pytest.raises(ConfigError):
        lk.get_lease_record("L", "")


def test_lease_records_and_the_fence_outlive_a_lease_held_past_the_idle_ttl(redis_url, prefix):
    """A lease renewed for longer than ``fence_idle_ttl`` whose holder then dies: its key (fence and
    lease records) lives on for the idle TTL, not only the lease's TTL. Before, renewals kept the
    key alive just as long as the lease, so it vanished with it (and beat, finding no slot
    record, published the slot again)."""
    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix, fence_idle_ttl=3)
    lease = locks.acquire("long", ttl=1).lease
    assert lease.put_record("slot", "published")
    deadline = time.monotonic() + 4.5
    while time.monotonic() < deadline:  # held past the 3 s idle TTL by renewals
        assert lease.renew()
        time.sleep(0.3)
    fence = lease.fencing_token
    time.sleep(1.5)  # the holder died: nobody renews; the lease is gone
    assert locks.holder("long") is None
    assert locks.get_lease_record("long", "slot") == "published"
    assert locks.acquire("long", ttl=5).lease.fencing_token > fence
    client.close()


def test_force_release_on_every_backend(any_locks):
    held = any_locks.acquire("f", ttl=30).lease
    assert any_locks.force_release("f") is True and any_locks.holder("f") is None
    assert any_locks.force_release("f") is False
    assert held.release() is False and held.lost
    with pytest.raises(ConfigError):
        any_locks.force_release("")
