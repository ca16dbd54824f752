#!/usr/bin/env python
"""Celery benchmark, publish included: GuardedTask beside redis-py Lock by hand, celery-once and
celery-singleton, on one real prefork worker.

Run from the repository root (celery-once and celery-singleton from
``bench/requirements-compare.txt``):

    .venv/bin/pip install -r bench/requirements-compare.txt
    .venv/bin/python bench/bench_celery_compare.py [--tasks N] [--rounds R] [--url URL]
    .venv/bin/python bench/bench_celery_compare.py --quick      # ~20 s, to check it runs

One ``celery -A celery_compare_app worker -P prefork -c 2`` subprocess (``bench/celery_compare_app.py``),
Redis broker and Redis result backend on the same Redis as the locks, a queue and key prefix unique
to the run. Five tasks with the same body (``return i``), each call its own key (no contention):

* ``unguarded``         ``@app.task``
* ``redis-py Lock``     the body under redis-py's ``Lock(timeout=60)`` taken and released by hand in
                        the task (what users write today: no fencing, renewal or skip reporting)
* ``guarded``           ``base=GuardedTask, key="noop:{i}"`` (ttl=60, renew=True: its defaults)
* ``celery-once``       ``base=QueueOnce``: the lock (redis-py ``Lock``, 60 s) is taken in
                        ``apply_async``, by the publisher, and deleted in the worker's ``after_return``
* ``celery-singleton``  ``base=Singleton``: ``SET NX`` (60 s) in ``apply_async``, ``DEL`` in the
                        worker's ``on_success``

Because two of them lock at publish, the timed window includes publishing: per round and kind,
this process publishes N tasks straight onto the worker's queue (the worker drains while the
publisher publishes) and the clock stops when all N results are stored (``EXISTS`` polls; the
values are read back and checked outside the window). Rounds are interleaved, the order rotated
each round. Printed: tasks/s end to end (median, min..max), the publish phase alone (ms per task),
per-round ratios guarded / each other kind (median, min..max), the targets (guarded >= 0.97x of
``redis-py Lock``; guarded faster than celery-once and celery-singleton), and the CPU time per task
of every process taking part: the publisher (this process; its result polling included), the
worker's main process, its pool children (/proc), and the Redis server (``INFO cpu``), with the
Redis commands per task (``INFO stats``, every client).

Reading it: on a 2-core machine the publisher, Redis, the worker's main process and both pool
children share the two cores, so tasks/s is largely a CPU budget: a lock taken at publish costs
the publisher's CPU (and a round trip per publish), one taken in the task costs the pool
children's. The CPU table shows where each kind's time goes. Other load on the host shows in the
'other load' line; compare runs made on the same, otherwise quiet machine. The worker is stopped
and every key of the run (queue, bindings, locks, fence counters, results) deleted at the end.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import platform
import signal
import statistics
import sys
import time
from typing import Any

import bench_celery as bc  # noqa: E402  (sets up sys.path for a checkout, as the other benches do)
import redis
from benchlib import fmt_table, git_state, run_prefix, verdict  # noqa: E402

import taskguard  # noqa: E402
from taskguard.urls import redact_url  # noqa: E402

KINDS = ("unguarded", "redis-py Lock", "guarded", "celery-once", "celery-singleton")
PUBLISHER = "publisher (this process)"
PROCS = (PUBLISHER, "worker main", "pool children", "redis-server (whole server)")


class CompareBench(bc.Bench):
    def __init__(self, args: argparse.Namespace, run: str, admin: redis.Redis) -> None:
        super().__init__(args, run, admin)
        import celery_compare_app as cm

        self.cm = cm
        self.skipped: dict[str, str] = {}
        for kind, task in (("celery-once", cm.once_noop), ("celery-singleton", cm.singleton_noop)):
            if task is None:
                self.skipped[kind] = f"does not import: {cm.IMPORT_ERRORS[kind]}"
            else:
                self.tasks[kind] = task
        self.kinds = [k for k in KINDS if k in self.tasks]

    def start_worker(self) -> float:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*bc.EXTRA_PATH, *filter(None, [os.environ.get("PYTHONPATH")])]),
            "TGBENCH_QUEUE": self.queue,
            "TGBENCH_PREFIX": self.run,
        }
        self.worker = bc.Worker(self.queue, f"{self.run}@%h", self.args.concurrency, env)
        self.worker.args[self.worker.args.index("celery_bench_app")] = "celery_compare_app"
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

    def cpu_snapshot(self) -> dict[str, float]:
        snap = super().cpu_snapshot()
        snap[PUBLISHER] = snap.pop("this process")
        snap["_redis_cmds"] = float(self.admin.info("stats")["total_commands_processed"])
        return snap

    def end_to_end(self, kind: str, n: int, measure_cpu: bool = True) -> dict[str, Any]:
        """Publish n tasks of one kind onto the worker's queue and wait until every result is stored."""
        task = self.tasks[kind]
        ids = list(self.ids(n))
        gc.collect()
        cpu0 = self.cpu_snapshot() if measure_cpu else None
        t0 = time.perf_counter()
        results = [task.apply_async((i,)) for i in ids]
        published = time.perf_counter() - t0
        self.task_ids += [r.id for r in results if getattr(r, "id", None)]
        self.wait_stored(results)
        wall = time.perf_counter() - t0
        cpu1 = self.cpu_snapshot() if measure_cpu else None
        self.worker.check()
        self.collect(kind, results, ids)
        out: dict[str, Any] = {"wall": wall, "rate": n / wall, "publish": published / n}
        if cpu0 is not None and cpu1 is not None:
            out["cpu"] = {k: cpu1[k] - cpu0[k] for k in cpu0}
        return out

    def try_kind(self, kind: str, n: int, measure_cpu: bool) -> dict[str, Any] | None:
        """One batch; a comparison library that fails is dropped with its error text."""
        try:
            return self.end_to_end(kind, n, measure_cpu)
        except Exception as e:
            if kind not in ("celery-once", "celery-singleton"):
                raise
            log = "\n".join(line for line in self.worker.output().splitlines()[-40:] if line.strip())
            self.skipped[kind] = f"failed: {type(e).__name__}: {e}" + (
                f"\n      worker log tail:\n{log}" if log else ""
            )
            self.kinds.remove(kind)
            return None

    def warm_up(self) -> None:
        for kind in list(self.kinds):
            self.try_kind(kind, self.args.warmup, measure_cpu=False)

    def throughput(self) -> dict[str, list[dict[str, Any]]]:
        n, rounds = self.args.tasks, self.args.rounds
        per: dict[str, list[dict[str, Any]]] = {k: [] for k in self.kinds}
        for r in range(rounds):
            kinds = list(self.kinds)
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            for kind in order if r % 2 == 0 else order[::-1]:
                res = self.try_kind(kind, n, measure_cpu=True)
                if res is None:
                    per.pop(kind, None)
                else:
                    per[kind].append(res)
            print(f"   round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        return per


def ratio_line(per: dict[str, list[dict[str, Any]]], a: str, b: str) -> tuple[float, str]:
    r = [x["rate"] / y["rate"] for x, y in zip(per[a], per[b], strict=True)]
    m = statistics.median(r)
    return m, f"{m:.3f}x (rounds {min(r):.3f}..{max(r):.3f})"


def report(per: dict[str, list[dict[str, Any]]], n: int, rounds: int, concurrency: int) -> dict[str, Any]:
    kinds = [k for k in KINDS if per.get(k)]
    print(f"## end to end, publish included: {rounds} interleaved rounds x {n} tasks per kind")
    print(
        f"   tasks/s = N / (first apply_async -> all N results stored), one worker -P prefork -c {concurrency} draining"
    )
    print("   while this process publishes; 'publish' = the publish phase alone, ms per task.\n")
    rows = []
    med = {}
    for kind in kinds:
        rates = [x["rate"] for x in per[kind]]
        med[kind] = statistics.median(rates)
        pub = statistics.median(x["publish"] for x in per[kind]) * 1e3
        vs_u = ratio_line(per, kind, "unguarded")[0]
        vs_l = ratio_line(per, kind, "redis-py Lock")[0] if "redis-py Lock" in per else float("nan")
        rows.append(
            [
                kind,
                f"{med[kind]:,.0f}",
                f"{min(rates):,.0f}..{max(rates):,.0f}",
                f"{1e3 / med[kind]:.3f}",
                f"{pub:.3f}",
                f"{vs_u:.3f}x",
                f"{vs_l:.3f}x",
            ]
        )
    heads = ["kind", "tasks/s", "rounds min..max", "ms/task", "publish ms/task", "vs unguarded", "vs redis-py Lock"]
    print(fmt_table(heads, rows))
    print()
    out: dict[str, Any] = {"_rounds": {}}
    for other in ("unguarded", "redis-py Lock", "celery-once", "celery-singleton"):
        if other in per and "guarded" in per:
            m, line = ratio_line(per, "guarded", other)
            out[other] = m
            out["_rounds"][other] = [x["rate"] / y["rate"] for x, y in zip(per["guarded"], per[other], strict=True)]
            print(f"   guarded / {other + ':':<18} {line}")
    print()

    def target(other: str, text: str, bound: float, strict: bool) -> None:
        if other not in out:
            print(f"   target: guarded {text}: not measured (see above)")
            return
        m, r = out[other], out["_rounds"][other]
        ok = m > bound if strict else m >= bound
        undecided = min(r) <= bound <= max(r)
        print(
            f"   target: guarded {text}: {m:.3f}x  {verdict(ok)}"
            + (f"  (the rounds span {min(r):.3f}..{max(r):.3f}, across the target: noise decides)" if undecided else "")
        )
        out["targets"][other] = ok

    out["targets"] = {}
    target("redis-py Lock", ">= 0.97x of redis-py Lock by hand", 0.97, False)
    target("celery-once", "faster than celery-once", 1.0, True)
    target("celery-singleton", "faster than celery-singleton", 1.0, True)

    if not all("cpu" in x for k in kinds for x in per[k]):
        return out
    total_n = {k: n * len(per[k]) for k in kinds}
    cpu = {k: {c: sum(x["cpu"][c] for x in per[k]) / total_n[k] * 1e6 for c in PROCS} for k in kinds}
    print("\n   CPU time per task, all rounds (/proc utime+stime in 10 ms ticks; redis-server from INFO cpu), us:")
    rows = []
    for c in (*PROCS, "total"):
        v = {k: (sum(cpu[k].values()) if c == "total" else cpu[k][c]) for k in kinds}
        rows.append([c, *(f"{v[k]:.0f}" for k in kinds)])
    cmds = {k: sum(x["cpu"]["_redis_cmds"] for x in per[k]) / total_n[k] for k in kinds}
    rows.append(["Redis commands per task", *(f"{cmds[k]:.1f}" for k in kinds)])
    print("   " + fmt_table(["process", *kinds], rows).replace("\n", "\n   "))
    cores = os.cpu_count() or 1
    busy = []
    for k in kinds:
        wall = sum(x["wall"] for x in per[k])
        ours = sum(cpu[k].values()) * total_n[k] / 1e6
        host = sum(x["cpu"][bc.HOST] for x in per[k])
        busy.append(f"{k} {ours / wall:.2f} (+{max(0.0, host - ours) / wall:.2f})")
    print(f"   cores busy during the rounds, ours (+ other load on this host), of {cores}: " + ", ".join(busy))
    if "guarded" in cpu:
        g = sum(cpu["guarded"].values())
        pred = "  ".join(f"{k} {sum(cpu[k].values()) / g:.3f}x" for k in kinds if k != "guarded")
        print(
            "   guarded / each kind if throughput were bound by the total CPU per task (the kind's CPU per task /\n"
            f"   guarded's): {pred}"
        )
    print(
        "   (Redis commands per task count every command Redis ran, those inside Lua scripts included, from every\n"
        "   client: the broker and result traffic, the locks, and this process's result polling)"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--url",
        default=os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="Redis URL: broker, results, locks (default: $TASKGUARD_REDIS_URL or redis://127.0.0.1:6379/0)",
    )
    ap.add_argument("--tasks", type=int, default=300, help="tasks per kind per round (default 300)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--concurrency", type=int, default=2, help="prefork pool size (default 2)")
    ap.add_argument("--warmup", type=int, default=100, help="warm-up tasks per kind (default 100)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for one batch's results (default 60)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 50 tasks: checks it runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks, args.rounds, args.warmup = 50, 2, 10
    if args.tasks < 2 or args.rounds < 1 or args.concurrency < 1 or args.warmup < 1:
        ap.error("--tasks must be >= 2; --rounds, --concurrency and --warmup >= 1")
    args.wait = "poll"  # Bench.wait_stored

    t_start = time.monotonic()
    admin = redis.Redis.from_url(args.url, client_name="tgbench-celery-compare-admin", decode_responses=True)
    try:
        server = admin.info("server")
        clients_before = bc.client_ids(admin)
    except redis.RedisError as e:
        print(f"cannot reach Redis at {redact_url(args.url)}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    args.url_host = (redis.connection.parse_url(args.url).get("host") or "") if args.url.startswith("redis") else ""

    run = run_prefix()
    os.environ["TASKGUARD_REDIS_URL"] = args.url
    os.environ["TGBENCH_QUEUE"] = run
    os.environ["TGBENCH_PREFIX"] = run

    import celery
    import celery_compare_app  # reads TGBENCH_QUEUE / TGBENCH_PREFIX, set just above
    import kombu

    def version(dist: str) -> str:
        from importlib.metadata import PackageNotFoundError, version as v

        try:
            return v(dist)
        except PackageNotFoundError:
            return "not installed"

    load = os.getloadavg()
    print("# taskguard Celery comparison: a guarded no-op end to end, publish included")
    print(
        f"python        {platform.python_implementation()} {platform.python_version()} on "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start"
    )
    print(f"celery        {celery.__version__}, kombu {kombu.__version__}, redis-py {redis.__version__}")
    print(f"celery-once   {version('celery_once')}, celery-singleton {version('celery-singleton')}")
    print(f"redis server  {server.get('redis_version')} at {redact_url(args.url).strip(chr(39) + chr(34))}")
    print(f"taskguard     {taskguard.__version__} from {os.path.dirname(taskguard.__file__)}{git_state()}")
    print(
        f"run           queue and key prefix {run} (deleted at the end); {args.tasks} tasks per kind x "
        f"{args.rounds} rounds; worker -P prefork -c {args.concurrency}, prefetch multiplier "
        f"{celery_compare_app.app.conf.worker_prefetch_multiplier}"
    )
    if len(clients_before) > 1:
        print(f"NOTE          {len(clients_before) - 1} other client(s) connected to this Redis at the start")
    print(flush=True)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    bench: CompareBench | None = None
    rc = 0
    try:
        bench = CompareBench(args, run, admin)
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
        per = bench.throughput()
        for kind, why in bench.skipped.items():
            print(f"{kind}: not measured, {why}\n")
        report(per, args.tasks, args.rounds, args.concurrency)
        load = os.getloadavg()
        print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the worker and cleaning up", file=sys.stderr)
        rc = 130
    except Exception as e:
        rc = bc.report_failure(bench, e)
    finally:
        rc = bc.wind_up(bench, admin, run, rc)
    print(f"total wall time {time.monotonic() - t_start:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
