"""A run's handle kept by run id and the settlement of a dead execution's lease
(:mod:`taskguard.handle_records`), against Redis (standalone and Cluster) and MemoryLocks: every
way :func:`settle_dead` can find a run — a running handle whose process died or lives, a retry's
kept handle, no handle (died before saving it), a stale handle of another lease — and the
supervisor's release by run id (Celery's main process, RQ's worker)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from taskguard import handle_records
from taskguard.handle_records import Settled, release_run, settle_dead
from taskguard.handoff import handle_of, release_handle
from taskguard.liveness import process_identity
from taskguard.run import GuardedRun, RunRequest

WHERE = "rq-job:j1"


@pytest.fixture(scope="module")
def dead_pid() -> int:
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(out.stdout)


def held(locks, key, holder, run_id="j1", total=None):
    lease = locks.acquire(key, ttl=30, run_id=run_id, holder=holder).lease
    if total is not None:
        lease.total = locks.acquire(total, ttl=30, run_id=run_id, holder=holder).lease
    return lease


def keys(*k):
    return lambda: list(k)


def test_a_dead_executions_running_handle_is_kept_for_its_retry_with_the_same_fence(any_locks, dead_pid):
    lk = any_locks
    lease = held(lk, "k", {**process_identity(), "pid": dead_pid}, total="all")
    handle_records.save(lk, WHERE, {**handle_of(lease), "running": True}, ttl=30)
    dead = settle_dead(lk, WHERE, "j1", ttl=10, retry_in=50, lease_keys=keys("k", "all"))
    assert (dead.how, dead.key, dead.seconds) == (Settled.KEPT, "k", 60)
    kept = handle_records.load(lk, WHERE)
    assert kept["running"] is False and kept["fence"] == lease.fencing_token
    assert kept["total"]["fence"] == lease.total.fencing_token
    assert 50 < lk.holders("k")[0].ttl <= 60 and 50 < lk.holders("all")[0].ttl <= 60  # stretched, both


def test_without_a_retry_the_lease_and_its_place_in_the_total_are_released_and_the_handle_dropped(any_locks, dead_pid):
    lk = any_locks
    lease = held(lk, "k", {**process_identity(), "pid": dead_pid}, total="all")
    handle_records.save(lk, WHERE, {**handle_of(lease), "running": True}, ttl=30)
    dead = settle_dead(lk, WHERE, "j1", ttl=10, retry_in=None, lease_keys=keys("k", "all"))
    assert (dead.how, dead.key, dead.unsaved) == (Settled.RELEASED, "k", False)
    assert lk.holders("k") == [] and lk.holders("all") == [] and handle_records.load(lk, WHERE) is None


def test_a_running_handle_whose_holder_process_lives_is_left_to_it(any_locks):
    """The process that died is not the holder (a worker killed while its work-horse runs on):
    neither kept nor released; the holder is named (host, pid), never its owner token."""
    lk = any_locks
    lease = held(lk, "k", process_identity())  # this process: alive
    handle_records.save(lk, WHERE, {**handle_of(lease), "running": True}, ttl=30)
    for retry_in in (None, 5.0):
        dead = settle_dead(lk, WHERE, "j1", ttl=10, retry_in=retry_in, lease_keys=keys("k"))
        assert dead.how == Settled.HELD and dead.holder["pid"] == process_identity()["pid"]
        assert lease.owner_token not in repr(dead)
    assert lk.holders("k")[0].fencing_token == lease.fencing_token and handle_records.load(lk, WHERE)["running"]


def test_a_retrys_kept_handle_is_settled_whoever_died(any_locks):
    """A kept handle (``running`` false) names no live execution: a cancelled or stopped job's
    kept lease is released even though the process that kept it lives (it moved on)."""
    lk = any_locks
    lease = held(lk, "k", process_identity())
    handle_records.save(lk, WHERE, {**handle_of(lease), "running": False}, ttl=30)
    assert settle_dead(lk, WHERE, "j1", ttl=10, retry_in=None, lease_keys=keys("k")).how == Settled.RELEASED
    assert lk.holders("k") == []


def test_no_handle_releases_by_run_id_only_a_lease_whose_holder_is_dead(any_locks, dead_pid):
    """Died in the round trip between taking its lease and saving its handle: its leases (key and
    place in the total) are found by run id and released only when their holder is dead — never
    a live execution's of the same run id, never another run's."""
    lk = any_locks
    held(lk, "k", {**process_identity(), "pid": dead_pid}, total="all")
    other = held(lk, "k2", {**process_identity(), "pid": dead_pid}, run_id="j2")
    live = held(lk, "k3", process_identity())
    dead = settle_dead(lk, WHERE, "j1", ttl=10, retry_in=5, lease_keys=keys("k", "all"))
    assert (dead.how, dead.key, dead.unsaved) == (Settled.RELEASED, "k", True)  # (nothing to keep: no handle)
    assert lk.holders("k") == [] and lk.holders("all") == []
    assert settle_dead(lk, WHERE, "j2", ttl=10, retry_in=None, lease_keys=keys("k")).how == Settled.NONE
    assert lk.holders("k2")[0].fencing_token == other.fencing_token
    assert settle_dead(lk, WHERE, "j1", ttl=10, retry_in=None, lease_keys=keys("k3")).how == Settled.NONE
    assert lk.holders("k3")[0].fencing_token == live.fencing_token


def test_a_stale_handle_of_another_lease_falls_back_to_the_run_ids_dead_lease(any_locks, dead_pid):
    """The stored handle is a retry's kept lease that a later execution claimed (a new owner token)
    and then died before saving its own: releasing the handle releases nothing; the dead
    execution's lease, found by run id, is released instead."""
    lk = any_locks
    earlier = held(lk, "k", process_identity())
    stale = {**handle_of(earlier), "running": False}
    assert earlier.release()
    later = held(lk, "k", {**process_identity(), "pid": dead_pid})
    handle_records.save(lk, WHERE, stale, ttl=30)
    dead = settle_dead(lk, WHERE, "j1", ttl=10, retry_in=None, lease_keys=keys("k"))
    assert (dead.how, dead.unsaved) == (Settled.RELEASED, True) and later.fencing_token
    assert lk.holders("k") == [] and handle_records.load(lk, WHERE) is None


