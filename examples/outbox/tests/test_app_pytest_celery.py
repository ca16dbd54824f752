"""The same guarantee end to end in the pytest-celery 1.x style, for users who have Docker: a real
worker in a container (pytest-celery's ``celery_setup``: broker, backend and worker containers),
the example task sent twice, and ``assert_skipped`` on what the client gets back.

Not run by this repository's suite (its machines have no Docker engine): the suite proves that
taskguard's plugin and tests work with pytest-celery installed, and ``tests/test_app.py`` checks
the same guarantee in memory. The worker container must be able to import taskguard and this
app: build it from the repository's ``Dockerfile`` and point pytest-celery's
``default_worker_container`` at it (pytest-celery's "custom worker" recipe), with
``TASKGUARD_REDIS_URL`` set to the setup's Redis. Run from ``examples/outbox``:
``pytest tests/test_app_pytest_celery.py``.
"""

import pytest

pytest_celery = pytest.importorskip("pytest_celery")

from taskguard.testing import assert_skipped  # noqa: E402


@pytest.fixture
def default_worker_tasks(default_worker_tasks: set) -> set:
    """pytest-celery copies these modules into its worker container."""
    import app

    default_worker_tasks.add(app)
    return default_worker_tasks


def test_a_second_report_while_one_runs_is_skipped(celery_setup):
    first = celery_setup.app.send_task("customers.sync", (7,), {"seconds": 3})
    second = celery_setup.app.send_task("customers.sync", (7,), {"seconds": 0})
    assert_skipped(second.get(timeout=30), reason="held")
    assert first.get(timeout=30)["customer"] == 7
