"""The runnable examples run as users run them, against the test Redis, and end OK."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "script, ok_line",
    [
        ("examples/outbox/demo.py", "result:                           OK"),
        ("examples/lease_demo.py", "summary: OK"),
        ("examples/limits/demo.py", "result: OK"),
    ],
)
def test_example_runs_and_reports_ok(redis_url, prefix, script, ok_line):
    """Each demo ends OK and leaves other apps' keys on its Redis alone: kombu's and RQ's shared
    bookkeeping written by other workers while it ran (an earlier version deleted every such key
    that had appeared during its run — the `unacked` hash of every worker on that Redis, other
    queues' bindings — and with them in-flight messages of the suite's Celery tests). On a Redis
    server of its own, so that only the demo can touch those keys."""
    import redis as redis_py

    server = RedisServer().start()
    client = redis_py.Redis.from_url(server.url)
    # keys shaped as other apps' shared bookkeeping, written once the demo is running
    others = [f"unacked-{prefix}", f"_kombu.binding.q-{prefix}", f"rq:workers:q-{prefix}"]
    try:
        proc = subprocess.Popen(
            [sys.executable, "-u", script],
            cwd=ROOT,
            env={**os.environ, "TASKGUARD_REDIS_URL": server.url},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first = proc.stdout.readline()
        time.sleep(1.0)
        client.hset(others[0], "tag", "x")
        client.sadd(others[1], f"q-{prefix}\x06\x16\x06\x16q-{prefix}")
        client.sadd(others[2], "worker")
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        out = first + out
        left = [k for k in others if client.exists(k)]
    finally:
        client.close()
        server.close()
    assert proc.returncode == 0, out + err
    assert ok_line in out
    assert left == others
    if "outbox" in script:
        assert re.search(r"duplicate moves: +0\n", out)
        assert re.search(r"rows moved: +40/40\n", out)
        assert re.search(r"retried and restored: +1 +1\n", out)
        assert "redis://" not in out or "***" in out or "@" not in out


@pytest.mark.parametrize("script", ["examples/outbox/demo.py", "examples/lease_demo.py", "examples/limits/demo.py"])
def test_demos_fail_fast_and_never_print_a_url_password(script):
    from .servers import free_port

    url = f"redis://:s3cretPW99@127.0.0.1:{free_port()}/0"  # nothing listens there
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, script],
        cwd=ROOT,
        env={**os.environ, "TASKGUARD_REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert time.monotonic() - started < 30  # fails fast, before starting any worker
    assert "s3cretPW99" not in proc.stdout + proc.stderr
    assert "***" in proc.stdout + proc.stderr


def test_storage_side_fencing_recipes(redis_url, prefix, tmp_path):
    import sqlite3

    import redis as redis_py

    from examples.fencing import redis_fenced_set, sql_fenced_update
    from taskguard import RedisLocks

    locks = RedisLocks(redis_py.Redis.from_url(redis_url), prefix=prefix)
    old = locks.acquire("report", ttl=0.1).lease
    time.sleep(0.2)  # the old holder's lease expires while it "pauses"
    new = locks.acquire("report", ttl=5).lease
    assert new.fencing_token > old.fencing_token

    db = sqlite3.connect(tmp_path / "fence.sqlite", isolation_level=None)
    db.execute("CREATE TABLE reports (id TEXT PRIMARY KEY, body TEXT, fence INTEGER NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO reports (id) VALUES ('daily')")
    assert sql_fenced_update(db, "reports", "daily", new.fencing_token, body="new") is True
    assert sql_fenced_update(db, "reports", "daily", new.fencing_token, body="new again") is True  # same token
    assert sql_fenced_update(db, "reports", "daily", old.fencing_token, body="stale") is False
    assert db.execute("SELECT body, fence FROM reports").fetchone() == ("new again", new.fencing_token)
    with pytest.raises(ValueError):
        sql_fenced_update(db, "reports; DROP TABLE reports", "daily", 1)

    client = redis_py.Redis.from_url(redis_url)
    key = f"{prefix}:store"
    try:
        assert redis_fenced_set(client, key, "new", new.fencing_token) is True
        assert redis_fenced_set(client, key, "stale", old.fencing_token) is False
        assert client.hget(key, "value") == b"new"
    finally:
        client.delete(key)
        new.release()


def test_example_celery_app_report_and_per_customer_syncs(redis_url, prefix, tmp_path):
    """The example app as a user imports it (own process: its shared tasks stay out of this one)."""
    script = """
import app as example
from taskguard import is_skipped
example.app.conf.task_always_eager = True
example.create_schema(4)
assert example.daily_report.delay("2026-11-29").get()["written"] is True
assert {"daily-report", "outbox-drain"} <= set(example.app.conf.beat_schedule)
held = example.sync_customer.taskguard_locks.acquire("customer-sync:7", ttl=10).lease
assert is_skipped(example.sync_customer.delay(7, seconds=0).get())   # customer 7 is busy
assert example.sync_customer.delay(8, seconds=0).get()["customer"] == 8  # customer 8 is not
held.release()
print("example app OK")
"""
    env = {
        **os.environ,
        "TASKGUARD_REDIS_URL": redis_url,
        "OUTBOX_DB": str(tmp_path / "app.sqlite"),
        "OUTBOX_PREFIX": prefix,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "examples" / "outbox"), str(ROOT)]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "example app OK" in proc.stdout
