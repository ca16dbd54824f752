"""RQ jobs with ``overlap="coalesce"`` on real ``rq worker --with-scheduler`` processes: a burst
while a job runs makes one pending follow-up (the latest job), held in RQ's ScheduledJobRegistry
and moved to now when the active job ends, or run once its lease expires when the active job's
worker is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from rq import Queue
from rq.job import JobStatus

from taskguard import ConfigError, is_skipped
from taskguard.overlap import PENDING_RECORD
from taskguard_rq import guarded_job, load_handle

from . import ledger, rq_jobs
from .test_rq import RQWorker, locks, wait_done


def _key(name: str) -> str:
    return "{" + os.environ["TASKGUARD_PREFIX"] + ":" + name + "}"


def _ran(queue, shop):
    raw = queue.connection.lrange(_key("ran:" + shop), 0, -1)
    return [(int(n), float(t)) for n, t in (x.decode().split() for x in raw)]


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_burst_coalesces_into_the_latest_job_which_runs_once_after_the_active_one(rq_env):
    """12 jobs while a job runs (until the 11 superseded ones ended, however long the loaded
    machine takes for them): 11 end FINISHED with Skipped("coalesced") naming the job that
    superseded them, the latest runs once, soon after the active job ends, never beside it."""
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2:
        first = rq_env.enqueue(rq_jobs.rebuild, "s1", 0, seconds=60.0, until="release")
        _wait(lambda: len(_ran(rq_env, "s1")) == 1)
        burst = [rq_env.enqueue(rq_jobs.rebuild, "s1", n, seconds=0.2) for n in range(1, 13)]
        for job in burst[:-1]:
            assert wait_done(job, timeout=30) == JobStatus.FINISHED
        assert [n for n, _ in _ran(rq_env, "s1")] == [0]  # superseded jobs end while the first still runs
        assert locks().get_record("index:s1", PENDING_RECORD) is not None
        rq_env.connection.set(_key("release"), 1, ex=60)  # the first job ends now
        assert wait_done(first) == JobStatus.FINISHED
        assert wait_done(burst[-1], timeout=30) == JobStatus.FINISHED
        output = w1.output() + w2.output()
    for i, job in enumerate(burst[:-1]):
        value = job.return_value()
        assert is_skipped(value) and value.reason == "coalesced", (value, output)
        assert value.follow_up == burst[i + 1].id
        assert job.get_meta(refresh=True)["taskguard"]["outcome"] == "skipped"
    assert burst[-1].return_value() == 12
    ran = _ran(rq_env, "s1")
    assert [n for n, _ in ran] == [0, 12], output
    entries = ledger.parse(rq_env.connection.lrange(_key("ledger:index:s1"), 0, -1))
    assert ledger.peak(entries, 1) == 1
    first_out = next(at for at, step, _slot, _fence in entries if step == -1)
    assert ran[1][1] - first_out < 3.0  # moved to now when the first ended (RQ's scheduler polls)
    assert locks().get_record("index:s1", PENDING_RECORD) is None
    assert "Traceback" not in output


def test_the_follow_up_job_runs_once_after_the_active_jobs_worker_is_sigkilled(rq_env):
    """The active job runs on its own queue's worker, which is SIGKILLed (main process and
    work-horse) while a follow-up waits
    in the other queue's ScheduledJobRegistry: the follow-up runs once, after the dead holder's
    lease (ttl 3 s) expired, with a larger fencing token. (RQ's scheduler is one per queue: a
    queue whose only scheduler died waits until another worker takes its scheduler lock.)"""
    other = Queue(rq_env.name.replace("q-", "q2-", 1), connection=rq_env.connection)
    jobs = []
    try:
        with RQWorker(rq_env) as w1, RQWorker(other) as w2:
            rq_env.enqueue(rq_jobs.rebuild, "s1", 0, seconds=60)
            _wait(lambda: len(_ran(rq_env, "s1")) == 1)
            jobs = [other.enqueue(rq_jobs.rebuild, "s1", n, seconds=0.2) for n in (1, 2)]
            assert wait_done(jobs[0], timeout=20) == JobStatus.FINISHED
            assert jobs[0].return_value().reason == "coalesced"
            horse = locks().holder("index:s1").holder["pid"]  # RQ's work-horse has its own process group
            os.killpg(w1.proc.pid, signal.SIGKILL)
            os.kill(horse, signal.SIGKILL)
            killed = time.time()
            assert wait_done(jobs[1], timeout=40) == JobStatus.FINISHED, w2.output()
            time.sleep(1.0)
            output = w2.output()
            values = [job.return_value() for job in jobs]
    finally:
        for job in jobs:
            job.delete()
        other.delete(delete_jobs=True)
    assert values[1] == 2, output
    ran = _ran(rq_env, "s1")
    assert [n for n, _ in ran] == [0, 2], output
    assert ran[1][1] > killed + 1.0  # after the dead holder's lease (ttl 3 s) expired
    entries = ledger.parse(rq_env.connection.lrange(_key("ledger:index:s1"), 0, -1))
    fences = [fence for _at, step, _slot, fence in entries if step == 1]
    assert fences[1] > fences[0]


def test_the_follow_up_job_runs_once_after_the_worker_that_made_it_pending_is_sigkilled(rq_env):
    """The worker that ran the follow-up job (which returned to RQ's ScheduledJobRegistry as the
    key's pending follow-up) is SIGKILLed while it is pending: nothing of it lived in that worker,
    so when the active job ends the follow-up is moved to now, enqueued by the queue's scheduler
    (another worker's) and run there, once, never beside the active job."""
    conn = rq_env.connection
    other = Queue(rq_env.name.replace("q-", "q2-", 1), connection=conn)
    blockers = Queue(rq_env.name.replace("q-", "q3-", 1), connection=conn)
    call = None
    try:
        # the scheduler of `other` is w3's (started first); w3 takes `blockers` jobs first
        with RQWorker(rq_env) as w1, RQWorker(other, blockers.name) as w3:
            _wait(lambda: conn.get(f"rq:scheduler-lock:{other.name}") is not None)
            with RQWorker(other) as w2:
                rq_env.enqueue(rq_jobs.rebuild, "s1", 0, seconds=6)
                _wait(lambda: len(_ran(rq_env, "s1")) == 1)
                blocker = blockers.enqueue(rq_jobs.slow, f"block-{os.getpid()}", seconds=8)
                _wait(lambda: blocker.get_status(refresh=True) == JobStatus.STARTED)  # w3 is busy
                call = other.enqueue(rq_jobs.rebuild, "s1", 1, seconds=0.2)  # w2 runs it: pending
                _wait(lambda: call.get_status(refresh=True) == JobStatus.SCHEDULED)
                assert locks().get_record("index:s1", PENDING_RECORD) is not None
                assert call.get_meta(refresh=True)["taskguard"]["outcome"] == "pending"
                os.killpg(w2.proc.pid, signal.SIGKILL)
                w2.proc.wait()
            assert wait_done(call, timeout=40) == JobStatus.FINISHED, w1.output() + w3.output()
            time.sleep(1.0)
            output = w1.output() + w3.output()
        assert call.return_value() == 1, output
        ran = _ran(rq_env, "s1")
        assert [n for n, _ in ran] == [0, 1], output
        entries = ledger.parse(conn.lrange(_key("ledger:index:s1"), 0, -1))
        assert ledger.peak(entries, 1) == 1  # never two bodies at once
    finally:
        if call is not None:
            call.delete()
        other.delete(delete_jobs=True)
        blockers.delete(delete_jobs=True)


def test_coalesce_is_refused_with_once_on_rq_too():
    with pytest.raises(ConfigError, match="overlap='coalesce' cannot be combined with once=True"):

        @guarded_job(overlap="coalesce", once=True, key="k:{x}")
        def f(x):
            pass

    with pytest.raises(ConfigError, match="overlap must be one of"):

        @guarded_job(overlap="sometimes")
        def g(x):
            pass


# -- overlap="replace" ----------------------------------------------------------------------------------
def _entries(queue, user):
    raw = queue.connection.lrange(_key("reportlog:" + user), 0, -1)
    return [(kind, int(n), int(fence), float(at)) for kind, n, fence, at in (x.decode().split() for x in raw)]


def test_replace_the_new_job_takes_the_lease_over_and_the_old_one_ends_replaced(rq_env):
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2:
        old = rq_env.enqueue(rq_jobs.report, "u1", 1, seconds=30)
        _wait(lambda: len(_entries(rq_env, "u1")) == 1)
        new = rq_env.enqueue(rq_jobs.report, "u1", 2, seconds=1.0)
        assert wait_done(old, timeout=15) == JobStatus.FINISHED
        assert wait_done(new, timeout=15) == JobStatus.FINISHED
        output = w1.output() + w2.output()
    value = old.return_value()
    assert is_skipped(value) and value.reason == "replaced" and value.follow_up == new.id, output
    entries = _entries(rq_env, "u1")
    starts = {n: (fence, at) for kind, n, fence, at in entries if kind == "start"}
    lost = [at for kind, n, _f, at in entries if kind == "lost" and n == 1]
    assert new.return_value() == {"n": 2, "fence": starts[2][0]} and starts[2][0] > starts[1][0]
    assert lost and lost[0] - starts[2][1] < 0.9  # within one renewal interval (0.5 s) plus a poll
    assert old.get_meta(refresh=True)["taskguard"]["outcome"] == "skipped"


def test_replace_terminate_stops_the_old_job_and_reports_it_replaced(rq_env):
    """The stopped job is a skip like Celery's terminated one: its skip reported (the core's skip
    event, which Prometheus counts; the function's skip count) and its meta saying so — it said
    ``outcome="running"`` for good and nothing counted it."""
    from taskguard_rq import skip_count

    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2:
        old = rq_env.enqueue(rq_jobs.report_stopping, "u2", 1, seconds=30)
        _wait(lambda: len(_entries(rq_env, "u2")) == 1)
        new = rq_env.enqueue(rq_jobs.report_stopping, "u2", 2, seconds=0.5)
        assert wait_done(new, timeout=15) == JobStatus.FINISHED
        assert wait_done(old, timeout=15) == JobStatus.STOPPED
        output = w1.output() + w2.output()
    assert new.return_value()["n"] == 2, output
    assert "stopped the replaced job" in output
    meta = old.get_meta(refresh=True)["taskguard"]
    assert (meta["outcome"], meta["reason"], meta["replaced_by"]) == ("skipped", "replaced", new.id), meta
    assert skip_count(rq_jobs.report_stopping.taskguard_name) == 1


def test_replace_terminate_of_a_job_in_a_simple_worker_stops_nothing_and_reports_it_once(rq_env):
    """The replaced job runs in its worker's own process (``SimpleWorker``: RQ's stop command has
    no work-horse to kill; on RQ 3 ``kill_horse`` does nothing): no stop is sent, the worker lives
    on, and the job — its lease taken over — ends ``Skipped("replaced")`` itself, reported once.
    (Before, the replacing job reported it and the job then reported itself: counted twice, and
    the log said it was stopped while it ran on.)"""
    from taskguard_rq import skip_count

    with RQWorker(rq_env, worker_class="rq.worker.SimpleWorker") as simple:
        old = rq_env.enqueue(rq_jobs.report_stopping, "u3", 1, seconds=30)
        _wait(lambda: len(_entries(rq_env, "u3")) == 1)
        with RQWorker(rq_env) as w2:
            new = rq_env.enqueue(rq_jobs.report_stopping, "u3", 2, seconds=0.5)
            assert wait_done(new, timeout=15) == JobStatus.FINISHED
            assert wait_done(old, timeout=15) == JobStatus.FINISHED
            output = simple.output() + w2.output()
        assert simple.proc.poll() is None, output  # the worker itself was not stopped
    value = old.return_value()
    assert is_skipped(value) and value.reason == "replaced" and value.follow_up == new.id, output
    assert new.return_value()["n"] == 2
    assert skip_count(rq_jobs.report_stopping.taskguard_name) == 1
    assert "cannot be stopped from here" in output and "stopped the replaced job" not in output


ROOT = Path(__file__).resolve().parents[1]
_PROBE = """
import os, sys, types, redis
from taskguard_rq.job import _in_work_horse
conn = redis.Redis.from_url(sys.argv[1])
if sys.argv[3] == "own-pid":
    conn.hset("rq:worker:" + sys.argv[2], "pid", os.getpid())
    conn.expire("rq:worker:" + sys.argv[2], 60)
print(_in_work_horse(types.SimpleNamespace(connection=conn, worker_name=sys.argv[2] or None)))
"""


@pytest.mark.parametrize(
    "leader, name, hash_pid, expected",
    [
        (False, "w", "none", "False"),  # not a process group leader: never a work-horse (RQ's expired hash)
        (True, "w", "none", "True"),  # a leader, no worker hash: unknown counts as a work-horse
        (True, "w", "own-pid", "False"),  # the worker's pid is this process's: a SimpleWorker
        (True, "", "none", "False"),  # no worker: performed by its caller (job.perform())
        (True, "sync", "none", "False"),  # Queue(is_async=False) from a process group leader (a script in a shell)
    ],
)
def test_a_job_outside_a_work_horse_is_told_apart(rq_env, leader, name, hash_pid, expected):
    """How a ``replace_terminate`` job tells it cannot be stopped (``stoppable``): every RQ
    work-horse leads a process group of its own; a process that leads one is a worker's own when
    the worker's hash names its pid. (A ``SimpleWorker`` whose hash RQ let expire — a negative
    ``job_timeout`` gives it a negative lifetime — is still told apart when it leads no group.)"""
    worker = name if name in ("", "sync") else f"{name}-{uuid.uuid4().hex}"  # ("sync": RQ's name for is_async=False)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, os.environ["TASKGUARD_REDIS_URL"], worker, hash_pid],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=leader,
        cwd=ROOT,
    )
    if worker:
        rq_env.connection.delete("rq:worker:" + worker)
    assert out.stdout.strip() == expected, out.stderr


def test_replace_terminate_of_a_job_waiting_for_its_retry_reports_it_once_and_stops_nothing(rq_env):
    """The replaced holder is a lease kept for a retry (the job SCHEDULED, nothing running): no
    stop command (it would stop nothing) and no report here — the retry, when it comes, ends
    ``Skipped("replaced")`` and reports itself, once. (Reported here too, the replacement was
    counted twice and the log said a job was stopped that ran later.)"""
    from rq import Retry

    from taskguard_rq import skip_count

    with RQWorker(rq_env) as w1:
        old = rq_env.enqueue(rq_jobs.replaced_retrying, "a", retry=Retry(max=1, interval=3))
        _wait(lambda: old.get_status(refresh=True) == JobStatus.SCHEDULED)
        new = rq_env.enqueue(rq_jobs.replaced_retrying, "a", fail=False)
        assert wait_done(new, timeout=15) == JobStatus.FINISHED
        assert wait_done(old, timeout=20) == JobStatus.FINISHED
        output = w1.output()
    value = old.return_value()
    assert is_skipped(value) and value.reason == "replaced", output
    assert "stopped the replaced job" not in output
    assert skip_count(rq_jobs.replaced_retrying.taskguard_name) == 1
    # the handle its failed run kept for the retry (its owner token) goes with the retry: it was
    # left to its TTL (the retry interval plus the lease TTL)
    assert load_handle(locks(), old.id) is None


# -- debounce= ------------------------------------------------------------------------------------------
def test_debounce_enqueue_debounced_makes_one_job_per_window_run_with_the_last_arguments(rq_env):
    """6 calls 0.1 s apart through fn.enqueue_debounced (debounce=1 s): one job (every call gets
    it), run once, about a second after the last call (RQ's scheduler counts whole seconds), with
    the last call's arguments."""
    with RQWorker(rq_env) as w1:
        jobs = []
        for n in range(6):
            jobs.append(rq_jobs.search.enqueue_debounced(rq_env, "s1", n))
            time.sleep(0.1)
        last_call = time.time() - 0.1
        assert len({j.id for j in jobs}) == 1
        assert wait_done(jobs[0], timeout=20) == JobStatus.FINISHED
        time.sleep(1.0)
        output = w1.output()
    assert jobs[0].return_value() == 5, output
    from taskguard.debounce import CLOSED

    # the closed window's call, kept for a requeue while its execution ran, went with it
    assert locks().get_record("search:s1", CLOSED + jobs[0].id) is None
    raw = rq_env.connection.lrange(_key("searched:s1"), 0, -1)
    ran = [(int(n), float(t)) for n, t in (x.decode().split() for x in raw)]
    assert [n for n, _ in ran] == [5]
    assert 0.9 <= ran[0][1] - last_call <= 4.0


@pytest.mark.parametrize("end", ["cancel", "delete", "fail_before_its_body"])
def test_debounce_a_window_whose_job_will_never_run_is_reopened_by_the_next_call(rq_env, end):
    """A window's job cancelled, deleted or failed without its body (a deploy renamed the
    function) swallowed every later call for debounce_max + 10 min: the cancelled job was returned
    and never ran, a deleted one made each call raise NoSuchJobError. The next call now opens a
    new window (a new job), which runs once with the last call's arguments (bullmq#2716: a
    debounce key outliving its removed job)."""
    with RQWorker(rq_env) as w:
        first = rq_jobs.search.enqueue_debounced(rq_env, "s9", 0)
        if end == "cancel":
            first.cancel()
        elif end == "delete":
            first.delete()
        else:
            first.func_name = "tests.rq_jobs.renamed_away"
            first.save()
            assert wait_done(first, timeout=20) == JobStatus.FAILED
        second = rq_jobs.search.enqueue_debounced(rq_env, "s9", 1)
        third = rq_jobs.search.enqueue_debounced(rq_env, "s9", 2)
        assert second.id != first.id and third.id == second.id
        assert wait_done(second, timeout=20) == JobStatus.FINISHED, w.output()
    assert second.return_value() == 2
    assert [x.decode().split()[0] for x in rq_env.connection.lrange(_key("searched:s9"), 0, -1)] == ["2"]


def test_debounce_the_functions_own_keyword_arguments_are_never_taken_for_rq_options(rq_env):
    """enqueue_debounced passed the call's keyword arguments to RQ's enqueue_in: a parameter named
    ``ttl`` became the job's queued TTL (the window's job expired unrun), one named ``meta`` a
    TypeError."""
    with RQWorker(rq_env) as w:
        first = rq_jobs.refresh_cache.enqueue_debounced(rq_env, "c1", ttl=1, meta={"v": 1})
        last = rq_jobs.refresh_cache.enqueue_debounced(rq_env, "c1", ttl=1, meta={"v": 2})
        assert first.id == last.id and last.ttl is None
        time.sleep(1.5)  # past ttl=1
        assert wait_done(last, timeout=20) == JobStatus.FINISHED, w.output()
    assert last.return_value() == {"ttl": 1, "meta": {"v": 2}}


def test_debounce_a_publisher_stalled_past_its_claim_never_overwrites_the_windows_job(rq_env, monkeypatch):
    """The opener stalls between writing the window and publishing it, past its claim: a joining
    call publishes the window (same job id), which runs with the last arguments. The opener's
    late enqueue overwrote that job, which ran again and ended Skipped("debounced") for every
    handle. Now it finds the job (RQ's unique=True) and returns it."""
    from taskguard import debounce

    monkeypatch.setattr(debounce, "PUBLISH_CLAIM", 1.0)
    real = type(rq_env).enqueue_in
    sent: list = []

    def stalls_first(self, *args, **kwargs):
        sent.append(kwargs.get("job_id"))
        if len(sent) == 1:
            time.sleep(2.5)  # past the 1 s claim, and past the window's run
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(rq_env), "enqueue_in", stalls_first)
    got: list = []
    with RQWorker(rq_env) as w:
        opener = threading.Thread(target=lambda: got.append(rq_jobs.search.enqueue_debounced(rq_env, "s8", 1)))
        opener.start()
        time.sleep(0.2)
        joiner = rq_jobs.search.enqueue_debounced(rq_env, "s8", 2)  # waits the claim out, publishes
        opener.join()
        assert got[0].id == joiner.id and sent == [joiner.id, joiner.id]
        assert wait_done(joiner, timeout=20) == JobStatus.FINISHED, w.output()
        time.sleep(3.0)  # (a second run would come now)
        output = w.output()
    assert joiner.return_value() == 2, output
    assert [x.decode().split()[0] for x in rq_env.connection.lrange(_key("searched:s8"), 0, -1)] == ["2"]


