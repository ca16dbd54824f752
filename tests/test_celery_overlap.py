"""Celery tasks with ``overlap="coalesce"``: a burst of calls while a run is active makes one
pending follow-up, the latest call's own message, which runs promptly once the active run ends,
or once its lease expires when the active run's worker is SIGKILLed; embedded and subprocess
workers against real Redis."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
from celery.concurrency.thread import TaskPool as ThreadPool
from prometheus_client import CollectorRegistry

from taskguard import ConfigError, TaskSkipped, as_skipped, is_skipped
from taskguard.metrics import Metrics
from taskguard.overlap import PENDING_RECORD
from taskguard_celery import guarded_task

from . import ledger
from .celery_app import make_app
from .celery_support import EventLog, WorkerProcess, embedded_worker


@pytest.fixture
def app(redis_url, prefix):
    a = make_app(f"q-{prefix}", prefix)
    yield a
    # (q1-/q2-: the queues of the SIGKILL tests' own workers)
    redis.Redis.from_url(redis_url).delete(a.tg_log, f"q-{prefix}", f"q1-{prefix}", f"q2-{prefix}")


def _ran(r, prefix, shop):
    """``(n, start time)`` of each body that ran, in order."""
    return [(int(n), float(t)) for n, t in (x.decode().split() for x in r.lrange(f"{prefix}:ran:{shop}", 0, -1))]


def _wait(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_burst_coalesces_into_the_latest_call_which_runs_once_promptly(app, redis_url, prefix):
    """40 calls while a run is active (it holds until the test has looked at the key's state, at
    most 30 s, so a loaded machine cannot end it early): 39 end Skipped("coalesced") naming the call that
    superseded them, the latest runs once, about a second after the active run ends, never beside
    it; no worker slot waits meanwhile (another key runs at once); the key's Redis state stays
    one record; the skips are reported as events and in Prometheus."""
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.rebuild"]
    locks = app.conf.taskguard_locks
    registry = CollectorRegistry()
    remove = locks.add_listener(Metrics(registry))
    try:
        with EventLog(app, tasks=["tg.rebuild"]) as events, embedded_worker(app, concurrency=2):
            first = task.delay("s1", 0, seconds=30.0, until="end:s1")
            _wait(lambda: len(_ran(r, prefix, "s1")) == 1)
            burst = [task.delay("s1", n, seconds=0.3) for n in range(1, 41)]
            skipped = [res.get(timeout=15) for res in burst[:-1]]  # superseded: their results come at once
            # one slot runs the active run, the other is free: a pending follow-up occupies none
            assert task.delay("s2", 99, seconds=0).get(timeout=5) == 99
            assert [n for n, _ in _ran(r, prefix, "s1")] == [0]  # still the active run only
            # what the burst left in Redis for the key: its lease hash, one pending record, one backstop mark
            keys = set(r.scan_iter(match=f"*{prefix}:index:s1*"))
            lease = f"{{{prefix}:index:s1}}"
            assert keys == {f"{lease}{k}".encode() for k in ("", ":r:coalesce", ":r:coalesce-backstop")}
            assert r.hlen(lease) <= 12 and r.memory_usage(f"{lease}:r:coalesce") < 2048
            assert locks.get_record("index:s1", PENDING_RECORD) is not None
            r.set(f"{prefix}:end:s1", 1, ex=600)  # the active run ends now
            assert first.get(timeout=10) == 0
            assert burst[-1].get(timeout=10) == 40
            coalesced_events = events.wait_for("task-skipped", 39)
    finally:
        remove()
    for i, value in enumerate(skipped):
        s = as_skipped(value)
        assert s is not None and s.reason == "coalesced", value
        assert s.follow_up == burst[i + 1].id  # the call that superseded it (the last one ran)
    ran = _ran(r, prefix, "s1")
    assert [n for n, _ in ran] == [0, 40]
    entries = ledger.parse(r.lrange(f"{prefix}:ledger:index:s1", 0, -1))
    assert ledger.peak(entries, 1) == 1  # never two bodies at once; fences grow
    first_out = next(at for at, step, _slot, _fence in entries if step == -1)
    assert ran[1][1] - first_out < 1.5  # woken when the active run ended, not at a retry delay
    assert {e["reason"] for e in coalesced_events} == {"coalesced"}
    assert {e["uuid"] for e in coalesced_events} == {res.id for res in burst[:-1]}
    assert (
        registry.get_sample_value(
            "taskguard_skips_total", {"task": "tg.rebuild", "reason": "coalesced", "shadow": "false"}
        )
        == 39
    )
    assert locks.get_record("index:s1", PENDING_RECORD) is None
    assert locks.holders("index:s1") == []


def test_a_lone_call_while_idle_runs_at_once_and_one_call_while_active_runs_after(app, redis_url, prefix):
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.rebuild"]
    with embedded_worker(app, concurrency=2):
        assert task.delay("s3", 1, seconds=0).get(timeout=10) == 1
        first = task.delay("s3", 2, seconds=1.0)
        _wait(lambda: len(_ran(r, prefix, "s3")) == 2)
        second = task.delay("s3", 3, seconds=0)
        assert first.get(timeout=10) == 2
        assert second.get(timeout=10) == 3  # the follow-up, not a skip
    assert [n for n, _ in _ran(r, prefix, "s3")] == [1, 2, 3]


def test_the_follow_up_runs_once_after_the_holders_worker_is_sigkilled(app, redis_url, prefix):
    """The active run's worker (its own queue) is SIGKILLed while a follow-up is pending on another
    worker: the follow-up runs once, when the dead holder's lease (ttl 3 s) has expired, with a
    larger fencing token."""
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.rebuild"]
    q1, q2 = f"q1-{prefix}", f"q2-{prefix}"
    with WorkerProcess(q1, prefix, concurrency=1) as w1, WorkerProcess(q2, prefix, concurrency=2) as w2:
        task.apply_async(("s1", 0), {"seconds": 60}, queue=q1)
        _wait(lambda: len(_ran(r, prefix, "s1")) == 1, timeout=20)
        calls = [task.apply_async(("s1", n), {"seconds": 0.2}, queue=q2) for n in (1, 2, 3)]
        superseded = [c.get(timeout=15) for c in calls[:2]]
        assert all(is_skipped(v) and v["reason"] == "coalesced" for v in superseded), superseded
        w1.signal_all(signal.SIGKILL)
        killed = time.time()
        assert calls[-1].get(timeout=30) == 3, w2.output()
        time.sleep(1.0)  # nothing else runs
        output = w2.output()
    ran = _ran(r, prefix, "s1")
    assert [n for n, _ in ran] == [0, 3], output
    assert ran[1][1] > killed + 1.0  # after the lease expired (renewed every second until the kill)
    entries = ledger.parse(r.lrange(f"{prefix}:ledger:index:s1", 0, -1))
    fences = [fence for _at, step, _slot, fence in entries if step == 1]
    assert fences[1] > fences[0]
    assert "Traceback" not in output


def test_the_follow_up_runs_once_when_the_pending_calls_worker_was_sigkilled(app, redis_url, prefix):
    """The worker that made a call pending is SIGKILLed (with the backstop message it holds); the
    call's message is kept in Redis, so when the holder ends it is published again and another
    worker of that queue runs it, once."""
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.rebuild"]
    q1, q2 = f"q1-{prefix}", f"q2-{prefix}"
    with WorkerProcess(q1, prefix, concurrency=1) as w1:
        task.apply_async(("s1", 0), {"seconds": 4.0}, queue=q1)
        _wait(lambda: len(_ran(r, prefix, "s1")) == 1, timeout=20)
        with WorkerProcess(q2, prefix, concurrency=1) as w2:
            call = task.apply_async(("s1", 1), {"seconds": 0.2}, queue=q2)
            _wait(lambda: app.conf.taskguard_locks.get_record("index:s1", PENDING_RECORD) is not None)
            time.sleep(0.3)  # its execution ended (Ignore) after sending the backstop
            w2.signal_all(signal.SIGKILL)
        with WorkerProcess(q2, prefix, concurrency=1) as w3:
            assert call.get(timeout=20) == 1, w1.output() + w3.output()
            time.sleep(1.0)
            output = w1.output() + w3.output()
    assert [n for n, _ in _ran(r, prefix, "s1")] == [0, 1], output
    assert ledger.peak(ledger.parse(r.lrange(f"{prefix}:ledger:index:s1", 0, -1)), 1) == 1
    assert "Traceback" not in output


@pytest.mark.parametrize(
    "extra, conflict",
    [
        ({"once": True, "key": "k:{x}"}, "once=True"),
        ({"unique": True}, "unique=True"),
        ({"on_skip": "retry"}, "on_skip='retry'"),
        ({"enforce": False}, "enforce=False"),
    ],
)
def test_coalesce_is_refused_at_declaration_where_it_cannot_work(extra, conflict):
    with pytest.raises(ConfigError, match=f"overlap='coalesce' cannot be combined with {conflict}"):

        @guarded_task(overlap="coalesce", **extra)
        def f(x):
            pass


@pytest.mark.parametrize(
    "value, message",
    [
        ("bogus", "overlap must be one of"),
        (
            "coalese",
            r"overlap must be one of \('skip', 'coalesce', 'replace'\), got 'coalese' \(did you mean 'coalesce'\?\)",
        ),
        ("allow", "overlap='allow' is for periodic entries only"),
    ],
)
def test_overlap_values_are_checked_at_declaration(value, message):
    with pytest.raises(ConfigError, match=message):

        @guarded_task(overlap=value)
        def f(x):
            pass

    with pytest.raises(ConfigError, match="did you mean 'overlap'"):

        @guarded_task(overlapp="coalesce")
        def g(x):
            pass


# -- overlap="replace" ----------------------------------------------------------------------------------
def _entries(r, prefix, user):
    return [
        (kind, int(n), int(fence), float(at))
        for kind, n, fence, at in (x.decode().split() for x in r.lrange(f"{prefix}:report:{user}", 0, -1))
    ]


def test_replace_a_new_run_takes_the_lease_over_and_the_old_one_ends_replaced(app, redis_url, prefix):
    """A report runs (ttl 1.5 s: renewed every 0.5 s); a new call starts at once with a larger
    fencing token; the old body finds its lease lost within one renewal interval and the old run
    ends SUCCESS with Skipped("replaced") naming the new run; a retry of the old task id never takes
    the lease back."""
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.report"]
    with EventLog(app, tasks=["tg.report"]) as events, embedded_worker(app, concurrency=3):
        old = task.delay("u1", 1, seconds=30)
        _wait(lambda: len(_entries(r, prefix, "u1")) == 1)
        new = task.delay("u1", 2, seconds=1.0)
        old_value = old.get(timeout=10)
        assert old.state == "SUCCESS"
        new_value = new.get(timeout=10)
        again = task.apply_async(("u1", 1), {"seconds": 0}, task_id=old.id)  # the replaced run's id again
        again_value = again.get(timeout=10)
        replaced_events = events.wait_for("task-skipped", 2)
    s = as_skipped(old_value)
    assert s is not None and s.reason == "replaced" and s.follow_up == new.id
    entries = _entries(r, prefix, "u1")
    starts = {n: (fence, at) for kind, n, fence, at in entries if kind == "start"}
    lost = [at for kind, n, _f, at in entries if kind == "lost" and n == 1]
    assert set(starts) == {1, 2}  # the retry of the replaced id did not run
    assert new_value == {"n": 2, "fence": starts[2][0]} and starts[2][0] > starts[1][0]
    assert starts[2][1] - starts[1][1] < 2.0  # the new run started at once, not after the old one
    assert lost and lost[0] - starts[2][1] < 0.5 + 0.4  # within one renewal interval (plus a poll)
    assert as_skipped(again_value).reason == "replaced"
    assert [e["reason"] for e in replaced_events] == ["replaced", "replaced"]
    assert app.conf.taskguard_locks.holders("report:u1") == []


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_replace_terminate_the_old_task_is_killed_and_ends_skipped_replaced_not_revoked(app, redis_url, prefix, pool):
    """``replace_terminate=True`` on a prefork or gevent worker (each pool that can terminate a task:
        prefork kills the child, gevent the greenlet): the new run stores the old one's result,
        ``Skipped("replaced")`` (SUCCESS), then revokes it with terminate; the old body is killed (it
        never reaches its end) and Celery's REVOKED does not overwrite the SUCCESS (a key-value result
        backend keeps a SUCCESS). Celery still sends ``task-revoked`` after ``task-skipped`` (Flower shows
    REVOKED)."""
    r = redis.Redis.from_url(redis_url)
    env = {"TG_TEST_REPLACE_TERMINATE": "1"}  # (the task is only in apps of prefork workers)
    with EventLog(app, tasks=["tg.report_term"]) as events:
        with WorkerProcess(f"q-{prefix}", prefix, pool=pool, concurrency=2, extra=("-E",), env=env) as worker:
            old = app.signature("tg.report_term", ("u2", 1), {"seconds": 30}).delay()
            _wait(lambda: len(_entries(r, prefix, "u2")) == 1, timeout=20)
            new = app.signature("tg.report_term", ("u2", 2), {"seconds": 1.0}).delay()
            new_value = new.get(timeout=15)
            old_value = old.get(timeout=15)
            skipped = events.wait_for("task-skipped", 1)
            time.sleep(1.0)
            output = worker.output()
    s = as_skipped(old_value)
    assert s is not None and s.reason == "replaced" and s.follow_up == new.id, output
    assert old.state == "SUCCESS"
    assert new_value["n"] == 2
    entries = _entries(r, prefix, "u2")
    assert ("end", 1) not in [(kind, n) for kind, n, _f, _at in entries]  # the old body was killed
    assert "revoked the replaced run" in output
    assert [e["uuid"] for e in skipped] == [old.id]
    assert f"Terminating {old.id}" in output  # Celery's own revoke, after the result was stored
    assert app.conf.taskguard_locks.holders("report:u2") == []


def test_a_replaced_run_ends_per_on_skip(app, redis_url, prefix):
    """A replaced run ends as any skip does, per ``on_skip``: with ``"raise"``, FAILURE with
    ``TaskSkipped("replaced")`` (the same with ``replace_terminate``: below)."""
    task = app.tasks["tg.report_raise"]
    r = redis.Redis.from_url(redis_url)
    with embedded_worker(app, concurrency=3):
        old = task.delay("os-raise", 1, seconds=30)
        _wait(lambda: len(_entries(r, prefix, "os-raise")) == 1)
        new = task.delay("os-raise", 2, seconds=0.5)
        assert new.get(timeout=10)["n"] == 2
        value = old.get(timeout=10, propagate=False)
    assert old.state == "FAILURE" and isinstance(value, TaskSkipped) and value.reason == "replaced"
    assert [n for kind, n, _f, _at in _entries(r, prefix, "os-raise") if kind == "start"] == [1, 2]


def test_replace_terminate_ends_the_replaced_run_per_on_skip(app, redis_url, prefix):
    """``replace_terminate=True`` with ``on_skip="raise"``: the replaced task's stored outcome is a
    failure, as without terminate (it was SUCCESS with the ``Skipped`` whatever ``on_skip`` said):
    FAILURE with ``TaskSkipped``, which Celery's own REVOKED may follow."""
    r = redis.Redis.from_url(redis_url)
    env = {"TG_TEST_REPLACE_TERMINATE": "1"}
    with WorkerProcess(f"q-{prefix}", prefix, concurrency=2, env=env) as worker:
        old = app.signature("tg.report_term_raise", ("u3", 1), {"seconds": 30}).delay()
        _wait(lambda: len(_entries(r, prefix, "u3")) == 1, timeout=20)
        new = app.signature("tg.report_term_raise", ("u3", 2), {"seconds": 0.5}).delay()
        assert new.get(timeout=15)["n"] == 2
        value = old.get(timeout=15, propagate=False)
        output = worker.output()
    assert old.state in ("FAILURE", "REVOKED"), (old.state, value, output)
    assert ("end", 1) not in [(kind, n) for kind, n, _f, _at in _entries(r, prefix, "u3")]


