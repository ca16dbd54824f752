#!/usr/bin/env python
"""Celery benchmark: a no-op task guarded with GuardedTask vs the same task unguarded.

Run from the repository root:

    .venv/bin/python bench/bench_celery.py [--tasks N] [--rounds R] [--calls C] [--url URL]

What it measures, in one run, on one Redis (default ``$TASKGUARD_REDIS_URL`` or
``redis://127.0.0.1:6379/0``; meant for loopback), with Celery's Redis broker and Redis result
backend and ONE ``celery worker -P prefork -c 2`` subprocess (``bench/celery_bench_app.py``):

* ``guarded``    ``@app.task(base=GuardedTask, key="noop:{i}")`` - each call its own key (no
                 contention), GuardedTask defaults: ttl=60, renew=True, wait=0, done marker on
* ``unguarded``  ``@app.task`` with the same body (``return i``)
* ``2x PING``    (throughput only) the unguarded body plus two PINGs on a plain redis-py client:
                 the two round trips (acquire, release) any Redis lease guard costs at least
* ``redis-py Lock`` (throughput only) the body under redis-py's ``Lock`` taken by hand
                 (``acquire(blocking=False)``, ``release()``): what users write today

1. Throughput, in interleaved rounds (order rotated each round). Each round, per kind: N
   messages are published to a staging list the worker does not consume, then moved onto the
   worker's queue in one atomic ``RENAMENX``; the clock runs from that move until all N results
   are in the result backend (``EXISTS`` on the result keys; the values are then read back with
   ``ResultSet.get()`` and checked, outside the window). So the timed window is the worker
   draining a backlog, not this client publishing or parsing on the same cores (``--wait celery``
   times ``ResultSet.get()`` instead; it is client-bound, see bench/README.md). Reported: tasks/s
   (median over rounds), the worker-side rate (first to last result ``date_done``), the
   guarded/unguarded ratio per round (median, min..max), and the CPU time per task of each process
   taking part (/proc, and ``INFO cpu`` for a local Redis).
2. Added latency: a sequential ``delay(i).get()`` loop, the two kinds alternating call by call;
   p50/p99 per kind and the median difference guarded - unguarded.
3. Redis commands per task while the worker drains one more batch per kind, by process: MONITOR,
   counting only this run's connections (client ports mapped to the worker's processes through
   /proc), so other clients of a shared Redis do not pollute it; the commands each taskguard
   script ran inside (acquire, release with the done marker, heartbeat renewals); ``INFO
   commandstats`` deltas over the same windows as a cross-check.
4. Diagnostic (``--no-diagnostics`` skips it): the guard's cost in this process, without the
   worker: ``task.apply()`` guarded, unguarded and with a pass-through ``__call__``; the bare
   ``Locks.acquire``/``release`` the guard runs, with and without heartbeat registration; 2x PING.

Queue, staging list and lease prefix are unique per run; the worker is stopped and every key,
queue, binding and result of the run is deleted at the end, also after an error or Ctrl-C.
Nothing in taskguard is patched.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.utils

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

EXTRA_PATH = [str(HERE)]  # what the worker subprocess needs on PYTHONPATH
try:  # run from a checkout without installing
    import taskguard
    import taskguard_celery  # noqa: F401
except ImportError:  # pragma: no cover
    EXTRA_PATH += [str(ROOT), str(ROOT / "integrations")]
    sys.path[:0] = EXTRA_PATH[1:]
    import taskguard

# (imported after the sys.path set-up above)
from benchlib import delete_matching, fmt_table, git_state, pct, run_prefix, verdict  # noqa: E402

from taskguard.urls import redact_url  # noqa: E402

KINDS = ("unguarded", "guarded")  # latency and command counts
#: throughput also runs the two comparison tasks of celery_bench_app (no taskguard in them)
THROUGHPUT_KINDS = ("unguarded", "2x PING", "redis-py Lock", "guarded")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- small helpers ---------------------------------------------------------------------------------
# -- the worker subprocess -------------------------------------------------------------------------
class Worker:
    """One ``celery -A celery_bench_app worker -P prefork -c N`` subprocess for this run's queue."""

    def __init__(self, queue: str, node: str, concurrency: int, env: dict[str, str]) -> None:
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_bench_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            str(concurrency),
            "-Q",
            queue,
            "-n",
            node,
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
        ]
        self.env = env
        fd, name = tempfile.mkstemp(prefix=f"{queue}-worker-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> None:
        self._log = open(self.log_path, "wb")
        # cwd: the bench directory, not the repository root: Celery puts the working directory
        # first on sys.path, where the root's taskguard/ would shadow the one PYTHONPATH names
        # (bench_ab.py measures other trees' taskguard this way)
        self.proc = subprocess.Popen(
            self.args, cwd=HERE, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def check(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(
                f"the worker exited (rc {self.proc.returncode if self.proc else None}):\n{self.output()[-4000:]}"
            )

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def pids(self) -> tuple[int, list[int]]:
        """(main pid, pool children pids)."""
        assert self.proc is not None
        kids: list[int] = []
        try:
            for task in os.listdir(f"/proc/{self.proc.pid}/task"):
                with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                    kids += [int(x) for x in f.read().split()]
        except OSError:
            pass
        return self.proc.pid, sorted(set(kids))

    def stop(self, timeout: float = 15.0) -> int | None:
        """Warm shutdown (SIGTERM); the whole process group is killed if that takes too long."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # pool children left behind by a killed main process
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def remove_log(self) -> None:
        try:
            self.log_path.unlink()
        except OSError:
            pass


HOST = "host (every process)"


def host_busy() -> float:
    """CPU seconds the whole host has been busy (all CPUs, from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def proc_times(pid: int) -> tuple[float, float, int]:
    """(user seconds, system seconds, voluntary context switches) of one process; zeros when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            vcsw = next((int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches")), 0)
        return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK, vcsw
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0, 0


# -- the run -----------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, run: str, admin: redis.Redis) -> None:
        self.args = args
        self.run = run
        self.queue = run
        self.staging = f"{run}.staging"
        self.admin = admin
        import celery_bench_app as m  # main() sets TGBENCH_QUEUE / TGBENCH_PREFIX before importing it

        self.m = m
        self.app = m.app
        self.tasks = {
            "unguarded": m.noop,
            "guarded": m.guarded_noop,
            "2x PING": m.two_pings_noop,
            "redis-py Lock": m.redispy_lock_noop,
        }
        self.task_ids: list[str] = []
        self.next_i = 0
        self.worker: Worker | None = None
        self.local_redis = args.url_host in ("127.0.0.1", "localhost", "::1")

    def ids(self, n: int) -> range:
        r = range(self.next_i, self.next_i + n)
        self.next_i += n
        return r

    # -- publishing and draining a backlog -----------------------------------------------------------
    def stage(self, kind: str, n: int) -> tuple[list[Any], list[int]]:
        """Publish n tasks of one kind to the staging list (not consumed by anyone)."""
        task = self.tasks[kind]
        ids = list(self.ids(n))
        results = [task.apply_async((i,), queue=self.staging) for i in ids]
        self.task_ids += [r.id for r in results]
        return results, ids

    def cpu_snapshot(self) -> dict[str, float]:
        assert self.worker is not None
        main, kids = self.worker.pids()
        mt = proc_times(main)
        kt = [proc_times(p) for p in kids]
        snap = {
            "worker main": mt[0] + mt[1],
            "pool children": sum(u + s for u, s, _ in kt),
            "this process": time.process_time(),
        }
        if self.local_redis:
            info = self.admin.info("cpu")
            snap["redis-server (whole server)"] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        snap[HOST] = host_busy()
        snap.update(
            {
                "_kids_user": sum(u for u, _, _ in kt),
                "_kids_sys": sum(s for _, s, _ in kt),
                "_kids_vcsw": sum(c for _, _, c in kt),
                "_main_vcsw": mt[2],
            }
        )
        return snap

    def release_batch(self) -> None:
        if not self.admin.renamenx(self.staging, self.queue):
            raise RuntimeError(f"queue {self.queue!r} is not empty; cannot release the batch")

    def wait_stored(self, results: list[Any]) -> None:
        """Return once every result of the batch is in the result backend.

        While messages are still queued the batch cannot be done: one ``LLEN`` every 5 ms. Then
        ``EXISTS`` on the last few result keys every 1 ms (the queue is FIFO, so those finish
        last), and on all of them to confirm. Cheap, so it hardly competes with the worker."""
        keys = [self.app.backend.get_key_for_task(r.id) for r in results]
        tail = keys[-8:]
        deadline = time.monotonic() + self.args.timeout
        polls = 0
        while True:
            polls += 1
            if polls % 100 == 0:
                self.worker.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"results not stored within {self.args.timeout} s")
            if self.admin.llen(self.queue):
                time.sleep(0.005)
                continue
            if self.admin.exists(*tail) == len(tail) and self.admin.exists(*keys) == len(keys):
                return
            time.sleep(0.001)

    def collect(self, kind: str, results: list[Any], expect: list[int]) -> list[Any]:
        from celery.result import ResultSet

        values = ResultSet(results).get(timeout=self.args.timeout, propagate=True)
        if values != expect:
            raise RuntimeError(f"{kind}: wrong results")
        return values

    def drain(self, kind: str, n: int, measure_cpu: bool = True) -> dict[str, Any]:
        """Stage n tasks, release them onto the worker's queue at once, wait for every result."""
        from celery.result import ResultSet

        results, expect = self.stage(kind, n)
        if self.admin.llen(self.staging) != n:
            raise RuntimeError(f"staging list holds {self.admin.llen(self.staging)} messages, expected {n}")
        gc.collect()
        cpu0 = self.cpu_snapshot() if measure_cpu else None
        t0 = time.perf_counter()
        self.release_batch()
        if self.args.wait == "celery":
            values = ResultSet(results).get(timeout=self.args.timeout, propagate=True)
            if values != expect:
                raise RuntimeError(f"{kind}: wrong results")
        else:
            self.wait_stored(results)
        wall = time.perf_counter() - t0
        cpu1 = self.cpu_snapshot() if measure_cpu else None
        self.worker.check()
        if self.args.wait != "celery":
            self.collect(kind, results, expect)
        done = sorted(r.date_done for r in results)
        span = (done[-1] - done[0]).total_seconds()
        out = {"wall": wall, "rate": n / wall, "worker_rate": (n - 1) / span if span > 0 else float("nan")}
        if cpu0 is not None and cpu1 is not None:
            out["cpu"] = {k: cpu1[k] - cpu0[k] for k in cpu0}
        return out

    # -- sections ------------------------------------------------------------------------------------
    def start_worker(self) -> float:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*EXTRA_PATH, *filter(None, [os.environ.get("PYTHONPATH")])]),
            "TGBENCH_QUEUE": self.queue,
            "TGBENCH_PREFIX": self.run,
        }
        self.worker = Worker(self.queue, f"{self.run}@%h", self.args.concurrency, env)
        t0 = time.perf_counter()
        self.worker.start()
        first = self.tasks["unguarded"].delay(-1)
        self.task_ids.append(first.id)
        deadline = time.monotonic() + 60
        while not first.ready():
            self.worker.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker ran no task within 60 s:\n{self.worker.output()[-4000:]}")
            time.sleep(0.05)
        return time.perf_counter() - t0

    def warm_up(self) -> None:
        """Both pool children import, connect, cache the scripts and start their heartbeat."""
        for kind in THROUGHPUT_KINDS:
            self.drain(kind, self.args.warmup, measure_cpu=False)

    def throughput(self) -> dict[str, Any]:
        n, rounds = self.args.tasks, self.args.rounds
        per: dict[str, list[dict[str, Any]]] = {k: [] for k in THROUGHPUT_KINDS}
        kinds = list(THROUGHPUT_KINDS)
        for r in range(rounds):
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]  # rotated each round
            for kind in order if r % 2 == 0 else order[::-1]:
                per[kind].append(self.drain(kind, n))
        return per

    def latency(self) -> dict[str, list[float]]:
        lat: dict[str, list[float]] = {k: [] for k in KINDS}
        clock = time.perf_counter
        timeout = self.args.timeout
        for k in KINDS:  # a few unmeasured calls first
            for i in self.ids(10):
                r = self.tasks[k].delay(i)
                self.task_ids.append(r.id)
                r.get(timeout=timeout)
        for c in range(self.args.calls):
            for kind in KINDS if c % 2 == 0 else KINDS[::-1]:
                (i,) = self.ids(1)
                s = clock()
                r = self.tasks[kind].delay(i)
                v = r.get(timeout=timeout)
                lat[kind].append(clock() - s)
                self.task_ids.append(r.id)
                if v != i:
                    raise RuntimeError(f"{kind}: wrong result {v!r} for {i}")
        return lat

    def commands(self) -> dict[str, dict[str, Any]]:
        """Per kind: one batch drained under MONITOR (commands attributed to this run's
        connections through /proc) and INFO commandstats deltas (every client)."""
        out = {}
        for kind in KINDS:
            n = self.args.count_tasks
            results, expect = self.stage(kind, n)
            mon = MonitorLog(self.args.url, self.run)
            mon.start()
            try:
                a = commandstats(self.admin)
                self.release_batch()
                self.wait_stored(results)
                b = commandstats(self.admin)
            finally:
                mon.stop(self.admin)
            self.worker.check()
            main, kids = self.worker.pids()
            labels = {main: "worker main", **{k: "pool child" for k in kids}, os.getpid(): "bench process"}
            ports = tcp_ports(labels)
            admin_addr = self.admin.client_info().get("addr", "")  # this end of the admin connection
            ports[admin_addr.rsplit(":", 1)[-1]] = "bench admin"
            out[kind] = {"stats": diff_stats(a, b), "monitor": mon.tally(ports), "lines": mon.count}
            self.collect(kind, results, expect)
        return out


