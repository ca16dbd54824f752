"""The package as users get it: ``python -m build`` makes an sdist and a wheel that ``twine check``
passes; the wheel installs with the ``celery`` and ``rq`` extras into a clean virtual environment,
and there — with no source tree on the path — the CLI, a guarded Celery task on real Redis, a
guarded RQ job and the pytest plugin work."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import taskguard

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.timeout(600)
def test_built_wheel_installs_and_works_without_the_source_tree(tmp_path, redis_url, prefix):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], timeout=300)
    version = taskguard.__version__
    wheel = dist / f"taskguard-{version}-py3-none-any.whl"
    sdist = dist / f"taskguard-{version}.tar.gz"
    assert wheel.exists() and sdist.exists(), sorted(p.name for p in dist.iterdir())
    _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], timeout=120)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    py = str(venv / "bin" / "python")
    _run(
        [py, "-m", "pip", "install", "--disable-pip-version-check", "-q", f"{wheel}[celery,rq]", "pytest"], timeout=400
    )

    work = tmp_path / "user"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TASKGUARD_REDIS_URL=redis_url, PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")

    assert _run([str(venv / "bin" / "taskguard"), "--version"], cwd=work, env=env, timeout=60).strip().endswith(version)

    (work / "user_tasks.py").write_text(
        textwrap.dedent(f"""
        import os
        import redis
        from celery import Celery
        from rq import Queue
        import taskguard, taskguard_celery, taskguard_rq
        from taskguard import RedisLocks, is_skipped
        from taskguard_celery import guarded_task
        from taskguard_rq import guarded_job

        assert "site-packages" in taskguard.__file__ and "site-packages" in taskguard_celery.__file__
        assert "site-packages" in taskguard_rq.__file__
        url = os.environ["TASKGUARD_REDIS_URL"]
        locks = RedisLocks.from_url(url, prefix="{prefix}")
        app = Celery("user", broker=url, set_as_current=False)
        app.conf.update(task_always_eager=True, taskguard_locks=locks)

        @app.task(base=taskguard_celery.GuardedTask, bind=True, ttl=10, key="report:{{day}}")
        def report(self, day):
            return self.lease.fencing_token

        taskguard_rq.use_locks(locks)

        @guarded_job(ttl=10, key="sync:{{n}}")
        def sync(n):
            return n * 2
    """)
    )
    script = textwrap.dedent("""
        import user_tasks as t
        from taskguard import is_skipped
        first = t.report.delay("d1").get()
        assert isinstance(first, int) and first >= 1
        held = t.locks.acquire("report:d2", ttl=10).lease
        assert is_skipped(t.report.delay("d2").get())
        held.release()
        assert t.sync(21) == 42
        held = t.locks.acquire("sync:5", ttl=10).lease
        assert is_skipped(t.sync(5))
        held.release()
        print("user tasks OK")
    """)
    assert "user tasks OK" in _run([py, "-c", script], cwd=work, env=env, timeout=120)

    (work / "test_user.py").write_text(
        textwrap.dedent("""
        from taskguard.testing import assert_skipped

        def test_fixture_gives_locks(taskguard_locks, taskguard_events):
            lease = taskguard_locks.acquire("k", ttl=5).lease
            assert_skipped(taskguard_locks.with_lease("k", lambda lease: 1, ttl=5), reason="held")
            lease.release()
            assert taskguard_events.of("acquire", "acquired")
    """)
    )
    out = _run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py", f"--taskguard-redis-url={redis_url}"],
        cwd=work,
        env=env,
        timeout=120,
    )
    assert "1 passed" in out
