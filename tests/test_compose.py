"""docker-compose.yml cannot run here (no Docker engine): check its structure instead, and that
every command it runs exists in this project (module, entry point, worker class, CLI command)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def load():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_redis_settings():
    compose = load()
    services = compose["services"]
    assert {
        "redis",
        "rabbitmq",
        "worker-1",
        "worker-2",
        "beat-1",
        "beat-2",
        "flower",
        "rq-worker",
        "metrics",
        "doctor",
    } <= set(services)
    redis_cmd = services["redis"]["command"]
    assert "noeviction" in redis_cmd and redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    for name in ("worker-1", "worker-2", "beat-1", "beat-2", "flower", "rq-worker", "metrics", "doctor"):
        env = services[name]["environment"]
        assert env["TASKGUARD_REDIS_URL"] == "redis://redis:6379/0", name
        assert services[name]["build"] == "."
    assert [services[b]["command"][services[b]["command"].index("-S") + 1] for b in ("beat-1", "beat-2")] == [
        "taskguard",
        "taskguard",
    ]
    schedules = {services[b]["command"][services[b]["command"].index("-s") + 1] for b in ("beat-1", "beat-2")}
    assert len(schedules) == 2  # each beat its own schedule file


def test_every_command_exists_in_the_project(monkeypatch):
    compose = load()
    dockerfile = (ROOT / "Dockerfile").read_text()
    for path in ("/app/examples/outbox", "/app/examples/rq_sync"):
        assert path in dockerfile
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "outbox"))
    for name, svc in compose["services"].items():
        cmd = svc.get("command")
        if not cmd or name in ("redis", "rabbitmq"):
            continue
        program = cmd[0]
        assert shutil.which(program, path=str(Path(sys.executable).parent)), f"{name}: {program} not installed"
        if program == "celery":
            module = cmd[cmd.index("-A") + 1]
            app_module = importlib.import_module(module)
            assert hasattr(app_module, "app"), name
            if "-S" in cmd:
                from importlib.metadata import entry_points

                alias = cmd[cmd.index("-S") + 1]
                assert alias in {e.name for e in entry_points(group="celery.beat_schedulers")}
        elif program == "rq":
            worker_class = cmd[cmd.index("-w") + 1]
            mod, _, cls = worker_class.rpartition(".")
            assert hasattr(importlib.import_module(mod), cls), name
        elif program == "taskguard":
            out = subprocess.run(
                [sys.executable, "-m", "taskguard.cli", cmd[1], "--help"], capture_output=True, text=True, timeout=30
            )
            assert out.returncode == 0, f"{name}: taskguard {cmd[1]}: {out.stderr}"


def test_the_metrics_service_reads_the_samples_the_workers_write():
    """``taskguard metrics`` serves the files of PROMETHEUS_MULTIPROC_DIR: in the stack that
    directory must be on the volume every app container mounts, not in each container's own
    filesystem (where the metrics service would serve none of the workers' samples)."""
    compose = load()
    dockerfile = (ROOT / "Dockerfile").read_text()
    where = next(
        line.split("PROMETHEUS_MULTIPROC_DIR=")[1].split()[0].rstrip("\\")
        for line in dockerfile.splitlines()
        if "PROMETHEUS_MULTIPROC_DIR=" in line
    )
    assert f"mkdir -p {where}" in dockerfile
    for name in ("worker-1", "worker-2", "rq-worker", "metrics"):
        mounts = [v.split(":")[1] for v in compose["services"][name]["volumes"]]
        assert any(where == m or where.startswith(m.rstrip("/") + "/") for m in mounts), (name, where, mounts)


def test_each_container_writes_its_metrics_samples_to_a_directory_of_its_own():
    """prometheus_client names a process's sample files by its PID, unique only within one
    container: containers sharing the volume would write each other's files (two PID 1
    processes, one file). Each container that runs taskguard has its own directory under the
    metrics service's, which serves their sum (``taskguard.metrics.serve``)."""
    services = load()["services"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "PROMETHEUS_MULTIPROC_DIR=/data/metrics" in dockerfile  # the metrics service's: the parent
    assert "PROMETHEUS_MULTIPROC_DIR" not in services["metrics"].get("environment", {})
    dirs = {
        name: svc["environment"]["PROMETHEUS_MULTIPROC_DIR"]
        for name, svc in services.items()
        if name not in ("redis", "rabbitmq", "metrics")
    }
    assert all(d == f"/data/metrics/{name}" for name, d in dirs.items()), dirs