class MonitorLog:
    """Records MONITOR output between two ECHO markers, in a thread."""

    def __init__(self, url: str, run: str) -> None:
        self.client = redis.Redis.from_url(url, decode_responses=False)
        self.begin, self.end = f"{run}-monitor-begin", f"{run}-monitor-end"
        self.lines: list[tuple[str, str, list[str]]] = []  # (client port or "lua", command, first args)
        self.count = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        recording = False
        try:
            with self.client.monitor() as m:
                self._ready.set()
                while True:
                    c = m.next_command()
                    words = c["command"].split(" ", 3)
                    name = words[0].upper()
                    if name == "ECHO" and len(words) > 1:
                        if words[1] == self.begin:
                            recording = True
                            continue
                        if words[1] == self.end:
                            return
                    if recording:
                        self.count += 1
                        who = "lua" if c["client_type"] == "lua" else str(c["client_port"])
                        self.lines.append((who, name, words[1:3]))
        except BaseException as e:  # reported by stop()
            self.error = e
            self._ready.set()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(5)
        time.sleep(0.05)
        self.client.echo(self.begin)

    def stop(self, admin: redis.Redis) -> None:
        admin.echo(self.end)
        self._thread.join(30)
        self.client.close()
        if self.error is not None:
            raise RuntimeError(f"MONITOR failed: {self.error!r}")
        if self._thread.is_alive():
            raise RuntimeError("MONITOR did not see its end marker")

    def tally(self, ports: dict[str, str]) -> dict[tuple[str, str], int]:
        """(process label, command) -> count; script-inner commands as (label, 'lua:<script>:<CMD>')."""
        from taskguard import scripts

        names = {s.sha: s.name for s in vars(scripts).values() if isinstance(s, scripts.Script)}
        out: dict[tuple[str, str], int] = {}
        owner = None  # (label, script name) of the script call the following lua lines belong to
        for who, name, args in self.lines:
            if who == "lua":
                if owner is not None:
                    label, script = owner
                    key = args[0] if args else ""
                    tag = (
                        "done marker"
                        if ":done:" in key
                        else (
                            "fence counter"
                            if key.endswith(":fence")
                            else ("waiting flag" if key.endswith(":waiting") else "")
                        )
                    )
                    cmd = f"lua:{script}:{name}" + (f" ({tag})" if tag else "")
                    out[(label, cmd)] = out.get((label, cmd), 0) + 1
                continue
            label = ports.get(who)
            owner = None
            if label is None:
                continue  # another client's command
            if name in ("EVALSHA", "EVAL"):
                script = names.get(args[0].lower(), "other") if name == "EVALSHA" and args else "eval"
                owner = (label, script)
                name = f"{name} {script}"
            out[(label, name)] = out.get((label, name), 0) + 1
        return out


