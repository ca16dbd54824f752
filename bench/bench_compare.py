#!/usr/bin/env python
"""taskguard against other Redis lock libraries, side by side in one run.

Run from the repository root (the comparison libraries live only in the benchmark's own
virtual environment, never in the project's dependencies):

    python3 -m venv bench/.venv-compare && bench/.venv-compare/bin/pip install -e . -r bench/requirements-compare.txt
    bench/.venv-compare/bin/python bench/bench_compare.py [--ops N] [--rounds R] [--url URL]

(``python3 bench/bench_compare.py --setup`` runs that one-liner and goes on; started from any
other interpreter, the script re-runs itself in ``bench/.venv-compare`` when that exists.) A
library that cannot be imported gets a "skipped: reason" row.

What it measures, on one Redis (``--url``, default ``$TASKGUARD_REDIS_URL`` or
``redis://127.0.0.1:6379/0``; meant for loopback):

1. One acquire + release, uncontended (a fresh key state each time), in interleaved rounds
   (every round runs every contender for ``--ops`` operations, the order rotated each round), on
   one shared ``redis.Redis`` client: ops/s, per-op latency p50/p99, and the per-round ratios of
   each contender's time to taskguard's and to two PINGs (medians, min..max over rounds).

   * ``taskguard``          ``RedisLocks.acquire(key, ttl=10)`` + ``lease.release()``
   * ``redis-py Lock``      ``client.lock(key, timeout=10).acquire(blocking=False)`` + ``release()``
   * ``python-redis-lock``  ``redis_lock.Lock(client, key, expire=10).acquire(blocking=False)`` + ``release()``
   * ``pottery Redlock``    ``Redlock(key=key, masters={client}, auto_release_time=10)`` (one master)
                            ``.acquire(blocking=False)`` + ``release()``
   * ``celery-once``        its Redis backend's lock path: ``raise_or_lock(key, timeout=10)`` +
                            ``clear_lock(key)`` (the backend's client replaced by the shared one)
   * ``2x PING``            ``client.ping()`` twice: the floor of two round trips

   Then, per contender, round trips per op (counted client-side), the commands Redis ran per op
   (``INFO commandstats`` deltas, the ones inside Lua scripts included) and threads started per op.

2. Contention on ONE key: 1, 8 and 32 threads (and 8 and 32 processes), each looping "acquire
   with a wait, hold ``--hold-ms``, release, pause ``--think-ms``" for ``--contention-seconds``, in
   interleaved rounds: taskguard ``acquire(key, ttl=10, wait=5)`` vs redis-py ``Lock(timeout=10,
   blocking_timeout=5)`` with its default ``sleep=0.1`` (and ``sleep=0.01``) vs python-redis-lock
   ``acquire(blocking=True, timeout=5)``. Reported: acquisitions/s, hand-off latency from a
   holder's release call to the next holder's acquire returning (p50/p99, when the next holder is
   another worker), how often the releaser took the lock straight back, how many workers got it
   at all, how long acquire waited (p50/p99), and the cost per successful acquisition: round
   trips (client-side count), Redis commands (``INFO commandstats`` deltas), Redis CPU and client
   CPU.

Keys live under a fresh ``tgbench-<pid>-<random>`` prefix and are deleted at the end (also after an
error, Ctrl-C or SIGTERM). Nothing in taskguard or the other libraries is patched; the only
instrumentation is a redis-py ``Connection`` subclass that counts the commands it sends.
"""

from __future__ import annotations

import gc
import importlib.metadata
import multiprocessing
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COMPARE_VENV = os.path.join(HERE, ".venv-compare")
REQUIREMENTS = os.path.join(HERE, "requirements-compare.txt")
SETUP_ONE_LINER = (
    "python3 -m venv bench/.venv-compare && bench/.venv-compare/bin/pip install -e . -r bench/requirements-compare.txt"
)
TTL = 10  # seconds, every contender


def _in_compare_venv() -> bool:
    return os.path.realpath(sys.prefix) == os.path.realpath(COMPARE_VENV)


