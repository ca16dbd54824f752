"""taskguard's pytest plugin (registered through the ``pytest11`` entry point, so installing
taskguard makes these available in any test suite).

Fixtures:

* ``taskguard_locks`` — a :class:`~taskguard.MemoryLocks` by default (no Redis needed, fast);
  a :class:`~taskguard.RedisLocks` on a real Redis with ``--taskguard-redis-url URL`` (or the
  ini option ``taskguard_redis_url``), under a prefix unique to the test whose keys are deleted
  afterwards. Wire it into your app: Celery ``taskguard_celery.use_locks(app, taskguard_locks)``;
  RQ ``taskguard_rq.use_locks(taskguard_locks)``.
* ``taskguard_events`` — a :class:`~taskguard.testing.CapturedEvents` recording every lease event
  of this process during the test (``taskguard_events.skips``, ``.of("acquire", "acquired")``).

Helper (an import, not a fixture): :func:`taskguard.testing.assert_skipped`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from .locks import Locks
from .memory_locks import MemoryLocks
from .testing import CapturedEvents


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("taskguard")
    group.addoption(
        "--taskguard-redis-url",
        default=None,
        help="taskguard_locks fixture: use this Redis instead of in-memory MemoryLocks",
    )
    parser.addini("taskguard_redis_url", "taskguard_locks fixture: a Redis URL (default: in-memory)", default="")


@pytest.fixture
def taskguard_locks(request: Any) -> Iterator[Locks]:
    """Locks for one test: in memory, or on ``--taskguard-redis-url`` under a fresh prefix."""
    url = request.config.getoption("--taskguard-redis-url") or request.config.getini("taskguard_redis_url")
    prefix = f"tgtest-{uuid.uuid4().hex[:12]}"
    if not url:
        locks: Locks = MemoryLocks(prefix=prefix)
        yield locks
        locks.close(timeout=1)
        return
    from .errors import ConfigError
    from .redis_locks import RedisLocks
    from .urls import check_url

    try:
        redis_locks = RedisLocks.from_url(check_url(url, "--taskguard-redis-url / taskguard_redis_url"), prefix=prefix)
    except ConfigError as e:  # no traceback: its frames would show the URL, password included
        pytest.fail(str(e), pytrace=False)
    try:
        yield redis_locks
    finally:
        try:
            client = redis_locks.client
            keys = list(client.scan_iter(match="{" + prefix + ":*", count=1000))
            if keys:
                client.delete(*keys)
        except Exception:  # an unreachable Redis was already reported by the test itself
            pass
        redis_locks.close(timeout=1)


@pytest.fixture
def taskguard_events() -> Iterator[CapturedEvents]:
    """Every lease event of this process during the test."""
    events = CapturedEvents().start()
    try:
        yield events
    finally:
        events.stop()