def tcp_ports(labels: dict[int, str]) -> dict[str, str]:
    """Local TCP port -> label, for the sockets the given processes hold (from /proc)."""
    inodes: dict[str, str] = {}
    for pid, label in labels.items():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = label
        except OSError:
            continue
    ports: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and parts[9] in inodes:
                        ports[str(int(parts[1].rsplit(":", 1)[1], 16))] = inodes[parts[9]]
        except OSError:
            continue
    return ports


def commandstats(admin: redis.Redis) -> dict[str, Any]:
    info = admin.info("stats", "commandstats")
    return {
        "total": int(info["total_commands_processed"]),
        "cmd": {
            k[len("cmdstat_") :]: (int(v["calls"]), int(v["usec"])) for k, v in info.items() if k.startswith("cmdstat_")
        },
    }


def diff_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    calls, usec = {}, {}
    for name, (c, u) in b["cmd"].items():
        c0, u0 = a["cmd"].get(name, (0, 0))
        if c - c0 and name != "info":
            calls[name], usec[name] = c - c0, u - u0
    return {"total": b["total"] - a["total"] - 1, "calls": calls, "usec": usec}  # -1: the first INFO


# -- printing -------------------------------------------------------------------------------------------
def print_throughput(
    per: dict[str, list[dict[str, Any]]], n: int, rounds: int, concurrency: int, wait: str
) -> dict[str, float]:
    print(f"## 1. throughput: {rounds} interleaved rounds x {n} tasks per kind (order rotated each round)")
    print("   each batch is published to a staging list first, then moved onto the worker's queue at once;")
    until = (
        "ResultSet.get() returns all N (client-bound!)"
        if wait == "celery"
        else "all N results are stored (EXISTS polls)"
    )
    print(f"   tasks/s = N / (move -> {until}); worker-side = (N-1) / (first..last date_done).")
    print("   2x PING: the unguarded body plus two PINGs on a plain redis-py client, the two round trips any")
    print("   Redis lease guard needs; redis-py Lock: the body under Lock(timeout=60), acquire(blocking=False)")
    print("   and release() by hand (no fencing, renewal, retry hand-over or skip reporting).\n")
    kinds = [k for k in THROUGHPUT_KINDS if per.get(k)]
    rows = []
    med = {}

    def ratios(a: str, b: str, field: str = "rate") -> list[float]:
        return [x[field] / y[field] for x, y in zip(per[a], per[b], strict=True)]

    for kind in kinds:
        rates = [x["rate"] for x in per[kind]]
        wrates = [x["worker_rate"] for x in per[kind]]
        med[kind] = statistics.median(rates)
        vs = ratios(kind, "unguarded")
        rows.append(
            [
                kind,
                f"{med[kind]:,.0f}",
                f"{min(rates):,.0f}..{max(rates):,.0f}",
                f"{1e3 / med[kind]:.3f}",
                f"{statistics.median(wrates):,.0f}",
                f"{statistics.median(vs):.3f}x",
            ]
        )
    print(fmt_table(["kind", "tasks/s", "rounds min..max", "ms/task", "worker-side tasks/s", "vs unguarded"], rows))
    r = ratios("guarded", "unguarded")
    w = ratios("guarded", "unguarded", "worker_rate")
    m, wm = statistics.median(r), statistics.median(w)
    print()
    print(
        f"   guarded / unguarded throughput = {m:.3f}x  (rounds {min(r):.3f}..{max(r):.3f})  "
        f"target >= 0.90x: {verdict(m >= 0.9)}"
    )
    print(f"   worker-side ratio              = {wm:.3f}x  (rounds {min(w):.3f}..{max(w):.3f})")
    out = {"ratio": m, "worker_ratio": wm}
    for other, label in (("2x PING", "the two-round-trip floor"), ("redis-py Lock", "redis-py Lock by hand")):
        if other in med:
            fl, vs = ratios(other, "unguarded"), ratios("guarded", other)
            out[other] = statistics.median(fl)
            print(
                f"   {other + ' / unguarded':<30} = {statistics.median(fl):.3f}x  "
                f"(rounds {min(fl):.3f}..{max(fl):.3f})"
                f"   guarded / {label} = {statistics.median(vs):.3f}x"
            )
    print(
        f"   added time per task: {(1 / med['guarded'] - 1 / med['unguarded']) * 1e6:+.0f} us of wall time "
        f"(at -c {concurrency}; the pool runs tasks in parallel)"
    )
    print(f"   per-round guarded/unguarded ratios: {' '.join(f'{x:.3f}' for x in r)}")
    # CPU per task
    if all("cpu" in x for k in kinds for x in per[k]):
        comps = [c for c in per["unguarded"][0]["cpu"] if c != HOST and not c.startswith("_")]
        cpu = {k: {c: sum(x["cpu"][c] for x in per[k]) / (n * rounds) * 1e6 for c in comps} for k in kinds}
        wall = {k: sum(x["wall"] for x in per[k]) for k in kinds}
        host = {k: sum(x["cpu"][HOST] for x in per[k]) for k in kinds}
        print(
            "\n   CPU time per task during the drains, all rounds (/proc utime+stime in 10 ms ticks; redis-server "
            "from INFO cpu), us:"
        )
        rows = []
        for c in comps + ["total"]:
            v = {k: (sum(cpu[k].values()) if c == "total" else cpu[k][c]) for k in kinds}
            rows.append([c, *(f"{v[k]:.0f}" for k in kinds), f"{v['guarded'] - v['unguarded']:+.0f}"])
        table = fmt_table(["process", *kinds, "guarded - unguarded"], rows)
        print("   " + table.replace("\n", "\n   "))
        cores = os.cpu_count() or 1
        ours = {k: sum(cpu[k].values()) * n * rounds / 1e6 for k in kinds}
        print(
            f"   cores busy during the drains: ours {ours['unguarded'] / wall['unguarded']:.2f} (unguarded) / "
            f"{ours['guarded'] / wall['guarded']:.2f} (guarded), other load on this host "
            f"{max(0.0, host['unguarded'] - ours['unguarded']) / wall['unguarded']:.2f} / "
            f"{max(0.0, host['guarded'] - ours['guarded']) / wall['guarded']:.2f}, of {cores}"
        )
        det = {
            k: {
                c: sum(x["cpu"][c] for x in per[k]) / (n * rounds)
                for c in ("_kids_user", "_kids_sys", "_kids_vcsw", "_main_vcsw")
            }
            for k in kinds
        }
        ug, gd = det["unguarded"], det["guarded"]
        print(
            f"   pool children: user {ug['_kids_user'] * 1e6:.0f} -> {gd['_kids_user'] * 1e6:.0f} us, "
            f"system {ug['_kids_sys'] * 1e6:.0f} -> {gd['_kids_sys'] * 1e6:.0f} us, "
            f"voluntary context switches {ug['_kids_vcsw']:.2f} -> {gd['_kids_vcsw']:.2f} "
            f"per task (worker main {ug['_main_vcsw']:.2f} -> {gd['_main_vcsw']:.2f})"
        )
        tu = sum(cpu["unguarded"].values())
        bound = "  ".join(f"{k} {tu / sum(cpu[k].values()):.3f}x" for k in kinds if k != "unguarded")
        print(f"   if the drain were bound by total CPU (CPU/task unguarded / CPU/task of the kind): {bound}")
    return out


