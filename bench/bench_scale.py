#!/usr/bin/env python
"""taskguard at scale: 10,000 live leases on one heartbeat, and Redis memory per distinct key.

Run from the repository root:

    .venv/bin/python bench/bench_scale.py [--leases N] [--seconds S] [--keys K] [--url URL]

What it measures, on one Redis (``--url``, default ``$TASKGUARD_REDIS_URL`` or
``redis://127.0.0.1:6379/0``; meant for loopback):

1. Heartbeat at scale: ``--leases`` (10,000) live leases in this process, acquired with
   ``renew=True, ttl=--ttl`` (3 s) and the default ``renew_fraction`` (1/3), kept alive by the
   process heartbeat alone for ``--seconds`` (15 s) after a warm-up. Reported: heartbeat rounds and
   pipelines (round trips) per round and per second, leases per pipeline, pipeline round-trip time,
   renewals per second (client-side and from ``INFO commandstats``), the CPU of this process per
   second (``time.process_time`` delta; also per thread from /proc), Redis's CPU, the PING latency
   another process sees meanwhile (vs before the leases existed), leases lost (must be 0) and the
   smallest TTL left on any lease at the end.

   Pipelines are counted on the client: ``client.pipeline`` is wrapped on the instance (the only
   instrumentation; taskguard is not patched).

2. Redis memory per idle distinct key: ``INFO memory`` ``used_memory`` before and after acquiring
   and releasing ``--keys`` (100,000) distinct keys (what stays: one hash per key with its fence
   and release mark, for ``fence_idle_ttl``, 3600 s here or ``--fence-idle-ttl``), then the same
   reading for the floor any fenced lock needs: one string key with a TTL and a 16-digit value
   under each of the same names. Printed: bytes per key of each and their ratio (target <= 1.15x).

Keys live under fresh ``tgbench-<pid>-<random>`` prefixes and are deleted at the end (also after an
error, Ctrl-C or SIGTERM). Other clients of the same Redis change ``used_memory`` too: run it on an
otherwise idle Redis for figures to quote.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any

import redis
import redis.client
import redis.cluster
import redis.utils

try:  # run from a checkout without installing
    import taskguard
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import taskguard

from benchlib import arg_parser, cleanup, exit_on_sigterm, fmt_table, git_state, open_admin, pct, run_prefix, verdict  # noqa: E402

from taskguard import RedisLocks
from taskguard.heartbeat import COALESCE, get_heartbeat
from taskguard.redis_backend import SIGNAL_TTL
from taskguard.urls import redact_url


# -- small helpers ---------------------------------------------------------------------------------
def redis_cpu(admins: list[redis.Redis]) -> float:
    """CPU seconds of the Redis servers (every primary of a Cluster), from ``INFO cpu``."""
    total = 0.0
    for admin in admins:
        info = admin.info("cpu")
        total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


def command_calls(admins: list[redis.Redis], name: str) -> int:
    return sum(int(a.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0)) for a in admins)


def evalsha_calls(admins: list[redis.Redis]) -> int:
    return command_calls(admins, "evalsha")


def getkeys_calls(admins: list[redis.Redis]) -> int:
    return command_calls(admins, "command|getkeys")


def thread_cpu() -> dict[str, float]:
    """CPU seconds per live thread of this process, by thread name (/proc; 10 ms ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for t in threading.enumerate():
        tid = getattr(t, "native_id", None)
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        name = t.name if not t.name.startswith("taskguard-renew") else "taskguard-renew (pool)"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def lat_cell(v: list[float]) -> str:
    if not v:
        return "n/a"
    return f"p50 {pct(v, 0.5) * 1e3:.2f} ms, p99 {pct(v, 0.99) * 1e3:.2f} ms, max {v[-1] * 1e3:.2f} ms ({len(v)} pings)"


# -- a PING prober in another process -----------------------------------------------------------------
def prober(url: str, stop: Any, out: Any, every: float) -> None:
    client = redis.Redis.from_url(url)
    clock = time.monotonic
    samples: list[tuple[float, float]] = []
    try:
        client.ping()
        while not stop.is_set():
            s = clock()
            client.ping()
            samples.append((s, clock() - s))
            time.sleep(every)
    finally:
        out.put(samples)
        client.close()


# -- part 1: the heartbeat with many leases -------------------------------------------------------------
class PipelineLog:
    """Counts every plain redis-py pipeline execute in this process (``redis.client.Pipeline``:
    what the heartbeat sends on standalone Redis, and per node on a Cluster): its size and round
    trip time. The class's ``execute`` is wrapped for the measurement only (taskguard is not
    patched) and restored by :meth:`close`."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, int, float]] = []  # (started monotonic, commands, seconds)
        self._orig = orig = redis.client.Pipeline.execute
        log = self.entries

        def execute(pipe: Any, *a: Any, **k: Any) -> Any:
            n = len(pipe.command_stack)
            s = time.monotonic()
            try:
                return orig(pipe, *a, **k)
            finally:
                log.append((s, n, time.monotonic() - s))

        redis.client.Pipeline.execute = execute  # type: ignore[method-assign]

    def close(self) -> None:
        redis.client.Pipeline.execute = self._orig  # type: ignore[method-assign]


def busy_loop(stop: threading.Event) -> None:
    """A CPU-bound pure-Python thread: it holds the GIL whenever the interpreter lets it."""
    while not stop.is_set():
        sum(i * i for i in range(2000))


def part_heartbeat(
    url: str,
    admins: list[redis.Redis],
    prefix: str,
    n: int,
    ttl: float,
    seconds: float,
    warmup: float,
    cluster: bool = False,
    busy: bool = False,
) -> dict[str, float]:
    if cluster:
        client: Any = redis.cluster.RedisCluster.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    else:
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    plog = PipelineLog()
    locks = RedisLocks(client, prefix=prefix)
    interval = ttl * locks.renew_fraction
    ctx = multiprocessing.get_context("fork")  # forked before any taskguard thread exists
    stop, out = ctx.Event(), ctx.Queue()
    probe = ctx.Process(target=prober, args=(url, stop, out, 0.002), daemon=True)
    probe.start()
    time.sleep(2.0)  # PING latency with no leases
    idle_end = time.monotonic()

    hb = get_heartbeat()
    t0 = time.monotonic()
    leases = []
    for i in range(n):
        acq = locks.acquire(f"live:{i}", ttl=ttl, renew=True)
        if not acq.acquired:
            raise RuntimeError(f"lease live:{i} unexpectedly held")
        leases.append(acq.lease)
    acquire_s = time.monotonic() - t0
    busy_stop = threading.Event()
    busy_thread = threading.Thread(target=busy_loop, args=(busy_stop,), name="cpu-busy", daemon=True)
    if busy:
        busy_thread.start()
    time.sleep(warmup)

    gc.collect()
    beats0, pipes0 = hb.beats, len(plog.entries)
    ev0, gk0, rcpu0 = evalsha_calls(admins), getkeys_calls(admins), redis_cpu(admins)
    cpu0, th0 = time.process_time(), thread_cpu()
    w0 = time.monotonic()
    time.sleep(seconds)
    w1 = time.monotonic()
    beats1, pipes1 = hb.beats, len(plog.entries)
    ev1, gk1, rcpu1 = evalsha_calls(admins), getkeys_calls(admins), redis_cpu(admins)
    cpu1, th1 = time.process_time(), thread_cpu()
    busy_stop.set()
    if busy:
        busy_thread.join()
    stop.set()
    samples = out.get(timeout=30)
    probe.join(10)
    plog.close()

    # end check: every lease still held, with how much TTL left (the lease's expiry field ``x``,
    # server milliseconds, against the server's TIME; the key itself lives for fence_idle_ttl)
    lost = sum(1 for lease in leases if lease.lost)
    pipe = client.pipeline(transaction=False)
    for lease in leases:
        pipe.hget(locks.backend.lease_key(lease.key), "x")
    expiries = pipe.execute()
    sec, usec = admins[0].time()
    now_ms = sec * 1000 + usec // 1000
    pttls = sorted(int(x) - now_ms if x is not None else -1 for x in expiries)
    t_rel = time.monotonic()
    not_released = sum(1 for lease in leases if not lease.release())
    release_s = time.monotonic() - t_rel

    window = [e for e in plog.entries[pipes0:pipes1]]
    sizes = [e[1] for e in window]
    rtts = sorted(e[2] for e in window)
    wall = w1 - w0
    rounds = beats1 - beats0
    renewals = sum(sizes)
    cpu = cpu1 - cpu0
    idle = sorted(x[1] for x in samples if x[0] < idle_end)
    busy_pings = sorted(x[1] for x in samples if w0 <= x[0] <= w1)

    where = f"a {len(admins)}-primary Redis Cluster" if cluster else "one Redis"
    print(
        f"## 1. {n:,} live leases on one heartbeat, {where}{', a CPU-busy thread beside it' if busy else ''}: "
        f"ttl={ttl:g} s, renew_fraction={locks.renew_fraction:.3g} (renewed every {interval:g} s,"
    )
    print(
        f"   up to {COALESCE:.0%} of that early to share a round); measured over {wall:.1f} s after a "
        f"{warmup:g} s warm-up\n"
    )
    rows = [
        ["acquire of the leases (renew=True), sequential", f"{acquire_s:.2f} s ({acquire_s / n * 1e6:.0f} us each)"],
        ["heartbeat rounds", f"{rounds} ({rounds / wall:.2f}/s)"],
        [
            "pipelines (round trips)",
            f"{len(window)} ({len(window) / wall:.2f}/s, {len(window) / max(rounds, 1):.2f} per round)",
        ],
        [
            "leases per pipeline",
            f"mean {statistics.mean(sizes):,.0f}, min {min(sizes):,}, max {max(sizes):,}" if sizes else "n/a",
        ],
        ["pipeline round trip", f"p50 {pct(rtts, 0.5) * 1e3:.1f} ms, max {rtts[-1] * 1e3:.1f} ms" if rtts else "n/a"],
        [
            "renewals / s (client-side)",
            f"{renewals / wall:,.0f} ({renewals / wall / n:.2f} per lease; 1/interval = {1 / interval:.2f})",
        ],
        ["EVALSHA / s (INFO commandstats)", f"{(ev1 - ev0) / wall:,.0f} (other clients' included)"],
        ["COMMAND GETKEYS in the window", f"{gk1 - gk0} (redis-py's ClusterPipeline asks one per EVALSHA)"],
        [
            "CPU of this process",
            f"{cpu / wall * 1e3:.0f} ms/s = {cpu / wall:.1%} of a core "
            f"({cpu / max(renewals, 1) * 1e6:.1f} us per renewal)",
        ],
    ]
    for name in sorted(th1):
        d = th1[name] - th0.get(name, 0.0)
        if d > 0 or name in ("taskguard-heartbeat", "MainThread"):
            rows.append([f"  thread {name}", f"{d / wall * 1e3:.0f} ms/s"])
    rows += [
        [
            "Redis CPU",
            f"{(rcpu1 - rcpu0) / wall * 1e3:.0f} ms/s "
            f"({(rcpu1 - rcpu0) / max(renewals, 1) * 1e6:.1f} us per renewal; other clients' included)",
        ],
        ["PING from another process, no leases", lat_cell(idle)],
        ["PING from another process, heartbeat on", lat_cell(busy_pings)],
        ["leases lost", f"{lost} of {n:,}"],
        [
            "TTL left at the end check",
            f"min {pttls[0] / 1e3:.2f} s, median {pct(pttls, 0.5) / 1e3:.2f} s (of ttl {ttl:g} s)",
        ],
        ["release of the leases, sequential", f"{release_s:.2f} s; {not_released} not released"],
    ]
    print(fmt_table(["measure", "value"], rows, align="ll"))
    client.close()
    return {"acq_rel_s": (acquire_s + release_s) / n}


# -- part 2: Redis memory per distinct key ------------------------------------------------------------
def used_memory(admin: redis.Redis, reads: int = 5) -> int:
    vals = []
    for _ in range(reads):
        vals.append(int(admin.info("memory")["used_memory"]))
        time.sleep(0.05)
    return int(statistics.median(vals))


def count_keys(admin: redis.Redis, prefix: str) -> int:
    return sum(1 for _ in admin.scan_iter(match=f"*{prefix}*", count=5000))


def mean_memory_usage(admin: redis.Redis, prefix: str, n: int = 200) -> float:
    keys = []
    for k in admin.scan_iter(match=f"*{prefix}*", count=5000):
        keys.append(k)
        if len(keys) >= n:
            break
    if not keys:
        return float("nan")
    pipe = admin.pipeline(transaction=False)
    for k in keys:
        pipe.memory_usage(k, samples=0)
    vals = [v for v in pipe.execute() if v is not None]
    return statistics.mean(vals) if vals else float("nan")


def wait_until(pred: Any, timeout: float, step: float = 1.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def part_memory(
    url: str, admin: redis.Redis, prefix: str, n: int, idle_ttl: float | None, per_op_hint: float | None
) -> None:
    """Memory per idle distinct key, side by side with its floor: one string key with a TTL (a
    16-digit value, what any fencing counter needs) under the same name."""
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    idle_ttl = idle_ttl or 3600.0
    locks = RedisLocks(client, prefix=prefix, fence_idle_ttl=idle_ttl)
    others0 = int(admin.dbsize())
    time.sleep(0.5)
    base = used_memory(admin)
    t0 = time.monotonic()
    for i in range(n):
        acq = locks.acquire(f"k:{i}", ttl=10)
        if not acq.acquired:
            raise RuntimeError(f"key k:{i} unexpectedly held")
        acq.lease.release()
    create_s = time.monotonic() - t0
    time.sleep(0.3)
    after = used_memory(admin)
    keys_after = count_keys(admin, prefix)
    usage = mean_memory_usage(admin, prefix)
    names = [locks.backend.lease_key(f"k:{i}") for i in range(n)]
    for i in range(0, n, 1000):
        admin.delete(*names[i : i + 1000])
    time.sleep(0.5)
    base2 = used_memory(admin)
    pipe = admin.pipeline(transaction=False)
    value = "1796078722691000"  # a fencing token: server microseconds
    for i, name in enumerate(names):
        pipe.set(name, value, px=int(idle_ttl * 1000))
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    time.sleep(0.3)
    floor = used_memory(admin)
    floor_usage = mean_memory_usage(admin, prefix)
    for i in range(0, n, 1000):
        admin.delete(*names[i : i + 1000])
    others1 = int(admin.dbsize()) - count_keys(admin, prefix)
    per_key, per_floor = (after - base) / n, (floor - base2) / n
    print(
        f"## 2. Redis memory per idle distinct key: {n:,} distinct keys acquired + released once "
        f"(fence_idle_ttl={idle_ttl:g} s), beside the floor of one string key with a TTL per name"
    )
    print(
        f"   creating them took {create_s:.1f} s ({create_s / n * 1e6:.0f} us per acquire+release); "
        f"used_memory = median of 5 INFO reads\n"
    )
    print(
        fmt_table(
            ["what", "keys", "B per key (used_memory delta)", "MEMORY USAGE (mean of 200)"],
            [
                [
                    "taskguard: the lease hash once released (fence + release mark)",
                    f"{keys_after:,}",
                    f"{per_key:.1f}",
                    f"{usage:.0f}",
                ],
                ["floor: SET name <16 digits> PX idle", f"{n:,}", f"{per_floor:.1f}", f"{floor_usage:.0f}"],
            ],
            align="lrrr",
        )
    )
    ratio = per_key / per_floor if per_floor > 0 else float("nan")
    print(f"   taskguard / floor = {ratio:.3f}x  target <= 1.15x: {verdict(ratio <= 1.15)}")
    print(
        f"   one key per distinct guard key; it goes after fence_idle_ttl (7 days by default) without use. "
        f"The release signal ({{P:K}}:signal, {SIGNAL_TTL:g} s) exists only when someone waited."
    )
    if others1 != others0:
        print(
            f"   NOTE: other clients' keys in this db went from {others0:,} to {others1:,} meanwhile; their "
            f"memory is in the deltas"
        )
    client.close()


def main_cluster(args: Any, t_start: float) -> int:
    """Part 1 on a local 3-primary Redis Cluster (tests/servers.py starts it), quiet and then
    beside a CPU-busy thread; the cluster is stopped at the end."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.servers import RedisCluster

    cluster = RedisCluster().start()
    try:
        admins = [redis.Redis(port=p, decode_responses=True) for p in cluster.ports]
        server = admins[0].info("server")
        print("# taskguard at scale on Redis Cluster: many leases on one heartbeat")
        print(
            f"python        {platform.python_implementation()} {platform.python_version()} on {platform.system()} "
            f"{platform.machine()}, {os.cpu_count()} CPUs, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        print(
            f"redis server  {server.get('redis_version')} (cluster of {len(admins)} primaries, no replicas, "
            f"ports {', '.join(map(str, cluster.ports))}; started for this run)"
        )
        print(f"redis-py      {redis.__version__}, hiredis {'yes' if redis.utils.HIREDIS_AVAILABLE else 'no'}")
        print(f"taskguard     {taskguard.__version__} from {os.path.dirname(taskguard.__file__)}{git_state()}\n")
        prefix = run_prefix()
        for busy in (False, True):
            part_heartbeat(
                cluster.url,
                admins,
                f"{prefix}:hb{int(busy)}",
                args.leases,
                args.ttl,
                args.seconds,
                args.warmup,
                cluster=True,
                busy=busy,
            )
            print()
        for a in admins:
            a.close()
    finally:
        cluster.close()
    print(
        f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"total wall time {time.monotonic() - t_start:.1f} s"
    )
    return 0


# -- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--leases", type=int, default=10_000, help="live leases in part 1 (default 10000)")
    ap.add_argument("--ttl", type=float, default=3.0, help="their TTL, seconds (default 3)")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window of part 1 (default 15)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the window (default 3)")
    ap.add_argument("--keys", type=int, default=100_000, help="distinct keys in part 2 (default 100000)")
    ap.add_argument(
        "--fence-idle-ttl",
        type=float,
        default=None,
        help="fence_idle_ttl of part 2, seconds (default: just long enough, see the docstring)",
    )
    ap.add_argument("--skip-heartbeat", action="store_true", help="part 2 only")
    ap.add_argument("--skip-memory", action="store_true", help="part 1 only")
    ap.add_argument(
        "--busy-thread", action="store_true", help="run part 1 again with a CPU-busy Python thread in the same process"
    )
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="part 1 on a 3-primary Redis Cluster of local redis-server processes started for "
        "the run (ignores --url; part 1 runs quiet and then beside a CPU-busy thread)",
    )
    args = ap.parse_args(argv)
    if args.leases < 1 or args.keys < 1 or args.seconds <= 0 or args.ttl <= 0:
        ap.error("--leases, --keys must be >= 1; --seconds, --ttl > 0")

    exit_on_sigterm()
    t_start = time.monotonic()
    if args.cluster:
        return main_cluster(args, t_start)
    opened = open_admin(args.url)
    if opened is None:
        return 2
    admin, server = opened
    prefix = run_prefix()
    mem = admin.info("memory")
    print("# taskguard at scale: many leases on one heartbeat, Redis memory per key")
    print(
        f"python        {platform.python_implementation()} {platform.python_version()} on {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"redis server  {server.get('redis_version')} ({server.get('redis_mode', '?')}, "
        f"{mem.get('mem_allocator', '?')}, maxmemory-policy {mem.get('maxmemory_policy', '?')}) at "
        f"{redact_url(args.url).strip(chr(39) + chr(34))}"
    )
    print(f"redis-py      {redis.__version__}, hiredis {'yes' if redis.utils.HIREDIS_AVAILABLE else 'no'}")
    print(f"taskguard     {taskguard.__version__} from {os.path.dirname(taskguard.__file__)}{git_state()}")
    print(f"key prefix    {prefix}:hb / {prefix}:mem (deleted at the end)")
    others = int(admin.info("clients").get("connected_clients", 0)) - 1
    if others > 0:
        print(f"NOTE          {others} other client(s) connected to this Redis; their load and keys add noise")
    print()
    hint = None
    try:
        if not args.skip_heartbeat:
            for busy in (False, True) if args.busy_thread else (False,):
                hint = part_heartbeat(
                    args.url, [admin], prefix + ":hb", args.leases, args.ttl, args.seconds, args.warmup, busy=busy
                )["acq_rel_s"]
                cleanup(admin, prefix + ":hb")  # part 1's counters (fence_idle_ttl 7 days) would skew part 2
                print()
        if not args.skip_memory:
            part_memory(args.url, admin, prefix + ":mem", args.keys, args.fence_idle_ttl, hint)
    finally:
        deleted, left = cleanup(admin, prefix)
        print(f"\ncleanup: deleted {deleted} keys under {prefix}; {left} left")
        admin.close()
    print(
        f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"total wall time {time.monotonic() - t_start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
