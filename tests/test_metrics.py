"""Prometheus metrics: in-process, from Celery prefork children and RQ work-horses (multiprocess
mode), and Flower's own counter of ``task-skipped`` events from a real ``celery flower``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, multiprocess

from taskguard import RedisLocks, add_listener, as_skipped, remove_listener
from taskguard.metrics import Metrics

from .celery_app import make_app
from .celery_support import ROOT, WorkerProcess, wait_for_body
from .servers import free_port


def sample(registry, name, **labels):
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_metrics_count_acquires_skips_losses_and_failed_renewals(client, prefix):
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    add_listener(metrics)
    try:
        locks = RedisLocks(client, prefix=prefix, renew_fraction=0.25)
        held = locks.acquire("k", ttl=0.4, renew=True, holder={"task": "reports.build"}).lease
        out = locks.with_lease("k", lambda lease: None, ttl=1, task="reports.build")
        client.hset("{" + prefix + ":k}", "o", "thief")
        time.sleep(0.5)  # the heartbeat finds it lost
        assert held.lost and out.reason == "held"
        # a claim (what a retry does with the lease its run kept) is counted apart from acquisitions
        kept = locks.acquire("c", ttl=5, holder={"task": "reports.build"}).lease
        assert locks.claim("c", kept.owner_token, ttl=5, holder={"task": "reports.build"}).lease.release()
    finally:
        remove_listener(metrics)
    assert sample(registry, "taskguard_leases_acquired_total", task="reports.build") == 2
    assert sample(registry, "taskguard_leases_restored_total", task="reports.build") == 1
    assert sample(registry, "taskguard_skips_total", task="reports.build", reason="held", shadow="false") == 1
    assert sample(registry, "taskguard_leases_lost_total", task="reports.build") == 1
    assert sample(registry, "taskguard_lease_renewals_failed_total") >= 1
    assert sample(registry, "taskguard_acquire_duration_seconds_count") == 3  # the claim is not an acquire
    exposition = "\n".join(str(m) for m in registry.collect())
    assert prefix not in exposition and held.owner_token not in exposition  # no keys, no tokens as labels


def multiproc_registry(path: Path) -> CollectorRegistry:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(path))
    return registry


def test_a_skip_in_a_prefork_child_is_counted(redis_url, prefix, tmp_path):
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "TASKGUARD_METRICS": "1"}
    try:
        with WorkerProcess(queue, prefix, concurrency=2, env=env):
            first = app.tasks["tg.slow"].delay(1, seconds=3.0)
            wait_for_body(app, "slow:1:start")
            assert as_skipped(app.tasks["tg.slow"].delay(1, seconds=0).get(timeout=10)).reason == "held"
            first.get(timeout=10)
        registry = multiproc_registry(tmp_path)  # what `taskguard metrics` would serve
        assert sample(registry, "taskguard_skips_total", task="tg.slow", reason="held", shadow="false") == 1
        assert sample(registry, "taskguard_leases_acquired_total", task="tg.slow") == 1
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, queue)


@pytest.mark.timeout(240)
def test_a_skip_in_an_rq_work_horse_is_counted(redis_url, prefix, tmp_path):
    from rq import Queue

    from . import rq_jobs

    env = {
        **os.environ,
        "TASKGUARD_REDIS_URL": redis_url,
        "TASKGUARD_PREFIX": prefix,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "TASKGUARD_METRICS": "1",
    }
    conn = redis.Redis.from_url(redis_url)
    queue = Queue(f"q-{prefix}", connection=conn)
    locks = RedisLocks(conn, prefix=prefix)
    held = locks.acquire("slow:5", ttl=30).lease
    job = queue.enqueue(rq_jobs.slow, 5, seconds=0)
    proc = subprocess.run(
        [sys.executable, "-m", "rq.cli", "worker", "-u", redis_url, "--burst", queue.name],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,  # (a plain rq worker on redis-py 8.2 may take 60 s to exit: README, RQ workers)
    )
    held.release()
    assert proc.returncode == 0, proc.stderr
    assert job.return_value().reason == "held"
    registry = multiproc_registry(tmp_path)
    assert (
        sample(registry, "taskguard_skips_total", task=rq_jobs.slow.taskguard_name, reason="held", shadow="false") == 1
    )
    queue.delete(delete_jobs=True)


def _served(directory) -> str:
    """What ``taskguard metrics`` serves from ``directory`` (its PROMETHEUS_MULTIPROC_DIR)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "taskguard.cli", "metrics", "--port", str(port), "--addr", "127.0.0.1"],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.2)
        return ""
    finally:
        server.terminate()
        server.wait(10)