def print_latency(lat: dict[str, list[float]], calls: int) -> None:
    print(f"## 2. latency: sequential delay(i).get(), {calls} calls per kind, kinds alternating call by call\n")
    rows = []
    for kind in KINDS:
        v = sorted(x * 1e3 for x in lat[kind])
        rows.append(
            [
                kind,
                f"{pct(v, 0.5):.3f}",
                f"{pct(v, 0.9):.3f}",
                f"{pct(v, 0.99):.3f}",
                f"{statistics.mean(v):.3f}",
                f"{v[0]:.3f}",
                f"{v[-1]:.3f}",
            ]
        )
    print(fmt_table(["kind", "p50 ms", "p90 ms", "p99 ms", "mean ms", "min ms", "max ms"], rows))
    gu = sorted(lat["guarded"])
    uu = sorted(lat["unguarded"])
    paired = [(g - u) * 1e3 for g, u in zip(lat["guarded"], lat["unguarded"], strict=True)]
    print()
    print(
        f"   median difference guarded - unguarded = {(pct(gu, 0.5) - pct(uu, 0.5)) * 1e3:+.3f} ms "
        f"(p50 - p50); median of the {len(paired)} adjacent-call differences {statistics.median(paired):+.3f} ms; "
        f"p99 - p99 {(pct(gu, 0.99) - pct(uu, 0.99)) * 1e3:+.3f} ms"
    )


