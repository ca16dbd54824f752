"""The taskguard demo: a real Celery worker drains an outbox under a fenced lease while
conflicting, retrying and stalled runs are thrown at it, then an RQ worker runs guarded
per-customer syncs beside it; prints what happened.

    python examples/outbox/demo.py        (TASKGUARD_REDIS_URL, default redis://127.0.0.1:6379/0)
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = 40


def describe(out) -> str:
    """One line, the same wording for every run of the demo."""
    from taskguard import as_skipped

    sk = as_skipped(out)  # a Celery JSON result carries the plain tagged dict
    if sk is not None:
        left = f", the holder had {sk.holder_ttl:.1f}s left" if sk.holder_ttl is not None else ""
        return f"skipped (lease {sk.key!r} {sk.reason}{left})"
    return f"ran with fence {out['fence']}, moved {out['moved']} rows"


def print_metrics(metrics_dir: Path) -> dict:
    """What Prometheus would scrape (`taskguard metrics` serves this directory). Returns
    ``{(metric, task): value}`` of the counters labelled by task."""
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    print("\nprometheus (taskguard_* from every worker process)")
    by_task: dict = {}
    for family in sorted(registry.collect(), key=lambda f: f.name):
        if not family.name.startswith("taskguard_"):
            continue
        for s in sorted(family.samples, key=lambda s: (s.name, sorted(s.labels.items()))):
            if s.name.endswith(("_created", "_bucket")) or (s.name.endswith("_sum") and not s.value):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            print(f"  {s.name}{{{labels}}} {s.value:g}")
            if "task" in s.labels:
                by_task[(s.name, s.labels["task"])] = by_task.get((s.name, s.labels["task"]), 0) + s.value
    return by_task


def print_doctor(url: str) -> None:
    """The doctor's report on the Redis the demo used (`taskguard doctor`)."""
    from taskguard import RedisLocks
    from taskguard.cli import doctor_checks

    print("\ntaskguard doctor")
    checks = doctor_checks(RedisLocks.from_url(url, connect_timeout=2, socket_timeout=2))
    for check in checks:
        mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}[check["status"]]
        print(f"  {mark} {check['name']}: {check['detail']}")
    if any(c["status"] == "fail" for c in checks):
        print("  (fine for a demo; production needs every check to pass: see README, Production checklist)")


def start_worker(env: dict, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "3",
            "-Q",
            env["OUTBOX_QUEUE"],
            "-n",
            f"demo-{env['OUTBOX_QUEUE']}@%h",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
        ],
        cwd=HERE,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while b" ready." not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:  # never leave a half-started worker behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            sys.exit(f"the Celery worker did not start:\n{log_path.read_text()}")
        time.sleep(0.1)
    return proc


