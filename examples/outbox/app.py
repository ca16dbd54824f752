"""The Celery example app: an outbox drain with fenced SQL writes, a singleton daily report on
beat, and per-customer keyed syncs — each guarded by a fenced lease.

Every batch moves rows from ``outbox`` to ``delivered`` in one SQLite transaction that first
checks the fencing token (``UPDATE drain_fence SET fence = :t WHERE fence <= :t``, row count 1),
so a holder whose lease was taken over can no longer write, even if it still runs.

Configuration: ``TASKGUARD_REDIS_URL`` (broker, results and leases), ``OUTBOX_DB`` (SQLite
path), ``OUTBOX_QUEUE`` (queue name), ``OUTBOX_PREFIX`` (lease key prefix).
"""

from __future__ import annotations

import os
import sqlite3
import time

from celery import Celery
from celery.schedules import crontab

from taskguard_celery import current_lease, guarded_task

REDIS_URL = os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
DB = os.environ.get("OUTBOX_DB", "outbox.sqlite")

app = Celery("outbox", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=os.environ.get("OUTBOX_QUEUE", "outbox"),
    taskguard_redis_url=REDIS_URL,
    taskguard_prefix=os.environ.get("OUTBOX_PREFIX", "outbox-demo"),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    # run with several `celery beat -S taskguard`: each due run is published once
    beat_schedule={
        "daily-report": {
            "task": "reports.daily",
            "schedule": crontab(hour=6, minute=0),
            "options": {"taskguard": {"ttl": 3600}},
        },
        "outbox-drain": {"task": "outbox.drain", "schedule": 10.0},
    },
)


class Transient(Exception):
    """A passing failure (the downstream API timed out): worth a retry."""


def connect() -> sqlite3.Connection:
    db = sqlite3.connect(DB, timeout=30, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    return db


def create_schema(rows: int) -> None:
    with connect() as db:
        db.executescript("""
            DROP TABLE IF EXISTS outbox; DROP TABLE IF EXISTS delivered;
            DROP TABLE IF EXISTS drain_fence; DROP TABLE IF EXISTS runs;
            CREATE TABLE outbox (id INTEGER PRIMARY KEY, payload TEXT NOT NULL);
            CREATE TABLE delivered (outbox_id INTEGER NOT NULL, payload TEXT NOT NULL, fence INTEGER NOT NULL);
            CREATE TABLE drain_fence (name TEXT PRIMARY KEY, fence INTEGER NOT NULL);
            INSERT INTO drain_fence VALUES ('outbox', 0);
            CREATE TABLE runs (task_id TEXT, attempt INTEGER, fence INTEGER, moved INTEGER, rejected INTEGER);
            DROP TABLE IF EXISTS reports; DROP TABLE IF EXISTS customers;
            CREATE TABLE reports (id TEXT PRIMARY KEY, body TEXT, fence INTEGER NOT NULL DEFAULT 0);
            CREATE TABLE customers (id INTEGER PRIMARY KEY, synced_at REAL, fence INTEGER NOT NULL DEFAULT 0);
        """)
        db.executemany(
            "INSERT INTO outbox (id, payload) VALUES (?, ?)", [(i, f"event-{i}") for i in range(1, rows + 1)]
        )


def move_batch(db: sqlite3.Connection, fence: int, size: int) -> int | None:
    """Move up to ``size`` rows under ``fence``; ``None`` when the fence check rejects the write."""
    db.execute("BEGIN IMMEDIATE")
    try:
        ok = (
            db.execute("UPDATE drain_fence SET fence = ? WHERE name = 'outbox' AND fence <= ?", (fence, fence)).rowcount
            == 1
        )
        if not ok:
            db.execute("ROLLBACK")
            return None
        ids = [r[0] for r in db.execute("SELECT id FROM outbox ORDER BY id LIMIT ?", (size,))]
        for row_id in ids:
            db.execute("INSERT INTO delivered SELECT id, payload, ? FROM outbox WHERE id = ?", (fence, row_id))
            db.execute("DELETE FROM outbox WHERE id = ?", (row_id,))
        db.execute("COMMIT")
        return len(ids)
    except BaseException:
        db.execute("ROLLBACK")
        raise


@guarded_task(name="outbox.drain", bind=True, ttl=10, key="outbox-drain", max_retries=3)
def drain(self, batches: int = 3, batch_size: int = 4, pause: float = 0.3, fail_first: bool = False):
    """Drain a few batches of the outbox; the lease makes this the only drainer at a time."""
    fence = self.lease.fencing_token
    if fail_first and self.request.retries == 0:
        record(self, fence, 0, 0)
        raise self.retry(exc=Transient("downstream timed out"), countdown=1.0)
    moved = rejected = 0
    with connect() as db:
        for _ in range(batches):
            time.sleep(pause)
            n = move_batch(db, fence, batch_size)
            if n is None:
                rejected += 1
                break
            moved += n
    record(self, fence, moved, rejected)
    return {"fence": fence, "moved": moved, "rejected": rejected, "attempt": self.request.retries}


@guarded_task(name="outbox.stalled_drain", bind=True, ttl=1.0, renew=False, key="outbox-drain", on_lost="warn")
def stalled_drain(self, stall: float = 2.5, batch_size: int = 4):
    """A drain that stalls (a long GC pause, a frozen VM) past its 1 s TTL without renewal, then
    tries to write: by then another drainer holds the lease with a larger fence."""
    fence = self.lease.fencing_token
    time.sleep(stall)
    with connect() as db:
        n = move_batch(db, fence, batch_size)
    record(self, fence, n or 0, 1 if n is None else 0)
    return {"fence": fence, "moved": n or 0, "rejected": 1 if n is None else 0, "attempt": 0}


def record(task, fence: int, moved: int, rejected: int) -> None:
    with connect() as db:
        db.execute(
            "INSERT INTO runs VALUES (?, ?, ?, ?, ?)", (task.request.id, task.request.retries, fence, moved, rejected)
        )


@guarded_task(name="reports.daily", ttl=600, key="report:{day}")
def daily_report(day: str = "today") -> dict:
    """The once-a-day report: the lease keeps two runs (two beats, a redelivery) from both
    building it; the fenced write keeps a stale run from overwriting a newer one."""
    from examples.fencing import sql_fenced_update  # noqa: E402 (the storage-side recipe)

    fence = current_lease().fencing_token
    with connect() as db:
        db.execute("INSERT OR IGNORE INTO reports (id) VALUES (?)", (day,))
        written = sql_fenced_update(db, "reports", day, fence, body=f"report for {day}, built under fence {fence}")
    return {"day": day, "fence": fence, "written": written}


@guarded_task(name="customers.sync", ttl=60, key="customer-sync:{customer_id}")
def sync_customer(customer_id: int, seconds: float = 0.5) -> dict:
    """One sync per customer at a time; different customers in parallel."""
    fence = current_lease().fencing_token
    time.sleep(seconds)
    with connect() as db:
        db.execute("INSERT OR IGNORE INTO customers (id) VALUES (?)", (customer_id,))
        db.execute(
            "UPDATE customers SET synced_at = ?, fence = ? WHERE id = ? AND fence <= ?",
            (time.time(), fence, customer_id, fence),
        )
    return {"customer": customer_id, "fence": fence}