def print_commands(res: dict[str, dict[str, Any]], n: int, others_active: bool) -> None:
    print(f"## 3. Redis commands per task, by process: MONITOR while the worker drains {n} tasks per kind")
    print("   only this run's connections are counted (their client ports mapped to processes through /proc);")
    print("   indented 'lua:' rows are the commands the EVALSHA above them ran inside its script.\n")
    mon = {k: res[k]["monitor"] for k in KINDS}
    order = {"worker main": 0, "pool child": 1, "bench process": 2, "bench admin": 3}
    keys = set(mon["unguarded"]) | set(mon["guarded"])
    by_label: dict[str, list[str]] = {}
    for label, cmd in keys:
        by_label.setdefault(label, []).append(cmd)
    rows = []
    for label in sorted(by_label, key=lambda x: order.get(x, 9)):
        cmds = by_label[label]
        top = sorted(c for c in cmds if not c.startswith("lua:"))
        for cmd in top:
            for c in [cmd] + (
                sorted(x for x in cmds if x.startswith(f"lua:{cmd.split(' ', 1)[1]}:"))
                if cmd.startswith("EVAL") and " " in cmd
                else []
            ):
                u, g = mon["unguarded"].get((label, c), 0) / n, mon["guarded"].get((label, c), 0) / n
                name = f"  {c}" if c.startswith("lua:") else c
                d = g - u if abs(g - u) >= 0.005 else 0.0
                rows.append([label, name, f"{u:.2f}", f"{g:.2f}", f"{d:+.2f}"])
    print(fmt_table(["process", "command", "unguarded/task", "guarded/task", "added"], rows, align="llrrr"))

    def total(kind: str, lua: bool) -> float:
        return sum(v for (_, c), v in mon[kind].items() if c.startswith("lua:") == lua) / n

    print()
    print(
        f"   client-sent commands per task: unguarded {total('unguarded', False):.2f}, guarded "
        f"{total('guarded', False):.2f} ({total('guarded', False) - total('unguarded', False):+.2f}); "
        f"run inside scripts: {total('guarded', True):.2f}"
    )
    g = mon["guarded"]

    def calls(script: str) -> float:
        return sum(v for (_, c), v in g.items() if c == f"EVALSHA {script}" or c == f"EVAL {script}") / n

    acq, rel, ren = calls("acquire"), calls("release"), calls("renew")
    print(
        f"   guard per task: {acq:.2f} ACQUIRE + {rel:.2f} RELEASE + {ren:.3f} RENEW (heartbeat renewals; at the "
        "default ttl=60 the first renewal falls due after 15-20 s, which a no-op never lasts)"
    )
    done_set = sum(v for (_, c), v in g.items() if c.startswith("lua:release:SET (done marker)")) / n
    done_chk = sum(v for (_, c), v in g.items() if c.startswith("lua:acquire:EXISTS (done marker)")) / n
    print(
        f"   done marker: {done_chk:.2f} EXISTS in ACQUIRE (refuses a finished run) + {done_set:.2f} SET in RELEASE "
        "(kept 1 day); the fence counter key is kept 7 days"
    )
    su, sg = res["unguarded"]["stats"], res["guarded"]["stats"]
    ev = lambda d: d["calls"].get("evalsha", 0) + d["calls"].get("eval", 0)  # noqa: E731
    ev_us = sg["usec"].get("evalsha", 0) + sg["usec"].get("eval", 0)
    print(
        f"   INFO commandstats over the same windows (every client): evalsha {ev(su) / n:.2f} -> {ev(sg) / n:.2f} "
        f"per task, total_commands_processed {su['total'] / n:.2f} -> {sg['total'] / n:.2f}; "
        f"Redis time per EVALSHA {ev_us / max(ev(sg), 1):.1f} us"
    )
    if others_active:
        print(
            "   (other clients were active: the commandstats figures include their commands; "
            "the MONITOR table does not)"
        )