def test_replace_terminate_is_refused_on_pools_that_cannot_terminate():
    from types import SimpleNamespace

    from celery import Celery

    from taskguard_celery.pools import check_pool

    a = Celery("tg-replace-terminate", set_as_current=False)

    @a.task(
        base=__import__("taskguard_celery").GuardedTask,
        shared=False,
        name="tg.rt",
        overlap="replace",
        replace_terminate=True,
    )
    def rt():
        pass

    # every pool that cannot terminate a running task: by name, by path, and a custom pool built
    # on one (celery/celery#8147: "-P threads can't revoke task"; #5929: solo)
    for pool in ("threads", "solo", "celery.concurrency.thread:TaskPool", _OwnThreadPool):
        with pytest.raises(SystemExit, match="replace_terminate=True .*tg.rt.* needs a pool"):
            check_pool(sender=SimpleNamespace(app=a, pool_cls=pool))
    for pool in ("prefork", "gevent", "celery.concurrency.prefork:TaskPool"):
        check_pool(sender=SimpleNamespace(app=a, pool_cls=pool))  # pools that can: the worker starts


class _OwnThreadPool(ThreadPool):
    """A custom pool on Celery's threads pool (no ``terminate_job`` of its own)."""


def test_replace_terminate_needs_replace():
    with pytest.raises(ConfigError, match="replace_terminate=True needs overlap='replace'"):

        @guarded_task(replace_terminate=True)
        def f(x):
            pass

    with pytest.raises(ConfigError, match="overlap='replace' cannot be combined with once=True"):

        @guarded_task(overlap="replace", once=True, key="k:{x}")
        def g(x):
            pass


