"""The runnable examples run as users run them, against the test Redis, and end OK."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "script, ok_line",
    [
        ("examples/outbox/demo.py", "result:                           OK"),
        ("examples/lease_demo.py", "summary: OK"),
        ("examples/limits/demo.py", "result: OK"),
    ],
)
def test_example_runs_and_reports_ok(redis_url, script, ok_line):
    import redis as redis_py

    client = redis_py.Redis.from_url(redis_url)
    demo_keys = "*demo-*"  # every demo names its keys with a fresh "<name>demo-<run>" prefix
    before = set(client.scan_iter(match=demo_keys, count=1000))
    try:
        proc = subprocess.run(
            [sys.executable, script],
            cwd=ROOT,
            env={**os.environ, "TASKGUARD_REDIS_URL": redis_url},
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:  # the demos leave their lease keys (7-day idle TTL) for a user to look at: not the suite
        made = set(client.scan_iter(match=demo_keys, count=1000)) - before
        if made:
            client.delete(*made)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ok_line in proc.stdout
    if "outbox" in script:
        assert re.search(r"duplicate moves: +0\n", proc.stdout)
        assert re.search(r"rows moved: +40/40\n", proc.stdout)
        assert re.search(r"retried and restored: +1 +1\n", proc.stdout)
        assert "redis://" not in proc.stdout or "***" in proc.stdout or "@" not in proc.stdout


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