def _setup_venv() -> None:
    py = os.path.join(COMPARE_VENV, "bin", "python")
    if not os.path.exists(py):
        print(f"setup: creating {os.path.relpath(COMPARE_VENV, ROOT)}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", COMPARE_VENV], check=True)
    print("setup: pip install -e . -r bench/requirements-compare.txt (into the benchmark's venv only)", file=sys.stderr)
    subprocess.run(
        [py, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-e", ROOT, "-r", REQUIREMENTS], check=True
    )


def _maybe_reexec(argv: list[str]) -> None:
    """Re-run in bench/.venv-compare (where the comparison libraries are) unless already there."""
    if "--setup" in argv:
        _setup_venv()
        argv = [a for a in argv if a != "--setup"]
    if "--no-reexec" in argv or _in_compare_venv() or os.environ.get("TGBENCH_COMPARE_REEXEC"):
        return
    py = os.path.join(COMPARE_VENV, "bin", "python")
    if os.path.exists(py):
        env = dict(os.environ, TGBENCH_COMPARE_REEXEC="1")
        os.execve(py, [py, os.path.abspath(__file__), *argv], env)


if __name__ == "__main__":
    _maybe_reexec(sys.argv[1:])

import redis  # noqa: E402
import redis.lock  # noqa: E402
import redis.utils  # noqa: E402

try:  # run from a checkout without installing
    import taskguard
except ImportError:  # pragma: no cover
    sys.path.insert(0, ROOT)
    import taskguard

from benchlib import (  # noqa: E402
    arg_parser,
    cleanup,
    exit_on_sigterm,
    fmt_table,
    git_state,
    interleaved_rounds,
    open_admin,
    pct,
    run_prefix,
)

from taskguard import RedisLocks, scripts  # noqa: E402
from taskguard.urls import redact_url  # noqa: E402


# -- small helpers ---------------------------------------------------------------------------------
def ratio_cell(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{statistics.median(vals):.2f}x [{min(vals):.2f}..{max(vals):.2f}]"


def version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def counting_client(url: str, **kw: Any) -> tuple[redis.Redis, list[int]]:
    """A client whose connections count the commands they send (one per round trip here)."""
    counter = [0]

    class CountingConnection(redis.Connection):
        def send_command(self, *args: Any, **kwargs: Any) -> None:
            counter[0] += 1
            super().send_command(*args, **kwargs)

    pool = redis.ConnectionPool.from_url(url, connection_class=CountingConnection, **kw)
    return redis.Redis(connection_pool=pool), counter


def cmdstats(admin: redis.Redis) -> dict[str, tuple[int, int]]:
    info = admin.info("commandstats")
    return {
        k[len("cmdstat_") :]: (int(v["calls"]), int(v["usec"])) for k, v in info.items() if k.startswith("cmdstat_")
    }


def cmd_delta(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> dict[str, int]:
    out = {}
    for name, (c, _) in b.items():
        d = c - a.get(name, (0, 0))[0]
        if d and name not in (
            "info",
            "client|list",
            "client|info",
            "hello",
            "client|setinfo",
            "client|setname",
            "select",
        ):
            out[name] = d
    return out


def redis_cpu(admin: redis.Redis) -> float:
    info = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def lua_calls(*sources: str | bytes) -> set[str]:
    """Command names a Lua script may run (``redis.call('NAME', ...)``), lower case."""
    out = set()
    for src in sources:
        if isinstance(src, bytes):
            src = src.decode()
        out |= {m.lower() for m in re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", src)}
    return out


class Skip(Exception):
    """A contender that cannot run here; the message is the reason."""


# -- section 1: contenders ------------------------------------------------------------------------
# Each factory returns (op, client-sent command names, Lua-run command names) or raises Skip.
def c_taskguard(client: redis.Redis, prefix: str) -> tuple[Callable[[], None], set[str], set[str]]:
    locks = RedisLocks(client, prefix=prefix)
    acquire = locks.acquire

    def op() -> None:
        acq = acquire("thr", ttl=TTL)
        if not acq.acquired:
            raise RuntimeError("taskguard: key unexpectedly held")
        acq.lease.release()

    return op, {"evalsha", "eval"}, lua_calls(scripts.ACQUIRE.source, scripts.RELEASE.source)


def c_redispy(client: redis.Redis, prefix: str) -> tuple[Callable[[], None], set[str], set[str]]:
    name, lock = f"{prefix}:rp:thr", client.lock

    def op() -> None:
        lk = lock(name, timeout=TTL)
        if not lk.acquire(blocking=False):
            raise RuntimeError("redis-py: key unexpectedly held")
        lk.release()

    return op, {"set", "evalsha", "eval", "script|load"}, lua_calls(redis.lock.Lock.LUA_RELEASE_SCRIPT)


def c_python_redis_lock(client: redis.Redis, prefix: str) -> tuple[Callable[[], None], set[str], set[str]]:
    try:
        import redis_lock
    except Exception as e:  # noqa: BLE001 - any import failure is a skip
        raise Skip(f"cannot import redis_lock ({type(e).__name__}: {e})") from None
    name, Lock = f"{prefix}:prl:thr", redis_lock.Lock

    def op() -> None:
        lk = Lock(client, name, expire=TTL)
        if not lk.acquire(blocking=False):
            raise RuntimeError("python-redis-lock: key unexpectedly held")
        lk.release()

    return op, {"get", "set", "evalsha", "eval", "blpop"}, lua_calls(redis_lock.UNLOCK_SCRIPT)


def c_pottery(client: redis.Redis, prefix: str) -> tuple[Callable[[], None], set[str], set[str]]:
    try:
        from pottery import Redlock
    except Exception as e:  # noqa: BLE001
        raise Skip(f"cannot import pottery ({type(e).__name__}: {e})") from None
    name, masters = f"{prefix}:pot:thr", {client}

    def op() -> None:
        lk = Redlock(key=name, masters=masters, auto_release_time=TTL)
        if not lk.acquire(blocking=False):
            raise RuntimeError("pottery: key unexpectedly held")
        lk.release()

    # its scripts are registered lazily; their commands: get, pttl, pexpire, del
    return op, {"set", "evalsha", "eval"}, {"get", "del", "pttl", "pexpire"}


def c_celery_once(client: redis.Redis, prefix: str) -> tuple[Callable[[], None], set[str], set[str]]:
    try:
        from celery_once.backends.redis import Redis as OnceRedis
        from celery_once.tasks import AlreadyQueued
    except Exception as e:  # noqa: BLE001
        raise Skip(f"cannot import celery_once ({type(e).__name__}: {e})") from None
    backend = OnceRedis({"url": "redis://127.0.0.1:6379/0"})  # builds a client, no I/O ...
    backend._redis = client  # ... replaced by the shared one (the attribute its ``redis`` property reads)
    key = f"qo_{prefix}:co:thr"

    def op() -> None:
        try:
            backend.raise_or_lock(key, timeout=TTL)
        except AlreadyQueued:
            raise RuntimeError("celery-once: key unexpectedly held") from None
        backend.clear_lock(key)

    return op, {"set", "del", "pttl"}, set()


def c_ping(client: redis.Redis, prefix: str) -> tuple[Callable[[], None], set[str], set[str]]:
    ping = client.ping

    def op() -> None:
        ping()
        ping()

    return op, {"ping"}, set()


CONTENDERS: list[tuple[str, str, Callable[..., Any], str]] = [
    # name, distribution, factory, what it does / guarantees (for the notes)
    (
        "taskguard",
        "taskguard",
        c_taskguard,
        "2 round trips (EVALSHA acquire, EVALSHA release); fencing token, owner-checked release, "
        "holder metadata, wakes waiters",
    ),
    (
        "redis-py Lock",
        "redis",
        c_redispy,
        "2 round trips (SET NX PX, EVALSHA release); owner-checked release; waiters poll",
    ),
    (
        "python-redis-lock",
        "python-redis-lock",
        c_python_redis_lock,
        "3 round trips (GET own-id check, SET NX EX, EVALSHA release); owner-checked release; "
        "every release pushes a wake-up signal",
    ),
    (
        "pottery Redlock",
        "pottery",
        c_pottery,
        "2 round trips, each on a new ThreadPoolExecutor thread (SET NX PX, EVALSHA release); "
        "owner-checked release; waiters poll",
    ),
    (
        "celery-once",
        "celery-once",
        c_celery_once,
        "2 round trips (SET NX PX via redis-py Lock, DEL): clear_lock deletes whoever holds the key",
    ),
    ("2x PING", "redis", c_ping, "the floor: two round trips doing nothing"),
]


def section_throughput(
    url: str, admin: redis.Redis, prefix: str, ops: int, rounds: int, count_ops: int, profile_ops: int
) -> None:
    client = redis.Redis.from_url(url)
    ops_by_name: dict[str, Callable[[], None]] = {}
    skipped: dict[str, str] = {}
    for name, _dist, factory, _ in CONTENDERS:
        try:
            ops_by_name[name] = factory(client, prefix)[0]
        except Skip as e:
            skipped[name] = str(e)
    names = list(ops_by_name)
    for name in names:  # warm-up: connection made, scripts cached server-side, imports done
        fn = ops_by_name[name]
        try:
            for _ in range(max(200, ops // 10)):
                fn()
        except Exception as e:  # noqa: BLE001 - a contender that fails here is reported, not fatal
            skipped[name] = f"failed at warm-up: {type(e).__name__}: {e}"
            del ops_by_name[name]
    names = list(ops_by_name)
    per_round, lat, _ = interleaved_rounds(ops_by_name, ops, rounds, warm_up=False)

    print(
        f"## 1. acquire + release, uncontended: {rounds} interleaved rounds x {ops} ops per contender, "
        f"one shared client"
    )
    print("   ratios are per round (time per op / the reference's in the same round): median [min..max];")
    print("   > 1.00x means slower than the reference.\n")

    def ratios(a: str, b: str) -> list[float]:
        if a not in per_round or b not in per_round:
            return []
        return [x / y for x, y in zip(per_round[a], per_round[b], strict=True)]

    rows = []
    for name, _dist, _, _ in CONTENDERS:
        if name in skipped:
            rows.append([name, f"skipped: {skipped[name]}"])
            continue
        med = statistics.median(per_round[name])
        rows.append(
            [
                name,
                f"{1 / med:,.0f}",
                f"{med * 1e6:.1f}",
                f"{pct(lat[name], 0.5) * 1e6:.1f}",
                f"{pct(lat[name], 0.99) * 1e6:.1f}",
                ratio_cell(ratios(name, "taskguard")),
                ratio_cell(ratios(name, "2x PING")),
            ]
        )
    print(fmt_table(["contender", "ops/s", "us/op", "p50 us", "p99 us", "time / taskguard", "time / 2x PING"], rows))
    if "taskguard" in per_round:
        faster = [
            n for n in names if n not in ("taskguard", "2x PING") and statistics.median(ratios(n, "taskguard")) < 1.0
        ]
        if faster:
            print(f"   faster than taskguard here: {', '.join(faster)} (see the round trips and commands below)")
    client.close()
    print()
    section_costs(url, admin, prefix, count_ops, skipped)
    if profile_ops:
        print()
        section_profile(url, prefix, profile_ops)


def section_costs(url: str, admin: redis.Redis, prefix: str, n: int, skipped: dict[str, str]) -> None:
    """Round trips (client-side count), Redis commands (commandstats), threads started, per op."""
    print(
        f"   per op ({n} ops each, on a client that counts the commands it sends; Redis commands from "
        f"INFO commandstats deltas,"
    )
    print("   the commands run inside Lua scripts included; 'threads/op' = threading.Thread.start calls):\n")
    client, sent = counting_client(url)
    rows, notes = [], []
    started = [0]
    orig_start = threading.Thread.start

    def counting_start(self: threading.Thread) -> None:  # counted only during this section
        started[0] += 1
        orig_start(self)

    for name, _dist, factory, _what in CONTENDERS:
        if name in skipped:
            continue
        fn, client_side, inside = factory(client, prefix + ":cnt")
        for _ in range(50):
            fn()
        sent[0], started[0] = 0, 0
        threading.Thread.start = counting_start  # type: ignore[method-assign]
        try:
            a = cmdstats(admin)
            for _ in range(n):
                fn()
            b = cmdstats(admin)
        finally:
            threading.Thread.start = orig_start  # type: ignore[method-assign]
        calls = cmd_delta(a, b)
        ours = client_side | inside
        foreign = {k: v for k, v in calls.items() if k not in ours}
        mine = {k: v for k, v in calls.items() if k in ours}
        usec = sum(b[k][1] - a.get(k, (0, 0))[1] for k in mine if k in client_side)
        per = " ".join(f"{k}={v / n:.2f}" for k, v in sorted(mine.items(), key=lambda kv: (-kv[1], kv[0])))
        rows.append(
            [
                name,
                f"{sent[0] / n:.2f}",
                f"{sum(mine.values()) / n:.2f}",
                f"{usec / n:.1f}",
                f"{started[0] / n:.2f}",
                per,
            ]
        )
        if foreign:
            notes.append(
                f"   NOTE: other clients ran {sum(foreign.values())} commands "
                f"({', '.join(sorted(foreign)[:8])}) during the {name} count; left out above"
            )
    print(
        fmt_table(
            ["contender", "round trips/op", "redis cmds/op", "server us/op", "threads/op", "commands per op"],
            rows,
            align="lrrrrl",
        )
    )
    print("   server us/op: Redis's own time in the commands the client sent (EVALSHA: the Lua inside).")
    for line in notes:
        print(line)
    print("\n   what each does per acquire + release:")
    for name, _dist, _, what in CONTENDERS:
        print(f"   - {name}: {what}")
    client.close()


# -- section 1c: where the time goes (cProfile) ------------------------------------------------------
def section_profile(url: str, prefix: str, n: int) -> None:
    """cProfile of taskguard and redis-py Lock, the time split by where it is spent."""
    import cProfile
    import pstats

    client = redis.Redis.from_url(url)
    rows = []
    tops: dict[str, list[tuple[float, str]]] = {}
    for name, factory in (("taskguard", c_taskguard), ("redis-py Lock", c_redispy)):
        fn = factory(client, prefix + ":prof")[0]
        for _ in range(300):
            fn()
        gc.collect()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        st = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        split = {"recv": 0.0, "send": 0.0, "taskguard": 0.0, "redis-py": 0.0, "stdlib": 0.0}
        top: list[tuple[float, str]] = []
        for (path, _line, func), (_, _, tt, _, _) in st.items():
            if path == "~" and "recv" in func:  # <method 'recv_into' of '_socket.socket' objects>
                split["recv"] += tt
            elif path == "~" and "send" in func:
                split["send"] += tt
            elif os.sep + "taskguard" + os.sep in path:
                split["taskguard"] += tt
                top.append((tt, f"{os.path.basename(path)}:{func}"))
            elif os.sep + "redis" + os.sep in path:
                split["redis-py"] += tt
            else:
                split["stdlib"] += tt
                top.append((tt, f"{os.path.basename(path) or '~'}:{func}" if path != "~" else func))
        total = sum(split.values())
        rows.append(
            [
                name,
                f"{total / n * 1e6:.1f}",
                f"{split['recv'] / n * 1e6:.1f}",
                f"{split['send'] / n * 1e6:.1f}",
                f"{split['redis-py'] / n * 1e6:.1f}",
                f"{split['taskguard'] / n * 1e6:.1f}",
                f"{split['stdlib'] / n * 1e6:.1f}",
            ]
        )
        tops[name] = sorted(top, reverse=True)[:6]
    client.close()
    print(f"   where the time goes, cProfile over {n} ops each (us/op; profiling inflates the Python parts):\n")
    print(
        fmt_table(
            [
                "contender",
                "total",
                "waiting for replies (recv)",
                "send",
                "redis-py code",
                "taskguard code",
                "stdlib / C calls",
            ],
            rows,
        )
    )
    print("   (redis-py Lock's own code is part of 'redis-py code'.)")
    for name, top in tops.items():
        print(
            f"   {name}, largest own + stdlib items: "
            + ", ".join(f"{label.strip()} {tt / n * 1e6:.1f}" for tt, label in top[:5])
        )


# -- section 2: contention ------------------------------------------------------------------------
WAIT = 5.0  # seconds every contender waits at most per acquire


def make_waiter(kind: str, client: redis.Redis, prefix: str) -> Callable[[], Callable[[], None] | None]:
    """-> acquire(): a release callable when acquired, None on a wait timeout."""
    if kind == "taskguard":
        locks = RedisLocks(client, prefix=prefix)

        def acquire() -> Callable[[], None] | None:
            acq = locks.acquire("hot", ttl=TTL, wait=WAIT)
            return acq.lease.release if acq.acquired else None

        return acquire
    if kind.startswith("redis-py Lock"):
        sleep = 0.01 if "0.01" in kind else 0.1
        name = f"{prefix}:rp:hot"

        def acquire() -> Callable[[], None] | None:
            lk = client.lock(name, timeout=TTL, sleep=sleep, blocking=True, blocking_timeout=WAIT)
            return lk.release if lk.acquire() else None

        return acquire
    if kind == "python-redis-lock":
        import redis_lock

        name = f"{prefix}:prl:hot"

        def acquire() -> Callable[[], None] | None:
            lk = redis_lock.Lock(client, name, expire=TTL)
            return lk.release if lk.acquire(blocking=True, timeout=int(WAIT)) else None

        return acquire
    raise ValueError(kind)


def contention_worker(
    kind: str, url: str, prefix: str, wid: int, hold: float, think: float, duration: float, ready: Any, out: Any
) -> None:
    """One contender: acquire (waiting), hold, release, think; until its deadline."""
    client, sent = counting_client(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        acquire = make_waiter(kind, client, prefix)
        client.ping()
        ready.wait()  # everyone connected: the parent takes its "before" readings
        sent[0] = 0
        ready.wait()  # go
        clock = time.monotonic
        cpu0 = time.process_time()
        deadline = clock() + duration
        recs: list[tuple[float, float, int, float]] = []
        timeouts = 0
        while clock() < deadline:
            t_call = clock()
            release = acquire()
            t_acq = clock()
            if release is None:
                timeouts += 1
                continue
            if t_acq < deadline:
                time.sleep(hold)
            t_rel = clock()
            release()
            recs.append((t_acq, t_rel, wid, t_call))
            if think:
                time.sleep(think)
        out.put((wid, recs, timeouts, sent[0], time.process_time() - cpu0, None))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out.put((wid, [], 0, sent[0], 0.0, f"{type(e).__name__}: {e}"))
    finally:
        client.close()


class _ListQueue:
    """The put() side of a queue for threads."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._lock = threading.Lock()

    def put(self, item: Any) -> None:
        with self._lock:
            self.items.append(item)


def run_contention(
    kind: str, mode: str, n: int, url: str, admin: redis.Redis, prefix: str, hold: float, think: float, duration: float
) -> dict[str, Any]:
    if mode == "threads":
        ready: Any = threading.Barrier(n + 1)
        out: Any = _ListQueue()
        workers = [
            threading.Thread(
                target=contention_worker, daemon=True, args=(kind, url, prefix, i, hold, think, duration, ready, out)
            )
            for i in range(n)
        ]
    else:
        ctx = multiprocessing.get_context("fork")
        ready = ctx.Barrier(n + 1)
        out = ctx.Queue()
        workers = [
            ctx.Process(
                target=contention_worker, daemon=True, args=(kind, url, prefix, i, hold, think, duration, ready, out)
            )
            for i in range(n)
        ]
    for w in workers:
        w.start()
    gc.collect()
    ready.wait(timeout=60)
    a, rcpu0 = cmdstats(admin), redis_cpu(admin)
    cpu0 = time.process_time()
    ready.wait(timeout=60)
    t0 = time.monotonic()
    results = []
    if mode == "threads":
        for w in workers:
            w.join(duration + 3 * WAIT + 30)
        results = out.items
    else:
        end = time.monotonic() + duration + 3 * WAIT + 30
        while len(results) < n and time.monotonic() < end:
            try:
                results.append(out.get(timeout=1.0))
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.kill()
    client_cpu = time.process_time() - cpu0 if mode == "threads" else sum(r[4] for r in results)
    b, rcpu1 = cmdstats(admin), redis_cpu(admin)
    errors = [r[5] for r in results if r[5]]
    recs = sorted((x for r in results for x in r[1]), key=lambda x: x[0])
    window_end = t0 + duration
    in_window = [x for x in recs if x[0] <= window_end]
    handoffs, self_again, overlaps = [], 0, 0
    for prev, nxt in zip(in_window, in_window[1:], strict=False):
        if nxt[0] < prev[1]:
            overlaps += 1  # the next holder got it before the previous one began releasing
        if nxt[2] == prev[2]:
            self_again += 1
        else:
            handoffs.append(nxt[0] - prev[1])
    handoffs.sort()
    waits = sorted(x[0] - x[3] for x in in_window)
    return {
        "waits": waits,
        "acq_window": len(in_window),
        "acq_total": len(recs),
        "duration": duration,
        "handoffs": handoffs,
        "self_again": self_again,
        "overlaps": overlaps,
        "served": len({x[2] for x in in_window}),
        "n": n,
        "timeouts": sum(r[2] for r in results),
        "sent": sum(r[3] for r in results),
        "calls": cmd_delta(a, b),
        "redis_cpu": rcpu1 - rcpu0,
        "client_cpu": client_cpu,
        "missing": n - len(results),
        "errors": errors,
    }


CONTENTION_KINDS = ["taskguard", "redis-py Lock sleep=0.1", "redis-py Lock sleep=0.01", "python-redis-lock"]


def expected_commands(kind: str) -> set[str]:
    if kind == "taskguard":
        return {"evalsha", "eval", "blpop"} | lua_calls(scripts.ACQUIRE.source, scripts.RELEASE.source)
    if kind.startswith("redis-py"):
        return {"set", "evalsha", "eval", "script|load"} | lua_calls(redis.lock.Lock.LUA_RELEASE_SCRIPT)
    import redis_lock

    return {"get", "set", "evalsha", "eval", "blpop"} | lua_calls(redis_lock.UNLOCK_SCRIPT)


def section_contention(
    url: str,
    admin: redis.Redis,
    prefix: str,
    threads: list[int],
    procs: list[int],
    seconds: float,
    rounds: int,
    hold: float,
    think: float,
) -> None:
    kinds = list(CONTENTION_KINDS)
    try:
        import redis_lock  # noqa: F401
    except Exception as e:  # noqa: BLE001
        kinds.remove("python-redis-lock")
        skip_prl = f"skipped: cannot import redis_lock ({type(e).__name__}: {e})"
    else:
        skip_prl = ""
    configs = [("threads", n) for n in threads] + [("processes", n) for n in procs]
    res: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in range(rounds):
        for mode, n in configs:
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            for kind in order:
                res.setdefault((mode, n, kind), []).append(
                    run_contention(kind, mode, n, url, admin, f"{prefix}:c{r}", hold, think, seconds)
                )

    print(f"## 2. contention on one key: {rounds} interleaved rounds x {seconds:g} s per cell; each worker loops")
    print(f"   acquire(wait <= {WAIT:g} s) -> hold {hold * 1e3:g} ms -> release -> pause {think * 1e3:g} ms")
    print("   hand-off = from the holder's release() call to the next holder's acquire returning, counted when")
    print("   the next holder is another worker; 'again' = the releaser itself took it next; 'served' = workers")
    print("   that got the lock in the window (median over rounds); wait = from calling acquire to holding the lock")
    print("   (the waiter's view, all acquisitions in the window; workers never served are not in it). Latencies")
    print("   pool all rounds.\n")
    rows = []
    for mode, n in configs:
        for kind in CONTENTION_KINDS:
            if kind not in kinds:
                rows.append([f"{n} {mode}", kind, skip_prl])
                continue
            rs = res[(mode, n, kind)]
            ho = sorted(h for x in rs for h in x["handoffs"])
            acq_s = statistics.median(x["acq_window"] / x["duration"] for x in rs)
            total = sum(x["acq_window"] for x in rs)
            again = sum(x["self_again"] for x in rs) / max(1, total - len(rs))
            served = statistics.median(x["served"] for x in rs)
            waits = sorted(w for x in rs for w in x["waits"])
            rows.append(
                [
                    f"{n} {mode}",
                    kind,
                    f"{acq_s:,.0f}",
                    str(len(ho)),
                    f"{pct(ho, 0.5) * 1e3:.2f}" if ho else "n/a",
                    f"{pct(ho, 0.99) * 1e3:.2f}" if ho else "n/a",
                    f"{again * 100:.0f}%",
                    f"{served:g}/{n}",
                    f"{pct(waits, 0.5) * 1e3:.1f}",
                    f"{pct(waits, 0.99) * 1e3:.1f}",
                    str(sum(x["timeouts"] for x in rs)),
                ]
            )
    print(
        fmt_table(
            [
                "workers",
                "contender",
                "acq/s",
                "hand-offs",
                "p50 ms",
                "p99 ms",
                "again",
                "served",
                "wait p50 ms",
                "wait p99 ms",
                "timeouts",
            ],
            rows,
            align="llrrrrrrrrr",
            lead=2,
        )
    )

    print("\n   cost per successful acquisition (all acquisitions of the cell, the drain after the window too):")
    print("   round trips = commands the workers' clients sent; redis cmds = INFO commandstats deltas, Lua-run")
    print("   commands included; CPU = Redis's (INFO cpu) and the workers' (process_time), per acquisition.\n")
    rows, notes = [], []
    foreign_cells: list[tuple[int, str]] = []
    foreign_names: set[str] = set()
    for mode, n in configs:
        for kind in CONTENTION_KINDS:
            if kind not in kinds:
                continue
            rs = res[(mode, n, kind)]
            acq = sum(x["acq_total"] for x in rs)
            exp = expected_commands(kind)
            calls: dict[str, int] = {}
            foreign = 0
            for x in rs:
                for k, v in x["calls"].items():
                    if k in exp:
                        calls[k] = calls.get(k, 0) + v
                    else:
                        foreign += v
            per = " ".join(
                f"{k}={v / acq:.2f}"
                for k, v in sorted(calls.items(), key=lambda kv: (-kv[1], kv[0]))
                if v / acq >= 0.005
            )
            sent = sum(x["sent"] for x in rs)
            rows.append(
                [
                    f"{n} {mode}",
                    kind,
                    f"{sent / acq:.2f}",
                    f"{sum(calls.values()) / acq:.2f}",
                    f"{sum(x['redis_cpu'] for x in rs) / acq * 1e6:.0f}",
                    f"{sum(x['client_cpu'] for x in rs) / acq * 1e6:.0f}",
                    per,
                ]
            )
            if foreign:
                foreign_cells.append((foreign, f"{n} {mode} / {kind}"))
                foreign_names.update(k for x in rs for k in x["calls"] if k not in exp)
            bad = [e for x in rs for e in x["errors"]]
            missing = sum(x["missing"] for x in rs)
            overlaps = sum(x["overlaps"] for x in rs)
            if bad or missing or overlaps:
                notes.append(
                    f"   PROBLEM in {n} {mode} / {kind}: {len(bad)} worker errors {bad[:2]}, "
                    f"{missing} workers did not report, {overlaps} overlapping holds"
                )
    print(
        fmt_table(
            [
                "workers",
                "contender",
                "round trips/acq",
                "redis cmds/acq",
                "redis CPU us/acq",
                "client CPU us/acq",
                "redis commands per acquisition",
            ],
            rows,
            align="llrrrrl",
        )
    )
    if foreign_cells:
        worst = max(foreign_cells)
        print(
            f"   NOTE: other clients ran commands this contender never runs in {len(foreign_cells)} cells "
            f"({sum(f for f, _ in foreign_cells)} in all, at most {worst[0]} in {worst[1]}; "
            f"{', '.join(sorted(foreign_names)[:6])}): left out of 'redis cmds', in 'redis CPU'"
        )
    for line in notes:
        print(line)
    tot_overlaps = sum(x["overlaps"] for rs in res.values() for x in rs)
    print(
        f"   mutual exclusion check: {tot_overlaps} overlapping holds in all cells (a hold begins when acquire "
        f"returns, ends when release is called)"
    )


# -- main -------------------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text.strip() else []


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--ops", type=int, default=1500, help="ops per contender per round (default 1500)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of section 1 (default 7)")
    ap.add_argument("--count-ops", type=int, default=500, help="ops per contender for the counts (default 500)")
    ap.add_argument(
        "--profile-ops",
        type=int,
        default=3000,
        help="ops per contender for the cProfile split of taskguard vs redis-py Lock (0: skip; default 3000)",
    )
    ap.add_argument("--threads", default="1,8,32", help="contending thread counts (default 1,8,32)")
    ap.add_argument("--procs", default="8,32", help="contending process counts ('' for none; default 8,32)")
    ap.add_argument("--contention-seconds", type=float, default=1.5, help="seconds per cell (default 1.5)")
    ap.add_argument("--contention-rounds", type=int, default=2, help="interleaved rounds of section 2 (default 2)")
    ap.add_argument("--hold-ms", type=float, default=1.0, help="hold time per acquisition (default 1 ms)")
    ap.add_argument("--think-ms", type=float, default=1.0, help="pause after each release (default 1 ms)")
    ap.add_argument("--skip-contention", action="store_true", help="section 1 only")
    ap.add_argument("--no-reexec", action="store_true", help="do not re-run in bench/.venv-compare")
    ap.add_argument("--setup", action="store_true", help="create/refresh bench/.venv-compare first")
    args = ap.parse_args(argv)
    if min(args.ops, args.rounds, args.count_ops, args.contention_rounds) < 1 or args.contention_seconds <= 0:
        ap.error("counts must be >= 1 and --contention-seconds > 0")
    threads, procs = int_list(args.threads), int_list(args.procs)

    exit_on_sigterm()
    t_start = time.monotonic()
    opened = open_admin(args.url)
    if opened is None:
        return 2
    admin, server = opened
    prefix = run_prefix()
    urlhost = redact_url(args.url).strip("'\"")
    probe = redis.Redis.from_url(args.url)
    conn = probe.connection_pool.get_connection()
    parser = type(conn._parser).__name__
    probe.connection_pool.release(conn)
    probe.close()

    print("# taskguard vs other Redis locks")
    print(
        f"python        {platform.python_implementation()} {platform.python_version()} on {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"interpreter   {sys.executable}"
        + ("  (bench/.venv-compare)" if _in_compare_venv() else f"  (not bench/.venv-compare: {SETUP_ONE_LINER})")
    )
    print(f"redis server  {server.get('redis_version')} ({server.get('redis_mode', '?')}) at {urlhost}")
    print(
        f"redis-py      {redis.__version__}, parser {parser}, hiredis "
        f"{'yes' if redis.utils.HIREDIS_AVAILABLE else 'no'}"
    )
    print(f"taskguard     {taskguard.__version__} from {os.path.dirname(taskguard.__file__)}{git_state()}")
    print(
        f"others        python-redis-lock {version_of('python-redis-lock')}, pottery {version_of('pottery')}, "
        f"celery-once {version_of('celery-once')}"
    )
    print(f"key prefix    {prefix} (deleted at the end)")
    others = int(admin.info("clients").get("connected_clients", 0)) - 1
    if others > 0:
        print(f"NOTE          {others} other client(s) connected to this Redis; their load adds noise")
    print()
    try:
        section_throughput(args.url, admin, prefix, args.ops, args.rounds, args.count_ops, args.profile_ops)
        if not args.skip_contention:
            print()
            section_contention(
                args.url,
                admin,
                prefix,
                threads,
                procs,
                args.contention_seconds,
                args.contention_rounds,
                args.hold_ms / 1e3,
                args.think_ms / 1e3,
            )
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