# -- debounce= ------------------------------------------------------------------------------------------
def _searched(r, prefix, shop):
    return [(int(n), float(t)) for n, t in (x.decode().split() for x in r.lrange(f"{prefix}:searched:{shop}", 0, -1))]


def test_debounce_a_burst_of_calls_makes_one_run_after_the_last_with_its_arguments(app, redis_url, prefix):
    """8 calls 0.1 s apart (debounce=1 s, debounce_max=2 s, not reached): one broker message, one
    run about a second after the last call, with the last call's arguments; every handle is that
    run's."""
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.search"]
    registry = CollectorRegistry()
    remove = app.conf.taskguard_locks.add_listener(Metrics(registry))
    try:
        with embedded_worker(app, concurrency=2):
            handles = []
            for n in range(8):
                handles.append(task.delay("s1", n))
                time.sleep(0.1)
            last_call = time.time() - 0.1
            assert r.llen(f"q-{prefix}") <= 1  # one message for the window (or none: the worker holds it)
            values = [h.get(timeout=10) for h in handles]
            time.sleep(0.5)
    finally:
        remove()
    assert len({h.id for h in handles}) == 1
    assert values == [7] * 8
    from taskguard.debounce import CLOSED

    # the closed window's call, kept for a redelivery while its execution ran, went with it
    assert app.conf.taskguard_locks.get_record("search:s1", CLOSED + handles[0].id) is None
    ran = _searched(r, prefix, "s1")
    assert [n for n, _ in ran] == [7]
    assert 0.8 <= ran[0][1] - last_call <= 2.0
    assert (
        registry.get_sample_value(
            "taskguard_skips_total", {"task": "tg.search", "reason": "debounced", "shadow": "false"}
        )
        == 7
    )


