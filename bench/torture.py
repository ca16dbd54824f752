#!/usr/bin/env python
"""A torture run of the lease protocol: many processes, few keys, holders killed and paused,
connections cut and delayed, every holder writing to a fenced ledger.

Run from the repository root:

    .venv/bin/python bench/torture.py [--procs 8] [--keys 4] [--acquisitions 100000] [--seconds 600] [--url URL]

``--procs`` processes loop on ``--keys`` keys: ``acquire(key, ttl=0.5, renew=True, wait=0.2)``
through a TCP proxy to Redis (the suite's ``tests/tcp_proxy.py``); each holder then writes to a
fenced ledger on Redis directly (the storage-side check of ``examples/fencing.py``: a write with a
fencing token below the last accepted one is rejected), checks that nobody else entered the key
meanwhile, and releases. Meanwhile the parent injects, at random every 0.1-0.3 s: SIGKILL of a
process (respawned), SIGSTOP of a process for two TTLs (then SIGCONT), a cut of every proxied
connection, or 0.3 s of proxy delay for a second. It stops at ``--acquisitions`` in all or after
``--seconds``, and prints acquisitions, faults injected, **overlaps** (two holds whose leases were
both held throughout, per their releases, inside the key at once: a holder saw one of them write
the occupancy marker during its own hold, or their entry/exit records interleave; must be 0) and
**fence regressions** (among holds that were held throughout, which therefore follow one another, a
later one with a lower or equal token; must be 0), plus the stale writes the fenced ledger rejected
and the unfenced occupancy writes made by holders whose lease had lapsed (a process paused past
its TTL acts late: no lease can stop that, only the fence, which is why the ledger is fenced).
It exits 1 when either is not 0. Keys live under a fresh prefix and are deleted at the end.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import redis  # noqa: E402
from benchlib import arg_parser, cleanup, exit_on_sigterm, open_admin, run_prefix  # noqa: E402
from torture_faults import Chaos, exit_on_term, start_process  # noqa: E402

TTL = 0.5
LEDGER = """
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < last then
  redis.call('INCR', KEYS[2])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[3], ARGV[1])
return 1
"""


def worker(proxy_url: str, direct_url: str, prefix: str, keys: int, seed: int) -> None:
    from taskguard import LeaseBackendError, RedisLocks

    exit_on_term()
    rng = random.Random(seed)
    locks = RedisLocks(redis.Redis.from_url(proxy_url, socket_timeout=1, socket_connect_timeout=1), prefix=prefix)
    store = redis.Redis.from_url(direct_url)
    ledger = store.register_script(LEDGER)
    while True:
        key = f"k{rng.randrange(keys)}"
        try:
            acq = locks.acquire(key, ttl=TTL, renew=True, wait=0.2)
        except LeaseBackendError:
            time.sleep(0.05)
            continue
        if not acq.acquired:
            continue
        lease = acq.lease
        store.incr(f"{prefix}:acquisitions")
        store.rpush(f"{prefix}:order:{key}", lease.fencing_token)  # after the acquire, before the release
        store.rpush(f"{prefix}:events:{key}", f"e:{lease.fencing_token}")
        occ = f"{prefix}:occ:{key}"
        store.set(occ, lease.fencing_token)
        time.sleep(rng.uniform(0, 0.01))
        accepted = (
            ledger(
                keys=[f"{prefix}:last:{key}", f"{prefix}:rejected", f"{prefix}:ledger:{key}"],
                args=[lease.fencing_token],
            )
            == 1
        )
        seen = int(store.get(occ) or 0)
        store.rpush(f"{prefix}:events:{key}", f"x:{lease.fencing_token}")  # before the release
        try:
            held = lease.release()
        except LeaseBackendError:
            held = False
        if held and not lease.lost:
            # holds that were held throughout do not overlap, so they were recorded (after their
            # acquire returned, before their release) in the order they held the key: their tokens
            # must only grow
            store.sadd(f"{prefix}:clean:{key}", lease.fencing_token)
            if seen != lease.fencing_token and accepted:
                # someone wrote the (unfenced) occupancy marker during this hold: an overlap if
                # that one's lease was held throughout too; else a holder whose lease had lapsed
                # (paused past its TTL) acting late, which only the fence can stop
                store.rpush(f"{prefix}:entered", f"{key}:{lease.fencing_token}:{seen}")


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--keys", type=int, default=4)
    ap.add_argument("--acquisitions", type=int, default=100_000)
    ap.add_argument("--seconds", type=float, default=600.0)
    args = ap.parse_args(argv)
    opened = open_admin(args.url)
    if opened is None:
        return 1
    admin, _ = opened
    exit_on_sigterm()
    prefix = run_prefix()

    def factory(proxy_url: str, seed: int):
        return start_process(worker, proxy_url, args.url, prefix, args.keys, seed)

    chaos = Chaos(args.url, [factory] * args.procs, stop_for=2 * TTL)
    try:
        elapsed = chaos.run(lambda: int(admin.get(f"{prefix}:acquisitions") or 0) >= args.acquisitions, args.seconds)
    finally:
        chaos.stop()
    faults = chaos.faults
    acquisitions = int(admin.get(f"{prefix}:acquisitions") or 0)
    rejected = int(admin.get(f"{prefix}:rejected") or 0)
    regressions = overlaps = interleaved = lapsed = 0
    clean_by_key = {}
    for k in range(args.keys):
        clean = clean_by_key[f"k{k}"] = admin.smembers(f"{prefix}:clean:k{k}")
        fences = [int(x) for x in admin.lrange(f"{prefix}:order:k{k}", 0, -1) if x in clean]
        regressions += sum(1 for a, b in zip(fences, fences[1:], strict=False) if b <= a)
        # the entry (e:) and exit (x:) records of the clean holds must not interleave
        inside = None
        for ev in admin.lrange(f"{prefix}:events:k{k}", 0, -1):
            kind, fence = ev.split(":")
            if fence not in clean:
                continue
            if kind == "e":
                interleaved += inside is not None
                inside = fence
            elif inside == fence:
                inside = None
    for entry in admin.lrange(f"{prefix}:entered", 0, -1):
        key, _fence, seen = entry.split(":")
        if seen in clean_by_key[key]:
            overlaps += 1
        else:
            lapsed += 1
    cleanup(admin, prefix)
    print(f"torture: {args.procs} processes, {args.keys} keys, {elapsed:.0f} s")
    print(f"   acquisitions {acquisitions:,} ({acquisitions / elapsed:,.0f}/s)")
    print("   faults injected: " + ", ".join(f"{n} {k}" for k, n in faults.items()))
    print(f"   stale writes rejected by the fence: {rejected}")
    print(f"   unfenced writes by a holder whose lease had lapsed, seen by the next holder: {lapsed}")
    print(f"   overlaps: {overlaps} (interleaved entry/exit records: {interleaved})   fence regressions: {regressions}")
    return 0 if overlaps == 0 and interleaved == 0 and regressions == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
