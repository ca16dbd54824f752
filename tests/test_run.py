"""GuardedRun, the one lifecycle of a guarded run, against real Redis (standalone and Cluster)."""

from __future__ import annotations

import os
import time

import pytest

from taskguard import LeaseLost, is_skipped
from taskguard.context import current_lease
from taskguard.run import GuardedRun


def run_of(locks, key="k", run_id="run-1", **kw):
    kw.setdefault("ttl", 5.0)
    return GuardedRun(locks, key, run_id=run_id, task="t", **kw)


def test_begin_finish_records_the_run_as_finished(locks):
    run = run_of(locks)
    assert run.begin() and run.state == "running"
    with run:
        assert current_lease() is run.lease
    run.finish()
    assert run.state == "finished" and locks.holder("k") is None
    copy = run_of(locks)
    assert not copy.begin(refuse_finished=True) and copy.reason == "duplicate"  # a redelivered copy
    assert run_of(locks).begin()  # a new publish of the same id runs


def test_hand_back_records_nothing(locks):
    run = run_of(locks)
    assert run.begin()
    run.hand_back()
    assert run.state == "handed_back" and locks.holder("k") is None
    assert run_of(locks).begin(refuse_finished=True)  # its redelivery runs


def test_fail_is_finished_and_finished_ttl_outlives_other_runs(locks):
    run = run_of(locks, finished_ttl=30.0)
    assert run.begin()
    run.fail()
    other = run_of(locks, run_id="run-2")
    assert other.begin()  # another run of the key takes it: the fence record forgets run-1
    other.finish()
    copy = run_of(locks, finished_ttl=30.0)  # a copy of the same task, which keeps markers too
    assert not copy.begin(refuse_finished=True) and copy.reason == "duplicate"  # the marker remembers


def test_held_by_another_run_skips_with_the_holders_ttl(locks):
    holder = run_of(locks, run_id="run-1")
    assert holder.begin()
    other = run_of(locks, run_id="run-2")
    assert not other.begin() and other.reason == "held" and 0 < other.holder_ttl <= 5
    skipped = other.skip()
    assert is_skipped(skipped) and skipped.reason == "held" and skipped.task == "t"
    holder.finish()


def test_same_run_is_reported_or_waited_for(locks):
    first = run_of(locks, ttl=1.0, renew=False)
    assert first.begin()
    second = run_of(locks)
    assert not second.begin() and second.reason == "running"
    third = run_of(locks)
    started = time.monotonic()
    assert third.begin(same_run="wait", same_run_wait=5.0)  # the first is never renewed: it expires
    assert 0.5 < time.monotonic() - started < 3.0
    third.finish()


def test_same_run_wait_is_bounded(locks):
    first = run_of(locks, ttl=2.0)  # renewed by the heartbeat: it stays
    assert first.begin()
    second = run_of(locks)
    started = time.monotonic()
    assert not second.begin(same_run="wait", same_run_wait=0.5) and second.reason == "running"
    assert time.monotonic() - started < 2.0
    first.finish()


def test_same_run_held_by_a_dead_process_is_released_at_once(locks):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    from taskguard.liveness import process_identity

    locks.acquire("k", ttl=30, run_id="run-1", holder={**process_identity(), "pid": pid})
    run = run_of(locks)
    assert run.begin()  # no waiting out the 30 s TTL
    run.finish()


def test_keep_hands_the_lease_to_a_retry_with_the_same_fence(locks):
    run = run_of(locks, renew=True)
    assert run.begin()
    fence = run.lease.fencing_token
    handle = run.keep(10.0)
    assert run.state == "kept" and handle["fence"] == fence
    retry = run_of(locks)
    assert retry.begin(handle=handle, refuse_finished=True) and retry.lease.fencing_token == fence
    twin = run_of(locks)  # a second copy of the same retry message
    assert not twin.begin(handle=handle, refuse_finished=True) and twin.reason == "running"
    retry.finish()
    twin = run_of(locks)
    assert not twin.begin(handle=handle, refuse_finished=True) and twin.reason == "duplicate"


def test_finish_raises_or_warns_when_the_lease_was_lost(locks, caplog):
    reported = []
    run = run_of(locks, on_lost_report=lambda r, reason: reported.append(reason))
    assert run.begin()
    locks.force_release("k")
    with pytest.raises(LeaseLost):
        run.finish()
    assert reported and run.state == "finished"
    run = run_of(locks, on_lost="warn")
    assert run.begin()
    locks.force_release("k")
    run.finish()  # logs, returns
    assert "was lost" in caplog.text


def test_each_end_happens_once(locks):
    run = run_of(locks)
    assert run.begin()
    run.finish()
    run.fail()
    run.hand_back()
    assert run.keep(5.0) is None and run.state == "finished"


def test_a_waiting_copy_never_waits_behind_its_own_run(locks):
    """A redelivered copy with wait > 0 while its own run holds the lease and another run of the
    key waits: it must not queue up behind its own run (and then run it a second time once that
    run finished and the other run passed); it reports "running" at once, for the caller to defer."""
    import threading

    original = run_of(locks, run_id="X")
    assert original.begin()
    other = run_of(locks, run_id="Y", wait=10.0)
    t = threading.Thread(target=lambda: other.begin() and (time.sleep(0.3), other.finish()))
    t.start()
    time.sleep(0.2)
    copy = run_of(locks, run_id="X", wait=10.0)
    started = time.monotonic()
    assert not copy.begin(refuse_finished=True) and copy.reason == "running"
    assert time.monotonic() - started < 1.0
    original.finish()
    t.join()


