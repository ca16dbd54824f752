"""The runnable examples run as users run them, against the test Redis, and end OK."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script, ok_line", [
    ("examples/outbox/demo.py", "result:                     OK"),
    ("examples/lease_demo.py", "summary: OK"),
])
def test_example_runs_and_reports_ok(redis_url, script, ok_line):
    proc = subprocess.run([sys.executable, script], cwd=ROOT, env={**os.environ, "TASKGUARD_REDIS_URL": redis_url},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ok_line in proc.stdout
    if "outbox" in script:
        assert "duplicate moves:            0" in proc.stdout
        assert "rows moved:                 40/40" in proc.stdout
