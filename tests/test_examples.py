"""The runnable examples run as users run them, against the test Redis, and end OK."""

from __future__ import annotations

import os
import re
import time
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script, ok_line", [
    ("examples/outbox/demo.py", "result:                           OK"),
    ("examples/lease_demo.py", "summary: OK"),
])
def test_example_runs_and_reports_ok(redis_url, script, ok_line):
    proc = subprocess.run([sys.executable, script], cwd=ROOT, env={**os.environ, "TASKGUARD_REDIS_URL": redis_url},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ok_line in proc.stdout
    if "outbox" in script:
        assert re.search(r"duplicate moves: +0\n", proc.stdout)
        assert re.search(r"rows moved: +40/40\n", proc.stdout)
        assert re.search(r"retried and restored: +1 +1\n", proc.stdout)
        assert "redis://" not in proc.stdout or "***" in proc.stdout or "@" not in proc.stdout


@pytest.mark.parametrize("script", ["examples/outbox/demo.py", "examples/lease_demo.py"])
def test_demos_fail_fast_and_never_print_a_url_password(script):
    from .servers import free_port

    url = f"redis://:s3cretPW99@127.0.0.1:{free_port()}/0"  # nothing listens there
    started = time.monotonic()
    proc = subprocess.run([sys.executable, script], cwd=ROOT, env={**os.environ, "TASKGUARD_REDIS_URL": url},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - started < 30  # fails fast, before starting any worker
    assert "s3cretPW99" not in proc.stdout + proc.stderr
    assert "***" in proc.stdout + proc.stderr
