"""RQ jobs with ``limit=N`` and ``rate=``, with real ``rq worker`` processes: the peak of a limited
key across workers, RQ 3's own ``RateLimit`` parking jobs instead of skipping them, rate-limited
jobs rescheduled through RQ's scheduler without consuming their ``Retry``."""

from __future__ import annotations

import os
import time

import pytest
from rq import Retry
from rq.job import JobStatus

from taskguard import ConfigError, is_skipped

from . import ledger, rq_jobs
from .test_rq import RQWorker, locks, wait_done


def _ledger(queue, key):
    return ledger.parse(queue.connection.lrange("{" + os.environ["TASKGUARD_PREFIX"] + ":ledger:" + key + "}", 0, -1))


def test_limit_across_three_workers_skips_with_reason_limit(rq_env):
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2, RQWorker(rq_env) as w3:
        jobs = [rq_env.enqueue(rq_jobs.export, "t1", seconds=1.5) for _ in range(3)]
        for job in jobs:
            assert wait_done(job) == JobStatus.FINISHED
        output = w1.output() + w2.output() + w3.output()
    values = [job.return_value() for job in jobs]
    skipped = [v for v in values if is_skipped(v)]
    assert sorted(v for v in values if not is_skipped(v)) == [0, 1], output
    assert len(skipped) == 1 and skipped[0].reason == "limit"
    assert "every slot of lease 'export:t1' held (limit)" in output
    assert ledger.peak(_ledger(rq_env, "export:t1"), 2) == 2
    assert locks().holders("export:t1") == []


def test_rq_rate_limit_parks_jobs_over_the_limit_instead_of_skipping(rq_env):
    """RQ >= 3.0: enqueued with RQ's own RateLimit for the job's key and limit, jobs over the limit
    wait (status rate_limited) and run when a slot frees: none is skipped, never more than 2 run."""
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2, RQWorker(rq_env) as w3:
        jobs = [
            rq_env.enqueue(rq_jobs.export, "t2", seconds=0.6, rate_limit=rq_jobs.export.rate_limit_for("t2"))
            for _ in range(5)
        ]
        parked = {job.get_status(refresh=True) for job in jobs}
        for job in jobs:
            assert wait_done(job, timeout=30) == JobStatus.FINISHED
        output = w1.output() + w2.output() + w3.output()
    assert JobStatus.RATE_LIMITED in parked
    assert sorted(job.return_value() for job in jobs) in ([0, 0, 0, 1, 1], [0, 0, 1, 1, 1]), output
    assert ledger.peak(_ledger(rq_env, "export:t2"), 2) == 2
    limit = rq_jobs.export.rate_limit_for("t2")
    assert limit.key == "taskguard:export:t2" and limit.concurrency == 2


def test_a_rate_limited_job_is_rescheduled_without_consuming_its_retry(rq_env):
    """8 jobs at once under 3/s on two workers with RQ's scheduler: every one runs once, at
    booked turns (at most 1 + 3 w calls in any window of w >= 1 s), and each keeps its Retry."""
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2:
        started = time.time()
        jobs = [rq_env.enqueue(rq_jobs.api_call, n, retry=Retry(max=1)) for n in range(8)]
        for job in jobs:
            assert wait_done(job, timeout=40) == JobStatus.FINISHED
        output = w1.output() + w2.output()
    assert [job.return_value() for job in jobs] == list(range(8)), output
    raw = rq_env.connection.lrange("{" + os.environ["TASKGUARD_PREFIX"] + ":calls}", 0, -1)
    calls = sorted(float(x.decode().split()[0]) for x in raw)
    assert len(calls) == 8
    assert calls[-1] - started >= 7 / 3 - 0.1
    for i, t0 in enumerate(calls):
        for w in (1.0, 2.0):
            assert sum(1 for t in calls[i:] if t < t0 + w) <= 1 + 3 * w
    for job in jobs:
        job.refresh()
        assert job.retries_left == 1  # the job's own Retry is untouched
        assert not job.number_of_retries  # nor the count of returned Retries
        assert "taskguard_rate" not in job.meta
    assert "rate-limited; its turn is booked" in output


def test_rate_max_wait_ends_in_a_rate_limited_skip(rq_env):
    with RQWorker(rq_env):
        first = rq_env.enqueue(rq_jobs.api_bounded, 1)
        second = rq_env.enqueue(rq_jobs.api_bounded, 2)
        assert wait_done(first) == wait_done(second) == JobStatus.FINISHED
    out = second.return_value()
    assert first.return_value() == 1 and is_skipped(out) and out.reason == "rate_limited"
    second.refresh()
    assert second.meta["taskguard"]["outcome"] == "skipped" and second.meta["taskguard"]["reason"] == "rate_limited"