def test_release_run_releases_by_run_id_and_dead_only_spares_live_holders(any_locks, dead_pid):
    lk = any_locks
    held(lk, "a", process_identity(), run_id="r")
    held(lk, "t", process_identity(), run_id="r")
    assert release_run(lk, "r", ["a", "t"]) is True  # a supervisor that knows the run is over
    assert lk.holders("a") == [] and lk.holders("t") == []
    assert release_run(lk, "r", ["a"]) is False  # nothing held
    held(lk, "a", process_identity(), run_id="r")
    assert release_run(lk, "r", ["a"], dead_only=True) is False and lk.holders("a")
    lk.release_run("a", "r")
    held(lk, "a", {**process_identity(), "pid": dead_pid}, run_id="r")
    assert release_run(lk, "r", ["a"], dead_only=True) is True and lk.holders("a") == []


def test_while_running_keeps_a_running_handle_and_drops_it_unless_kept_for_a_retry(any_locks):
    lk = any_locks

    def run_of():
        run = GuardedRun(lk, RunRequest(key="k", ttl=10, run_id="j1"))
        assert run.begin()
        return run

    run = run_of()
    with handle_records.while_running(lk, WHERE, run, ttl=30):
        assert handle_records.load(lk, WHERE)["running"] is True
        run.finish()
    assert handle_records.load(lk, WHERE) is None  # finished: dropped
    run = run_of()
    with handle_records.while_running(lk, WHERE, run, ttl=30):
        assert handle_records.keep_for_retry(lk, WHERE, run, 5.0) is True
    kept = handle_records.load(lk, WHERE)
    assert kept["running"] is False and kept["fence"] == run.lease.fencing_token  # the retry's, kept
    handle_records.drop(lk, WHERE)
    assert release_handle(lk, kept)
    run = run_of()
    with handle_records.while_running(lk, None, run, ttl=30):  # a direct call: nothing kept
        assert handle_records.load(lk, WHERE) is None
        run.finish()
    run = run_of()
    assert handle_records.keep_for_retry(lk, WHERE, run, None) is False and lk.holders("k") == []  # failed
    # durations a framework accepts past the longest TTL (RQ: job_timeout=10**9, Retry(interval=10**9)):
    # the record and the kept lease last the longest TTL instead of failing the job with a ttl error
    run = run_of()
    with handle_records.while_running(lk, WHERE, run, ttl=10**9 + 60):
        assert handle_records.load(lk, WHERE)["running"] is True
        assert handle_records.keep_for_retry(lk, WHERE, run, 10**9) is True
    assert lk.holders("k")[0].ttl > 10**8 and handle_records.load(lk, WHERE)["running"] is False
    handle_records.drop(lk, WHERE)
    assert release_handle(lk, handle_of(run.lease))


