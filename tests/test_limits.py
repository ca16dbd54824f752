"""Per-key holder limits (``acquire(limit=N)``): a fenced, crash-safe semaphore on Redis
(standalone and Cluster) and MemoryLocks — slots, per-slot fences, expiry of a crashed holder,
waiting woken by a release, claims keeping their slot, holders(), lowering a limit, and a ledger
kept by several OS processes showing the peak never exceeds N."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from taskguard import ConfigError, RedisLocks
from taskguard.lease import slot_of

from . import ledger as ledger_checks


def test_up_to_n_holders_each_with_its_own_slot_and_fence(any_locks):
    got = [any_locks.acquire("exports:t1", ttl=5, limit=3) for _ in range(4)]
    assert [a.acquired for a in got] == [True, True, True, False]
    assert sorted(a.lease.slot for a in got[:3]) == [0, 1, 2]
    assert got[3].reason == "limit" and 0 < got[3].holder_ttl <= 5
    held = any_locks.holders("exports:t1")
    assert [h.slot for h in held] == [0, 1, 2]
    assert {h.fencing_token for h in held} == {a.lease.fencing_token for a in got[:3]}
    assert all(a.lease.owner_token not in repr(held) for a in got[:3])  # never a token
    # a release frees exactly that slot; the next holder takes it with a larger fence of that slot
    old = got[1].lease
    assert old.release() is True
    again = any_locks.acquire("exports:t1", ttl=5, limit=3)
    assert again.lease.slot == old.slot and again.lease.fencing_token > old.fencing_token
    # renewals, verification and lease records work per holder
    assert got[2].lease.renew(8) is True
    got[2].lease.ensure_held(verify=True)
    assert got[2].lease.put_record("note", "x") is True
    for a in (got[0], got[2], again):
        assert a.lease.release() is True
    assert any_locks.holders("exports:t1") == []


def test_a_limit_of_one_is_a_plain_lease(any_locks):
    a = any_locks.acquire("plain", ttl=5, limit=1, run_id="r1")
    b = any_locks.acquire("plain", ttl=5)
    assert a.lease.slot == 0 and b.reason == "held" and b.holder_run == "r1"
    assert any_locks.holder("plain").slot == 0


def test_an_expired_holder_gives_its_slot_back(any_locks):
    short = any_locks.acquire("k", ttl=0.2, limit=2).lease
    any_locks.acquire("k", ttl=5, limit=2)
    assert not any_locks.acquire("k", ttl=5, limit=2)
    time.sleep(0.3)
    back = any_locks.acquire("k", ttl=5, limit=2)
    assert back.lease.slot == short.slot and back.lease.fencing_token > short.fencing_token
    assert short.renew() is False and short.lost  # the old holder cannot come back


def test_another_execution_of_a_run_never_takes_a_second_slot(any_locks):
    any_locks.acquire("s", ttl=5, limit=3, run_id="task-1")
    copy = any_locks.acquire("s", ttl=5, limit=3, run_id="task-1")
    assert not copy.acquired and copy.holder_run == "task-1"
    assert any_locks.acquire("s", ttl=5, limit=3, run_id="task-2").acquired
    # the worker-side release by run id finds that run's slot
    assert any_locks.release_run("s", "task-2") is True
    assert [h.run_id for h in any_locks.holders("s")] == ["task-1"]


def test_a_claim_keeps_its_slot_and_fence(any_locks):
    any_locks.acquire("c", ttl=5, limit=2)
    first = any_locks.acquire("c", ttl=5, limit=2).lease
    assert first.slot == 1
    claimed = any_locks.claim("c", first.owner_token, ttl=5, run_id="retry")
    assert claimed.acquired and claimed.lease.slot == 1
    assert claimed.lease.fencing_token == first.fencing_token
    assert any_locks.claim("c", first.owner_token, ttl=5).reason == "not_owner"  # one-shot
    assert [h.run_id for h in any_locks.holders("c")] == [None, "retry"]


def test_lowering_a_limit_never_admits_more_than_the_new_limit_beside_old_holders(any_locks):
    for _ in range(4):
        assert any_locks.acquire("low", ttl=5, limit=4)
    assert any_locks.acquire("low", ttl=5, limit=2).reason == "limit"  # 4 in, limit now 2
    assert any_locks.force_release("low") is True and any_locks.holders("low") == []
    assert [any_locks.acquire("low", ttl=5, limit=2).acquired for _ in range(3)] == [True, True, False]


def test_waiting_wakes_on_a_release(any_locks):
    import threading

    leases = [any_locks.acquire("w", ttl=30, limit=2).lease for _ in range(2)]
    threading.Timer(0.3, leases[0].release).start()
    started = time.monotonic()
    got = any_locks.acquire("w", ttl=5, wait=10, limit=2)
    assert got.acquired and got.lease.slot == leases[0].slot
    assert time.monotonic() - started < 3  # woken by the release, not by the 30 s expiry
    assert any_locks.acquire("w", ttl=5, wait=0.2, limit=2).reason == "wait_timeout"


@pytest.mark.parametrize("limit", [0, -1, 101, 2.0, True, "3"])
def test_bad_limits_are_config_errors(any_locks, limit):
    with pytest.raises(ConfigError, match="limit"):
        any_locks.acquire("bad", ttl=5, limit=limit)


def test_with_lease_reports_limit_as_the_skip_reason(any_locks):
    first = any_locks.acquire("wl", ttl=5, limit=1).lease
    skipped = any_locks.with_lease("wl", lambda lease: 1, ttl=5, limit=2)
    assert skipped == 1  # a second slot was free
    other = any_locks.acquire("wl", ttl=5, limit=2)
    assert other.acquired and other.lease.slot == 1  # with_lease released its slot
    result = any_locks.with_lease("wl", lambda lease: 1, ttl=5, limit=2)
    assert not result and result.reason == "limit"
    first.release()
    other.lease.release()


def test_a_resent_acquire_finds_its_own_slot(redis_url, prefix):
    """redis-py may re-send a script after a dropped connection although it ran: the second run
    finds this owner's slot and answers the same (the script is idempotent per owner token)."""
    from taskguard import scripts

    locks = RedisLocks.from_url(redis_url, prefix=prefix)
    locks.acquire("idem", ttl=5, limit=3)
    args = ("tok", 5000, "{}", 60000, 0, "", "0", "", 3)
    first = scripts.ACQUIRE(locks.client, (locks.backend.lease_key("idem"),), args)
    second = scripts.ACQUIRE(locks.client, (locks.backend.lease_key("idem"),), args)
    assert first[0] == second[0] == 1 and first[1] == second[1] and first[3] == second[3] == 1
    assert len(locks.holders("idem")) == 2