def print_diagnostics(rows: list[list[str]], lines: list[str]) -> None:
    print(
        "## 4. diagnostic: the guard's cost in this process, without the worker (5 interleaved rounds, "
        "medians per call, us)"
    )
    print("   CPU: process CPU (every thread); caller CPU: the calling thread only; 'in EVALSHA': inside the")
    print("   redis-py calls that run the scripts (wall, and the caller's CPU there: redis-py + socket syscalls)\n")
    print(fmt_table(["what", "wall", "CPU", "caller CPU", "in EVALSHA wall", "in EVALSHA CPU"], rows))
    print()
    for line in lines:
        print(line)


# -- section 4 ----------------------------------------------------------------------------------------------
def diagnostics(bench: Bench, ops: int, rounds: int) -> tuple[list[list[str]], list[str]]:
    m = bench.m
    locks = m.guarded_noop.taskguard_locks
    client = locks.client
    path = locks.client  # the guard's script calls go through the client's execute_command
    orig = path.execute_command
    inside = [0.0, 0.0]
    clock, tclock = time.perf_counter, time.thread_time

    def timed_execute(*a: Any, **k: Any) -> Any:  # an instance attribute on this process's path only
        if not a or a[0] not in ("EVALSHA", "EVAL"):
            return orig(*a, **k)
        s, ts = clock(), tclock()
        try:
            return orig(*a, **k)
        finally:
            inside[0] += clock() - s
            inside[1] += tclock() - ts

    holder = {"task": m.GUARDED_NOOP, "task_id": "x"}

    def plain() -> None:
        (i,) = bench.ids(1)
        m.noop.apply(args=(i,))

    def passthrough() -> None:
        (i,) = bench.ids(1)
        m.passthrough_noop.apply(args=(i,))

    ping = client.ping

    def two_pings() -> None:
        ping()
        ping()

    def guarded() -> None:
        (i,) = bench.ids(1)
        r = m.guarded_noop.apply(args=(i,))
        if r.state != "SUCCESS":
            raise RuntimeError(f"guarded apply: {r.state} {r.result!r}")

    def bare(renew: bool) -> Callable[[], None]:
        def fn() -> None:
            (i,) = bench.ids(1)
            acq = locks.acquire(f"noop:{i}", ttl=60.0, holder=holder, renew=renew, run_id=secrets.token_hex(16))
            acq.lease.release(finished=True, finished_ttl=3660.0)

        return fn

    U, P, G = "unguarded task.apply()", "pass-through __call__ task.apply()", "guarded task.apply()"
    B1, B0 = "bare acquire(renew=True) + release(finished=True)", "  the same with renew=False"
    PING = "2x PING on the guard's redis client"
    contenders = {U: plain, P: passthrough, G: guarded, B1: bare(True), B0: bare(False), PING: two_pings}
    path.execute_command = timed_execute
    try:
        for fn in contenders.values():
            for _ in range(100):
                fn()
        res: dict[str, list[tuple[float, ...]]] = {k: [] for k in contenders}
        names = list(contenders)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                fn = contenders[name]
                gc.collect()
                inside[0] = inside[1] = 0.0
                c0, tc0, t0 = time.process_time(), tclock(), clock()
                for _ in range(ops):
                    fn()
                wall, cpu, tcpu = clock() - t0, time.process_time() - c0, tclock() - tc0
                res[name].append((wall / ops, cpu / ops, tcpu / ops, inside[0] / ops, inside[1] / ops))
    finally:
        del path.execute_command
    med = {k: tuple(statistics.median(x[j] for x in v) * 1e6 for j in range(5)) for k, v in res.items()}
    rows = [[k] + [f"{x:.1f}" for x in v] for k, v in med.items()]
    u, p, g, b1, b0, pg = med[U], med[P], med[G], med[B1], med[B0], med[PING]
    # columns: 0 wall, 1 CPU (all threads), 2 caller CPU, 3 in-EVALSHA wall, 4 in-EVALSHA caller CPU
    locks_py = b1[2] - b1[4]  # the bare Locks API's own Python
    celery_call = p[2] - u[2]  # Task.__call__, paid by any class overriding __call__
    guard_py = (g[2] - g[4]) - p[2] - locks_py  # GuardedTask.__call__'s own Python
    other_threads = (g[1] - g[2]) - (u[1] - u[2])
    lines = [
        f"   guard per call (guarded - unguarded apply): {g[0] - u[0]:+.1f} us wall, {g[1] - u[1]:+.1f} us CPU. "
        "Of that:",
        f"     {g[3] - g[4]:6.1f} us  wall waiting for Redis inside the 2 EVALSHA calls (loopback round trips, Lua)",
        f"     {g[4]:6.1f} us  CPU in the 2 script calls through the client's execute_command: pool, packing, retry "
        f"wrapper, sendall/recv syscalls, hiredis (2x PING through redis-py's pool costs {pg[2]:.1f} us CPU)",
        f"     {locks_py:6.1f} us  CPU in the Locks API around them (acquire: checks, holder JSON, owner token, Lease, "
        "heartbeat add; release: heartbeat discard, events)",
        f"     {celery_call:6.1f} us  CPU in Celery's Task.__call__ (request push/pop), which the tracer skips for a "
        "task class without its own __call__",
        f"     {guard_py:6.1f} us  CPU in GuardedTask.__call__ itself (key render, locks lookup, holder dict, header, "
        "contextvar, _finish)",
        f"     {other_threads:6.1f} us  CPU in other threads: the heartbeat thread, woken by every add() "
        f"(bare renew=True - renew=False: {(b1[1] - b1[2]) - (b0[1] - b0[2]):+.1f} us)",
    ]
    return rows, lines


