"""Testing the example app's guarded tasks with taskguard's pytest plugin, as a user would: no
Redis, no broker, no worker — the ``taskguard_locks`` fixture (in memory; pass
``--taskguard-redis-url redis://...`` for a real Redis), the ``taskguard_events`` fixture and
``assert_skipped``. Run it from ``examples/outbox``: ``pytest tests/test_app.py``."""

import app as example
import pytest

from taskguard.testing import assert_skipped
from taskguard_celery import use_locks


@pytest.fixture(autouse=True)
def guarded_in_memory(taskguard_locks, tmp_path, monkeypatch):
    monkeypatch.setattr(example, "DB", str(tmp_path / "outbox.sqlite"))
    example.create_schema(4)
    use_locks(example.app, taskguard_locks)  # the app's guarded tasks use the test's locks
    return taskguard_locks


def test_a_report_is_built_once_per_day_and_a_concurrent_run_is_skipped(taskguard_locks, taskguard_events):
    held = taskguard_locks.acquire("report:2026-12-01", ttl=60).lease  # a run already building it
    assert_skipped(example.daily_report("2026-12-01"), reason="held", key="report:2026-12-01")
    assert [e.status for e in taskguard_events.skips] == ["held"]
    held.release()
    out = example.daily_report("2026-12-01")
    assert out["written"] is True and out["fence"] > held.fencing_token


def test_syncs_of_different_customers_do_not_block_each_other(taskguard_locks):
    busy = taskguard_locks.acquire("customer-sync:7", ttl=60).lease
    assert_skipped(example.sync_customer(7, seconds=0), reason="held")
    assert example.sync_customer(8, seconds=0)["customer"] == 8
    busy.release()