# -- across processes: a ledger of entries and exits ------------------------------------------------


def _worker(url, prefix, limit, seconds, start, ledger_path, seed):
    import random

    rnd = random.Random(seed)
    locks = RedisLocks.from_url(url, prefix=prefix)
    start.wait(60)  # all six contend from the same moment, however long each took to start
    until = time.time() + seconds
    while time.time() < until:
        acq = locks.acquire("pool", ttl=2, limit=limit, wait=0.5)
        if not acq:
            continue
        lease = acq.lease
        with open(ledger_path, "a") as f:
            f.write(f"in {time.time():.6f} {os.getpid()} {lease.slot} {lease.fencing_token}\n")
            f.flush()
        time.sleep(rnd.uniform(0.001, 0.02))
        with open(ledger_path, "a") as f:
            f.write(f"out {time.time():.6f} {os.getpid()} {lease.slot} {lease.fencing_token}\n")
            f.flush()
        assert lease.release()


def test_peak_never_exceeds_the_limit_across_processes(redis_url, prefix, tmp_path):
    """Six processes contend for 3 slots for 4 s, logging entry and exit under the lease (exit
    written before the release, entry after the acquire): at every point of the merged ledger at
    most 3 are inside, every slot is used, and each slot's fences strictly increase."""
    ledger = tmp_path / "ledger"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(6)
    procs = [ctx.Process(target=_worker, args=(redis_url, prefix, 3, 4, start, str(ledger), i)) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    entries = ledger_checks.parse(ledger.read_text().splitlines())
    assert sum(1 for e in entries if e[1] == 1) > 100 and {e[2] for e in entries} == {0, 1, 2}
    assert ledger_checks.peak(entries, 3) == 3  # never above the limit, and it was reached


def _hold_forever(url, prefix, ready):
    locks = RedisLocks.from_url(url, prefix=prefix)
    lease = locks.acquire("crash", ttl=1.0, limit=2, renew=True).lease
    ready.put(lease.slot)
    time.sleep(60)


def test_a_sigkilled_holders_slot_returns_after_its_ttl(redis_url, prefix):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    procs = [ctx.Process(target=_hold_forever, args=(redis_url, prefix, ready)) for _ in range(2)]
    for p in procs:
        p.start()
    slots = sorted(ready.get(timeout=30) for _ in procs)
    assert slots == [0, 1]
    locks = RedisLocks.from_url(redis_url, prefix=prefix)
    time.sleep(1.5)  # the heartbeat keeps both alive past their TTL
    assert locks.acquire("crash", ttl=1, limit=2).reason == "limit"
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    started = time.monotonic()
    got = [locks.acquire("crash", ttl=5, limit=2, wait=3) for _ in range(2)]
    assert all(got) and sorted(a.lease.slot for a in got) == [0, 1]
    assert time.monotonic() - started < 2.5  # back within one TTL of the kill (plus a renewal period)
    assert slot_of(got[0].lease.owner_token) == got[0].lease.slot


@pytest.mark.parametrize("token", ["abc#\u00b2", "abc#\u0661", "abc#", "#", "abc#99999999999999999999"])
def test_odd_owner_tokens_are_never_another_holders_and_never_crash(any_locks, token):
    held = any_locks.acquire("odd", ttl=5, limit=2).lease
    assert any_locks.claim("odd", token, ttl=5).acquired is False
    assert any_locks.restore("odd", token, ttl=5).release() is False
    assert held.renew() is True and [h.slot for h in any_locks.holders("odd")] == [0]


@pytest.mark.parametrize("limit", [1, 3])
def test_release_run_with_the_fencing_token_seen_never_releases_a_later_lease_of_the_run(any_locks, limit):
    """A supervisor looks at a run's holder (to see its process dead), then releases it by run id.
    If the run's lease changed hands in between (released, and taken again by another execution
    of the same run id: a retry, a redelivered copy), the fencing token it saw no longer matches
    and nothing is released; the token of the lease it saw releases it; a malformed token is a
    ConfigError before anything is sent."""
    seen = any_locks.acquire("s", ttl=5, limit=limit, run_id="job-1").lease
    info = next(h for h in any_locks.holders("s") if h.run_id == "job-1")
    assert info.fencing_token == seen.fencing_token
    seen.release()
    again = any_locks.acquire("s", ttl=5, limit=limit, run_id="job-1").lease  # the run's next execution
    assert any_locks.release_run("s", "job-1", fencing_token=info.fencing_token) is False
    assert [h.fencing_token for h in any_locks.holders("s")] == [again.fencing_token]
    assert again.renew() is True
    for bad in ("1", 1.0, True):
        with pytest.raises(ConfigError, match="fencing_token"):
            any_locks.release_run("s", "job-1", fencing_token=bad)
    assert any_locks.release_run("s", "job-1", fencing_token=again.fencing_token) is True
    assert any_locks.holders("s") == [] and again.renew() is False
