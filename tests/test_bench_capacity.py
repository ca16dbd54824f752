"""The capacity and Celery comparison benchmarks run end to end (``--quick``: a few seconds each)
and leave no key behind. No figure is checked: the benchmarks print ratios, measured side by side;
python-redis-lock, celery-once and celery-singleton rows appear only where
``bench/requirements-compare.txt`` is installed, and the scripts say so when they are not."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, redis_url: str) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--url", redis_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return out.stdout


def test_bench_capacity_quick(redis_url):
    out = run_bench("bench_capacity.py", redis_url)
    for line in (
        "## distinct:",
        "## hot:",
        "taskguard / redis-py Lock: Redis CPU per cycle",
        "cycles/s per Redis core",
    ):
        assert line in out, out
    assert "keys under tgbench-" in out and "; 0 left" in out, out


def test_bench_celery_compare_quick(redis_url):
    out = run_bench("bench_celery_compare.py", redis_url)
    for line in (
        "guarded / redis-py Lock:",
        "target: guarded >= 0.97x of redis-py Lock by hand:",
        "target: guarded faster than celery-once:",
        "target: guarded faster than celery-singleton:",
        "publisher (this process)",
        "pool children",
    ):
        assert line in out, out
    assert "; 0 left" in out, out
