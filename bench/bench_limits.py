#!/usr/bin/env python
"""The cost of the guards beyond one holder — holder limits (``acquire(limit=N)``) and rate
decisions (``Locks.throttle``) — side by side in one run, and a limited key against the common
sorted-set semaphore after a SIGKILL.

Run from the repository root:

    .venv/bin/python bench/bench_limits.py [--ops N] [--rounds R] [--url URL]

§1 Holder limits. Contenders, each one acquire + release per op, in interleaved rounds:

* ``limit=1``: ``acquire(key, ttl=30).lease.release()``, a plain lease;
* ``limit=5, 4 held`` / ``limit=50, 49 held``: the same on a key whose other slots are all held, so
  the acquire script looks at every slot and takes the last free one;
* ``sorted-set semaphore, 4 held``: the common recipe (``ZREMRANGEBYSCORE`` the expired members,
  ``ZADD`` this one, ``ZRANK`` it, ``ZREM`` it when over the limit, in one MULTI; ``ZREM`` to
  release) — also two round trips, no renewal, no fencing token, client clocks;
* ``2x PING``: the floor of two round trips.

Redis time per op comes from ``INFO commandstats`` around a separate run of each contender.

§2 After a SIGKILL. A child process takes both slots of a limit-2 key and is SIGKILLed; how long
until a slot is free again: taskguard (TTL 2 s, renewed while alive), the sorted-set recipe
(timeout 2 s) and an ``INCR``/``DECR`` counting semaphore (no expiry: its slots never return).

§3 Publishing with ``unique=True``. A Celery ``apply_async`` of a guarded task to a Redis broker
(no worker), in interleaved rounds: plain; ``unique=True`` with a new key each time (the mark
script, then the publish); ``unique=True`` on a key already queued (the mark script answers, nothing
is published).

§4 Rate decisions. Contenders, each one decision per op on one shared ``redis.Redis`` client
(hiredis), in interleaved rounds (every round runs every contender ``--ops`` times, the order
rotated):

* ``taskguard throttle``: ``RedisLocks.throttle(key, rate="1000000/s", burst=10**9)`` — the whole
  API: validation, the GCRA script (one round trip), the ``Throttle`` answer;
* ``taskguard throttle, cost=250``: the same decision weighted (a call of 250 cost units): the
  same script and round trip, one more argument;
* ``1x PING``: the floor of any decision that asks Redis;
* ``INCR+PEXPIRE fixed window``: the common recipe (``INCR`` then ``PEXPIRE`` on a per-second key,
  pipelined in one round trip) — about as cheap, but it lets 2x the rate through at a window
  boundary and every denied caller retries at the same instant.

§5 A limit per key and a total (``limit=2, limit_total=10``). Contenders, each one guarded run
begun and handed back per op (``GuardedRun.begin()`` then ``hand_back()``, the path a task takes,
no heartbeat), in interleaved rounds:

* ``1x PING``: one round trip, the floor;
* ``one limit``: ``limit=2`` on a tenant key — acquire + release, two round trips;
* ``two limits``: ``limit=2, limit_total=10`` — the key's slot, then the total's, and both
  released: four round trips (each a single-key script, as on Redis Cluster);
* ``two limits, total full``: the total held by 10 other runs — the key's slot taken, the total
  refused, the key's slot given back: three round trips, the run skipped ``limit_total``.

Printed: ops/s, µs/op, p50/p99 and each contender's ratio to the PING floor (median of per-round
ratios, with the range). Keys live under a fresh ``tgbench-<pid>-<random>`` prefix and are deleted
at the end.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Any

import redis
import redis.utils

try:  # run from a checkout without installing
    import taskguard
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import taskguard

import multiprocessing
import signal

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

from taskguard import RedisLocks
from taskguard.urls import redact_url


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--ops", type=int, default=2000, help="decisions per contender per round (default 2000)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    args = ap.parse_args(argv)
    if args.ops < 1 or args.rounds < 1:
        ap.error("--ops and --rounds must be >= 1")
    exit_on_sigterm()
    opened = open_admin(args.url)
    if opened is None:
        return 2
    admin, server = opened
    prefix = run_prefix()
    client = redis.Redis.from_url(args.url)
    locks = RedisLocks(client, prefix=prefix)
    print("# taskguard rate decisions (Locks.throttle) vs the one-round-trip floor and a fixed-window counter")
    print(f"python        {platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs")
    print(f"redis server  {server.get('redis_version')} at {redact_url(args.url)}")
    print(f"redis-py      {redis.__version__}, hiredis {'yes' if redis.utils.HIREDIS_AVAILABLE else 'no'}")
    print(f"taskguard     {taskguard.__version__} from {os.path.dirname(taskguard.__file__)}{git_state()}")
    print(f"key prefix    {prefix} (deleted at the end)\n")
    window_key = f"{prefix}:window"

    def throttle() -> None:
        locks.throttle("rate", rate="1000000/s", burst=10**9)

    def weighted() -> None:
        locks.throttle("wrate", rate="1000000/s", burst=10**9, cost=250)

    def ping() -> None:
        client.ping()

    def fixed_window() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.incr(f"{window_key}:{int(time.time())}")
        pipe.pexpire(f"{window_key}:{int(time.time())}", 2000)
        pipe.execute()

    try:
        bench_holder_limits(args, client, locks, admin, prefix)
        bench_sigkill(args.url, admin, prefix)
        bench_unique_publish(args, admin, prefix)
        bench_two_limits(args, client, locks, admin)
        print("## §4 rate decisions\n")
        contenders = {
            "taskguard throttle": throttle,
            "taskguard throttle, cost=250": weighted,
            "1x PING": ping,
            "INCR+PEXPIRE fixed window": fixed_window,
        }
        per_round, lat, _orders = interleaved_rounds(contenders, args.ops, args.rounds)
        base = per_round["1x PING"]
        rows = []
        for name in contenders:
            med = statistics.median(per_round[name])
            ratios = sorted(a / b for a, b in zip(per_round[name], base, strict=True))
            rows.append(
                [
                    name,
                    f"{1 / med:,.0f}",
                    f"{med * 1e6:.1f}",
                    f"{pct(lat[name], 0.5) * 1e6:.1f}",
                    f"{pct(lat[name], 0.99) * 1e6:.1f}",
                    f"{statistics.median(ratios):.3f}x ({ratios[0]:.2f}..{ratios[-1]:.2f})",
                ]
            )
        print(f"{args.rounds} interleaved rounds x {args.ops} decisions per contender\n")
        print(fmt_table(["contender", "ops/s", "us/op", "p50 us", "p99 us", "vs 1x PING"], rows, align="lrrrrr"))
        print(
            "\n   a throttle decision is one round trip, weighted (cost=) or not, as the fixed window's is; the"
            "\n   fixed window lets up to 2x the rate through across a window boundary and tells denied callers"
            "\n   nothing about when to come back"
        )
    finally:
        deleted, left = cleanup(admin, prefix)
        print(f"\ncleanup: deleted {deleted} keys under {prefix}; {left} left")
        client.close()
        admin.close()
    return 0


# -- §1 holder limits -------------------------------------------------------------------------------

ZSEM_TIMEOUT = 30.0


def zset_acquire(client: redis.Redis, key: str, member: str, limit: int, timeout: float) -> bool:
    """The common sorted-set semaphore: drop expired members, add this one, keep it if its rank is
    under the limit (one MULTI round trip; a second to give the slot back when over)."""
    now = time.time()
    pipe = client.pipeline(transaction=True)
    pipe.zremrangebyscore(key, "-inf", now - timeout)
    pipe.zadd(key, {member: now})
    pipe.zrank(key, member)
    rank = pipe.execute()[-1]
    if rank is not None and rank < limit:
        return True
    client.zrem(key, member)
    return False


def _commandstats(admin: redis.Redis) -> dict[str, tuple[int, int]]:
    return {k: (v["calls"], v["usec"]) for k, v in admin.info("commandstats").items()}


def _redis_cost(before: dict, after: dict, ops: int) -> tuple[float, float]:
    """(Redis µs per op, commands per op) between two ``INFO commandstats``. A script's own entry
    already includes the commands it runs (which are also listed on their own), and so does
    ``EXEC`` for a MULTI block: only the outermost commands' time is summed."""
    delta = {k: (after[k][0] - before.get(k, (0, 0))[0], after[k][1] - before.get(k, (0, 0))[1]) for k in after}
    delta.pop("cmdstat_info", None)
    calls = sum(c for c, _ in delta.values())
    if delta.get("cmdstat_evalsha", (0, 0))[0] or delta.get("cmdstat_eval", (0, 0))[0]:
        outer = ("cmdstat_evalsha", "cmdstat_eval")
    else:
        outer = tuple(k for k in delta if k not in ("cmdstat_multi", "cmdstat_exec"))
    return sum(delta.get(k, (0, 0))[1] for k in outer) / ops, calls / ops


