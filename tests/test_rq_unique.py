"""Enqueue-time uniqueness for RQ (``taskguard_rq.enqueue_unique``) with real ``rq worker``
processes: one job per key while one is queued or running, RQ's own ``unique=`` where the job id
is the key, no mark left by a failed enqueue, a job that will never start (cancelled, failed
before its body) blocking its key no longer than the next enqueue, a lost or deleted job no
longer than ``unique_ttl``."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from rq.job import JobStatus

from taskguard.locks import SHADOW_QUEUED
from taskguard_rq import enqueue_unique

from . import rq_jobs
from .test_rq import RQWorker, locks, log, wait_done


def test_ten_concurrent_enqueues_make_one_job_and_one_run(rq_env):
    jobs: list = []
    barrier = threading.Barrier(10)

    def enqueue():
        barrier.wait()
        jobs.append(enqueue_unique(rq_env, rq_jobs.unique_job, ("a",)))

    threads = [threading.Thread(target=enqueue) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({j.id for j in jobs}) == 1 and rq_env.count == 1
    with RQWorker(rq_env):
        assert wait_done(jobs[0]) == JobStatus.FINISHED
        again = enqueue_unique(rq_env, rq_jobs.unique_job, ("a",))  # finished: a new job goes out
        assert again.id != jobs[0].id and wait_done(again) == JobStatus.FINISHED
    assert log(rq_env).count("unique:a") == 2


def test_a_running_job_is_returned_and_an_explicit_job_id_uses_rqs_own_unique(rq_env):
    with RQWorker(rq_env):
        running = enqueue_unique(rq_env, rq_jobs.unique_job, ("b",), {"seconds": 1.5})
        deadline = time.monotonic() + 10
        while locks().holder("uq:b") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert enqueue_unique(rq_env, rq_jobs.unique_job, ("b",)).id == running.id
        report = f"report-c-{uuid.uuid4().hex}"  # an id of this test's own (the Redis is shared)
        mine = enqueue_unique(rq_env, rq_jobs.unique_job, ("c",), job_id=report)
        assert enqueue_unique(rq_env, rq_jobs.unique_job, ("c",), job_id=report).id == mine.id
        assert wait_done(running) == wait_done(mine) == JobStatus.FINISHED


def test_a_failed_enqueue_leaves_no_mark_and_a_lost_job_blocks_only_until_unique_ttl(rq_env, monkeypatch):
    def broken(*a, **k):
        raise ConnectionError("queue down")

    with monkeypatch.context() as m:
        m.setattr(type(rq_env), "enqueue_call", broken)
        with pytest.raises(ConnectionError):
            enqueue_unique(rq_env, rq_jobs.unique_job, ("d",))
    first = enqueue_unique(rq_env, rq_jobs.unique_job, ("d",), unique_ttl=1)  # no mark was left behind
    rq_env.connection.delete(rq_env.key)  # the queue's list is lost; the job's hash still says queued
    assert enqueue_unique(rq_env, rq_jobs.unique_job, ("d",), unique_ttl=1).id == first.id
    time.sleep(1.2)  # unique_ttl=1
    second = enqueue_unique(rq_env, rq_jobs.unique_job, ("d",), unique_ttl=1)
    assert second.id != first.id
    rq_env.empty()  # deleted while queued: not told from a job its publisher has not written yet
    assert enqueue_unique(rq_env, rq_jobs.unique_job, ("d",), unique_ttl=1).id == second.id
    time.sleep(1.2)
    assert enqueue_unique(rq_env, rq_jobs.unique_job, ("d",), unique_ttl=1).id != second.id
    first.delete()  # its hash outlived its lost list, without a TTL (the fixture empties the queue only)


def _cancel(queue, job):
    job.cancel()  # (a plain `rq worker`: no GuardedWorker maintenance clears its mark)


def _fail_before_its_body(queue, job):
    # a deploy renamed the function while the job was queued: the worker fails it (FAILED) without
    # ever calling the guarded function, which would have cleared its mark
    job.func_name = "tests.rq_jobs.renamed_away"
    job.save()
    with RQWorker(queue):
        assert wait_done(job) == JobStatus.FAILED


@pytest.mark.parametrize("end", [_cancel, _fail_before_its_body])
def test_a_mark_whose_job_will_never_start_blocks_its_key_only_until_the_next_enqueue(rq_env, end):
    """A queued mark outliving its job blocked every ``enqueue_unique`` of the key for the mark's
    TTL (an hour by default): each way RQ ends a queued job without running it. The next
    enqueue finds the job over, clears that mark and enqueues a job that runs (the kind of
    sidekiq-unique-jobs#546 and wurk#211: a unique lock outliving its job)."""
    first = enqueue_unique(rq_env, rq_jobs.unique_job, ("n",), {"seconds": 0}, unique_ttl=600)
    assert enqueue_unique(rq_env, rq_jobs.unique_job, ("n",)).id == first.id  # queued: it blocks
    end(rq_env, first)
    again = enqueue_unique(rq_env, rq_jobs.unique_job, ("n",), {"seconds": 0})
    assert again.id != first.id
    assert enqueue_unique(rq_env, rq_jobs.unique_job, ("n",)).id == again.id  # the new job is marked
    with RQWorker(rq_env):
        assert wait_done(again) == JobStatus.FINISHED
    assert log(rq_env).count("unique:n") == 1


def test_a_mark_whose_job_is_not_written_yet_blocks_however_long_its_publisher_stalls(rq_env):
    """The caller that marked a key writes its job after: a publisher stalled there (a GC pause,
    SIGSTOP, a slow network) still holds the key; the job is returned once written."""
    job_id = f"written-late-{uuid.uuid4().hex}"
    assert locks().mark_queued("uq:w", job_id, ttl=60, task=rq_jobs.unique_job.taskguard_name) == (True, job_id)
    found = enqueue_unique(rq_env, rq_jobs.unique_job, ("w",))
    time.sleep(1.0)
    assert enqueue_unique(rq_env, rq_jobs.unique_job, ("w",)).id == found.id == job_id and rq_env.count == 0
    rq_env.enqueue_call(rq_jobs.unique_job, args=("w",), job_id=job_id)
    assert enqueue_unique(rq_env, rq_jobs.unique_job, ("w",)).id == job_id and rq_env.count == 1


def test_concurrent_enqueues_finding_a_cancelled_jobs_mark_make_one_new_job(rq_env):
    first = enqueue_unique(rq_env, rq_jobs.unique_job, ("v",), {"seconds": 0})
    first.cancel()
    jobs: list = []
    barrier = threading.Barrier(6)

    def enqueue():
        barrier.wait()
        jobs.append(enqueue_unique(rq_env, rq_jobs.unique_job, ("v",), {"seconds": 0}))

    threads = [threading.Thread(target=enqueue) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({j.id for j in jobs}) == 1 and jobs[0].id != first.id and rq_env.count == 1
    with RQWorker(rq_env):
        assert wait_done(jobs[0]) == JobStatus.FINISHED


def test_the_bound_helper_enqueues_uniquely(rq_env):
    first = rq_jobs.unique_job.enqueue_unique(rq_env, "e", seconds=0)
    assert rq_jobs.unique_job.enqueue_unique(rq_env, "e").id == first.id
    assert first.kwargs == {"seconds": 0} and first.meta["taskguard_unique"] == "uq:e"


def test_a_scheduled_unique_job_keeps_its_own_keyword_arguments(rq_env):
    from datetime import timedelta

    job = enqueue_unique(rq_env, rq_jobs.unique_job, ("j",), {"seconds": 0.25}, in_=timedelta(seconds=1), ttl=600)
    assert job.kwargs == {"seconds": 0.25} and job.ttl == 600
    assert enqueue_unique(rq_env, rq_jobs.unique_job, ("j",)).id == job.id


def test_an_explicit_job_id_that_is_over_is_enqueued_again_and_a_live_one_is_returned(rq_env):
    """Issue 22, input 7: RQ keeps a finished job 500 s and a failed one a year, and its own
    ``unique=True`` refused the id all that time; the promise is "unless a job of this key is
    queued or running". A job of the id that is over is deleted (registries, result) and the new
    one runs; a live one is returned."""
    ids = {n: f"report-{n}-{uuid.uuid4().hex}" for n in "fgh"}  # (not "tgtest-": swept while in use)
    with RQWorker(rq_env):
        done = enqueue_unique(rq_env, rq_jobs.unique_outcome, ("f",), job_id=ids["f"])
        failed = enqueue_unique(rq_env, rq_jobs.unique_outcome, ("g",), {"fail": True}, job_id=ids["g"])
        assert wait_done(done) == JobStatus.FINISHED and wait_done(failed) == JobStatus.FAILED
        assert ids["g"] in rq_env.failed_job_registry.get_job_ids()
        again = enqueue_unique(rq_env, rq_jobs.unique_outcome, ("f",), job_id=ids["f"])
        retried = enqueue_unique(rq_env, rq_jobs.unique_outcome, ("g",), job_id=ids["g"])
        assert wait_done(again) == wait_done(retried) == JobStatus.FINISHED
        assert ids["g"] not in rq_env.failed_job_registry.get_job_ids()  # not listed as failed any more
        assert rq_env.finished_job_registry.get_job_ids().count(ids["f"]) == 1
        running = enqueue_unique(rq_env, rq_jobs.unique_outcome, ("h",), {"seconds": 1.5}, job_id=ids["h"])
        deadline = time.monotonic() + 10
        while running.get_status(refresh=True) != JobStatus.STARTED and time.monotonic() < deadline:
            time.sleep(0.05)
        same = enqueue_unique(rq_env, rq_jobs.unique_outcome, ("h",), job_id=ids["h"])  # running: returned
        assert same.id == running.id and same.kwargs == {"seconds": 1.5}
        assert wait_done(running) == JobStatus.FINISHED
    entries = log(rq_env)
    assert [entries.count(f"outcome:{n}") for n in "fgh"] == [2, 2, 1]


def test_concurrent_enqueues_of_an_explicit_id_that_is_over_make_one_job(rq_env):
    ids = {"k": f"report-k-{uuid.uuid4().hex}"}
    with RQWorker(rq_env):
        first = enqueue_unique(rq_env, rq_jobs.unique_outcome, ("k",), job_id=ids["k"])
        assert wait_done(first) == JobStatus.FINISHED
        jobs: list = []
        barrier = threading.Barrier(8)

        def enqueue():
            barrier.wait()
            jobs.append(enqueue_unique(rq_env, rq_jobs.unique_outcome, ("k",), {"seconds": 1.0}, job_id=ids["k"]))

        threads = [threading.Thread(target=enqueue) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(jobs) == 8 and len({j.id for j in jobs}) == 1 and wait_done(jobs[0]) == JobStatus.FINISHED
    assert log(rq_env).count("outcome:k") == 2  # the first run and exactly one new one


def test_shadow_mode_enqueues_every_call_and_reports_the_would_be_suppressions(rq_env):
    """A shadow-mode job (``enforce=False``) through ``enqueue_unique``: every call is enqueued
    and run; the calls enforcement would have refused are reported (``publish`` events with
    ``shadow=True``); the enforced queued mark is never taken, and the shadow mark goes when the
    job starts. Before, uniqueness was enforced in shadow mode: one job of three."""
    lk = locks()
    seen: list = []
    remove = lk.add_listener(seen.append)
    try:
        jobs = [enqueue_unique(rq_env, rq_jobs.shadowed, ("su",)) for _ in range(3)]
        assert len({j.id for j in jobs}) == 3 and len(rq_env) == 3
        suppressed = [e for e in seen if e.kind == "publish" and e.status == "suppressed"]
        assert len(suppressed) == 2 and all(e.shadow for e in suppressed)
        assert lk.mark_queued("shadow:su", "probe", ttl=1, task=rq_jobs.shadowed.taskguard_name) == (True, "probe")
        lk.clear_queued("shadow:su", "probe", rq_jobs.shadowed.taskguard_name)
        with RQWorker(rq_env):
            assert [wait_done(j) for j in jobs] == [JobStatus.FINISHED] * 3
        assert lk.get_record("shadow:su", SHADOW_QUEUED + rq_jobs.shadowed.taskguard_name) is None
    finally:
        remove()