def test_taskguard_metrics_command_serves_the_multiprocess_directory(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    writer = (
        "import os; from taskguard.metrics import Metrics; "
        "m = Metrics(); m.skips.labels(task='t', reason='held', shadow='false').inc(3)"
    )
    subprocess.run([sys.executable, "-c", writer], env=env, check=True, timeout=30)
    assert 'taskguard_skips_total{reason="held",shadow="false",task="t"} 3.0' in _served(tmp_path)


def test_taskguard_metrics_adds_up_the_subdirectories_of_containers_sharing_a_volume(tmp_path):
    """Processes of several containers share one volume, each container with a directory of its
    own (prometheus_client names sample files by PID, unique only within a container; two PID 1
    processes would write the same file). ``install()`` creates a container's directory; the
    metrics server, pointed at the parent, serves the sum of the parent's and every
    subdirectory's samples."""
    writer = (
        "import sys; from taskguard.metrics import install; "
        "install().skips.labels(task='t', reason='held', shadow='false').inc(int(sys.argv[1]))"
    )
    for where, n in ((tmp_path / "worker-1", 3), (tmp_path / "worker-2", 4), (tmp_path, 5)):
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(where)}
        subprocess.run([sys.executable, "-c", writer, str(n)], env=env, check=True, timeout=30)
    assert (tmp_path / "worker-1").is_dir() and list((tmp_path / "worker-2").glob("*.db"))
    body = _served(tmp_path)
    assert 'taskguard_skips_total{reason="held",shadow="false",task="t"} 12.0' in body, body


def test_taskguard_metrics_without_a_multiprocess_directory_refuses_to_start(tmp_path):
    """Without PROMETHEUS_MULTIPROC_DIR the command would serve only its own process's samples
    (none of taskguard's): it exits 78 naming the variable instead of serving an empty endpoint."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    for extra, said in (({}, "is not set"), ({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "none")}, "not a directory")):
        out = subprocess.run(
            [sys.executable, "-m", "taskguard.cli", "metrics", "--port", str(free_port()), "--addr", "127.0.0.1"],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 78 and "PROMETHEUS_MULTIPROC_DIR" in out.stderr and said in out.stderr, out


@pytest.mark.parametrize("mode", ["result", "ignore"])
def test_flower_counts_task_skipped_events(redis_url, prefix, mode):
    """A real ``celery flower`` counts the worker's task-skipped events in
    ``flower_events_total{type="task-skipped"}``; with on_skip="ignore" its task list shows the
    state SKIPPED (with "result" the task-succeeded event that follows outranks it)."""
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    port = free_port()
    env = {**os.environ, "TG_TEST_QUEUE": queue, "TG_TEST_PREFIX": prefix, "FLOWER_UNAUTHENTICATED_API": "true"}
    log = open(Path(tempfile.gettempdir()) / f"tg-flower-{prefix}.log", "wb")
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.celery_app", "flower", f"--port={port}", "--address=127.0.0.1"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    task = "tg.slow" if mode == "result" else "tg.on_skip_ignore"
    args = (1,) if mode == "result" else ()
    try:
        metrics = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                time.sleep(0.3)
        with WorkerProcess(queue, prefix, concurrency=2, extra=("-E",)):  # all task events on
            time.sleep(2.0)
            first = app.tasks[task].apply_async(args, {"seconds": 3.0})
            wait_for_body(app, "slow:1:start" if mode == "result" else "ignore:0:ran")
            second = app.tasks[task].apply_async(args, {"seconds": 0})
            first.get(timeout=15)
            line = ""
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not line:
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                line = next(
                    (
                        m
                        for m in metrics.splitlines()
                        if m.startswith("flower_events_total") and 'type="task-skipped"' in m and f'task="{task}"' in m
                    ),
                    "",
                )
                time.sleep(0.3)
            import json

            state = json.loads(
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/task/info/{second.id}", timeout=5).read()
            )["state"]
        print("   ", line, "| state:", state)
        assert line.endswith(" 1.0")
        assert state == ("SUCCESS" if mode == "result" else "SKIPPED")
    finally:
        flower.terminate()
        flower.wait(15)
        log.close()
        redis.Redis.from_url(redis_url).delete(app.tg_log, queue)


_BLOCKED = "import sys; sys.modules[{mod!r}] = None; from taskguard.cli import main; main()"


@pytest.mark.parametrize(
    "mod, args, extra",
    [
        ("prometheus_client", ["metrics", "--port", "0", "--addr", "127.0.0.1"], "prometheus"),
        ("taskguard_rq.cron", ["rq-cron", "no_such_config.py"], "rq"),
    ],
    ids=["metrics", "rq-cron"],
)
def test_a_command_whose_extra_is_missing_says_which_extra_and_never_to_install_by_name(tmp_path, mod, args, extra):
    """``taskguard metrics`` without prometheus_client (before: a raw ModuleNotFoundError
    traceback) and ``taskguard rq-cron`` without RQ: one clean line naming the extra, never
    ``pip install taskguard[...]`` (that name on PyPI is an unrelated project)."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "TASKGUARD_REDIS_URL": "redis://127.0.0.1:6379/0"}
    out = subprocess.run(
        [sys.executable, "-c", _BLOCKED.format(mod=mod), *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 78, out  # EX_CONFIG, as a refused configuration or missing directory
    assert "Traceback" not in out.stderr and f"{extra!r} extra" in out.stderr, out.stderr
    assert "pip install taskguard" not in out.stderr and 'pip install "taskguard[' not in out.stderr


def test_metrics_install_without_prometheus_client_names_the_extra(monkeypatch):
    from taskguard import metrics

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setattr(metrics, "_installed", None)
    with pytest.raises(ImportError, match="'prometheus' extra") as info:
        metrics.install()
    assert 'pip install "taskguard[' not in str(info.value)