def bench_holder_limits(args, client, locks, admin, prefix) -> None:
    held = [locks.acquire("lim5", ttl=600, limit=5).lease for _ in range(4)]
    held += [locks.acquire("lim50", ttl=600, limit=50).lease for _ in range(49)]
    zkey = f"{prefix}:zsem"
    for i in range(4):
        zset_acquire(client, zkey, f"held-{i}", 5, 3600)
    counter = iter(range(10**9))

    def limit1() -> None:
        locks.acquire("lim1", ttl=30).lease.release()

    def limit5() -> None:
        locks.acquire("lim5", ttl=30, limit=5).lease.release()

    def limit50() -> None:
        locks.acquire("lim50", ttl=30, limit=50).lease.release()

    def zsem() -> None:
        member = f"m{next(counter)}"
        assert zset_acquire(client, zkey, member, 5, ZSEM_TIMEOUT)
        client.zrem(zkey, member)

    def pings() -> None:
        client.ping()
        client.ping()

    contenders = {
        "limit=1": limit1,
        "limit=5, 4 held": limit5,
        "limit=50, 49 held": limit50,
        "sorted-set semaphore, 4 held": zsem,
        "2x PING": pings,
    }
    per_round, lat, _orders = interleaved_rounds(contenders, args.ops, args.rounds)
    redis_us = {}
    for name, fn in contenders.items():  # Redis time, each alone
        before = _commandstats(admin)
        for _ in range(args.ops):
            fn()
        redis_us[name] = _redis_cost(before, _commandstats(admin), args.ops)
    base, one = per_round["2x PING"], per_round["limit=1"]
    rows = []
    for name in contenders:
        med = statistics.median(per_round[name])
        r_ping = sorted(a / b for a, b in zip(per_round[name], base, strict=True))
        r_one = sorted(a / b for a, b in zip(per_round[name], one, strict=True))
        rows.append(
            [
                name,
                f"{med * 1e6:.1f}",
                f"{pct(lat[name], 0.99) * 1e6:.1f}",
                f"{redis_us[name][1]:.1f}",
                f"{redis_us[name][0]:.1f}",
                f"{statistics.median(r_ping):.3f}x ({r_ping[0]:.2f}..{r_ping[-1]:.2f})",
                f"{statistics.median(r_one):.3f}x",
            ]
        )
    print(f"## §1 holder limits: acquire + release, {args.rounds} interleaved rounds x {args.ops} ops\n")
    print(
        fmt_table(
            ["contender", "us/op", "p99 us", "cmds/op", "redis us/op", "vs 2x PING", "vs limit=1"],
            rows,
            align="lrrrrrr",
        )
    )
    print(
        "\n   every contender is two round trips (acquire, release); cmds/op counts the commands Redis ran"
        "\n   (a script is 1 + the commands inside it). A limited acquire reads each slot inside one script.\n"
    )
    for lease in held:
        lease.release()