def test_a_malformed_record_is_ignored_and_logged_without_its_content(any_locks, caplog):
    any_locks.put_record(WHERE, "handle", '{"key": "k", "owner": "secret-owner-token", "fence": "1"}', ttl=30)
    assert handle_records.load(any_locks, WHERE) is None
    assert "ignoring its stored lease handle" in caplog.text and "secret-owner-token" not in caplog.text


def test_release_run_by_execution_finds_a_lease_named_by_another_run_id(any_locks):
    """Celery's main process knows the execution's task id; a beat slot's run is named by its slot
    (shared by every message of the slot): the lease is found by the holder metadata's task id, and
    only that execution's, by its fencing token."""
    lk = any_locks
    held(lk, "k", {"task_id": "other"}, run_id="beat:e:s1")
    assert release_run(lk, "t-1", ["k"], execution={"task_id": "t-1"}) is False and lk.holders("k")
    lk.release_run("k", "beat:e:s1")
    held(lk, "k", {"task_id": "t-1"}, run_id="beat:e:s1", total="all")
    assert release_run(lk, "t-1", ["k", "all"], execution={"task_id": "t-1"}) is True
    assert lk.holders("k") == [] and lk.holders("all") == []


def test_settling_never_drops_a_handle_a_later_execution_saved_meanwhile(any_locks, dead_pid, monkeypatch):
    """Between reading the dead execution's handle and dropping it, a later execution of the same
    run id (a retry on another worker) saves its own running handle: that one stays (the drop is
    conditional on the record read)."""
    lk = any_locks
    lease = held(lk, "k", {**process_identity(), "pid": dead_pid})
    handle_records.save(lk, WHERE, {**handle_of(lease), "running": True}, ttl=30)
    later = {**handle_of(lease), "owner": "a-later-execution", "running": True}
    restore = handle_records.restore_handle

    def meanwhile(locks, handle, ttl):
        handle_records.save(lk, WHERE, later, ttl=30)
        return restore(locks, handle, ttl=ttl)

    monkeypatch.setattr(handle_records, "restore_handle", meanwhile)
    assert settle_dead(lk, WHERE, "j1", ttl=10, retry_in=None, lease_keys=keys("k")).how == Settled.RELEASED
    assert handle_records.load(lk, WHERE)["owner"] == "a-later-execution"


def test_release_when_dead_waits_for_the_holder_process_to_end(any_locks, dead_pid):
    """A supervisor that has just signalled an execution (Celery's revoke with terminate, a hard
    time limit) releases its leases once its process is dead: at once when it is, else when it
    dies (a watcher thread), never while it runs; and not at all when the execution released them
    itself meanwhile (a child that survived the signal and ended its body)."""
    import time

    lk = any_locks
    ident = {k: v for k, v in process_identity().items() if k != "pid"}

    def wait(pred, timeout=3.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end and not pred():
            time.sleep(0.02)
        return pred()

    held(lk, "k", {"task_id": "t-1", "pid": dead_pid}, run_id="t-1", total="all")
    assert handle_records.release_when_dead(lk, "t-1", ["k", "all"], execution={"task_id": "t-1", **ident}) is True
    assert lk.holders("k") == [] and lk.holders("all") == []

    released = []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        held(lk, "k", {"task_id": "t-2", "pid": child.pid}, run_id="t-2", total="all")
        execution = {"task_id": "t-2", "pid": child.pid, **ident}
        assert (
            handle_records.release_when_dead(lk, "t-2", ["k", "all"], execution=execution, on_release=released.append)
            is False
        )
        time.sleep(0.5)
        assert lk.holders("k") and lk.holders("all") and released == []  # its process runs: kept
        child.kill()
        child.wait()
        assert wait(lambda: lk.holders("k") == [] and lk.holders("all") == [])
        assert wait(lambda: released == ["k"])
    finally:
        child.kill()
        child.wait()

    # the execution releases its lease itself while watched; a later run takes the key: never released
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lease = lk.acquire("k", ttl=30, run_id="t-3", holder={"task_id": "t-3", "pid": child.pid}).lease
        execution = {"task_id": "t-3", "pid": child.pid, **ident}
        assert handle_records.release_when_dead(lk, "t-3", ["k"], execution=execution) is False
        lease.release()
        later = lk.acquire("k", ttl=30, run_id="t-3", holder={"task_id": "t-3", "pid": child.pid}).lease
        child.kill()
        child.wait()
        time.sleep(1.0)
        assert [i.fencing_token for i in lk.holders("k")] == [later.fencing_token]  # fenced: not the later lease
        later.release()
    finally:
        child.kill()
        child.wait()