def _digested(queue, user):
    return [x.decode() for x in queue.connection.lrange(_key("digested:" + user), 0, -1)]


@pytest.mark.parametrize("how", ["returned_retry", "requeue"])
def test_debounce_a_retry_or_requeue_of_a_windows_run_runs_the_windows_arguments(rq_env, how):
    """The first execution of a window's job takes the window; its retry (a returned Retry) or a
    requeue of the failed job found the window gone and ended Skipped("debounced") without running
    (the retry's kept lease held meanwhile). Now the job carries the window's arguments from then
    on, and runs them."""
    with RQWorker(rq_env) as w:
        rq_jobs.digest.enqueue_debounced(rq_env, "r1", 1, fail_first="retry" if how == "returned_retry" else "raise")
        job = rq_jobs.digest.enqueue_debounced(
            rq_env, "r1", 2, fail_first="retry" if how == "returned_retry" else "raise"
        )
        if how == "requeue":
            assert wait_done(job, timeout=20) == JobStatus.FAILED, w.output()
            rq_env.failed_job_registry.requeue(job.id)  # (`rq requeue`: by id; a stale Job object saves its own state)
        assert wait_done(job, timeout=20) == JobStatus.FINISHED, w.output()
        output = w.output()
    assert job.return_value() == 2 and _digested(rq_env, "r1") == ["2"], output
    assert locks().holder("digest:r1") is None


