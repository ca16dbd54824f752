"""An acquisition clears the run's publish-time queued mark in the same atomic step
(``Locks.acquire(queued_mark=(task, run_id))``, the ACQUIRE script's optional arguments), on Redis,
Redis Cluster and MemoryLocks: a worker that dies right after taking its lease cannot leave its
run marked as queued, which would suppress every publish of the key until the mark's TTL."""

from __future__ import annotations

import pytest

from taskguard import ConfigError


def test_the_acquisition_of_the_marked_run_deletes_its_mark(any_locks):
    locks = any_locks
    assert locks.mark_queued("k", "r1", ttl=60, task="t") == (True, "r1")
    acq = locks.acquire("k", ttl=10, run_id="r1", queued_mark=("t", "r1"))
    assert acq.acquired
    # no mark left: a publish now finds only the running holder, and none once it is released
    assert locks.mark_queued("k", "r2", ttl=60, task="t") == (True, "r2")
    assert locks.clear_queued("k", "r2", "t")
    acq.lease.release()
    assert locks.mark_queued("k", "r3", ttl=60, task="t") == (True, "r3")


def test_a_refused_acquisition_and_another_runs_mark_are_left_alone(any_locks):
    locks = any_locks
    held = locks.acquire("k", ttl=10).lease
    assert locks.mark_queued("k", "r1", ttl=60, task="t").marked
    assert not locks.acquire("k", ttl=10, run_id="r1", queued_mark=("t", "r1")).acquired
    assert locks.mark_queued("k", "r2", ttl=60, task="t") == (False, "r1")  # still queued
    held.release()
    # the lease taken by another run (or for another task's mark) does not clear r1's mark
    other = locks.acquire("k", ttl=10, run_id="r9", queued_mark=("t", "r9"))
    assert other.acquired
    assert locks.mark_queued("k", "r2", ttl=60, task="t") == (False, "r1")
    other.lease.release()
    assert locks.acquire("k", ttl=10, run_id="r1", queued_mark=("u", "r1")).acquired
    assert locks.mark_queued("k", "r2", ttl=60, task="t") == (False, "r1")


def test_a_holder_under_a_limit_clears_its_mark_too(any_locks):
    locks = any_locks
    first = locks.acquire("k", ttl=10, limit=3).lease
    assert locks.mark_queued("k", "r1", ttl=60, task="t").marked
    acq = locks.acquire("k", ttl=10, limit=3, run_id="r1", queued_mark=("t", "r1"))
    assert acq.acquired and acq.lease.slot == 1
    assert locks.mark_queued("k", "r2", ttl=60, task="t") == (True, "r2")
    acq.lease.release()
    first.release()


@pytest.mark.parametrize("bad", ["t", ("t",), ("", "r"), ("t", ""), ("t", 5), ["t", "r"]])
def test_a_malformed_queued_mark_is_a_config_error(any_locks, bad):
    with pytest.raises(ConfigError, match="queued_mark"):
        any_locks.acquire("k", ttl=10, run_id="r", queued_mark=bad)
    assert any_locks.holder("k") is None  # nothing was taken