# -- §5 a limit per key and a total -------------------------------------------------------------------


def bench_two_limits(args: Any, client: redis.Redis, locks: RedisLocks, admin: redis.Redis) -> None:
    from taskguard.run import GuardedRun, RunRequest

    def one_limit() -> None:
        run = GuardedRun(locks, RunRequest("exp:t1", 30.0, renew=False, limit=2))
        assert run.begin()
        run.hand_back()

    def two_limits() -> None:
        run = GuardedRun(locks, RunRequest("exp:t1", 30.0, renew=False, limit=2, total=("exports", 10)))
        assert run.begin()
        run.hand_back()

    def total_full() -> None:
        run = GuardedRun(locks, RunRequest("exp:t2", 30.0, renew=False, limit=2, total=("exports-full", 10)))
        assert not run.begin() and run.reason == "limit_total"

    def ping() -> None:
        client.ping()

    held = [locks.acquire("exports-full", ttl=600, limit=10).lease for _ in range(10)]
    contenders = {
        "1x PING": ping,
        "one limit (limit=2)": one_limit,
        "two limits (limit=2, limit_total=10)": two_limits,
        "two limits, total full: refused": total_full,
    }
    per_round, lat, _orders = interleaved_rounds(contenders, args.ops, args.rounds)
    redis_us = {}
    for name, fn in contenders.items():  # Redis time, each alone
        before = _commandstats(admin)
        for _ in range(args.ops):
            fn()
        redis_us[name] = _redis_cost(before, _commandstats(admin), args.ops)
    base, one = per_round["1x PING"], per_round["one limit (limit=2)"]
    rows = []
    for name in contenders:
        med = statistics.median(per_round[name])
        r_ping = sorted(a / b for a, b in zip(per_round[name], base, strict=True))
        r_one = sorted(a / b for a, b in zip(per_round[name], one, strict=True))
        rows.append(
            [
                name,
                f"{1 / med:,.0f}",
                f"{med * 1e6:.1f}",
                f"{pct(lat[name], 0.5) * 1e6:.1f}",
                f"{pct(lat[name], 0.99) * 1e6:.1f}",
                f"{redis_us[name][0]:.1f}",
                f"{statistics.median(r_ping):.3f}x ({r_ping[0]:.2f}..{r_ping[-1]:.2f})",
                f"{statistics.median(r_one):.3f}x",
            ]
        )
    print(f"## §5 a limit per key and a total: begin + hand back, {args.rounds} interleaved rounds x {args.ops} ops\n")
    print(
        fmt_table(
            ["contender", "ops/s", "us/op", "p50 us", "p99 us", "redis us/op", "vs 1x PING", "vs one limit"],
            rows,
            align="lrrrrrrr",
        )
    )
    print(
        "\n   round trips per op: PING 1, one limit 2, two limits 4 (the key, the total, two releases),"
        "\n   a refusal by the total 3 (the key taken and given back); each is a single-key script\n"
    )
    for lease in held:
        lease.release()