def test_debounce_a_window_due_while_the_previous_windows_run_holds_the_key_runs_after_it(rq_env):
    """A window falling due while the previous window's run still holds the key's lease ended
    Skipped("held"): that burst's last call never ran. The window is put back and runs once the
    lease is free, with its last call's arguments (two workers: one runs the first window; the
    caveat of bull#1034: a debounced job due while the previous one is active)."""
    with RQWorker(rq_env) as w, RQWorker(rq_env) as w2:
        first = rq_jobs.digest.enqueue_debounced(rq_env, "h1", 1, seconds=3.0)
        deadline = time.monotonic() + 10
        while locks().holder("digest:h1") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rq_jobs.digest.enqueue_debounced(rq_env, "h1", 2)
        second = rq_jobs.digest.enqueue_debounced(rq_env, "h1", 3)
        assert second.id != first.id
        assert wait_done(second, timeout=30) == JobStatus.FINISHED, w.output() + w2.output()
        output = w.output() + w2.output()
    assert second.return_value() == 3 and first.return_value() == 1, output
    assert "debounce window put back" in output
    assert _digested(rq_env, "h1") == ["1", "3"]


def test_debounce_a_window_that_pends_or_waits_its_rate_turn_runs_its_last_call_when_it_comes_back(rq_env):
    """A window's run that became the key's pending follow-up (overlap="coalesce") or was
    deferred to its rate turn came back with its window entry, found the window gone (taken when
    it closed) and ended Skipped("debounced"): the burst's last call never ran. Whatever brings a
    closed window's job back now runs its arguments."""
    with RQWorker(rq_env) as w, RQWorker(rq_env) as w2:
        first = rq_jobs.digest_coalesced.enqueue_debounced(rq_env, "c1", 1, seconds=3.0)
        rated = rq_jobs.digest_rated.enqueue_debounced(rq_env, "t1", 1)
        deadline = time.monotonic() + 10
        while (locks().holder("dc:c1") is None or wait_done(rated, timeout=10) is None) and time.monotonic() < deadline:
            time.sleep(0.05)
        rq_jobs.digest_coalesced.enqueue_debounced(rq_env, "c1", 2)
        pending = rq_jobs.digest_coalesced.enqueue_debounced(rq_env, "c1", 3)
        rq_jobs.digest_rated.enqueue_debounced(rq_env, "t1", 2)
        turn = rq_jobs.digest_rated.enqueue_debounced(rq_env, "t1", 3)  # inside the 4 s of the rate
        assert pending.id != first.id and turn.id != rated.id
        assert wait_done(pending, timeout=30) == JobStatus.FINISHED, w.output() + w2.output()
        assert wait_done(turn, timeout=30) == JobStatus.FINISHED, w.output() + w2.output()
        output = w.output() + w2.output()
    assert (pending.return_value(), turn.return_value()) == (3, 3), output
    assert (_digested(rq_env, "c1"), _digested(rq_env, "t1")) == (["1", "3"], ["1", "3"]), output