def test_direct_calls_wait_for_their_turn(rq_env):
    started = time.monotonic()
    assert [rq_jobs.api_call(n) for n in range(3)] == [0, 1, 2]
    assert time.monotonic() - started >= 0.6  # 3/s: 1/3 s apart


def test_rate_limit_for_needs_rq_3():
    import rq

    if int(rq.__version__.split(".")[0]) >= 3:
        assert rq_jobs.export.rate_limit_for("t").concurrency == 2
    else:
        with pytest.raises(ConfigError, match="RQ >= 3.0"):
            rq_jobs.export.rate_limit_for("t")


def test_bad_options_fail_at_declaration():
    from taskguard_rq import guarded_job

    with pytest.raises(ConfigError, match="limit"):
        guarded_job(limit=0)(lambda: None)
    with pytest.raises(ConfigError, match="need rate"):
        guarded_job(rate_max_wait=3)(lambda: None)


# -- weighted rates (cost=) and back-off on 429 (RateLimited) -----------------------------------


def _rows(queue, name):
    return [
        x.decode().split()
        for x in queue.connection.lrange("{" + os.environ["TASKGUARD_PREFIX"] + ":" + name + "}", 0, -1)
    ]


def test_a_weighted_rate_holds_in_cost_units_across_two_workers(rq_env):
    """16 jobs of 20-80 tokens under 400 tokens/s (burst 100) on two workers with RQ's scheduler:
    each runs once, keeps its Retry, and the tokens whose bodies started in any window of w >= 1 s
    stay within 100 + 400 (w + 1) (+ one job's cost: a start is after its admission, a deferred
    one by up to RQ's scheduler's second); over the whole run, no faster than the rate."""
    import random

    rnd = random.Random(26)
    tokens = [rnd.randint(20, 80) for _ in range(16)]
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2:
        jobs = [rq_env.enqueue(rq_jobs.llm, n, t, retry=Retry(max=1)) for n, t in enumerate(tokens)]
        for job in jobs:
            assert wait_done(job, timeout=60) == JobStatus.FINISHED
        output = w1.output() + w2.output()
    assert [job.return_value() for job in jobs] == list(range(16)), output
    rows = sorted((float(x[0]), int(x[2])) for x in _rows(rq_env, "llm"))
    assert len(rows) == 16
    assert rows[-1][0] - rows[0][0] >= (sum(tokens) - 100) / 400 - 1.0  # (RQ's scheduler: whole seconds)
    # a deferred job is moved to its queue by RQ's scheduler, which looks once a second
    # (rq/scheduler.py): it may start up to about a second after its booked turn, beside jobs
    # admitted after it, so the starts in w seconds stay within the admissions of w + 1 seconds
    for i, (t0, _) in enumerate(rows):
        for w in (1.0, 2.0):
            assert sum(c for t, c in rows[i:] if t < t0 + w) <= 100 + 400 * (w + 1.0) + 80
    for job in jobs:
        job.refresh()
        assert job.retries_left == 1 and not job.number_of_retries


def test_a_429_pauses_the_rate_for_every_worker_and_defers_the_job_without_consuming_its_retry(rq_env):
    """12 jobs under 10/s (burst 2) on two workers; job 3 raises RateLimited(retry_after=3) once.
    On the Redis clock no job body starts from the 429 (+ 0.3 s) until the pause ends; job 3 runs
    again after it with its Retry untouched (it has none: Retry(max=0) would fail it)."""
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2:
        jobs = [rq_env.enqueue(rq_jobs.upstream, n, fail_on=3, pause=3.0) for n in range(12)]
        for job in jobs:
            assert wait_done(job, timeout=60) == JobStatus.FINISHED
        output = w1.output() + w2.output()
    assert [job.return_value() for job in jobs] == list(range(12)), output
    rows = _rows(rq_env, "up")
    t429 = [float(x[0]) for x in rows if x[1] == "429"]
    assert len(t429) == 1
    starts = [(float(x[0]), int(x[1])) for x in rows if x[1] != "429"]
    assert [s for s in starts if t429[0] + 0.3 <= s[0] < t429[0] + 3.0] == []
    assert [s[1] for s in starts].count(3) == 2
    assert "backing off (upstream rate limit); " in output  # (the core's Defer.describe())
    jobs[3].refresh()
    assert jobs[3].meta["taskguard"]["outcome"] != "failed"