def main() -> int:
    run = uuid.uuid4().hex[:8]
    tmp = Path(tempfile.mkdtemp(prefix="taskguard-demo-"))
    metrics_dir = tmp / "metrics"  # prometheus_client multiprocess mode: every worker process writes here
    metrics_dir.mkdir()
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "TASKGUARD_METRICS": "1",
        "OUTBOX_DB": str(tmp / "outbox.sqlite"),
        "OUTBOX_QUEUE": f"outbox-{run}",
        "OUTBOX_PREFIX": f"outbox-demo-{run}",
        "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    os.environ.update({k: v for k, v in env.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "TASKGUARD_METRICS")})
    sys.path.insert(0, str(HERE))
    import app as outbox  # noqa: E402  (configured by the environment above)
    import redis

    from taskguard import as_skipped, is_skipped
    from taskguard.urls import check_url, redact_url

    try:  # fail fast, before starting a worker that would retry for a minute
        check_url(outbox.REDIS_URL, "TASKGUARD_REDIS_URL")
        redis.Redis.from_url(outbox.REDIS_URL, socket_connect_timeout=2, socket_timeout=2).ping()
    except Exception as e:
        print(f"cannot use Redis at {redact_url(outbox.REDIS_URL)}: {e}", file=sys.stderr)
        return 1

    outbox.create_schema(ROWS)
    print(
        f"taskguard demo: a prefork Celery worker (3 processes) drains an outbox of {ROWS} rows "
        f"in SQLite, guarded by a fenced lease on {redact_url(outbox.REDIS_URL)}\n"
    )
    worker = start_worker(env, tmp / "worker.log")
    results: dict[str, list] = {"ran": [], "skipped": [], "retried": [], "stale": []}
    try:
        print("1. four drains enqueued at once")
        burst = [outbox.drain.delay(batches=3, pause=0.4) for _ in range(4)]
        for r in burst:
            out = r.get(timeout=30)
            if is_skipped(out):
                results["skipped"].append(out)
            else:
                results["ran"].append(out)
            print(f"   {r.id[:8]}: {describe(out)}")

        print("2. a drain that fails once (downstream timeout) and retries; a rival arrives during its countdown")
        retrying = outbox.drain.delay(batches=3, pause=0.2, fail_first=True)
        time.sleep(0.5)
        rival = outbox.drain.delay(batches=1)
        rival_out = rival.get(timeout=30)
        out = retrying.get(timeout=30)
        with sqlite3.connect(env["OUTBOX_DB"]) as db:
            attempts = db.execute(
                "SELECT attempt, fence FROM runs WHERE task_id = ? ORDER BY attempt", (retrying.id,)
            ).fetchall()
        restored = len(attempts) == 2 and attempts[0][1] == attempts[1][1]
        results["ran"].append(out)
        if restored:
            results["retried"].append(out)
        if is_skipped(rival_out):
            results["skipped"].append(rival_out)
        print(
            f"   {retrying.id[:8]}: attempt 1 failed with fence {attempts[0][1]}; its retry ran with fence "
            f"{attempts[-1][1]} ({'the same lease, restored' if restored else 'a different lease'}), "
            f"moved {out['moved']} rows"
        )
        print(f"   {rival.id[:8]} (the rival, during the countdown): {describe(rival_out)}")

        print("3. a drain stalls past its 1 s TTL (no renewal); a second drain takes over")
        stalled = outbox.stalled_drain.delay(stall=2.5)
        time.sleep(1.6)
        takeover = outbox.drain.delay(batches=2, pause=0.2)
        t_out, s_out = takeover.get(timeout=30), stalled.get(timeout=30)
        results["ran"] += [t_out, s_out]
        results["stale"].append(s_out)
        print(f"   {takeover.id[:8]} (new holder): {describe(t_out)}")
        print(
            f"   {stalled.id[:8]} (stalled holder) woke with fence {s_out['fence']}: its fenced write was "
            f"{'rejected' if s_out['rejected'] else 'ACCEPTED'}, moved {s_out['moved']} rows"
        )

        print("4. drains until the outbox is empty")
        while True:
            with sqlite3.connect(env["OUTBOX_DB"]) as db:
                left = db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
            if not left:
                break
            r = outbox.drain.delay(batches=5, pause=0.05, batch_size=5)
            out = r.get(timeout=30)
            (results["skipped"] if is_skipped(out) else results["ran"]).append(out)
            print(f"   {r.id[:8]}: {describe(out)}")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        # kombu's bindings of the demo's queue have no TTL: they go with the demo
        conn = redis.Redis.from_url(outbox.REDIS_URL)
        leftovers = [k for k in conn.scan_iter(match=f"*{env['OUTBOX_QUEUE']}*") if conn.ttl(k) == -1]
        if leftovers:
            conn.delete(*leftovers)
        conn.close()

    sys.path.insert(0, str(HERE.parent / "rq_sync"))
    import demo as rq_demo  # noqa: E402

    rq = rq_demo.run(
        outbox.REDIS_URL, extra_env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "TASKGUARD_METRICS": "1"}
    )

    with sqlite3.connect(env["OUTBOX_DB"]) as db:
        delivered, distinct = db.execute("SELECT COUNT(*), COUNT(DISTINCT outbox_id) FROM delivered").fetchone()
        left = db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
        rejected = db.execute("SELECT COALESCE(SUM(rejected), 0) FROM runs").fetchone()[0]
    reasons = sorted({as_skipped(s).reason for s in results["skipped"]})
    duplicates = delivered - distinct
    ok = (
        distinct == ROWS
        and left == 0
        and duplicates == 0
        and rejected >= 1
        and len(results["retried"]) == 1
        and len(results["skipped"]) >= 3
        and len(rq["skipped"]) == 1
        and rq["retried"] == 1
    )
    rq_reasons = {s.reason for s in rq["skipped"]}
    rows = [
        ("", "Celery", "RQ"),
        ("ran (runs that held the lease)", len(results["ran"]), rq["ran"]),
        ("skipped", len(results["skipped"]), len(rq["skipped"])),
        ("  skip reasons", ", ".join(reasons) or "-", ", ".join(sorted(rq_reasons)) or "-"),
        ("retried and restored", len(results["retried"]), rq["retried"]),
        ("rows moved", f"{distinct}/{ROWS}", ""),
        ("stale writes rejected", rejected, ""),
        ("duplicate moves", duplicates, ""),
        ("result", "OK" if ok else "UNEXPECTED", ""),
    ]
    print("\nsummary")
    for label, celery, rq_value in rows:
        print(f"  {label + (':' if label.strip() else ''):<34}{celery!s:<8}{rq_value}".rstrip())
    print(f"  (database and worker log kept in {tmp})")
    by_task = print_metrics(metrics_dir)

    def total(metric: str, prefix: str) -> int:
        return int(sum(v for (m, t), v in by_task.items() if m == metric and t.startswith(prefix)))

    # every run that held the lease acquired it afresh, once; a retry restores its run's lease
    counted = {
        "Celery": (
            total("taskguard_leases_acquired_total", "outbox."),
            total("taskguard_leases_restored_total", "outbox."),
        ),
        "RQ": (total("taskguard_leases_acquired_total", "jobs."), total("taskguard_leases_restored_total", "jobs.")),
    }
    expected = {"Celery": (len(results["ran"]), len(results["retried"])), "RQ": (rq["ran"], rq["retried"])}
    agree = counted == expected
    print(
        f"  metrics vs summary: acquired afresh = ran, restored = retried and restored: "
        f"{'agree' if agree else 'DISAGREE'} (Celery {counted['Celery']}, RQ {counted['RQ']})"
    )
    print_doctor(outbox.REDIS_URL)
    return 0 if ok and agree else 1


if __name__ == "__main__":
    sys.exit(main())
