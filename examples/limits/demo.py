"""The limits demo: a real prefork Celery worker (4 processes) runs per-tenant exports under
``limit=2`` and calls to a partner API under a cluster-wide ``rate=``, all published at once.

It shows that no tenant ever has more than two exports running (the others are re-published
until a slot frees, and every export runs in the end), that the API calls never exceed the rate
in any 1-second window (over-rate calls come back at their booked turn without consuming
``max_retries=0``), and ends with ``result: OK`` (exit 0), or says what went wrong (exit 1).

    .venv/bin/python examples/limits/demo.py   (TASKGUARD_REDIS_URL, default redis://127.0.0.1:6379/0)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPORTS = {"acme": 8, "globex": 4}
API_CALLS = 12


class SkipEvents:
    """Collects the ``task-skipped`` events (one per deferral) of the task ids this run published.
    The worker sends them even without ``-E``."""

    def __init__(self, app) -> None:
        self.app = app
        self.ids: set[str] = set()
        self.events: list[dict] = []
        self._receiver = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"task-skipped": self.events.append})
            self._ready.set()
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)
        time.sleep(0.5)  # the receiver's subscription is in place

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(5)

    def deferrals(self, reason: str) -> dict[str, int]:
        """Deferrals per task id: runs re-published to try again (``retrying``) for ``reason``."""
        out: dict[str, int] = {}
        for e in list(self.events):
            if e.get("uuid") in self.ids and e.get("retrying") and e.get("reason") == reason:
                out[e["uuid"]] = out.get(e["uuid"], 0) + 1
        return out


def start_worker(env: dict, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "4",
            "-Q",
            env["LIMITS_QUEUE"],
            "-n",
            f"demo-{env['LIMITS_QUEUE']}@%h",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
        ],
        cwd=HERE,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while b" ready." not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:  # never leave a half-started worker behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            sys.exit(f"the Celery worker did not start:\n{log_path.read_text()}")
        time.sleep(0.1)
    return proc


def stop_worker(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # warm shutdown
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def read_ledger(conn, key: str) -> list[tuple]:
    """The exports' entry/exit records, time-ordered: (time, +1/-1, tenant, slot, fence)."""
    out = []
    for raw in conn.lrange(key, 0, -1):
        kind, at, tenant, slot, fence, _pid = raw.decode().split()
        out.append((float(at), 1 if kind == "in" else -1, tenant, int(slot), int(fence)))
    return sorted(out, key=lambda e: (e[0], e[1]))  # an exit before an entry at the same instant


def peak_and_fences(ledger: list[tuple], tenant: str) -> tuple[int, int, dict[int, list[int]]]:
    """(peak exports of ``tenant`` running at once, exports entered, fencing tokens per slot in entry order)."""
    inside = peak = entered = 0
    fences: dict[int, list[int]] = {}
    for _at, step, who, slot, fence in ledger:
        if who != tenant:
            continue
        inside += step
        peak = max(peak, inside)
        if step == 1:
            entered += 1
            fences.setdefault(slot, []).append(fence)
    return peak, entered, fences


def most_in_window(times: list[float], window: float) -> int:
    """The most calls in any half-open window of ``window`` seconds."""
    return max((sum(1 for t in times[i:] if t < t0 + window) for i, t0 in enumerate(times)), default=0)


