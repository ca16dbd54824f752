#!/usr/bin/env python
"""The cost of a cluster-wide rate decision (``Locks.throttle``), side by side in one run.

Run from the repository root:

    .venv/bin/python bench/bench_limits.py [--ops N] [--rounds R] [--url URL]

Contenders, each one decision per op on one shared ``redis.Redis`` client (hiredis), in
interleaved rounds (every round runs every contender ``--ops`` times, the order rotated):

* ``taskguard throttle``: ``RedisLocks.throttle(key, rate="1000000/s", burst=10**9)`` — the whole
  API: validation, the GCRA script (one round trip), the ``Throttle`` answer;
* ``1x PING``: the floor of any decision that asks Redis;
* ``INCR+PEXPIRE fixed window``: the common recipe (``INCR`` then ``PEXPIRE`` on a per-second key,
  pipelined in one round trip) — about as cheap, but it lets 2x the rate through at a window
  boundary and every denied caller retries at the same instant.

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

import redis
import redis.utils

try:  # run from a checkout without installing
    import taskguard
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import taskguard

from taskguard import RedisLocks
from taskguard.urls import redact_url
from benchlib import arg_parser, cleanup, exit_on_sigterm, fmt_table, git_state, interleaved_rounds, open_admin, pct, run_prefix  # noqa: E402


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

    def ping() -> None:
        client.ping()

    def fixed_window() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.incr(f"{window_key}:{int(time.time())}")
        pipe.pexpire(f"{window_key}:{int(time.time())}", 2000)
        pipe.execute()

    try:
        contenders = {"taskguard throttle": throttle, "1x PING": ping, "INCR+PEXPIRE fixed window": fixed_window}
        per_round, lat, _orders = interleaved_rounds(contenders, args.ops, args.rounds)
        base = per_round["1x PING"]
        rows = []
        for name in contenders:
            med = statistics.median(per_round[name])
            ratios = sorted(a / b for a, b in zip(per_round[name], base))
            rows.append([name, f"{1 / med:,.0f}", f"{med * 1e6:.1f}", f"{pct(lat[name], .5) * 1e6:.1f}",
                         f"{pct(lat[name], .99) * 1e6:.1f}",
                         f"{statistics.median(ratios):.3f}x ({ratios[0]:.2f}..{ratios[-1]:.2f})"])
        print(f"## {args.rounds} interleaved rounds x {args.ops} decisions per contender\n")
        print(fmt_table(["contender", "ops/s", "us/op", "p50 us", "p99 us", "vs 1x PING"], rows, align="lrrrrr"))
        print("\n   a throttle decision is one round trip, as the fixed window's is; the fixed window lets up to 2x the"
              "\n   rate through across a window boundary and tells denied callers nothing about when to come back")
    finally:
        deleted, left = cleanup(admin, prefix)
        print(f"\ncleanup: deleted {deleted} keys under {prefix}; {left} left")
        client.close()
        admin.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