# -- cleanup ----------------------------------------------------------------------------------------------
def cleanup(admin: redis.Redis, run: str, task_ids: list[str]) -> tuple[int, int]:
    """Delete every key of the run; remove its members from kombu's shared binding sets and any
    unacked entries of its messages. -> (keys deleted, keys left)."""
    deleted = delete_matching(admin, f"*{run}*")
    metas = [f"celery-task-meta-{t}" for t in task_ids]
    for i in range(0, len(metas), 1000):
        deleted += admin.delete(*metas[i : i + 1000])
    for key in admin.scan_iter(match="_kombu.binding*", count=1000):
        if admin.type(key) == "set":
            members = [mb for mb in admin.sscan_iter(key, match=f"*{run}*")]
            if members:
                admin.srem(key, *members)
    stale = [f for f, v in admin.hscan_iter("unacked", count=1000) if run in v]
    if stale:
        admin.hdel("unacked", *stale)
        admin.zrem("unacked_index", *stale)
    left = sum(1 for _ in admin.scan_iter(match=f"*{run}*", count=1000))
    left += sum(admin.exists(*metas[i : i + 1000]) for i in range(0, len(metas), 1000))
    return deleted, left


def client_ids(admin: redis.Redis) -> dict[int, dict[str, Any]]:
    return {int(c["id"]): c for c in admin.client_list()}


# -- main -----------------------------------------------------------------------------------------------


def report_failure(bench: Any, e: Exception) -> int:
    """A benchmark that failed: say why, with the end of the worker's log. Returns the exit code."""
    print(f"\nbenchmark failed: {type(e).__name__}: {e}", file=sys.stderr)
    if bench is not None and bench.worker is not None:
        print(f"worker log ({bench.worker.log_path}):\n{bench.worker.output()[-3000:]}", file=sys.stderr)
    return 1