def test_debounce_a_window_run_whose_work_horse_is_killed_runs_its_last_call_when_requeued(rq_env):
    """The work-horse running a window's run is SIGKILLed; the worker saves its own copy of the
    job (the first call's arguments, the window entry) over what the horse saved, and a requeue
    then ran the first call's arguments, or found the window gone. The closed window's call is
    kept until its execution ends; the requeue runs it."""
    with RQWorker(rq_env) as w:
        rq_jobs.digest.enqueue_debounced(rq_env, "k1", 1, seconds=4.0)
        job = rq_jobs.digest.enqueue_debounced(rq_env, "k1", 2, seconds=4.0)
        deadline = time.monotonic() + 20
        while not (locks().holder("digest:k1") and _digested(rq_env, "k1")) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(locks().holder("digest:k1").holder["pid"], signal.SIGKILL)
        assert wait_done(job, timeout=20) == JobStatus.FAILED, w.output()
        rq_env.failed_job_registry.requeue(job.id)
        assert wait_done(job, timeout=20) == JobStatus.FINISHED, w.output()
    assert job.return_value() == 2 and _digested(rq_env, "k1") == ["2", "2"]


def test_enqueue_debounced_needs_debounce():
    with pytest.raises(ConfigError, match="enqueue_debounced needs debounce="):
        rq_jobs.rebuild.enqueue_debounced(None, "s1", 1)
