"""``debounce=``: the publisher of a call SIGKILLed at each step of the publish
(:func:`taskguard.debounce.publish` and the adapter's publish around it), opening a window or
joining one. A later call's handle resolves to the window's one run, which runs the last call's
arguments, once: the last call's work is never lost and nothing runs twice at once. Real
publisher processes, a real Celery worker / ``rq worker``, real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from rq.job import JobStatus

from .celery_app import make_app
from .celery_support import embedded_worker
from .test_rq import RQWorker, wait_done

ROOT = Path(__file__).resolve().parent.parent
#: (this call opens the window, the step it is killed at)
CASES = [
    (True, "before_record"),
    (True, "after_record"),
    (True, "after_publish"),
    (False, "before_record"),
    (False, "after_record"),
]


class Publisher:
    """``python -m tests.debounce_crash``: set up, then make one call when told and die at ``step``."""

    def __init__(self, framework: str, step: str, shop: str, n: int, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.debounce_crash", framework, step, shop, str(n)],
            cwd=ROOT,
            env={**os.environ, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", line + self.proc.stdout.read()

    def call(self) -> str:
        """Make the call; returns the process's output once it died."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.read()
        assert self.proc.wait(20) == -9, out  # SIGKILLed at its step
        return out


def _ran(r, key):
    return [int(x.decode().split()[0]) for x in r.lrange(key, 0, -1)]


@pytest.mark.parametrize("opens, step", CASES, ids=[f"{'open' if o else 'join'}-{s}" for o, s in CASES])
def test_celery_a_publisher_killed_at_each_step_loses_no_work_and_runs_nothing_twice(redis_url, prefix, opens, step):
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.search"]  # debounce=1 s, debounce_max=2 s
    try:
        with embedded_worker(app, concurrency=2):
            killed = Publisher("celery", step, "c1", 2, {"TG_TEST_QUEUE": queue, "TG_TEST_PREFIX": prefix})
            first = None if opens else task.delay("c1", 1)  # the window is open and published
            out = killed.call()
            last = task.delay("c1", 3)
            assert last.get(timeout=15) == 3, out
            if first is not None:
                assert first.id == last.id and first.get(timeout=5) == 3
            time.sleep(2.5)  # a second message of the window, if any, arrives and is dropped
        ran = _ran(r, f"{prefix}:searched:c1")
        assert ran == [3], (ran, out)
    finally:
        r.delete(app.tg_log, queue)


@pytest.mark.parametrize("opens, step", CASES, ids=[f"{'open' if o else 'join'}-{s}" for o, s in CASES])
def test_rq_a_publisher_killed_at_each_step_loses_no_work_and_runs_nothing_twice(rq_env, prefix, opens, step):
    from . import rq_jobs

    with RQWorker(rq_env) as worker:
        killed = Publisher("rq", step, "r1", 2, {"TG_TEST_QUEUE": rq_env.name})
        first = None if opens else rq_jobs.search.enqueue_debounced(rq_env, "r1", 1)
        out = killed.call()
        last = rq_jobs.search.enqueue_debounced(rq_env, "r1", 3)  # debounce=1 s, debounce_max=2.5 s
        assert wait_done(last, timeout=20) == JobStatus.FINISHED, out + worker.output()
        assert last.return_value() == 3
        if first is not None:
            assert first.id == last.id
        time.sleep(2.5)
        output = worker.output()
    ran = _ran(rq_env.connection, "{" + prefix + ":searched:r1}")
    assert ran == [3], (ran, out, output)
