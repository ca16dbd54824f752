"""Mutual exclusion across OS processes, proven by an occupancy counter and by fence order."""

from __future__ import annotations

import multiprocessing as mp

import redis

from taskguard import RedisLocks

PROCS = 4
ROUNDS = 100


def contend(url: str, prefix: str, rounds: int, out: mp.Queue) -> None:
    c = redis.Redis.from_url(url)
    locks = RedisLocks(c, prefix=prefix)
    occupancy = f"{prefix}:occupancy"
    violations = 0
    for _ in range(rounds):
        acq = locks.acquire("shared", ttl=5, wait=30)
        assert acq.acquired, acq
        lease = acq.lease
        if c.incr(occupancy) != 1:  # checked on entry
            violations += 1
        c.rpush(f"{prefix}:ledger", lease.fencing_token)  # in acquisition order
        c.decr(occupancy)
        if not lease.release():
            violations += 1
    out.put(violations)


def test_processes_never_overlap_and_fences_follow_acquisition_order(redis_url, prefix):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=contend, args=(redis_url, prefix, ROUNDS, out)) for _ in range(PROCS)]
    for p in procs:
        p.start()
    violations = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    c = redis.Redis.from_url(redis_url)
    try:
        ledger = [int(x) for x in c.lrange(f"{prefix}:ledger", 0, -1)]
        assert sum(violations) == 0
        assert len(ledger) == PROCS * ROUNDS
        assert all(a < b for a, b in zip(ledger, ledger[1:], strict=False)), "fences must strictly increase"
    finally:
        c.delete(f"{prefix}:ledger", f"{prefix}:occupancy")
        c.close()
