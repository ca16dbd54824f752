"""RQ jobs with ``once=True`` and ``enforce=False`` (shadow mode), with real ``rq worker``
processes."""

from __future__ import annotations

from rq.job import JobStatus

from taskguard import IdempotencyConflict

from . import rq_jobs
from .test_rq import RQWorker, locks, wait_done


def test_the_first_success_is_stored_and_returned_across_workers_and_restarts(rq_env):
    with RQWorker(rq_env):
        first = rq_env.enqueue(rq_jobs.charge, 1, 100)
        assert wait_done(first) == JobStatus.FINISHED
        again = rq_env.enqueue(rq_jobs.charge, 1, 100)
        assert wait_done(again) == JobStatus.FINISHED
    stored = first.return_value()
    assert stored["n"] == 1 and again.return_value() == stored
    again.refresh()
    assert again.meta["taskguard"]["outcome"] == "once"
    for _ in range(2):  # another worker process, then again after it stopped
        with RQWorker(rq_env):
            later = rq_env.enqueue(rq_jobs.charge, 1, 100)
            assert wait_done(later) == JobStatus.FINISHED
        assert later.return_value() == stored
    assert rq_jobs.charge(1, 100) == stored  # a direct call agrees on the fingerprint
    assert locks().holder("charge:1") is None


def test_a_failure_stores_nothing_and_a_conflict_fails_the_job(rq_env):
    with RQWorker(rq_env):
        failed = rq_env.enqueue(rq_jobs.charge, 2, 50, fail=True)
        assert wait_done(failed) == JobStatus.FAILED
        ok = rq_env.enqueue(rq_jobs.charge, 2, 50)
        assert wait_done(ok) == JobStatus.FINISHED
        conflict = rq_env.enqueue(rq_jobs.charge, 2, 51)
        assert wait_done(conflict) == JobStatus.FAILED
    assert ok.return_value()["n"] == 2  # the failed attempt stored nothing
    assert "IdempotencyConflict" in conflict.latest_result().exc_string
    assert "51" not in str(IdempotencyConflict("charge:2"))


def test_shadow_mode_runs_the_job_without_the_lease_and_says_what_it_would_have_done(rq_env):
    held = locks().acquire("shadow:s", ttl=30).lease
    with RQWorker(rq_env) as worker:
        job = rq_env.enqueue(rq_jobs.shadowed, "s")
        assert wait_done(job) == JobStatus.FINISHED
        output = worker.output()
    held.release()
    assert job.return_value() == {"leased": False}
    job.refresh()
    assert job.meta["taskguard"]["shadow"] == "held"
    assert "shadow mode: would have been skipped (held" in output


def test_shadow_mode_records_a_would_be_rate_limit_as_it_records_a_held_lease(rq_env):
    """Over its rate in shadow mode the job runs, and says so where a held lease's shadow run
    says so: the log line and ``job.meta["taskguard"]["shadow"]`` (the meta said nothing; the
    Celery adapter logged nothing: one rule now, :func:`taskguard.pipeline.shadow_line`)."""
    with RQWorker(rq_env) as worker:
        first = rq_env.enqueue(rq_jobs.shadow_rated, "r")
        second = rq_env.enqueue(rq_jobs.shadow_rated, "r")
        assert wait_done(first) == JobStatus.FINISHED and wait_done(second) == JobStatus.FINISHED
        output = worker.output()
    assert first.return_value() == second.return_value() == "ran"
    assert "shadow" not in first.get_meta(refresh=True)["taskguard"]
    meta = second.get_meta(refresh=True)["taskguard"]
    assert meta["shadow"] == "rate_limited" and meta["key"] == "shadow-rated:r", meta  # the lease key stays
    assert "shadow mode: would have been rate-limited (rate key 'shadow-rate:r'); running it" in output
