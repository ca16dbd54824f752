"""The RQ half of the demo: two ``rq worker`` processes (taskguard_rq.GuardedWorker) sync customers while
conflicting and retrying jobs are enqueued. ``run(redis_url)`` prints its part of the summary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
from rq import Queue, Retry
from rq.job import JobStatus

HERE = Path(__file__).resolve().parent
DONE = (JobStatus.FINISHED, JobStatus.FAILED)


def wait(job, timeout=30.0):
    deadline = time.monotonic() + timeout
    while job.get_status(refresh=True) not in DONE:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job.id} still {job.get_status()}")
        time.sleep(0.05)
    return job


def run(redis_url: str, extra_env: dict | None = None) -> dict:
    tag = uuid.uuid4().hex[:8]
    env = {
        **os.environ,
        "TASKGUARD_REDIS_URL": redis_url,
        "TASKGUARD_PREFIX": f"rq-demo-{tag}",
        "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **(extra_env or {}),
    }
    os.environ.update({k: env[k] for k in ("TASKGUARD_REDIS_URL", "TASKGUARD_PREFIX")})
    sys.path.insert(0, str(HERE))
    import jobs  # noqa: E402

    from taskguard import is_skipped

    conn = redis.Redis.from_url(redis_url)
    queue = Queue(f"rq-demo-{tag}", connection=conn)
    workers = []
    for i in range(2):  # two worker processes, so two jobs can meet
        log_path = Path(tempfile.gettempdir()) / f"taskguard-rq-demo-{tag}-{i}.log"
        log = open(log_path, "wb")
        workers.append(
            (
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "rq.cli",
                        "worker",
                        "-u",
                        redis_url,
                        "-w",
                        "taskguard_rq.GuardedWorker",
                        "--with-scheduler",
                        queue.name,
                    ],
                    cwd=HERE,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
                log_path,
            )
        )
    try:
        deadline = time.monotonic() + 30
        for worker, log_path in workers:
            while b"Listening on" not in log_path.read_bytes():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the rq worker did not start:\n{log_path.read_text()}")  # finally stops them
                time.sleep(0.1)
        print("5. RQ: two syncs of customer 7 (one skipped), and a sync of customer 8 that fails once and retries")
        first = queue.enqueue(jobs.sync_customer, 7, seconds=1.5)
        time.sleep(0.4)
        second = queue.enqueue(jobs.sync_customer, 7, seconds=0)
        retried = queue.enqueue(jobs.sync_customer, 8, seconds=0.2, fail_first=True, retry=Retry(max=2, interval=1))
        for job in (first, second, retried):
            wait(job)
        outs = {"first": first.return_value(), "second": second.return_value(), "retried": retried.return_value()}
        second.refresh()
        print(f"   job {first.id[:8]}: ran with fence {outs['first']['fence']}")
        sk = outs["second"]
        print(
            f"   job {second.id[:8]}: skipped (lease {sk.key!r} {sk.reason}, the holder had {sk.holder_ttl:.1f}s "
            f"left); job.meta outcome: {second.meta['taskguard']['outcome']}"
        )
        fences = [int(f) for f in conn.lrange(jobs.fences_key(8), 0, -1)]
        restored = retried.get_status() == JobStatus.FINISHED and len(fences) == 2 and fences[0] == fences[1]
        print(
            f"   job {retried.id[:8]}: failed once, retried by RQ; fences per attempt {fences} -> "
            f"the retry restored the same lease: {restored}"
        )
        return {
            "ran": 2,
            "skipped": [outs["second"]] if is_skipped(outs["second"]) else [],
            "retried": 1 if restored else 0,
        }
    finally:
        for worker, _ in workers:
            worker.send_signal(signal.SIGTERM)
        for worker, _ in workers:
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
        queue.delete(delete_jobs=True)
        # RQ's registries of this queue (finished, failed, ...) have no TTL: the demo's go with it
        leftovers = [k for k in conn.scan_iter(match=f"rq:*:rq-demo-{tag}*") if conn.ttl(k) == -1]
        if leftovers:
            conn.delete(*leftovers)
