"""Explicit set-up: importing ``taskguard_celery`` connects no Celery signal; the first
``GuardedTask`` bound to an app (or ``taskguard_celery.install``) connects the adapter's receivers,
once per process — and real workers, which bind their tasks before they start, still run them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

from taskguard import as_skipped

from .celery_app import make_app
from .celery_support import ROOT, WorkerProcess, wait_for_body

# Runs in a fresh interpreter (the suite's own process has bound guarded tasks long ago). Prints
# one JSON line: the receivers taskguard added to each Celery signal after each step.
PROBE = """
import json, sys
from celery import Celery, signals
from celery.utils.dispatch import Signal

def receivers():
    return {name: [r for _, r in sig.receivers] for name, sig in sorted(vars(signals).items())
            if isinstance(sig, Signal)}

before = receivers()

def added():
    now = receivers()
    out = {}
    for name, rs in now.items():
        new = [r for r in rs if not any(r is b for b in before[name])]
        if new:
            out[name] = [getattr(r, "__module__", "?") + "." + getattr(r, "__qualname__", repr(r)) for r in new]
    return out

steps = {}
import taskguard_celery
from taskguard_celery import GuardedTask, guarded_task
steps["import"] = added()
app = Celery("probe", broker="memory://", set_as_current=False)
how = sys.argv[1]
if how == "app.task":
    @app.task(base=GuardedTask, name="probe.t", key="k")
    def t():
        return 1
    steps["declared"] = added()  # a lazy task of an unfinalized app is not bound yet
    app.finalize()
elif how == "shared":
    @guarded_task(name="probe.t", key="k")
    def t():
        return 1
    steps["declared"] = added()  # a shared task is bound when an app finalizes
    app.finalize()
elif how == "register_task":
    class T(GuardedTask):
        name = "probe.t"
        key = "k"

        def run(self):
            return 1
    steps["declared"] = added()
    app.register_task(T())
elif how == "install":
    steps["declared"] = added()
    taskguard_celery.install(app)
steps["bound"] = added()
other = Celery("probe2", broker="memory://", set_as_current=False)

@other.task(base=GuardedTask, name="probe.u", key="u")
def u():
    return 2

other.finalize()
assert u() == 2 and u.app is other
taskguard_celery.install()
taskguard_celery.install(app)
steps["again"] = added()
print(json.dumps(steps))
"""

EXPECTED = {
    "task_failure": ["taskguard_celery.supervision._on_failure"],
    "task_revoked": ["taskguard_celery.supervision._on_revoked"],
    "task_unknown": ["taskguard_celery.supervision._on_unknown"],
    "worker_init": ["taskguard_celery.metrics._main_process", "taskguard_celery.pools.check_pool"],
    "worker_process_init": ["taskguard_celery.metrics._pool_child"],
}


@pytest.mark.parametrize("how", ["app.task", "shared", "register_task", "install"])
def test_import_connects_nothing_and_binding_connects_every_receiver_once(how):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, how], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    steps = json.loads(out.stdout.strip().splitlines()[-1])
    assert steps["import"] == {}, steps  # importing taskguard_celery connects no receiver
    assert steps["declared"] == {}, steps
    assert steps["bound"] == EXPECTED, steps  # each receiver connected, once
    # a second app's tasks and two more install() calls connect nothing more
    assert steps["again"] == EXPECTED, steps


def test_a_fresh_cli_worker_runs_the_worker_init_check(redis_url, prefix):
    """``celery worker`` binds its app's tasks (finalizing it) before it sends ``worker_init``, so
    the settings check connected by the first bind still stops a worker with a bad setting."""
    worker = WorkerProcess(
        f"q-{prefix}",
        prefix,
        pool="solo",
        concurrency=1,
        conf={"taskguard_locks": None, "taskguard_redis_url": "redis://:s3cr3t@host:6379/0?bogus=1"},
    )
    worker.start(wait_ready=False)
    try:
        code = worker.proc.wait(60)
    finally:
        worker.stop()
    output = worker.output()
    assert code != 0 and "app.conf.taskguard_redis_url" in output, output[-3000:]
    assert "s3cr3t" not in output and " ready." not in output


def test_spawned_prefork_children_run_the_worker_process_init_receiver(redis_url, prefix, tmp_path):
    """A prefork child started as a fresh interpreter (``worker_pool_start_method="spawn"``)
    inherits nothing: it binds its tasks before ``worker_process_init``, whose receiver installs
    the metrics that ``app.conf.taskguard_metrics`` asks for; the child's skip is counted."""
    from prometheus_client import CollectorRegistry, multiprocess

    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "TASKGUARD_METRICS": ""}
    # (the app is pickled to the child: its Redis from settings, not a RedisLocks object)
    conf = {
        "taskguard_metrics": True,
        "worker_pool_start_method": "spawn",
        "taskguard_locks": None,
        "taskguard_redis_url": redis_url,
        "taskguard_prefix": prefix,
    }
    try:
        with WorkerProcess(queue, prefix, concurrency=2, env=env, conf=conf) as worker:
            first = app.tasks["tg.slow"].delay(7, seconds=3.0)
            wait_for_body(app, "slow:7:start")
            assert as_skipped(app.tasks["tg.slow"].delay(7, seconds=0).get(timeout=20)).reason == "held"
            first.get(timeout=20)
            output = worker.output()
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
        skips = registry.get_sample_value(
            "taskguard_skips_total", {"task": "tg.slow", "reason": "held", "shadow": "false"}
        )
        # (>= 1: on a loaded machine the Redis transport was seen delivering both messages twice
        # while the spawned children started — each copy of the skipped call is judged afresh and
        # counted; what this test checks is that a spawned child counts at all)
        assert skips is not None and skips >= 1, output[-3000:]
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, queue)
