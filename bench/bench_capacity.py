#!/usr/bin/env python
"""One Redis's capacity: Redis CPU per acquire + release cycle, taskguard beside redis-py Lock and
python-redis-lock, on distinct keys and on one hot key.

Run from the repository root (python-redis-lock from ``bench/requirements-compare.txt``):

    .venv/bin/pip install -r bench/requirements-compare.txt
    .venv/bin/python bench/bench_capacity.py [--procs 8] [--rounds 7] [--seconds 2] [--url URL]
    .venv/bin/python bench/bench_capacity.py --quick          # a few seconds, to check it runs

One Redis serves a whole fleet of workers, so what runs out first at scale is its CPU: this bench
measures Redis's CPU per completed cycle, not the clients' speed. ``--procs`` client processes
(default 8) each loop over one contender for ``--seconds`` per window:

* ``taskguard``          ``RedisLocks.acquire(key, ttl=10)`` then ``lease.release()``
* ``redis-py Lock``      ``client.lock(key, timeout=10)``, ``acquire(blocking=False)``, ``release()``
* ``python-redis-lock``  ``redis_lock.Lock(client, key, expire=10)``, ``acquire(blocking=False)``,
                         ``release()``

on two key patterns: ``distinct`` (every cycle a fresh key: no contention, one cycle per attempt)
and ``hot`` (every process on one key, non-blocking: an attempt that finds the key held fails and
is tried again at once; a failed attempt is Redis work too, so completed cycles and attempts are
counted separately and the CPU is charged to completed cycles).

Redis CPU per window is the ``INFO cpu`` delta of the server's main thread
(``used_cpu_sys_main_thread`` + ``used_cpu_user_main_thread``; the whole server's figures when
those are missing), read just before the processes start and just after they all stopped. From
it: Redis CPU us per completed cycle (and per attempt), and the cycles per second one Redis core
could serve at that cost (1 / CPU seconds per cycle). The windows are interleaved: each round runs
every (pattern, contender) window in a rotated order, plus an ``idle`` window (the processes
waiting) whose Redis CPU per second is the baseline of the server's own housekeeping and of any
other client. Medians over rounds with min..max; the ratios taskguard / redis-py Lock and
taskguard / python-redis-lock are taken per round.

How to read it: on a 2-core machine 8 Python clients cannot load Redis fully (Redis is one of the
processes sharing the two cores), so the cycles/s the clients reached measure the clients, not
Redis; it is printed for reference only. The CPU per cycle (and the capacity it implies) is the
figure that counts. Other clients of the same Redis add CPU to every window: use an otherwise idle
Redis, and compare the idle baseline and the NOTE lines. Keys go under a fresh
``tgbench-<pid>-<random>`` prefix and are deleted at the end.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

try:  # run from a checkout without installing
    import taskguard
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import taskguard

from benchlib import arg_parser, cleanup, exit_on_sigterm, fmt_table, git_state, open_admin, run_prefix  # noqa: E402

from taskguard import RedisLocks  # noqa: E402
from taskguard.urls import redact_url  # noqa: E402

TTL = 10  # seconds, every contender
CONTENDERS = ("taskguard", "redis-py Lock", "python-redis-lock")
PATTERNS = ("distinct", "hot")
IDLE = "idle"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def prl_import_error() -> str | None:
    try:
        import redis_lock  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


# -- the client processes ---------------------------------------------------------------------------
def make_cycle(name: str, pattern: str, client: redis.Redis, locks: RedisLocks, prefix: str, wid: int) -> Callable:
    """One attempt of an acquire + release cycle; -> True when the lock was taken (and released)."""
    counter = iter(range(1 << 62))
    if name == "taskguard":
        acquire = locks.acquire
        if pattern == "hot":

            def tg_hot() -> bool:
                acq = acquire("hot", ttl=TTL)
                if acq.acquired:
                    acq.lease.release()
                    return True
                return False

            return tg_hot

        def tg_distinct() -> bool:
            acq = acquire(f"d:{wid}:{next(counter)}", ttl=TTL)
            if not acq.acquired:
                raise RuntimeError("taskguard: a fresh key was held")
            acq.lease.release()
            return True

        return tg_distinct
    if name == "redis-py Lock":
        lock = client.lock
        key = f"{prefix}:rp"

        def rp() -> bool:
            lk = lock(f"{key}:hot" if pattern == "hot" else f"{key}:{wid}:{next(counter)}", timeout=TTL)
            if lk.acquire(blocking=False):
                lk.release()
                return True
            if pattern != "hot":
                raise RuntimeError("redis-py Lock: a fresh key was held")
            return False

        return rp
    if name == "python-redis-lock":
        import logging

        import redis_lock

        logging.getLogger("redis_lock").setLevel(logging.ERROR)  # it logs every failed attempt
        Lock = redis_lock.Lock
        key = f"{prefix}:prl"

        def prl() -> bool:
            lk = Lock(client, f"{key}:hot" if pattern == "hot" else f"{key}:{wid}:{next(counter)}", expire=TTL)
            if lk.acquire(blocking=False):
                lk.release()
                return True
            if pattern != "hot":
                raise RuntimeError("python-redis-lock: a fresh key was held")
            return False

        return prl
    raise ValueError(name)


def client_main(wid: int, url: str, prefix: str, conn: Any, go: Any, stop: Any) -> None:
    """A client process: per command, build the contender's cycle, say ready, wait for ``go``,
    loop until ``stop``, send back (completed cycles, attempts, seconds looped)."""
    client = redis.Redis.from_url(url)
    locks = RedisLocks(client, prefix=prefix)
    try:
        while True:
            cmd = conn.recv()
            if cmd is None:
                return
            what, name, pattern, warm = cmd
            if what == IDLE:
                conn.send("ready")
                go.wait()
                while not stop.value:
                    time.sleep(0.005)
                conn.send((0, 0, 0.0, 0.0))
                continue
            fn = make_cycle(name, pattern, client, locks, prefix, wid)
            for _ in range(warm):  # connections made, scripts loaded
                fn()
            conn.send("ready")
            go.wait()
            done = tries = 0
            t0, c0 = time.perf_counter(), time.process_time()
            while not stop.value:
                tries += 1
                if fn():
                    done += 1
            conn.send((done, tries, time.perf_counter() - t0, time.process_time() - c0))
    except BaseException as e:  # reported by the parent
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except Exception:
            pass
    finally:
        locks.close()
        client.close()


class Clients:
    def __init__(self, n: int, url: str, prefix: str) -> None:
        ctx = mp.get_context("fork")
        self.go = ctx.Event()
        self.stop = ctx.Value("b", 0, lock=False)
        self.conns = []
        self.procs = []
        for wid in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=client_main, args=(wid, url, prefix, child, self.go, self.stop), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def _recv(self, conn: Any) -> Any:
        if not conn.poll(120):
            raise RuntimeError("a client process did not answer within 120 s")
        msg = conn.recv()
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise RuntimeError(f"a client process failed: {msg[1]}")
        return msg

    def window(
        self, what: str, name: str, pattern: str, seconds: float, warm: int, cpu: Callable[[], dict[str, float]]
    ) -> dict[str, Any]:
        self.go.clear()
        self.stop.value = 0
        for c in self.conns:
            c.send((what, name, pattern, warm))
        for c in self.conns:
            if self._recv(c) != "ready":
                raise RuntimeError("a client process is out of step")
        a = cpu()
        h0 = host_busy()
        t0 = time.perf_counter()
        self.go.set()
        time.sleep(seconds)
        self.stop.value = 1
        res = [self._recv(c) for c in self.conns]
        wall = time.perf_counter() - t0
        h1 = host_busy()
        b = cpu()
        clients_cpu = sum(r[3] for r in res)
        return {
            "clients_cpu": clients_cpu,
            "other": max(0.0, (h1 - h0) - clients_cpu - (b["server"] - a["server"])),
            "cycles": sum(r[0] for r in res),
            "attempts": sum(r[1] for r in res),
            "wall": wall,
            "cpu": b["cpu"] - a["cpu"],
            "commands": b["commands"] - a["commands"] - 1,  # -1: the INFO of the second reading
        }

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def host_busy() -> float:
    """CPU seconds the whole host has been busy (all CPUs, from /proc/stat); NaN without it."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def server_cpu(admin: redis.Redis) -> Callable[[], dict[str, float]]:
    info = admin.info("cpu")
    main_thread = "used_cpu_sys_main_thread" in info
    fields = (
        ("used_cpu_sys_main_thread", "used_cpu_user_main_thread") if main_thread else ("used_cpu_sys", "used_cpu_user")
    )

    def read() -> dict[str, float]:
        i = admin.info("cpu", "stats")
        return {
            "cpu": float(i[fields[0]]) + float(i[fields[1]]),
            "server": float(i["used_cpu_sys"]) + float(i["used_cpu_user"]),
            "commands": int(i["total_commands_processed"]),
        }

    read.fields = fields  # type: ignore[attr-defined]
    return read


