"""Copied to the root of Celery's source tree as ``conftest.py`` for the guarded run of
``./run celery-suite``: every task of the integration suite's test app is a
:class:`taskguard_celery.GuardedTask` (``Celery(task_cls=...)``, through the
``celery_parameters`` fixture that ``celery.contrib.pytest`` asks projects to redefine), with a
key unique to each run (its task id), so no two runs ever contend: the guard must then be
invisible. Leases go to ``TASKGUARD_REDIS_URL`` (a private redis-server)."""

from __future__ import annotations

import os
import uuid

import pytest
from celery import current_task

from taskguard_celery import GuardedTask


def run_key(**_arguments: object) -> str:
    """A key per run: the id of the request being run (a worker's or ``apply()``'s; retries keep
    it), a fresh one for a direct call."""
    request = getattr(current_task, "request", None)
    task_id = None if request is None or request.called_directly else request.id
    return f"celery-suite:{task_id or uuid.uuid4().hex}"


class SuiteTask(GuardedTask):
    """The test app's task class: guarded, never contending."""

    key = run_key


@pytest.fixture(scope="session")
def celery_parameters():
    return {"task_cls": SuiteTask}


@pytest.fixture(scope="session", autouse=True)
def taskguard_really_guards(celery_session_app):
    """Write how many of the test app's tasks are guarded to ``$TASKGUARD_SUITE_REPORT`` (the
    script refuses a guarded run where the hook did not take)."""
    yield
    tasks = [t for n, t in celery_session_app.tasks.items() if n.startswith("t.integration.tasks.")]
    guarded = [t for t in tasks if isinstance(t, GuardedTask)]
    with open(os.environ["TASKGUARD_SUITE_REPORT"], "w") as f:
        f.write(f"{len(guarded)} {len(tasks)}\n")