def test_a_per_call_limit_is_read_per_job_and_lowering_it_admits_nobody_beside_the_holders(rq_env):
    """limit=lambda tenant: the tenant's plan, read per job. Under a plan of 3, three exports run
    at once on four workers; the plan drops to 1 while they run: the next two exports are skipped,
    not admitted beside the three holders (reason "held": a limit of 1 is a plain lease)."""
    r = rq_env.connection
    plan = "{" + os.environ["TASKGUARD_PREFIX"] + ":limit:acme}"
    r.set(plan, 3, ex=600)
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2, RQWorker(rq_env) as w3, RQWorker(rq_env) as w4:
        first = [rq_env.enqueue(rq_jobs.export_tiered, "acme", seconds=2.5) for _ in range(3)]
        deadline = time.monotonic() + 10
        while len(locks().holders("export:acme")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        r.set(plan, 1, ex=600)
        later = [rq_env.enqueue(rq_jobs.export_tiered, "acme", seconds=0.1) for _ in range(2)]
        for job in first + later:
            assert wait_done(job, timeout=30) == JobStatus.FINISHED
        output = w1.output() + w2.output() + w3.output() + w4.output()
    assert sorted(job.return_value() for job in first) == [0, 1, 2], output
    skipped = [job.return_value() for job in later]
    assert all(is_skipped(v) and v.reason == "held" for v in skipped), (skipped, output)
    assert ledger.peak(_ledger(rq_env, "export:acme"), 3) == 3


# -- a limit per key and a total (limit_total=) ------------------------------------------------


def test_a_limit_per_key_and_a_total_hold_across_worker_processes(rq_env):
    """limit=2 per tenant, limit_total=3, on four rq workers: of the first four exports (three of
    t1, one of t2) the third t1 is skipped with reason "limit"; the two exports enqueued while
    three run (t2, t3) are skipped with reason "limit_total" and hold nothing afterwards; the
    ledgers show at most 2 per tenant and 3 in all."""
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2, RQWorker(rq_env) as w3, RQWorker(rq_env) as w4:
        first = [rq_env.enqueue(rq_jobs.export_total, t, seconds=2.5) for t in ("t1", "t1", "t1", "t2")]
        deadline = time.monotonic() + 15
        while len(locks().holders("exports")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        later = [rq_env.enqueue(rq_jobs.export_total, t, seconds=0.1) for t in ("t2", "t3")]
        for job in first + later:
            assert wait_done(job, timeout=30) == JobStatus.FINISHED
        output = w1.output() + w2.output() + w3.output() + w4.output()
    values = [job.return_value() for job in first + later]
    reasons = sorted(v.reason for v in values if is_skipped(v))
    assert reasons == ["limit", "limit_total", "limit_total"], (values, output)
    assert sorted(v for v in values if not is_skipped(v)) == [0, 1, 2]
    assert ledger.peak(_ledger(rq_env, "exports"), 3) == 3
    assert ledger.peak(_ledger(rq_env, "export:t1"), 2) == 2
    assert ledger.peak(_ledger(rq_env, "export:t2"), 2) == 1
    assert _ledger(rq_env, "export:t3") == []
    assert "every place in the total 'exports' held (limit_total)" in output
    assert locks().holders("exports") == [] and locks().holders("export:t2") == []


def test_a_retry_claims_both_holds_from_the_handle_record(rq_env):
    """A failed job with a Retry keeps its lease and its place in the total in its handle record
    (the total's nested); the retry claims both with the same fencing tokens."""
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.export_total_flaky, "t1", retry=Retry(max=1))
        assert wait_done(job, timeout=30) == JobStatus.FINISHED
    fences = _rows(rq_env, "fences:t1")
    assert len(fences) == 2 and fences[0] == fences[1], fences
    assert locks().holders("exports") == [] and locks().holders("export:t1") == []


def test_a_killed_work_horse_settles_both_holds(rq_env):
    """GuardedWorker settles a killed work-horse's lease and its place in the total from the
    job's handle record: kept for its retry (which claims both with the same fencing tokens),
    or, without a retry, released at once (the TTL is 30 s)."""
    from .test_rq import log

    with RQWorker(rq_env) as worker:
        kept = rq_env.enqueue(rq_jobs.export_total_killed, "k", retry=Retry(max=1, interval=1))
        assert wait_done(kept, timeout=30) == JobStatus.FINISHED, worker.output()
        entries = [e.split(":") for e in log(rq_env) if e.startswith("ek:k:")]
        assert len(entries) == 2 and entries[0][3:] == entries[1][3:], entries
        assert kept.return_value() == int(entries[0][4])
        gone = rq_env.enqueue(rq_jobs.export_total_killed, "n")
        assert wait_done(gone, timeout=30) == JobStatus.FAILED
        time.sleep(0.3)
        assert locks().holders("export:n") == [] and locks().holders("exports") == []
        output = worker.output()
    assert "lease 'export:k' kept" in output and "lease 'export:n' released" in output