# -- the run -----------------------------------------------------------------------------------------
def run(clients: Clients, contenders: list[str], rounds: int, seconds: float, warm: int, cpu: Callable) -> dict:
    windows = [(p, c) for p in PATTERNS for c in contenders] + [(IDLE, IDLE)]
    res: dict[tuple[str, str], list[dict[str, Any]]] = {w: [] for w in windows}
    for r in range(rounds):
        order = windows[r % len(windows) :] + windows[: r % len(windows)]
        if r % 2:
            order = order[::-1]
        for pattern, name in order:
            what = IDLE if name == IDLE else "run"
            res[(pattern, name)].append(clients.window(what, name, pattern, seconds, warm, cpu))
        print(f"   round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return res


def med_range(v: list[float], fmt: str) -> tuple[str, str]:
    return format(statistics.median(v), fmt), f"{format(min(v), fmt)}..{format(max(v), fmt)}"


def report(res: dict, contenders: list[str], procs: int, seconds: float) -> dict[str, Any]:
    idle = res[(IDLE, IDLE)]
    base = [w["cpu"] / w["wall"] for w in idle]
    base_cmds = [w["commands"] / w["wall"] for w in idle]
    print(
        f"idle baseline (the processes waiting): Redis main thread {statistics.median(base) * 1e3:.2f} ms CPU/s "
        f"(rounds {min(base) * 1e3:.2f}..{max(base) * 1e3:.2f}), {statistics.median(base_cmds):.1f} commands/s "
        "from other clients; the figures below are raw (baseline not subtracted)\n"
    )
    summary: dict[str, Any] = {}
    for pattern in PATTERNS:
        title = (
            "distinct keys: every cycle a fresh key (no contention)"
            if pattern == "distinct"
            else f"one hot key: {procs} processes, non-blocking attempts, a failed one retried at once"
        )
        print(f"## {pattern}: {title}\n")
        rows = []
        per: dict[str, list[float]] = {}
        for name in contenders:
            ws = res[(pattern, name)]
            per_cycle = [w["cpu"] / w["cycles"] * 1e6 if w["cycles"] else float("inf") for w in ws]
            per_attempt = [w["cpu"] / w["attempts"] * 1e6 for w in ws]
            cap = [1e6 / x for x in per_cycle]
            rate = [w["cycles"] / w["wall"] for w in ws]
            att = [w["attempts"] / max(w["cycles"], 1) for w in ws]
            busy = [w["cpu"] / w["wall"] for w in ws]
            ccpu = [w["clients_cpu"] / max(w["cycles"], 1) * 1e6 for w in ws]
            other = [w["other"] / w["wall"] for w in ws]
            cmds = [w["commands"] / max(w["cycles"], 1) for w in ws]
            per[name] = per_cycle
            m, rg = med_range(per_cycle, ".1f")
            cm, crg = med_range(cap, ",.0f")
            row = [name, m, rg, cm, crg]
            if pattern == "hot":
                row += [f"{statistics.median(per_attempt):.1f}", f"{statistics.median(att):.2f}"]
            row += [
                f"{statistics.median(cmds):.2f}",
                f"{statistics.median(rate):,.0f}",
                f"{statistics.median(busy) * 100:.0f}%",
                f"{statistics.median(ccpu):.0f}",
                f"{statistics.median(other):.2f}",
            ]
            rows.append(row)
        heads = ["contender", "Redis us/cycle", "rounds", "cycles/s per Redis core", "rounds"]
        if pattern == "hot":
            heads += ["Redis us/attempt", "attempts/cycle"]
        heads += ["cmds/cycle", "clients' cycles/s", "Redis busy", "clients' us/cycle", "other load"]
        print(fmt_table(heads, rows))
        print()
        for other in contenders[1:]:
            r = [a / b for a, b in zip(per["taskguard"], per[other], strict=True)]
            m = statistics.median(r)
            summary[(pattern, other)] = m
            print(
                f"   taskguard / {other}: Redis CPU per cycle {m:.2f}x (rounds {min(r):.2f}..{max(r):.2f}); "
                f"one Redis core serves {1 / m:.2f}x as many taskguard cycles"
            )
        summary[(pattern, "taskguard")] = statistics.median(per["taskguard"])
        print()
    print(
        f"   'clients' cycles/s': what {procs} Python client processes reached on this machine - they are the\n"
        "   bottleneck (see 'Redis busy': the main thread's share of one core), so it measures the clients, not\n"
        "   Redis. 'cycles/s per Redis core' = 1 / (Redis CPU seconds per completed cycle): the capacity of one\n"
        "   Redis core at that cost. cmds/cycle: commands Redis ran per completed cycle, sent by the clients or\n"
        "   run inside Lua scripts (INFO stats total_commands_processed; every client's count). clients' us/cycle:\n"
        "   the client processes' CPU per completed cycle. other load: cores busy with anything else on this host\n"
        "   during the windows (/proc/stat minus the clients and redis-server; median over rounds)."
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--procs", type=int, default=8, help="client processes (default 8)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per window (default 2)")
    ap.add_argument("--warm", type=int, default=50, help="unmeasured cycles per process before a window (default 50)")
    ap.add_argument("--quick", action="store_true", help="2 processes, 2 rounds of 0.3 s windows: checks it runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.procs, args.rounds, args.seconds, args.warm = 2, 2, 0.3, 5
    if args.procs < 1 or args.rounds < 1 or args.seconds <= 0 or args.warm < 0:
        ap.error("--procs and --rounds must be >= 1, --seconds > 0, --warm >= 0")
    exit_on_sigterm()

    t_start = time.monotonic()
    opened = open_admin(args.url, "tgbench-capacity-admin")
    if opened is None:
        return 2
    admin, server = opened
    contenders = list(CONTENDERS)
    missing = prl_import_error()
    if missing:
        contenders.remove("python-redis-lock")
    prefix = run_prefix()
    cpu = server_cpu(admin)
    load = os.getloadavg()

    print("# taskguard capacity benchmark: Redis CPU per acquire + release cycle")
    print(
        f"python        {platform.python_implementation()} {platform.python_version()} on "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start"
    )
    print(
        f"redis server  {server.get('redis_version')} ({server.get('redis_mode', '?')}) at "
        f"{redact_url(args.url).strip(chr(39) + chr(34))}; CPU from INFO cpu {' + '.join(cpu.fields)}"  # type: ignore[attr-defined]
    )
    print(f"redis-py      {redis.__version__}")
    if missing:
        print(f"python-redis-lock  skipped: {missing} (pip install -r bench/requirements-compare.txt)")
    else:
        import redis_lock

        print(f"python-redis-lock  {getattr(redis_lock, '__version__', '?')}")
    print(f"taskguard     {taskguard.__version__} from {os.path.dirname(taskguard.__file__)}{git_state()}")
    print(
        f"run           {args.procs} client processes, {args.rounds} interleaved rounds x "
        f"{len(PATTERNS) * len(contenders) + 1} windows of {args.seconds:g} s; key prefix {prefix} (deleted at the end)"
    )
    others = int(admin.info("clients").get("connected_clients", 0)) - 1
    if others > 0:
        print(f"NOTE          {others} other client(s) connected to this Redis at the start; their load adds noise")
    print(flush=True)

    clients = None
    rc = 0
    try:
        clients = Clients(args.procs, args.url, prefix)
        res = run(clients, contenders, args.rounds, args.seconds, args.warm, cpu)
        report(res, contenders, args.procs, args.seconds)
        load = os.getloadavg()
        print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up", file=sys.stderr)
        rc = 130
    finally:
        if clients is not None:
            clients.close()
        deleted, left = cleanup(admin, prefix)
        print(f"\ncleanup: deleted {deleted} keys under {prefix}; {left} left")
        admin.close()
    print(f"total wall time {time.monotonic() - t_start:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