# -- §3 publishing with unique=True ------------------------------------------------------------------


def bench_unique_publish(args: Any, admin: Any, prefix: str) -> None:
    from celery import Celery

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integrations"))
    from taskguard_celery import GuardedTask

    app = Celery(f"{prefix}-app", broker=args.url, set_as_current=False)
    app.conf.update(
        task_default_queue=f"{prefix}-q",
        taskguard_redis_url=args.url,
        taskguard_prefix=prefix,
        broker_connection_retry_on_startup=True,
    )

    @app.task(base=GuardedTask, shared=False, name=f"{prefix}.job", key="job:{n}")
    def job(n):
        return n

    counter = iter(range(10**9))
    ops = max(200, args.ops // 4)

    def plain() -> None:
        job.apply_async((next(counter),))

    def unique_new() -> None:
        job.apply_async((next(counter),), unique=True)

    def unique_queued() -> None:
        job.apply_async((-1,), unique=True)  # the first call marked it; every later one is suppressed

    try:
        contenders = {
            "apply_async": plain,
            "unique=True, new key": unique_new,
            "unique=True, key queued": unique_queued,
        }
        per_round, lat, _orders = interleaved_rounds(contenders, ops, args.rounds)
        base = per_round["apply_async"]
        rows = []
        for name in contenders:
            med = statistics.median(per_round[name])
            ratios = sorted(a / b for a, b in zip(per_round[name], base, strict=True))
            rows.append(
                [
                    name,
                    f"{med * 1e6:.1f}",
                    f"{pct(lat[name], 0.99) * 1e6:.1f}",
                    f"{statistics.median(ratios):.3f}x ({ratios[0]:.2f}..{ratios[-1]:.2f})",
                ]
            )
        print(f"## §3 publishing a guarded Celery task, {args.rounds} interleaved rounds x {ops} publishes\n")
        print(fmt_table(["publish", "us/op", "p99 us", "vs apply_async"], rows, align="lrrr"))
        print(
            "\n   unique=True adds one round trip (the mark script) before the publish; a suppressed publish is"
            "\n   that round trip alone.\n"
        )
    finally:
        admin.delete(f"{prefix}-q")
        app.close()


# -- §2 after a SIGKILL -------------------------------------------------------------------------------


def _take_two(url: str, prefix: str, how: str, ready: Any) -> None:
    client = redis.Redis.from_url(url)
    if how == "taskguard":
        locks = RedisLocks(client, prefix=prefix)
        for _ in range(2):
            assert locks.acquire("crash", ttl=2, limit=2, renew=True)
    elif how == "zset":
        for i in range(2):
            assert zset_acquire(client, f"{prefix}:zcrash", f"dead-{i}", 2, 2.0)
    else:
        client.incrby(f"{prefix}:counter", 2)
    ready.put(how)
    time.sleep(600)


def _slot_free(url: str, prefix: str, how: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        if how == "taskguard":
            acq = RedisLocks(client, prefix=prefix).acquire("crash", ttl=5, limit=2)
            if acq:
                acq.lease.release()
            return bool(acq)
        if how == "zset":
            ok = zset_acquire(client, f"{prefix}:zcrash", "probe", 2, 2.0)
            client.zrem(f"{prefix}:zcrash", "probe")
            return ok
        n = client.incr(f"{prefix}:counter")
        client.decr(f"{prefix}:counter")
        return n <= 2
    finally:
        client.close()


def bench_sigkill(url: str, admin: Any, prefix: str, give_up: float = 8.0) -> None:
    print("## §2 a holder SIGKILLed while holding both slots of a limit-2 key\n")
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for how, label in (
        ("taskguard", "taskguard limit=2 (ttl 2 s, renewed)"),
        ("zset", "sorted-set semaphore (timeout 2 s)"),
        ("counter", "INCR/DECR counter"),
    ):
        ready = ctx.Queue()
        proc = ctx.Process(target=_take_two, args=(url, prefix, how, ready))
        proc.start()
        ready.get(timeout=30)
        time.sleep(2.5)  # alive past its TTL: a renewed lease stays held
        alive_held = not _slot_free(url, prefix, how)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        killed = time.monotonic()
        back = None
        while time.monotonic() - killed < give_up:
            if _slot_free(url, prefix, how):
                back = time.monotonic() - killed
                break
            time.sleep(0.05)
        when = "never (leaked)" if back is None else f"{back:.2f} s"
        if not alive_held:
            when = "- (gone before it)"
        rows.append([label, "yes" if alive_held else "NO", when, "per slot" if how == "taskguard" else "none"])
    print(
        fmt_table(
            ["semaphore", "held past TTL while alive", "slot back after SIGKILL", "fencing token"], rows, align="lrrr"
        )
    )
    print(
        "\n   the sorted-set recipe cannot renew: a holder alive past its timeout loses its slot unnoticed"
        "\n   and nothing fences its late writes; the counter never gives a dead holder's slots back.\n"
    )


if __name__ == "__main__":
    sys.exit(main())