def test_debounce_max_runs_a_steady_stream_at_least_that_often(app, redis_url, prefix):
    """Calls every 0.3 s for 4.5 s never leave a second of quiet: debounce_max=2 s still runs them
    at least every 2 s, each run with its window's latest call, the last call included."""
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.search"]
    with embedded_worker(app, concurrency=2):
        started = time.time()
        handles = []
        for n in range(15):
            handles.append(task.delay("s2", n))
            time.sleep(0.3)
        values = [h.get(timeout=10) for h in handles]
        time.sleep(0.5)
    ran = _searched(r, prefix, "s2")
    assert len(ran) >= 2 and ran[-1][0] == 14
    assert values[-1] == 14 and sorted(set(values)) == [n for n, _ in ran]
    starts = [started] + [t for _, t in ran]
    assert all(b - a <= 2.0 + 1.0 for a, b in zip(starts, starts[1:], strict=False))  # max plus a worker's delay


def _window(app, key):
    from taskguard.debounce import RECORD

    return app.conf.taskguard_locks.get_record(key, RECORD)


@pytest.mark.parametrize("end", ["revoked", "unknown_task"])
def test_debounce_a_window_whose_message_will_never_run_is_dropped_and_the_next_call_opens_one(
    app, redis_url, prefix, end
):
    """A window whose message was revoked, or rejected by a worker that does not know the task,
    swallowed every later call for debounce_max + 10 min (each got the dead window's
    AsyncResult). The worker's ``task_revoked`` / ``task_unknown`` now drops the window; the
    next call opens one, which runs once with the last call's arguments."""
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.search"]
    if end == "revoked":
        with embedded_worker(app, concurrency=2):
            first = task.delay("s9", 0)
            app.control.revoke(first.id)
            deadline = time.monotonic() + 10
            while (first.state != "REVOKED" or _window(app, "search:s9")) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert first.state == "REVOKED" and _window(app, "search:s9") is None
    else:
        first = task.delay("s9", 0)
        older = make_app(f"q-{prefix}", prefix)  # a worker of an older deploy: no tg.search
        older.tasks.unregister("tg.search")
        with embedded_worker(older):
            deadline = time.monotonic() + 10
            while _window(app, "search:s9") is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _window(app, "search:s9") is None and first.state == "FAILURE"
    second, third = task.delay("s9", 1), task.delay("s9", 2)
    assert second.id != first.id and third.id == second.id
    with embedded_worker(app, concurrency=2):
        assert third.get(timeout=10) == 2
    assert [n for n, _ in _searched(r, prefix, "s9")] == [2]


