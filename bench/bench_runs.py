#!/usr/bin/env python
"""What a finished guarded Celery run leaves in Redis, side by side with what Celery itself leaves.

Run from the repository root:

    .venv/bin/python bench/bench_runs.py [--runs N] [--url URL]

For four kinds of task — early ack and ``acks_late``, each with its results in the Redis result
backend and with ``ignore_result`` — ``--runs`` (400) runs of a no-op guarded task on one key go
through an embedded Celery worker (threads pool, one thread) on a Redis broker whose
``visibility_timeout`` is 60 s. Then the keys under the run's taskguard prefix are counted and
their ``MEMORY USAGE`` summed, and set beside the ``celery-task-meta-*`` keys the same runs left
in the result backend. Printed per kind: taskguard keys left, those that name a run, bytes per
finished run, the longest TTL among them, and the ratio of taskguard's bytes to Celery's own
result bytes per run.

Keys live under a fresh ``tgbench-<pid>-<random>`` prefix and queue and are deleted at the end
(also after an error, Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import arg_parser, cleanup, exit_on_sigterm, fmt_table, open_admin, run_prefix  # noqa: E402


def measure(url: str, admin, prefix: str, kind: str, acks_late: bool, ignore_result: bool, runs: int) -> list[str]:
    import redis
    from celery import Celery
    from celery.contrib.testing.worker import start_worker

    from taskguard import RedisLocks
    from taskguard_celery import GuardedTask

    tg_prefix = f"{prefix}-{kind}"
    queue = f"{prefix}-{kind}-q"
    app = Celery(f"bench-{kind}", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        broker_transport_options={"visibility_timeout": 60},
        taskguard_locks=RedisLocks(redis.Redis.from_url(url), prefix=tg_prefix),
        result_expires=3600,
        worker_hijack_root_logger=False,
    )

    @app.task(
        base=GuardedTask, shared=False, name=f"bench.noop_{kind}", acks_late=acks_late, ignore_result=ignore_result
    )
    def noop() -> int:
        return 1

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False, loglevel="WARNING"):
        results = [noop.delay() for _ in range(runs)]
        if ignore_result:
            import time

            deadline = time.monotonic() + 120
            while admin.llen(queue) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)
        else:
            for r in results:
                r.get(timeout=120)
    ids = {r.id for r in results}
    tg_keys = list(admin.scan_iter(match="{" + tg_prefix + ":*", count=1000))
    per_run = [k for k in tg_keys if any(i in k for i in ids)]
    tg_bytes = sum(admin.memory_usage(k) or 0 for k in tg_keys)
    ttls = [admin.pttl(k) for k in per_run]
    meta_keys = [f"celery-task-meta-{i}" for i in ids]
    celery_bytes = sum(admin.memory_usage(k) or 0 for k in meta_keys)
    admin.delete(*meta_keys)
    admin.delete(queue)
    per_run_bytes = sum(admin.memory_usage(k) or 0 for k in per_run) / runs
    ratio = f"{per_run_bytes / (celery_bytes / runs):.2f}x" if celery_bytes else "n/a (no result)"
    return [
        kind,
        str(len(tg_keys)),
        str(len(per_run)),
        f"{per_run_bytes:.0f} B",
        f"{max(ttls) / 1000:.0f} s" if ttls else "-",
        f"{tg_bytes} B",
        f"{celery_bytes / runs:.0f} B",
        ratio,
    ]


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--runs", type=int, default=400, help="finished runs per kind (default 400)")
    args = ap.parse_args(argv)
    opened = open_admin(args.url)
    if opened is None:
        return 1
    admin, _info = opened
    exit_on_sigterm()
    prefix = run_prefix()
    rows = []
    try:
        for kind, late, ignore in (
            ("early-ack", False, False),
            ("early-ack, ignore_result", False, True),
            ("acks_late", True, False),
            ("acks_late, ignore_result", True, True),
        ):
            rows.append(
                measure(args.url, admin, prefix, kind.replace(", ", "-").replace("_", "-"), late, ignore, args.runs)
            )
            rows[-1][0] = kind
    finally:
        cleanup(admin, prefix)
    print(f"{args.runs} finished runs of one guarded no-op task per kind (Redis broker, visibility_timeout 60 s)")
    print(
        fmt_table(
            [
                "task",
                "taskguard keys left",
                "naming a run",
                "taskguard B / run",
                "longest TTL",
                "taskguard B in all",
                "Celery result B / run",
                "taskguard / Celery per run",
            ],
            rows,
        )
    )
    print("Keys that name no run are per guard key: its lease hash (fencing token, release mark, last finished run).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
