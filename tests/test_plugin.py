"""taskguard's pytest plugin as users get it: registered by the ``pytest11`` entry point (no
``conftest.py`` line), its fixtures and ``assert_skipped`` used by the example app's own tests,
run by pytest in a subprocess — with pytest-celery 1.x installed, as Celery users have it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from taskguard import MemoryLocks, Skipped
from taskguard.testing import CapturedEvents, assert_skipped

ROOT = Path(__file__).resolve().parent.parent


def _pytest(args, cwd, env=None):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_the_example_apps_tests_pass_with_the_plugin(backend, redis_url, tmp_path):
    args = ["tests/test_app.py", f"--basetemp={tmp_path / 'pt'}"]
    if backend == "redis":
        args.append(f"--taskguard-redis-url={redis_url}")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "examples" / "outbox"), str(ROOT)])}
    out = _pytest(args, ROOT / "examples" / "outbox", env)
    print("   ", out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "2 passed" in out.stdout


def test_pytest_celery_is_installed_and_its_plugin_loads_beside_ours():
    """The suite runs with pytest-celery 1.x installed (it replaces Celery's classic fixtures)."""
    import pytest_celery

    out = _pytest(["--fixtures", str(ROOT / "tests" / "test_plugin.py")], ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "celery_setup" in out.stdout and "taskguard_locks" in out.stdout and "taskguard_events" in out.stdout
    assert pytest_celery.__version__.split(".")[0] == "1"


def test_assert_skipped_and_captured_events():
    locks = MemoryLocks()
    events = CapturedEvents().start()
    held = locks.acquire("k", ttl=5).lease
    out = locks.with_lease("k", lambda lease: "ran", ttl=5)
    events.stop()
    assert assert_skipped(out, "held", key="k") == out
    assert assert_skipped(out.to_dict(), "held").key == "k"  # the form a Celery JSON result carries
    with pytest.raises(AssertionError, match="expected a skip with reason 'running'"):
        assert_skipped(out, "running")
    with pytest.raises(AssertionError, match="expected a skipped run, got 'ran'"):
        assert_skipped("ran")
    assert [e.status for e in events.of("acquire")] == ["acquired", "held"] and events.skips[0].status == "held"
    assert isinstance(out, Skipped)
    held.release()


def test_a_bad_redis_url_for_the_fixture_is_named_and_never_shown(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_x(taskguard_locks):\n    pass\n")
    out = _pytest(["test_x.py", "--taskguard-redis-url=http://:S3cretPW@h/0"], tmp_path)
    assert out.returncode != 0
    assert "--taskguard-redis-url" in out.stdout and "S3cretPW" not in out.stdout + out.stderr