def _digested(r, prefix, user):
    return [x.decode() for x in r.lrange(f"{prefix}:digested:{user}", 0, -1)]


def test_debounce_a_retry_of_a_windows_run_runs_the_windows_arguments(app, redis_url, prefix):
    """The window's run calls ``self.retry()``: the retry kept the window's header, found the
    window gone (taken by the first attempt) and was ignored, its state RETRY for good and its
    kept lease held; it also carried the first call's arguments. Now it runs the window's."""
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.digest"]
    with embedded_worker(app, concurrency=2):
        task.delay("r1", 1, fail_first=True)
        handle = task.delay("r1", 2, fail_first=True)
        assert handle.get(timeout=15) == 2
    assert _digested(r, prefix, "r1") == ["2"]
    assert app.conf.taskguard_locks.holder("digest:r1") is None


def test_debounce_a_window_due_while_the_previous_windows_run_holds_the_key_runs_after_it(app, redis_url, prefix):
    """A window falling due while the previous window's run still holds the key's lease ended
    Skipped("held"): that burst's last call never ran. It is put back and runs once the lease is
    free, with its last call's arguments."""
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.digest"]
    with embedded_worker(app, concurrency=2):
        first = task.delay("h1", 1, seconds=3.0)
        deadline = time.monotonic() + 10
        while app.conf.taskguard_locks.holder("digest:h1") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        task.delay("h1", 2)
        second = task.delay("h1", 3)
        assert second.id != first.id
        assert second.get(timeout=20) == 3 and first.get(timeout=10) == 1
    assert _digested(r, prefix, "h1") == ["1", "3"]