def main() -> int:
    run = uuid.uuid4().hex[:8]
    tmp = Path(tempfile.gettempdir()) / "taskguard-demo-limits"
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = tmp / f"worker-{run}.log"
    env = {
        **os.environ,
        "LIMITS_QUEUE": f"limits-{run}",
        "LIMITS_PREFIX": f"limits-demo-{run}",
        "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    os.environ.update({k: env[k] for k in ("LIMITS_QUEUE", "LIMITS_PREFIX")})
    sys.path.insert(0, str(HERE))
    import app as limits  # noqa: E402  (configured by the environment above)
    import redis

    from taskguard import as_skipped
    from taskguard.urls import check_url, redact_url

    try:  # fail fast, before starting a worker that would retry for a minute
        check_url(limits.REDIS_URL, "TASKGUARD_REDIS_URL")
        redis.Redis.from_url(limits.REDIS_URL, socket_connect_timeout=2, socket_timeout=2).ping()
    except Exception as e:
        print(f"cannot use Redis at {redact_url(limits.REDIS_URL)}: {e}", file=sys.stderr)
        return 1

    conn = redis.Redis.from_url(limits.REDIS_URL)
    count, period = limits.API_RATE
    rate_per_s = count / period
    print(
        f"taskguard limits demo: a prefork Celery worker (4 processes) on {redact_url(limits.REDIS_URL)}, "
        f"key prefix {limits.PREFIX}\n"
    )
    events = SkipEvents(limits.app)
    events.start()
    worker = start_worker(env, log_path)
    exports: dict[str, list] = {}
    calls: list = []
    every: list = []
    problems: list[str] = []
    try:
        started = time.time()
        for tenant, n in EXPORTS.items():
            exports[tenant] = [limits.export.delay(tenant, rows=100 * (i + 1)) for i in range(n)]
        calls = [limits.call_api.delay(n) for n in range(API_CALLS)]
        every = [r for rs in exports.values() for r in rs] + calls
        events.ids.update(r.id for r in every)
        print(
            f"published at once: {', '.join(f'{n} exports for {t!r}' for t, n in EXPORTS.items())}, "
            f"{API_CALLS} API calls\n"
        )
        outcomes = {}
        for r in every:
            try:
                outcomes[r.id] = ("ok", r.get(timeout=60, propagate=False), r.state)
            except Exception as e:  # a timeout: the worker stopped taking tasks
                outcomes[r.id] = ("timeout", repr(e), r.state)
        finished = time.time()
        time.sleep(0.5)  # the last events arrive
    finally:
        events.stop()
        stop_worker(worker)

    ledger = read_ledger(conn, limits.LEDGER)
    call_times = sorted(float(x.decode().split()[0]) for x in conn.lrange(limits.CALLS, 0, -1))
    worker_log = log_path.read_text(errors="replace")

    limit_deferrals = events.deferrals("limit")
    print(f'exports (limit={limits.EXPORT_LIMIT} per tenant, on_skip="retry" every 0.5 s)')
    for tenant, results in exports.items():
        ran = [outcomes[r.id][1] for r in results if outcomes[r.id][2] == "SUCCESS"]
        done = [v for v in ran if isinstance(v, dict) and as_skipped(v) is None]
        peak, entered, fences = peak_and_fences(ledger, tenant)
        deferred = sum(limit_deferrals.get(r.id, 0) for r in results)
        waited = sum(1 for r in results if limit_deferrals.get(r.id))
        growing = all(b > a for fs in fences.values() for a, b in zip(fs, fs[1:], strict=False))
        slots = ", ".join(f"slot {s} x{len(fs)}" for s, fs in sorted(fences.items()))
        print(
            f"  {tenant}: {len(done)}/{len(results)} ran, peak {peak} at once; {waited} found both slots taken "
            f"and were re-published ({deferred} deferrals in all)"
        )
        print(
            f"  {' ' * len(tenant)}  leases held: {slots}; fencing token grew on every run of a slot: "
            f"{'yes' if growing else 'NO'}"
        )
        if len(done) != len(results) or entered != len(results):
            problems.append(f"{tenant}: {len(done)} of {len(results)} exports ran ({entered} entered the body)")
        if peak > limits.EXPORT_LIMIT:
            problems.append(f"{tenant}: {peak} exports ran at once (limit {limits.EXPORT_LIMIT})")
        if not growing:
            problems.append(f"{tenant}: fencing tokens did not grow per slot: {fences}")

    rate_deferrals = events.deferrals("rate_limited")
    values = [outcomes[r.id] for r in calls]
    skipped = [v for _, v, state in values if state == "SUCCESS" and as_skipped(v) is not None]
    failed = [(v, state) for _, v, state in values if state != "SUCCESS"]
    max_retries_failed = sum(1 for v, _ in failed if "MaxRetriesExceeded" in repr(v))
    max_retries_failed += worker_log.count("MaxRetriesExceededError")
    allowed = limits.API_BURST + rate_per_s * 1.0
    peak_calls = most_in_window(call_times, 1.0)
    span = call_times[-1] - call_times[0] if call_times else 0.0
    per = "s" if period == 1 else f"{period:g}s"
    print(f'\nAPI calls (rate {count}/{per}, burst {limits.API_BURST}, rate_key "partner-api", max_retries=0)')
    print(f"  {len(call_times)}/{API_CALLS} calls made, over {span:.1f} s")
    print(
        f"  most calls in any 1 s window: {peak_calls} (allowed: burst {limits.API_BURST} + "
        f"{rate_per_s:g}/s x 1 s = {allowed:g})"
    )
    print(
        f"  {len(rate_deferrals)} calls were deferred to a booked turn ({sum(rate_deferrals.values())} deferrals, "
        f"state RETRY), {len(skipped)} skipped past rate_max_wait"
    )
    print(f"  calls failed for max retries: {max_retries_failed}")
    if sorted(int(x.decode().split()[1]) for x in conn.lrange(limits.CALLS, 0, -1)) != list(range(API_CALLS)):
        problems.append(f"API calls: expected each of {API_CALLS} calls to run exactly once, {len(call_times)} ran")
    if peak_calls > allowed:
        problems.append(f"API calls: {peak_calls} calls in one 1 s window, more than {allowed:g}")
    if skipped or failed:
        problems.append(f"API calls: {len(skipped)} skipped, {len(failed)} did not succeed: {failed[:3]}")
    if max_retries_failed:
        problems.append(f"API calls: {max_retries_failed} failed for max retries")
    if "Traceback" in worker_log:
        problems.append("the worker logged a traceback")

    # the run's keys: leases, fences, the rate, the lists, the results, the queue's bookkeeping
    mine = list(conn.scan_iter(match=f"*{limits.PREFIX}*"))
    mine += [k for k in conn.scan_iter(match=f"*{env['LIMITS_QUEUE']}*") if conn.ttl(k) == -1]
    conn.delete(*mine)
    for r in every:
        r.forget()  # the stored results
    conn.close()

    print(f"\nall done in {finished - started:.1f} s")
    if problems:
        print("what went wrong:")
        for p in problems:
            print(f"  - {p}")
        print(f"  (worker log kept in {log_path})")
        print("result: UNEXPECTED")
        return 1
    log_path.unlink(missing_ok=True)
    print("result: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