def test_a_new_delivery_of_a_finished_run_id_is_not_a_duplicate(locks):
    first = run_of(locks, run_id="T", delivery="pub-1")
    assert first.begin()
    first.finish()
    assert not run_of(locks, run_id="T", delivery="pub-1").begin(refuse_finished=True)  # its redelivery
    second = run_of(locks, run_id="T", delivery="pub-2")
    assert second.begin(refuse_finished=True)  # a redelivery of a new publish that never ran: runs
    second.finish()


def test_an_unknown_same_run_mode_is_a_config_error(locks):
    from taskguard import ConfigError

    with pytest.raises(ConfigError, match="same_run"):
        run_of(locks).begin(same_run="ignore")
    assert locks.holder("k") is None


def test_an_error_after_the_lease_is_taken_and_before_the_body_leaves_nothing_held(redis_server):
    """once=True looks at the completion record again once it holds the lease. When that look
    fails (Redis gone: LeaseBackendError) or finds another fingerprint (IdempotencyConflict), the
    body will not run: the lease is handed back (released, or, with Redis gone, no longer renewed
    so its TTL ends it), never kept renewed by the heartbeat for a run that is not running."""
    import redis as redis_py

    from taskguard import IdempotencyConflict, LeaseBackendError, RedisLocks
    from taskguard.once import OncePolicy, encode_record, fingerprint_of

    locks = RedisLocks.from_url(
        redis_server.url, prefix="tgtest-begin", connect_timeout=0.3, socket_timeout=0.3, retries=0, renew_fraction=0.2
    )
    client = redis_py.Redis.from_url(redis_server.url)
    policy = OncePolicy(fingerprint_of("mine"), ttl=60)
    other = encode_record(OncePolicy(fingerprint_of("other"), ttl=60), "theirs", "k1")
    hook: list = []
    locks.add_listener(lambda e: hook[0](e) if hook and e.kind == "acquire" and e.status == "acquired" else None)
    try:
        # another fingerprint completed the key between the first look and the lease
        hook[:] = [lambda e: client.set(locks.backend.completion_key("k1"), other, px=60000)]
        with pytest.raises(IdempotencyConflict):
            GuardedRun(locks, "k1", ttl=1.0, run_id="r1", task="t", once=policy).begin()
        assert locks.holder("k1") is None
        # Redis goes away right after the lease was taken
        hook[:] = [lambda e: redis_server.stop()]
        with pytest.raises(LeaseBackendError):
            GuardedRun(locks, "k2", ttl=1.0, run_id="r2", task="t", once=policy).begin()
        hook[:] = []
        time.sleep(0.5)
        redis_server.start()  # appendonly: the lease comes back, and must not be renewed any more
        time.sleep(1.5)  # past its TTL (1 s): renewed every 0.2 s, it would still be held
        assert locks.holder("k2") is None
    finally:
        hook[:] = []
        locks.close(timeout=1)
        client.close()


def test_a_holder_that_exited_but_was_not_reaped_is_dead():
    """A SIGKILLed holder whose parent died too waits as a zombie until PID 1 reaps it, and a PID 1
    that is not a reaping init (a container started without one) may never do so: ``kill(pid, 0)``
    still succeeds. Such a holder is dead (its lease can be released at once), a live one is not."""
    import signal as _signal

    from taskguard.liveness import holder_is_dead, process_identity

    child = os.fork()
    if child == 0:  # pragma: no cover (the child exits at once)
        os._exit(0)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # exited, not reaped: a zombie
            with open(f"/proc/{child}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        os.kill(child, 0)  # (still answers)
        assert holder_is_dead({**process_identity(), "pid": child})
        assert not holder_is_dead(process_identity())  # this process
        stopped = os.fork()
        if stopped == 0:  # pragma: no cover
            time.sleep(30)
            os._exit(0)
        try:
            os.kill(stopped, _signal.SIGSTOP)  # stopped is not dead
            assert not holder_is_dead({**process_identity(), "pid": stopped})
        finally:
            os.kill(stopped, _signal.SIGKILL)
            os.waitpid(stopped, 0)
    finally:
        os.waitpid(child, 0)


def test_a_call_inside_a_run_that_lost_its_lease_is_not_nested_under_it(locks):
    """A direct call of the key its enclosing run holds runs nested under that run's lease
    (``nested_in``) — unless that lease was lost (expired, taken by another holder): then it is a
    run of its own, which another holder of the key keeps out. Nesting under a lost lease ran the
    inner call beside the new holder."""
    from taskguard.context import running
    from taskguard.run import nested_in

    run = run_of(locks)
    assert run.begin()
    with running(run):
        nested = nested_in("k", locks)
        assert nested is not None and nested.lease is run.lease
        assert nested_in("other", locks) is None
        locks.release_run("k", run.run_id)  # the lease goes (expired, say) and another takes the key
        other = locks.acquire("k", ttl=30).lease
        assert run.lease.renew() is False and run.lease.lost  # (the renewer finds out so)
        assert nested_in("k", locks) is None
    other.release()
    with pytest.raises(LeaseLost):  # (on_lost="raise": the run's end says so)
        run.finish()