def test_debounce_a_window_that_pends_waits_its_rate_turn_or_backs_off_runs_its_last_call(app, redis_url, prefix):
    """A window's run that became the key's pending follow-up (overlap="coalesce"), was deferred
    to its rate turn, or backed off after an upstream 429 came back with the window's header,
    found the window gone (taken when it closed) and was ignored: the burst's last call never ran
    (its handle PENDING or RETRY for good). Whatever brings a closed window's run back now runs
    its arguments."""
    r = redis.Redis.from_url(redis_url)
    coalesced, rated = app.tasks["tg.digest_coalesced"], app.tasks["tg.digest_rated"]
    with embedded_worker(app, concurrency=4):
        first = coalesced.delay("c1", 1, seconds=3.0)
        rated.delay("t1", 1).get(timeout=10)
        deadline = time.monotonic() + 10
        while app.conf.taskguard_locks.holder("dc:c1") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        coalesced.delay("c1", 2)
        pending = coalesced.delay("c1", 3)
        rated.delay("t1", 2)
        turn = rated.delay("t1", 3)  # inside the 4 s of the rate
        backs_off = rated.delay("b1", 1, upstream_429=True)
        assert pending.id != first.id
        assert (pending.get(timeout=20), turn.get(timeout=20), backs_off.get(timeout=20)) == (3, 3, 1)
    assert [_digested(r, prefix, u) for u in ("c1", "t1", "b1")] == [["1", "3"], ["1", "3"], ["1"]]