def wind_up(bench: Any, admin: Any, run: str, rc: int, what: str = "") -> int:
    """Stop the worker (its log kept when it logged errors or the run failed), close the app and
    the locks, delete the run's keys and say so. Returns ``rc`` (1 when the cleanup failed)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the cleanup finish
    worker_rc = None
    if bench is not None and bench.worker is not None:
        worker_rc = bench.worker.stop()
        log = bench.worker.output()
        problems = [line for line in log.splitlines() if "Traceback" in line or "ERROR" in line]
        if problems or rc:
            print(f"\nworker log ({len(problems)} error line(s)) kept at {bench.worker.log_path}")
        else:
            bench.worker.remove_log()
    try:
        if bench is not None:
            try:
                bench.m.guarded_noop.taskguard_locks.close()
            except Exception:
                pass
            bench.app.close()
        deleted, left = cleanup(admin, run, bench.task_ids if bench else [])
        what = f" {what}" if what else ""
        print(f"\ncleanup: worker stopped (rc {worker_rc}); deleted {deleted} keys of {run}{what}; {left} left")
    except redis.RedisError as e:
        print(f"cleanup failed: {type(e).__name__}: {e}", file=sys.stderr)
        rc = rc or 1
    admin.close()
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--url",
        default=os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="Redis URL: broker, results, leases (default: $TASKGUARD_REDIS_URL or redis://127.0.0.1:6379/0)",
    )
    ap.add_argument("--tasks", type=int, default=600, help="tasks per kind per throughput round (default 600)")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved throughput rounds (default 8)")
    ap.add_argument("--calls", type=int, default=400, help="sequential delay().get() calls per kind (default 400)")
    ap.add_argument("--count-tasks", type=int, default=500, help="tasks per kind for the command counts (default 500)")
    ap.add_argument("--concurrency", type=int, default=2, help="prefork pool size (default 2)")
    ap.add_argument("--warmup", type=int, default=200, help="warm-up tasks per kind (default 200)")
    ap.add_argument("--diag-ops", type=int, default=500, help="calls per contender per diagnostic round (default 500)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for one batch's results (default 60)")
    ap.add_argument(
        "--wait",
        choices=("poll", "celery"),
        default="poll",
        help="how a throughput round waits for its results: poll (EXISTS on the result keys, then "
        "ResultSet.get() outside the timed window; default) or celery (ResultSet.get() inside it: "
        "client-bound, see README)",
    )
    ap.add_argument("--no-diagnostics", action="store_true", help="skip section 4")
    args = ap.parse_args(argv)
    for name in ("tasks", "rounds", "calls", "count_tasks", "concurrency", "warmup", "diag_ops"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.tasks < 2:
        ap.error("--tasks must be >= 2")

    t_start = time.monotonic()
    admin = redis.Redis.from_url(args.url, client_name="tgbench-celery-admin", decode_responses=True)
    try:
        server = admin.info("server")
        clients_before = client_ids(admin)
    except redis.RedisError as e:
        print(f"cannot reach Redis at {redact_url(args.url)}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    my_admin_id = admin.client_id()
    others_at_start = [c for i, c in clients_before.items() if i != my_admin_id]
    args.url_host = (redis.connection.parse_url(args.url).get("host") or "") if args.url.startswith("redis") else ""

    run = run_prefix()
    os.environ["TASKGUARD_REDIS_URL"] = args.url
    os.environ["TGBENCH_QUEUE"] = run
    os.environ["TGBENCH_PREFIX"] = run
    sys.path.insert(0, str(HERE))

    import celery
    import celery_bench_app  # reads TGBENCH_QUEUE / TGBENCH_PREFIX, set just above
    import kombu

    hv = None
    try:
        import hiredis  # noqa: F401

        hv = getattr(hiredis, "__version__", "?")
    except ImportError:
        pass
    urlhost = redact_url(args.url).strip("'\"")
    print("# taskguard Celery benchmark: GuardedTask no-op vs the same no-op unguarded")
    print(
        f"one `celery worker -P prefork -c {args.concurrency}` subprocess, Redis broker + Redis result backend, "
        "queue and key prefix unique to this run"
    )
    print(
        f"python        {platform.python_implementation()} {platform.python_version()} on "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"
    )
    print(f"celery        {celery.__version__}, kombu {kombu.__version__}")
    print(f"redis-py      {redis.__version__}, hiredis {'yes ' + hv if hv and redis.utils.HIREDIS_AVAILABLE else 'no'}")
    print(
        f"redis server  {server.get('redis_version')} ({server.get('redis_mode', '?')}, "
        f"{server.get('multiplexing_api', '?')}, io-threads {server.get('io_threads_active', '?')}) at {urlhost}"
    )
    print(f"taskguard     {taskguard.__version__} from {os.path.dirname(taskguard.__file__)}{git_state()}")
    print(f"run           queue {run}, key prefix {run} (deleted at the end)")
    print(
        f"tasks         {args.tasks} per kind per round x {args.rounds} rounds; {args.calls} latency calls per kind; "
        f"worker prefetch multiplier {celery_bench_app.app.conf.worker_prefetch_multiplier}"
    )
    if others_at_start:
        print(
            f"NOTE          {len(others_at_start)} other client(s) connected to this Redis at the start; "
            "their load adds noise"
        )
    print(flush=True)

    bench: Bench | None = None

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    rc = 0
    try:
        bench = Bench(args, run, admin)
        atexit.register(
            lambda: (
                bench.worker
                and bench.worker.proc
                and bench.worker.proc.poll() is None
                and os.killpg(bench.worker.proc.pid, signal.SIGKILL)
            )
        )
        startup = bench.start_worker()
        bench.warm_up()
        main_pid, kids = bench.worker.pids()
        print(
            f"worker        pid {main_pid}, pool children {kids}; first result {startup:.1f} s after start, "
            f"warmed up with {args.warmup} tasks per kind\n",
            flush=True,
        )
        mine = set(client_ids(admin)) - set(clients_before)
        t_measure = time.monotonic()

        per = bench.throughput()
        print_throughput(per, args.tasks, args.rounds, args.concurrency, args.wait)
        print(flush=True)
        lat = bench.latency()
        print_latency(lat, args.calls)
        print(flush=True)
        stats = bench.commands()
        # other clients active while the worker was measured
        now = client_ids(admin)
        elapsed = time.monotonic() - t_measure
        active = [c for i, c in now.items() if i not in mine and i != my_admin_id and int(c.get("idle", 0)) < elapsed]
        print_commands(stats, args.count_tasks, bool(active))
        if active:
            print(
                f"\n   NOTE: {len(active)} other client(s) sent commands to this Redis during sections 1-3 "
                f"(idle < {elapsed:.0f} s in CLIENT LIST): their commands are in the counts above and their load in "
                "the timings"
            )
        if not args.no_diagnostics:
            print(flush=True)
            rows, lines = diagnostics(bench, args.diag_ops, 5)
            print_diagnostics(rows, lines)
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the worker and cleaning up", file=sys.stderr)
        rc = 130
    except Exception as e:
        rc = report_failure(bench, e)
    finally:
        rc = wind_up(bench, admin, run, rc, "(queue, bindings, leases, fence counters, done markers, results)")
    print(f"total wall time {time.monotonic() - t_start:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
