"""Several OS processes contend for fenced leases on a real Redis; prints who ran, who skipped,
and the fencing tokens that let storage reject a stale holder's write.

    python examples/lease_demo.py          (TASKGUARD_REDIS_URL, default redis://127.0.0.1:6379/0)

Three acts:
1. six processes start the same "daily report" at once with ``wait=0``: one runs, five get an
   explicit ``Skipped`` (never ``None``);
2. six processes drain one outbox with ``wait``: they take turns, and the fencing tokens grow in
   the order they held the lease;
3. a holder pauses past its TTL (like a long GC pause or a stopped VM); another process takes the
   lease with a larger fence and writes; the paused one wakes up and its fenced write is rejected
   by the database (``UPDATE ... WHERE fence <= :token``), and its release reports the loss.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import sys
import tempfile
import time
import uuid

import redis

import taskguard
from taskguard import RedisLocks, is_skipped
from taskguard.urls import redact_url

URL = os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")


def fenced_write(db_path: str, row: str, value: str, token: int) -> bool:
    """The storage-side check: accept a token equal to or above the last one seen, reject lower."""
    with sqlite3.connect(db_path, timeout=10) as db:
        cur = db.execute(
            "UPDATE report SET value = ?, fence = ? WHERE id = ? AND fence <= ?", (value, token, row, token)
        )
        return cur.rowcount == 1


def make_locks(prefix: str) -> RedisLocks:
    return RedisLocks(redis.Redis.from_url(URL), prefix=prefix)


def report_worker(name: str, prefix: str, db_path: str, start_at: float, out: mp.Queue) -> None:
    locks = make_locks(prefix)
    time.sleep(max(0.0, start_at - time.time()))

    def build_report(lease: taskguard.Lease) -> str:
        time.sleep(1.0)  # the report takes a while; the others arrive meanwhile
        ok = fenced_write(db_path, "daily", f"built by {name}", lease.fencing_token)
        return f"wrote the report (fence {lease.fencing_token}, accepted={ok})"

    result = locks.with_lease("daily-report", build_report, ttl=10, task="reports.daily")
    out.put((name, result))


def outbox_worker(name: str, prefix: str, db_path: str, out: mp.Queue) -> None:
    locks = make_locks(prefix)
    acq = locks.acquire("outbox-drain", ttl=10, wait=20, holder={"worker": name})
    with acq.lease as lease:
        with sqlite3.connect(db_path, timeout=10) as db:
            rows = db.execute("SELECT id FROM outbox WHERE sent_fence IS NULL ORDER BY id LIMIT 2").fetchall()
            for (row_id,) in rows:
                db.execute(
                    "UPDATE outbox SET sent_fence = ? WHERE id = ? AND sent_fence IS NULL",
                    (lease.fencing_token, row_id),
                )
        out.put((name, lease.fencing_token, time.time(), [r[0] for r in rows]))
        time.sleep(0.1)


def paused_worker(prefix: str, db_path: str, out: mp.Queue) -> None:
    locks = make_locks(prefix)
    lease = locks.acquire("nightly-export", ttl=1.0).lease  # no heartbeat: the pause outlives it
    out.put(("paused", "acquired", lease.fencing_token))
    time.sleep(2.0)  # paused past the TTL
    accepted = fenced_write(db_path, "export", "written by the paused holder", lease.fencing_token)
    released = lease.release()
    out.put(("paused", "woke up", lease.fencing_token, accepted, released, lease.lost))


def takeover_worker(prefix: str, db_path: str, out: mp.Queue) -> None:
    locks = make_locks(prefix)
    time.sleep(0.3)
    acq = locks.acquire("nightly-export", ttl=10, wait=5)
    with acq.lease as lease:
        accepted = fenced_write(db_path, "export", "written by the new holder", lease.fencing_token)
        out.put(("takeover", "acquired", lease.fencing_token, accepted))
        time.sleep(2.0)


def main() -> int:
    ctx = mp.get_context("spawn")
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(URL)
    try:
        client.ping()
    except redis.RedisError as e:
        print(f"cannot reach Redis at {redact_url(URL)}: {e}", file=sys.stderr)
        return 1
    tmp = tempfile.mkdtemp(prefix="taskguard-demo-")
    db_path = os.path.join(tmp, "demo.sqlite")
    with sqlite3.connect(db_path) as db:
        db.execute("CREATE TABLE report (id TEXT PRIMARY KEY, value TEXT, fence INTEGER NOT NULL)")
        db.executemany("INSERT INTO report VALUES (?, '', 0)", [("daily",), ("export",)])
        db.execute("CREATE TABLE outbox (id INTEGER PRIMARY KEY, sent_fence INTEGER)")
        db.executemany("INSERT INTO outbox (id) VALUES (?)", [(i,) for i in range(1, 13)])

    print(f"taskguard {taskguard.__version__} demo on {redact_url(URL)} (key prefix {prefix})\n")

    # Act 1 ----------------------------------------------------------------------------------
    print("1. six processes start the daily report at the same moment (wait=0)")
    out: mp.Queue = ctx.Queue()
    start_at = time.time() + 1.5
    procs = [ctx.Process(target=report_worker, args=(f"proc-{i}", prefix, db_path, start_at, out)) for i in range(6)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    ran = [(n, r) for n, r in results if not is_skipped(r)]
    skipped = [(n, r) for n, r in results if is_skipped(r)]
    for n, r in sorted(results):
        print(f"   {n}: {r.describe() if is_skipped(r) else r}")
    print(
        f"   -> ran: {len(ran)}, skipped: {len(skipped)} (each an explicit Skipped, reason "
        f"{sorted({r.reason for _, r in skipped})})\n"
    )

    # Act 2 ----------------------------------------------------------------------------------
    print("2. six processes drain one outbox, waiting their turn (wait=20)")
    procs = [ctx.Process(target=outbox_worker, args=(f"proc-{i}", prefix, db_path, out)) for i in range(6)]
    for p in procs:
        p.start()
    turns = sorted((out.get(timeout=60) for _ in procs), key=lambda t: t[2])
    for p in procs:
        p.join()
    for name, fence, _, rows in turns:
        print(f"   {name}: fence {fence} moved rows {rows}")
    fences = [t[1] for t in turns]
    with sqlite3.connect(db_path) as db:
        moved = db.execute("SELECT COUNT(*) FROM outbox WHERE sent_fence IS NOT NULL").fetchone()[0]
    increasing = all(a < b for a, b in zip(fences, fences[1:], strict=False))
    print(
        f"   -> turns: {len(turns)}, fences strictly increasing in lease order: {increasing}, rows moved: {moved}/12\n"
    )

    # Act 3 ----------------------------------------------------------------------------------
    print("3. a holder pauses past its 1 s TTL; another process takes over")
    procs = [
        ctx.Process(target=paused_worker, args=(prefix, db_path, out)),
        ctx.Process(target=takeover_worker, args=(prefix, db_path, out)),
    ]
    for p in procs:
        p.start()
    events = [out.get(timeout=60) for _ in range(3)]
    for p in procs:
        p.join()
    stale_rejected = False
    for ev in events:
        if ev[1] == "acquired" and ev[0] == "paused":
            print(f"   paused holder: acquired, fence {ev[2]}, then stops for 2 s")
        elif ev[0] == "takeover":
            print(f"   new holder:    acquired after the TTL ran out, fence {ev[2]}, fenced write accepted={ev[3]}")
        else:
            _, _, fence, accepted, released, lost = ev
            stale_rejected = not accepted
            print(
                f"   paused holder: woke up with fence {fence}: fenced write accepted={accepted}, "
                f"release()={released}, lease.lost={lost}"
            )
    with sqlite3.connect(db_path) as db:
        value, fence = db.execute("SELECT value, fence FROM report WHERE id = 'export'").fetchone()
    print(f"   -> the row says {value!r} (fence {fence}); stale write rejected: {stale_rejected}\n")

    ok = len(ran) == 1 and len(skipped) == 5 and increasing and moved == 12 and stale_rejected
    print(
        "summary: "
        + ("OK" if ok else "UNEXPECTED")
        + f" - act 1 ran {len(ran)} / skipped {len(skipped)}; act 2 {len(turns)} turns, {moved} rows, "
        f"fences increasing={increasing}; act 3 stale write rejected={stale_rejected}"
    )
    keys = list(client.scan_iter(match="{" + prefix + ":*"))
    if keys:
        client.delete(*keys)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