def test_debounce_a_window_run_whose_pool_child_dies_runs_its_last_call_on_redelivery(app, redis_url, prefix):
    """acks_late + reject_on_worker_lost: the pool child running a window's run is SIGKILLed and
    the broker delivers the message again. That copy found the window gone (taken when it
    closed) and was ignored: the burst's last call never ran, its handle PENDING. The closed
    window's call is kept until its execution ends; the redelivery runs it."""
    r = redis.Redis.from_url(redis_url)
    task, locks = app.tasks["tg.digest_acked"], app.conf.taskguard_locks
    with WorkerProcess(f"q-{prefix}", prefix, concurrency=1):
        task.delay("k1", 1, seconds=4.0)
        last = task.delay("k1", 2, seconds=4.0)
        deadline = time.monotonic() + 20
        while not (locks.holder("da:k1") and _digested(r, prefix, "k1")) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(locks.holder("da:k1").holder["pid"], signal.SIGKILL)
        assert last.get(timeout=40) == 2
    assert _digested(r, prefix, "k1") == ["2", "2"]


def test_debounce_options_are_checked_at_declaration():
    with pytest.raises(ConfigError, match="debounce_max needs debounce="):

        @guarded_task(debounce_max=5)
        def f(x):
            pass

    with pytest.raises(ConfigError, match=r"debounce_max \(1.0\) must be >= debounce \(2.0\)"):

        @guarded_task(debounce=2, debounce_max=1)
        def g(x):
            pass

    with pytest.raises(ConfigError, match="debounce= cannot be combined with unique=True"):

        @guarded_task(debounce=2, unique=True)
        def h(x):
            pass
