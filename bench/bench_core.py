#!/usr/bin/env python
"""Core-path benchmark of taskguard against its floor and against redis-py's Lock.

Run from the repository root:

    .venv/bin/python bench/bench_core.py [--ops N] [--rounds R] [--handoffs H] [--url URL]

What it measures, in one run, on one Redis (default ``$TASKGUARD_REDIS_URL`` or
``redis://127.0.0.1:6379/0``; meant for loopback):

1. Throughput and per-op latency of one "acquire + release", side by side, in interleaved rounds
   (every round runs every contender for ``--ops`` operations, in an order rotated each round):

   * ``taskguard``      ``RedisLocks.acquire(key, ttl=10)`` then ``lease.release()``
   * ``2x PING``         ``client.ping(); client.ping()`` - the floor of two round trips
   * ``redis-py Lock``   ``client.lock(key, timeout=10)``, ``acquire(blocking=False)``, ``release()``
   * ``tg scripts raw``  diagnostic: taskguard's two Lua scripts through ``Script.__call__``
                         with the same arguments and the same connection path as ``taskguard``,
                         without the Python API around them

   All contenders share one ``redis.Redis`` client (hiredis parser when installed). Ratios are
   computed per round (the rounds are interleaved, so each round's ratio compares runs made
   seconds apart) and the median over rounds is reported, with the min..max range.

2. Hand-off latency: a holder thread holds a lease, a waiter thread on its own client waits for it
   (taskguard: ``acquire(key, ttl=10, wait=5)`` with ``poll_interval=1.0``; redis-py:
   ``Lock(blocking=True, sleep=0.1)``); the time from the holder's ``release()`` returning to the
   waiter's ``acquire`` returning. The holder keeps the lease a random 30-130 ms first, so the
   release falls at a random phase of redis-py's 100 ms polling.

3. Server-side commands per taskguard acquire+release (``INFO stats``/``INFO commandstats``
   deltas): client commands (= round trips) and the commands the Lua scripts run inside.

4. Where taskguard's extra time goes: on a dedicated locks object whose script calls are timed
   (a wrapper on its connection path), the time inside the two EVALSHA calls vs outside them, for
   ``taskguard`` and ``tg scripts raw``.

5. Client-side CPU of the taskguard API (no Redis I/O): the whole API over a no-op backend (hot
   loop, and right after a round trip) and its pieces: holder metadata, owner token, events, ...

Keys live under a fresh unique prefix and are deleted at the end. Nothing in taskguard is patched.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import re
import secrets
import socket
import statistics
import sys
import threading
import time
import timeit
import weakref
from collections.abc import Callable
from typing import Any

import redis
import redis.lock
import redis.utils

try:  # run from a checkout without installing
    import taskguard
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import taskguard

from benchlib import (  # noqa: E402
    arg_parser,
    cleanup,
    fmt_table,
    git_state,
    interleaved_rounds,
    open_admin,
    pct,
    run_chunk,
    run_prefix,
    verdict,
)

from taskguard import RedisLocks, scripts
from taskguard.backend import AcquireReply, AcquireStatus
from taskguard.events import LeaseEvent
from taskguard.heartbeat import get_heartbeat
from taskguard.lease import Acquisition, Lease
from taskguard.leasing import holder_meta, new_owner_token
from taskguard.locks import Locks, check_seconds
from taskguard.redis_backend import RedisBackend
from taskguard.urls import redact_url

TTL = 10  # seconds, every contender


# -- small helpers ---------------------------------------------------------------------------------
def parser_name(client: redis.Redis) -> tuple[str, Any]:
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        return type(conn._parser).__name__, getattr(conn, "protocol", "?")
    finally:
        pool.release(conn)


# -- the fenced-lease floor -------------------------------------------------------------------------
# The smallest two-script fenced lease, the floor of Redis time for any lease that fences with a
# counter kept across leases and expires on the Redis clock. Acquire: TIME, read owner/expiry/fence,
# set fence/owner/expiry, give the key an idle TTL (without one every distinct key would stay
# forever). Release: compare the owner, delete owner and expiry. It has none of taskguard's
# other duties (holder metadata, run ids, limits, waiters, finished runs, answers to re-sent calls,
# refusing an expired owner's release).
FLOOR_ACQUIRE = scripts.Script(
    "floor_acquire",
    """
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now = math.floor(now_us / 1000)
local v = redis.call('HMGET', KEYS[1], 'o', 'x', 'f')
local exp = tonumber(v[2])
if exp and exp > now then
  return {0, exp - now}
