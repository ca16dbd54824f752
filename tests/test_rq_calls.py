"""RQ: a call's own errors keep their type, and a guarded function called directly inside a
running guarded job is judged by its own call (real ``rq worker`` processes, real Redis)."""

from __future__ import annotations

import pytest
from rq.job import JobStatus

from taskguard import ConfigError
from taskguard_rq import enqueue_unique

from . import rq_jobs
from .test_rq import RQWorker, locks, log, wait_done


def _guard_keys(queue) -> list[str]:
    import os

    prefix = os.environ["TASKGUARD_PREFIX"]
    return sorted(k.decode() for k in queue.connection.scan_iter(match="{" + prefix + ":*", count=1000))


def test_wrong_arguments_raise_type_error_and_lock_nothing(rq_env):
    """``add(5)`` raises ``TypeError`` as the function would: called directly, at
    ``enqueue_unique``, and in the worker (the job fails with it). Before, the key template bound
    the arguments first and raised ``ConfigError``."""
    queue = rq_env
    for call in (
        lambda: rq_jobs.add(5),
        lambda: rq_jobs.add(5, 5, wrong_arg=5),
        lambda: rq_jobs.add(1, 2, 3, 4),
        lambda: enqueue_unique(queue, rq_jobs.add, (5,)),
    ):
        with pytest.raises(TypeError) as info:
            call()
        assert not isinstance(info.value, ConfigError), info.value
    with pytest.raises(TypeError, match="missing a required argument: 'y'"):
        rq_jobs.add(5)
    with RQWorker(queue):
        jobs = [
            queue.enqueue(rq_jobs.add, 5),
            queue.enqueue(rq_jobs.add, 5, 5, wrong_arg=5),
            queue.enqueue(rq_jobs.add, 2, 3),
        ]
        states = [wait_done(job) for job in jobs]
    assert states == [JobStatus.FAILED, JobStatus.FAILED, JobStatus.FINISHED]
    for job in jobs[:2]:
        exc = job.latest_result().exc_string
        assert "TypeError" in exc and "ConfigError" not in exc, exc
    assert jobs[2].return_value() == 5 and log(queue) == ["add:2:3"]
    assert not [k for k in _guard_keys(queue) if ":add:5" in k or "rq-job:" + jobs[0].id in k]


def test_a_direct_call_of_the_key_its_job_holds_runs_nested_under_the_jobs_lease(rq_env):
    """Recursion with the same key: the inner call runs under the job's lease (same fencing
    token), as Celery's does (the decision is the core's, ``taskguard.run.nested_in``). Before, RQ
    returned ``Skipped(reason="held")`` to its own caller — a recursive job silently skipped its
    own inner call — from a worker and from a direct call alike."""
    with RQWorker(rq_env) as worker:
        job = rq_env.enqueue(rq_jobs.nest, 1)
        assert wait_done(job) == JobStatus.FINISHED
        output = worker.output()
    outer, inner = job.return_value()
    assert isinstance(outer, int) and inner == outer, output
    outer, inner = rq_jobs.nest(2)  # called directly, outside any job
    assert isinstance(outer, int) and inner == outer
    assert locks().holders("nest:1") == [] and locks().holders("nest:2") == []  # released once, by the outer run


def test_a_direct_call_inside_a_job_is_judged_by_its_own_call(rq_env):
    """A guarded function called directly inside a running job (recursion with a new key each
    level, another guarded job) runs under its own lease and leaves the job's own kept handle and
    ``meta["taskguard"]`` alone. Before, it took the enclosing job for its own: it wrote its
    handle over the job's and dropped it when it returned (a killed work-horse's lease could no
    longer be found), and its key over the job's meta."""
    queue = rq_env
    with RQWorker(queue):
        job = queue.enqueue(rq_jobs.down, 2)
        assert wait_done(job) == JobStatus.FINISHED
    assert job.return_value() == [2, 1, 0, 1, 2, 3]
    entries = log(queue)
    assert [e for e in entries if e.startswith("down:") and ":handle:" not in e] == [
        "down:2:down:2",
        "down:1:down:1",
        "down:0:down:0",
    ]
    assert [e for e in entries if ":handle:" in e] == [
        "down:0:handle:down:2",
        "down:1:handle:down:2",
        "down:2:handle:down:2",
    ], entries
    assert job.get_meta(refresh=True)["taskguard"]["key"] == "down:2"
    assert rq_jobs.down(1) == [1, 0, 1, 2]  # and called directly from outside any job