end
local fence = math.max((tonumber(v[3]) or 0) + 1, now_us)
redis.call('HSET', KEYS[1], 'f', fence, 'o', ARGV[1], 'x', now + tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, fence}
""",
)
FLOOR_RELEASE = scripts.Script(
    "floor_release",
    """
if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
  return 0
end
redis.call('HDEL', KEYS[1], 'o', 'x')
return 1
""",
)


# -- contenders ------------------------------------------------------------------------------------
def make_contenders(client: redis.Redis, locks: RedisLocks, prefix: str) -> dict[str, Callable[[], None]]:
    tg_key = "thr"
    rp_key = f"{prefix}:rp:thr"
    acquire = locks.acquire
    lock = client.lock
    ping = client.ping

    def tg() -> None:
        acq = acquire(tg_key, ttl=TTL)
        if not acq.acquired:
            raise RuntimeError("taskguard: key unexpectedly held")
        acq.lease.release()

    def two_pings() -> None:
        ping()
        ping()

    def rp() -> None:
        lk = lock(rp_key, timeout=TTL)
        if not lk.acquire(blocking=False):
            raise RuntimeError("redis-py: key unexpectedly held")
        lk.release()

    # Diagnostic: taskguard's own scripts, same keys and argument sizes, no API around them.
    lease_k = locks.backend.lease_key("raw")
    owner = new_owner_token()
    holder_json = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}, separators=(",", ":"))
    acq_args = (owner, TTL * 1000, holder_json, int(locks.fence_idle_ttl * 1000), 0, "", "0", "")
    rel_args = (owner, int(locks.fence_idle_ttl * 1000), 0, "bench", "")
    ACQ, REL = scripts.ACQUIRE, scripts.RELEASE
    path = locks.client  # the path taskguard's own calls take: the client's execute_command

    def raw() -> None:
        ACQ(path, (lease_k,), acq_args)
        REL(path, (lease_k,), rel_args)

    floor_k = locks.backend.lease_key("floor")
    floor_acq = (TTL * 1000, int(locks.fence_idle_ttl * 1000))

    def floor() -> None:
        token = new_owner_token()
        if FLOOR_ACQUIRE(path, (floor_k,), (token, *floor_acq))[0] != 1:
            raise RuntimeError("floor: key unexpectedly held")
        FLOOR_RELEASE(path, (floor_k,), (token,))

    return {"taskguard": tg, "2x PING": two_pings, "redis-py Lock": rp, "tg scripts raw": raw, "fenced floor": floor}


def throughput(contenders: dict[str, Callable[[], None]], ops: int, rounds: int) -> dict[str, Any]:
    per_round, lat, orders = interleaved_rounds(contenders, ops, rounds)
    return {"per_round": per_round, "lat": lat, "orders": orders}


def print_throughput(res: dict[str, Any], ops: int, rounds: int) -> dict[str, float]:
    pr, lat = res["per_round"], res["lat"]
    base, rp = "2x PING", "redis-py Lock"

    def ratios(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(pr[a], pr[b], strict=True)]

    rows = []
    for name in pr:
        med = statistics.median(pr[name])
        r_ping, r_rp = ratios(name, base), ratios(name, rp)
        rows.append(
            [
                name,
                f"{1 / med:,.0f}",
                f"{med * 1e6:.1f}",
                f"{pct(lat[name], 0.50) * 1e6:.1f}",
                f"{pct(lat[name], 0.99) * 1e6:.1f}",
                f"{statistics.median(r_ping):.3f}x",
                f"{statistics.median(r_rp):.3f}x",
            ]
        )
    print(
        f"## 1. acquire+release throughput: {rounds} interleaved rounds x {ops} ops per contender "
        f"(order rotated each round)"
    )
    print("   us/op: wall time of a round / ops, median over rounds; ops/s = 1 / that;")
    print("   p50/p99: per-op latencies of all rounds pooled;")
    print("   ratios: per-round (mean op time / mean op time of the other), median over rounds.\n")
    print(fmt_table(["contender", "ops/s", "us/op", "p50 us", "p99 us", "vs 2xPING", "vs redis-py Lock"], rows))
    tg_ping, tg_rp = ratios("taskguard", base), ratios("taskguard", rp)
    m_ping, m_rp = statistics.median(tg_ping), statistics.median(tg_rp)
    p50_ping = pct(lat["taskguard"], 0.5) / pct(lat[base], 0.5)
    p50_rp = pct(lat["taskguard"], 0.5) / pct(lat[rp], 0.5)
    print()
    print(
        f"   taskguard / 2x PING       = {m_ping:.3f}x  (rounds {min(tg_ping):.3f}..{max(tg_ping):.3f}; "
        f"p50/p50 {p50_ping:.3f}x)  target <= 1.20x: {verdict(m_ping <= 1.2)}"
    )
    print(
        f"   taskguard / redis-py Lock = {m_rp:.3f}x  (rounds {min(tg_rp):.3f}..{max(tg_rp):.3f}; "
        f"p50/p50 {p50_rp:.3f}x)  target <= 1.05x: {verdict(m_rp <= 1.05)}"
    )
    med = {n: statistics.median(v) for n, v in pr.items()}
    print("   decomposition of the taskguard op (medians, us/op):")
    print(f"     2 round trips (2x PING)                    {med[base] * 1e6:7.1f}")
    print(
        f"     + the scripts on taskguard's path          {(med['tg scripts raw'] - med[base]) * 1e6:+7.1f}"
        "   (tg scripts raw - 2x PING: bigger commands, Lua, array replies,"
    )
    print("                                                           less redis-py's per-call overhead)")
    print(
        f"     + taskguard Python API around the scripts  {(med['taskguard'] - med['tg scripts raw']) * 1e6:+7.1f}"
        "   (taskguard - tg scripts raw)"
    )
    print("   (every row goes through redis-py's client: pool checkout, its Retry, its hooks)")
    return {"tg_ping": m_ping, "tg_rp": m_rp, **{f"us:{n}": v * 1e6 for n, v in med.items()}}


# -- hand-off ----------------------------------------------------------------------------------------
def _blocked_in_blpop(admin: redis.Redis, name: str) -> bool:
    for c in admin.client_list():
        if c.get("name") == name:
            return c.get("cmd") == "blpop" and "b" in c.get("flags", "")
    return False


def handoff_taskguard(
    url: str, client: redis.Redis, admin: redis.Redis, prefix: str, n: int, rng: random.Random
) -> tuple[list[float], int, int]:
    holder = RedisLocks(client, prefix=prefix)
    wname = f"{prefix}-tgwaiter"
    wclient = redis.Redis.from_url(url, client_name=wname)
    waiter = RedisLocks(wclient, prefix=prefix, poll_interval=1.0)
    out: list[float] = []
    blocked = failed = 0
    for i in range(-3, n):  # 3 warm-up hand-offs
        key = f"ho:{i + 3}"
        lease = holder.acquire(key, ttl=TTL).lease
        started = threading.Event()
        box: dict[str, Any] = {}

        def wait(started: threading.Event = started, key: str = key, box: dict[str, Any] = box) -> None:
            started.set()
            acq = waiter.acquire(key, ttl=TTL, wait=5)
            box["t"] = time.perf_counter()
            box["acq"] = acq

        th = threading.Thread(target=wait)
        th.start()
        started.wait()
        time.sleep(rng.uniform(0.03, 0.13))
        deadline = time.monotonic() + 2
        is_blocked = _blocked_in_blpop(admin, wname)
        while not is_blocked and time.monotonic() < deadline:
            time.sleep(0.002)
            is_blocked = _blocked_in_blpop(admin, wname)
        lease.release()
        t_rel = time.perf_counter()
        th.join()
        acq = box["acq"]
        if acq.acquired:
            acq.lease.release()
        if i < 0:
            continue
        blocked += is_blocked
        if acq.acquired:
            out.append(box["t"] - t_rel)
        else:
            failed += 1
    waiter.close()
    wclient.close()
    return sorted(out), blocked, failed


def handoff_redispy(url: str, client: redis.Redis, prefix: str, n: int, rng: random.Random) -> tuple[list[float], int]:
    wclient = redis.Redis.from_url(url, client_name=f"{prefix}-rpwaiter")
    out: list[float] = []
    failed = 0
    for i in range(-3, n):
        name = f"{prefix}:rp:ho:{i + 3}"
        hl = client.lock(name, timeout=TTL)
        assert hl.acquire(blocking=False)
        started = threading.Event()
        box: dict[str, Any] = {}

        def wait(started: threading.Event = started, name: str = name, box: dict[str, Any] = box) -> None:
            wl = wclient.lock(name, timeout=TTL, sleep=0.1, blocking=True, blocking_timeout=5)
            started.set()
            ok = wl.acquire()
            box["t"] = time.perf_counter()
            box["ok"] = ok
            if ok:
                wl.release()

        th = threading.Thread(target=wait)
        th.start()
        started.wait()
        time.sleep(rng.uniform(0.03, 0.13))
        hl.release()
        t_rel = time.perf_counter()
        th.join()
        if i < 0:
            continue
        if box["ok"]:
            out.append(box["t"] - t_rel)
        else:
            failed += 1
    wclient.close()
    return sorted(out), failed


def print_handoff(
    url: str, client: redis.Redis, admin: redis.Redis, prefix: str, n: int, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    tg, blocked, tg_failed = handoff_taskguard(url, client, admin, prefix, n, rng)
    rp, rp_failed = handoff_redispy(url, client, prefix, n, rng)
    print(f"## 2. hand-off latency: holder release() returns -> waiter acquire returns; {n} hand-offs each")
    print("   holder and waiter are threads of this process with their own clients; the holder keeps")
    print("   the lease a random 30-130 ms after the waiter starts waiting.\n")

    def row(name: str, v: list[float], failed: int) -> list[str]:
        ms = [x * 1e3 for x in v]
        return [
            name,
            str(len(v)),
            str(failed),
            f"{pct(ms, 0.5):.2f}",
            f"{pct(ms, 0.99):.2f}",
            f"{min(ms):.2f}",
            f"{statistics.mean(ms):.2f}",
            f"{max(ms):.2f}",
        ]

    print(
        fmt_table(
            ["waiter", "n", "failed", "p50 ms", "p99 ms", "min ms", "mean ms", "max ms"],
            [
                row("taskguard acquire(wait=5), poll_interval=1.0", tg, tg_failed),
                row("redis-py Lock(blocking=True, sleep=0.1)", rp, rp_failed),
            ],
        )
    )
    if min(tg + rp, default=0) < 0:
        print("   (a negative time: the waiter had the lock before the holder's release() call got back to")
        print("   Python and read the clock - both threads race for the GIL once Redis has answered)")
    print(
        f"\n   taskguard waiter was blocked in BLPOP at release in {blocked}/{n} hand-offs (checked with CLIENT LIST)."
    )
    p50_tg, p99_tg = pct(tg, 0.5) * 1e3, pct(tg, 0.99) * 1e3
    print(
        f"   taskguard p50 {p50_tg:.2f} ms, p99 {p99_tg:.2f} ms; target 'a few ms': {verdict(p99_tg <= 5.0)}"
        f"  (p50 redis-py / p50 taskguard = {pct(rp, 0.5) / pct(tg, 0.5):.0f}x)"
    )
    return {"ho_tg_p50": p50_tg, "ho_tg_p99": p99_tg, "ho_rp_p50": pct(rp, 0.5) * 1e3}


# -- server-side command counts ---------------------------------------------------------------------
def snapshot(admin: redis.Redis) -> dict[str, Any]:
    info = admin.info("stats", "commandstats")
    return {
        "total": int(info["total_commands_processed"]),
        "cmd": {
            k[len("cmdstat_") :]: (int(v["calls"]), int(v["usec"])) for k, v in info.items() if k.startswith("cmdstat_")
        },
    }


def count_commands(admin: redis.Redis, fn: Callable[[], None], n: int) -> dict[str, Any]:
    a = snapshot(admin)
    for _ in range(n):
        fn()
    b = snapshot(admin)
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for name, (c, u) in b["cmd"].items():
        c0, u0 = a["cmd"].get(name, (0, 0))
        if c - c0 and name != "info":
            calls[name] = c - c0
            usec[name] = u - u0
    return {"total": b["total"] - a["total"] - 1, "calls": calls, "usec": usec}  # -1: the first INFO


def _lua_calls(*sources: str) -> set[str]:
    """Command names a Lua script may run (``redis.call('NAME', ...)``)."""
    return {m.lower() for src in sources for m in re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", src)}


# Commands each contender may cause; anything else seen during its count is other clients' traffic.
EXPECTED = {
    "taskguard": {"evalsha", "eval"} | _lua_calls(scripts.ACQUIRE.source, scripts.RELEASE.source),
    "2x PING": {"ping"},
    "redis-py Lock": {"set", "evalsha", "eval", "script|load"} | _lua_calls(redis.lock.Lock.LUA_RELEASE_SCRIPT),
    "fenced floor": {"evalsha", "eval"} | _lua_calls(FLOOR_ACQUIRE.source, FLOOR_RELEASE.source),
}
CLIENT_SIDE = {
    "taskguard": {"evalsha", "eval"},
    "2x PING": {"ping"},
    "redis-py Lock": {"set", "evalsha"},
    "fenced floor": {"evalsha", "eval"},
}


def redis_cpu(admin: redis.Redis) -> float:
    """The Redis server's CPU seconds so far (``INFO cpu``: user + system, main thread and all)."""
    info = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def print_redis_time(
    admin: redis.Redis, contenders: dict[str, Callable[[], None]], ops: int, rounds: int
) -> dict[str, float]:
    """Redis's own time per acquire+release, in interleaved rounds: ``INFO commandstats`` usec of
    the commands the client sent (an EVALSHA's includes the Lua it runs) and ``INFO cpu`` deltas.
    Both count every client of the Redis; a round where other clients ran commands a contender
    never runs is flagged, and the ratios are taken per round."""
    names = ["taskguard", "fenced floor", "redis-py Lock"]
    usec: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    foreign_rounds = 0
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            c0 = redis_cpu(admin)
            d = count_commands(admin, contenders[name], ops)
            c1 = redis_cpu(admin)
            if any(k not in EXPECTED[name] for k in d["calls"]):
                foreign_rounds += 1
            usec[name].append(sum(d["usec"].get(c, 0) for c in CLIENT_SIDE[name]) / ops)
            cpu[name].append((c1 - c0) * 1e6 / ops)

    def ratio(what: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
        rs = [x / y for x, y in zip(what[a], what[b], strict=True) if y > 0]
        return statistics.median(rs), min(rs), max(rs)

    print(
        f"## 3. Redis time per acquire+release: {rounds} interleaved rounds x {ops} ops "
        "(INFO commandstats usec of the client-sent commands; INFO cpu deltas)\n"
    )
    rows = []
    for n in names:
        rs = ratio(usec, n, "fenced floor")
        rows.append(
            [
                n,
                f"{statistics.median(usec[n]):.1f}",
                f"{min(usec[n]):.1f}..{max(usec[n]):.1f}",
                f"{rs[0]:.3f}x ({rs[1]:.2f}..{rs[2]:.2f})",
                f"{statistics.median(cpu[n]):.1f}",
            ]
        )
    print(
        fmt_table(
            ["contender", "Redis us/op", "rounds", "vs fenced floor", "Redis CPU us/op (INFO cpu)"], rows, align="lrrrr"
        )
    )
    m, lo, hi = ratio(usec, "taskguard", "fenced floor")
    cm, clo, chi = ratio(cpu, "taskguard", "fenced floor")
    print(
        f"\n   taskguard / fenced floor, Redis time = {m:.3f}x (rounds {lo:.3f}..{hi:.3f}); "
        f"Redis CPU {cm:.3f}x ({clo:.2f}..{chi:.2f})  target <= 1.15x: {verdict(m <= 1.15)}"
    )
    print("   the floor: TIME, HMGET owner/expiry/fence, HSET fence/owner/expiry, PEXPIRE idle; HGET owner, HDEL")
    print("   (see FLOOR_ACQUIRE in this file). INFO cpu counts the whole server (its event loop, other clients)")
    if foreign_rounds:
        print(
            f"   NOTE: other clients ran commands in {foreign_rounds} of {rounds * len(names)} counts: read the ratios"
        )
    return {"redis_tg_floor": m, **{f"redis_us:{n}": statistics.median(v) for n, v in usec.items()}}


def print_commands(admin: redis.Redis, contenders: dict[str, Callable[[], None]], locks: RedisLocks, n: int) -> None:
    print(f"## 3b. Redis commands executed per acquire+release ({n} ops each; INFO stats/commandstats deltas)")
    print("   total_commands_processed counts the commands Lua scripts run inside EVALSHA as well;")
    print("   'client cmds' are the commands the client sent, i.e. the round trips.\n")
    rows = []
    notes = []
    for name in ("taskguard", "fenced floor", "redis-py Lock", "2x PING"):
        d = count_commands(admin, contenders[name], n)
        client_cmds = sum(d["calls"].get(c, 0) for c in CLIENT_SIDE[name])
        foreign = {k: v for k, v in d["calls"].items() if k not in EXPECTED[name]}
        total = d["total"] - sum(foreign.values())
        order = sorted(d["calls"].items(), key=lambda kv: (kv[0] not in CLIENT_SIDE[name], -kv[1], kv[0]))
        per = " ".join(f"{k}={v / n:.2f}" for k, v in order if k not in foreign)
        srv_us = sum(d["usec"].get(c, 0) for c in CLIENT_SIDE[name]) / n
        rows.append([name, f"{client_cmds / n:.2f}", f"{total / n:.2f}", f"{srv_us:.1f}", per])
        if foreign:
            notes.append(
                f"   NOTE: other clients ran {sum(foreign.values())} commands ({', '.join(sorted(foreign))}) "
                f"during the {name} count; excluded above where told apart by name"
            )
    print(
        fmt_table(
            ["contender", "client cmds/op", "server cmds/op", "server us/op", "per command, per op"],
            rows,
            align="lrrrl",
        )
    )
    print("   server us/op: Redis's own time in the client-sent commands (for EVALSHA: the Lua inside).")
    # Server time of each taskguard script on its own: n acquisitions of distinct keys, then n releases.
    keys = [f"cnt:{i}" for i in range(n)]
    a = snapshot(admin)
    leases = [locks.acquire(k, ttl=TTL).lease for k in keys]
    b = snapshot(admin)
    for lease in leases:
        lease.release()
    c = snapshot(admin)

    def us(x: dict, y: dict) -> float:
        return (y["cmd"]["evalsha"][1] - x["cmd"].get("evalsha", (0, 0))[1]) / n

    inner = [sorted(_lua_calls(x.source)) for x in (scripts.ACQUIRE, scripts.RELEASE)]
    print(f"   taskguard server time per script call: ACQUIRE {us(a, b):.1f} us (Lua may run: {' '.join(inner[0])}),")
    print(f"   RELEASE {us(b, c):.1f} us (Lua may run: {' '.join(inner[1])})")
    print("   (measured apart: acquisitions of distinct fresh keys, then their releases)")
    for line in notes:
        print(line)


# -- where taskguard's time goes: inside vs outside the EVALSHA calls ---------------------------------
def print_split(url: str, prefix: str, ops: int, rounds: int) -> None:
    """taskguard vs its raw scripts on a dedicated locks object whose script calls are timed (an
    instance attribute wrapper on its connection path: taskguard's code is not touched)."""
    client = redis.Redis.from_url(url)
    locks = RedisLocks(client, prefix=prefix)
    path = locks.client
    clock = time.perf_counter
    orig = path.execute_command
    inside = [0.0]

    def timed_execute(*a: Any, **k: Any) -> Any:
        if a and a[0] != "EVALSHA":
            return orig(*a, **k)
        s = clock()
        try:
            return orig(*a, **k)
        finally:
            inside[0] += clock() - s

    path.execute_command = timed_execute
    cont = make_contenders(client, locks, prefix)
    names = ["taskguard", "tg scripts raw"]
    for name in names:
        for _ in range(300):
            cont[name]()
    res: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            gc.collect()
            inside[0] = 0.0
            wall, _ = run_chunk(cont[name], ops)
            res[name].append((wall / ops, inside[0] / ops))
    locks.close()
    client.close()
    med = {n: (statistics.median(w for w, _ in v), statistics.median(i for _, i in v)) for n, v in res.items()}
    print(
        f"## 4. where taskguard's extra time goes: time inside the 2 EVALSHA calls vs outside them "
        f"({rounds} alternating rounds x {ops} ops, medians, us/op)\n"
    )
    rows = [[n, f"{w * 1e6:.1f}", f"{i * 1e6:.1f}", f"{(w - i) * 1e6:.1f}"] for n, (w, i) in med.items()]
    print(fmt_table(["contender", "wall", "inside evalsha x2", "outside (Python around them)"], rows))
    (tw, ti), (rw, ri) = med["taskguard"], med["tg scripts raw"]
    print(f"   taskguard - raw = {(tw - rw) * 1e6:+.1f} us/op:")
    print(f"     {((tw - ti) - (rw - ri)) * 1e6:+6.1f} us  taskguard's own Python code between and around the calls")
    print(f"     {(ti - ri) * 1e6:+6.1f} us  slower EVALSHA calls, though the scripts and argument sizes are the same")
    print("                (so not Redis work): round trips run slower with more Python between them (as section 5's")
    print("                API code costs more right after a round trip than in a hot loop). On small VMs loopback")
    print("                RTT is also bimodal (~30 vs ~65 us: client and Redis on one vCPU or two), which makes")
    print("                this line swing most from run to run")


# -- client-side CPU breakdown -----------------------------------------------------------------------
class _NullBackend(RedisBackend):
    """A Redis backend that answers at once (no I/O): the taskguard API over it costs pure client-side CPU."""

    def acquire(self, request, wait):  # type: ignore[override]
        self.lease_key(request.key)
        return AcquireReply(AcquireStatus.ACQUIRED, 1)

    def release(self, key, owner, *rest, **kw):  # type: ignore[override]
        self.lease_key(key)
        return True


def print_breakdown(client: redis.Redis) -> None:
    null = Locks(_NullBackend(client, "tgbench-null", 1.0, 7 * 86400.0), prefix="tgbench-null")
    acquire = null.acquire

    def whole() -> None:
        acquire("k", ttl=TTL).lease.release()

    meta = {"host": socket.gethostname(), "pid": os.getpid()}
    ws: weakref.WeakSet[Any] = weakref.WeakSet()
    lease = Lease(null.leasing, "k", "o", ttl=10.0, fencing_token=1, expires_at=0.0, holder=meta)
    hb = get_heartbeat()
    emitter = null.emitter

    def events() -> None:
        emitter.emit(LeaseEvent("acquire", "k", "acquired", 0.0, fencing_token=1, ttl=10.0, holder=meta))
        emitter.emit(LeaseEvent("release", "k", "released", 0.0, fencing_token=1))

    def weakset() -> None:
        ws.add(lease)
        ws.discard(lease)

    def validation() -> None:
        check_seconds("ttl", 10)
        check_seconds("wait", 0.0, allow_zero=True)

    def clocks() -> None:  # time.monotonic x5 + time.time x2 (+ Lease's) in acquire/release
        m = time.monotonic
        m()
        m()
        m()
        m()
        m()
        time.time()
        time.time()  # noqa: E702  (one line: the calls counted above)

    parts = [
        ("whole API over a no-op backend (acquire+release)", whole),
        ("holder_meta(None): gethostname + getpid + json.dumps", lambda: holder_meta(None)),
        ("socket.gethostname()", socket.gethostname),
        ("json.dumps(holder meta)", lambda: json.dumps(meta, separators=(",", ":"))),
        ("secrets.token_urlsafe(18) (owner token)", lambda: secrets.token_urlsafe(18)),
        ("2 LeaseEvent built + emitted (no listeners)", events),
        (
            "Lease(...) handle (threading.Lock, getpid, dict)",
            lambda: Lease(null.leasing, "k", "o", ttl=10.0, fencing_token=1, expires_at=0.0, holder=meta),
        ),
        ("Acquisition(...) dataclass", lambda: Acquisition(True, lease)),
        ("WeakSet add + discard", weakset),
        ("get_heartbeat().discard(lease) (2 locks)", lambda: hb.discard(lease)),
        ("check_seconds x2 (+ _check_key)", validation),
        ("clock reads (monotonic x5, time x2)", clocks),
        ("os.getpid()", os.getpid),
    ]

    def best_of(fn: Callable[[], Any]) -> float:
        t = timeit.Timer(fn)
        n = max(100, int(0.03 / max(t.timeit(500) / 500, 1e-9)))  # ~30 ms per repeat
        return min(t.repeat(repeat=5, number=n)) / n

    def between_round_trips(fn: Callable[[], Any], n: int = 3000) -> float:
        """Median cost of fn() when each call follows a PING round trip (as in real use)."""
        clock, ping, out = time.perf_counter, client.ping, []
        for _ in range(n):
            ping()
            s = clock()
            fn()
            out.append(clock() - s)
        return statistics.median(out)

    rows = [[label, f"{best_of(fn) * 1e6:.2f}"] for label, fn in parts]
    rows.insert(
        1, ["  the same, each call right after a PING round trip (median)", f"{between_round_trips(whole) * 1e6:.2f}"]
    )
    print(
        "## 5. client-side CPU of the taskguard API per acquire+release (no Redis I/O in the API; timeit, best of 5)\n"
    )
    print(fmt_table(["piece", "us"], rows))
    print("   (the pieces are parts of the whole; they show where its time goes and do not add up exactly)")


# -- main -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--ops", type=int, default=2000, help="ops per contender per round (default 2000)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--handoffs", type=int, default=50, help="hand-offs per waiter kind (default 50)")
    ap.add_argument("--count-ops", type=int, default=1000, help="ops for the command counts (default 1000)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random hold times (default 1)")
    ap.add_argument("--no-diagnostics", action="store_true", help="skip sections 4-5 (where taskguard's time goes)")
    args = ap.parse_args(argv)
    if args.ops < 1 or args.rounds < 1 or args.handoffs < 1 or args.count_ops < 1:
        ap.error("--ops, --rounds, --handoffs and --count-ops must be >= 1")

    t_start = time.monotonic()
    opened = open_admin(args.url)
    if opened is None:
        return 2
    admin, server = opened
    client = redis.Redis.from_url(args.url)
    prefix = run_prefix()
    locks = RedisLocks(client, prefix=prefix)
    parser, proto = parser_name(client)
    urlhost = redact_url(args.url).strip("'\"")  # never print a password

    print("# taskguard core benchmark")
    print("compares, on one shared redis.Redis client: taskguard RedisLocks.acquire(key, ttl=10) + lease.release()")
    print(
        "  vs 2x client.ping() (the two-round-trip floor) vs redis-py Lock(timeout=10) "
        "acquire(blocking=False) + release()"
    )
    print(
        f"python        {platform.python_implementation()} {platform.python_version()} on "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"
    )
    print(
        f"redis server  {server.get('redis_version')} ({server.get('redis_mode', '?')}, "
        f"{server.get('multiplexing_api', '?')}) at {urlhost}"
    )
    print(f"redis-py      {redis.__version__}, protocol RESP{proto}, parser {parser}")
    hv = None
    try:
        import hiredis  # noqa: F401

        hv = getattr(hiredis, "__version__", "?")
    except ImportError:
        pass
    print(f"hiredis       {'yes ' + hv if hv and redis.utils.HIREDIS_AVAILABLE else 'no'}")
    print(f"taskguard     {taskguard.__version__} from {os.path.dirname(taskguard.__file__)}{git_state()}")
    print(f"key prefix    {prefix} (deleted at the end)")
    others = admin.info("clients").get("connected_clients", 0) - 2
    if others > 0:
        print(f"NOTE          {others} other client(s) connected to this Redis; their load adds noise")
    print()

    try:
        contenders = make_contenders(client, locks, prefix)
        res = throughput(contenders, args.ops, args.rounds)
        print_throughput(res, args.ops, args.rounds)
        print()
        print_handoff(args.url, client, admin, prefix, args.handoffs, args.seed)
        print()
        print_redis_time(admin, contenders, args.count_ops, args.rounds)
        print()
        print_commands(admin, contenders, locks, args.count_ops)
        if not args.no_diagnostics:
            print()
            print_split(args.url, prefix, args.ops, min(args.rounds, 5))
            print()
            print_breakdown(client)
    finally:
        locks.close()
        deleted, left = cleanup(admin, prefix)
        print(f"\ncleanup: deleted {deleted} keys under {prefix}; {left} left")
        client.close()
        admin.close()
    print(f"total wall time {time.monotonic() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
