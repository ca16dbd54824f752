"""Lease semantics against real Redis: standalone and a 3-primary Redis Cluster (``locks`` fixture)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from taskguard import ConfigError, LeaseLost, RedisLocks, Skipped, is_skipped


def raw_client(locks: RedisLocks):
    return locks.client


def lease_key(locks: RedisLocks, key: str) -> str:
    return "{" + locks.prefix + ":" + key + "}"


# -- 1. acquire is one atomic script -------------------------------------------------------------


def test_acquire_sets_lease_and_fence_atomically(locks):
    acq = locks.acquire("report", ttl=5, holder={"task": "daily_report"})
    assert acq.acquired and acq.reason is None
    lease = acq.lease
    c = raw_client(locks)
    k = lease_key(locks, "report")
    stored = c.hgetall(k)
    stored = {a.decode(): b.decode() for a, b in stored.items()}
    # one hash holds the lease and its fence: owner, fencing token, holder, expiry (server ms)
    assert stored["o"] == lease.owner_token
    assert int(stored["f"]) == lease.fencing_token
    assert '"task":"daily_report"' in stored["h"]
    secs, micros = c.time()
    assert 3500 < int(stored["x"]) - (int(secs) * 1000 + int(micros) // 1000) <= 5000
    assert c.pttl(k) > 5000  # the key itself idles for fence_idle_ttl, keeping the fence
    second = locks.acquire("report", ttl=5)
    assert not second.acquired and second.reason == "held"
    assert 0 < second.holder_ttl <= 5
    lease.release()


def test_acquire_is_a_single_evalsha_round_trip(redis_url, prefix):
    """MONITOR shows exactly one top-level command for an acquire (the script) and one for a
    release; SET/HSET/INCR run inside the script, never as separate client commands."""
    c = redis.Redis.from_url(redis_url)
    locks = RedisLocks(c, prefix=prefix)
    locks.acquire("warm", ttl=1).lease.release()  # script cached
    mon_client = redis.Redis.from_url(redis_url)
    with mon_client.monitor() as m:
        lease = locks.acquire("one", ttl=5).lease
        lease.release()
        c.ping()  # end marker
        top_level = []
        for cmd in m.listen():
            if cmd["client_type"] == "lua":
                continue
            text = cmd["command"]
            if "PING" == text.split(" ")[0].upper() and top_level:
                break
            if prefix in text:
                top_level.append(text.split(" ")[0].upper())
    mon_client.close()
    assert top_level == ["EVALSHA", "EVALSHA"], top_level


def test_concurrent_acquires_one_winner_one_fence(locks):
    results = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(locks.acquire("race", ttl=5))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r.acquired]
    assert len(winners) == 1
    assert all(r.reason == "held" for r in results if not r.acquired)
    c = raw_client(locks)
    assert int(c.hget(lease_key(locks, "race"), "f")) == winners[0].lease.fencing_token


# -- 2. fencing tokens only grow, also when the counter is lost ------------------------------------


def test_fence_grows_across_acquisitions(locks):
    fences = []
    for _ in range(20):
        lease = locks.acquire("f", ttl=5).lease
        fences.append(lease.fencing_token)
        assert lease.release()
    assert fences == sorted(fences) and len(set(fences)) == 20


def test_fence_grows_after_counter_is_lost(locks):
    c = raw_client(locks)
    k = lease_key(locks, "lostctr")
    first = locks.acquire("lostctr", ttl=5).lease
    first.release()
    c.delete(k)  # as an eviction or a restart without persistence would
    second = locks.acquire("lostctr", ttl=5).lease
    assert second.fencing_token > first.fencing_token
    second.release()
    # even a counter rewound far below the last token cannot make tokens go back
    c.hset(k, "f", 1)
    third = locks.acquire("lostctr", ttl=5).lease
    assert third.fencing_token > second.fencing_token
    third.release()


def test_fence_counter_has_idle_ttl_bounding_memory(backend, prefix):
    _, c = backend
    locks = RedisLocks(c, prefix=prefix, fence_idle_ttl=3600)
    locks.acquire("mem", ttl=1).lease.release()
    k = lease_key(locks, "mem")
    assert 3500_000 < c.pttl(k) <= 3600_000  # the key (and its fence) go once idle
    assert locks.holder("mem") is None  # the lease is gone at release
    assert c.hexists(k, "x") == 0 and c.hexists(k, "h") == 0
    assert c.exists(k + ":signal") == 0  # nobody waited: no signal
    holder = locks.acquire("mem", ttl=5).lease
    assert not locks.acquire("mem", ttl=1, wait=0.05).acquired  # a waiter came and gave up
    now_ms = int(c.time()[0]) * 1000 + int(c.time()[1]) // 1000
    assert 0 < int(c.hget(k, "w")) - now_ms <= 1_100  # its mark outlives its wait by 1 s
    holder.release()
    assert 0 < c.pttl(k + ":signal") <= 10_000  # the release signal expires by itself


# -- 3. renew / release compare the owner token ---------------------------------------------------


def test_stale_owner_cannot_renew_or_release_newer_lease(locks):
    old = locks.acquire("stale", ttl=0.2).lease
    time.sleep(0.3)
    new = locks.acquire("stale", ttl=5).lease
    assert new.fencing_token > old.fencing_token
    assert old.renew() is False
    assert old.lost
    assert old.release() is False
    info = locks.holder("stale")
    assert info is not None and info.fencing_token == new.fencing_token
    assert info.ttl > 4
    assert new.release() is True


def test_renew_never_recreates_a_missing_lease(locks):
    lease = locks.acquire("gone", ttl=5).lease
    raw_client(locks).delete(lease_key(locks, "gone"))
    assert lease.renew(10) is False
    assert lease.lost
    assert raw_client(locks).exists(lease_key(locks, "gone")) == 0
    assert locks.holder("gone") is None


def test_renew_extends_and_release_frees(locks):
    lease = locks.acquire("r", ttl=0.5).lease
    assert lease.renew(5) is True
    assert lease.expires_at > time.time() + 4
    assert locks.holder("r").ttl > 4
    assert lease.release() is True
    assert not lease.lost and lease.released
    assert locks.holder("r") is None
    assert lease.release() is False  # already released: no second effect
    with pytest.raises(LeaseLost):
        lease.ensure_held()


def test_lease_context_manager_releases(locks):
    with locks.acquire("cm", ttl=5).lease as lease:
        assert locks.holder("cm").fencing_token == lease.fencing_token
    assert locks.holder("cm") is None


def test_ensure_held_verify_asks_redis(locks):
    lease = locks.acquire("verify", ttl=5).lease
    lease.ensure_held(verify=True)
    raw_client(locks).hset(lease_key(locks, "verify"), "o", "someone-else")
    lease.ensure_held()  # local knowledge only: still looks held
    with pytest.raises(LeaseLost):
        lease.ensure_held(verify=True)
    assert lease.lost


# -- 5. bounded waits that wake on release -------------------------------------------------------


def test_wait_is_bounded(locks):
    holder = locks.acquire("busy", ttl=30).lease
    started = time.monotonic()
    acq = locks.acquire("busy", ttl=5, wait=0.5)
    took = time.monotonic() - started
    assert not acq.acquired and acq.reason == "wait_timeout"
    # never early; late only by scheduling noise (the holder's 30 s TTL is the alternative)
    assert 0.5 <= took < 1.0, took
    holder.release()


def test_waiter_wakes_on_release_not_by_polling(backend, prefix):
    _, c = backend
    locks = RedisLocks(c, prefix=prefix, poll_interval=1.0)
    waiter_locks = RedisLocks(c, prefix=prefix, poll_interval=1.0)
    gaps = []
    for _ in range(5):
        holder = locks.acquire("handoff", ttl=30).lease
        got = {}

        def wait_for_it(got=got):
            acq = waiter_locks.acquire("handoff", ttl=5, wait=5)
            got["at"] = time.monotonic()
            got["lease"] = acq.lease

        t = threading.Thread(target=wait_for_it)
        t.start()
        time.sleep(0.3)  # waiter is blocked, its fallback poll (1 s) far away
        holder.release()
        released_at = time.monotonic()
        t.join(5)
        assert got["lease"] is not None
        gaps.append(got["at"] - released_at)
        assert got["lease"].fencing_token > holder.fencing_token
        got["lease"].release()
    # polling (1 s here) would make every gap about 0.7 s; the release signal makes them milliseconds
    assert sorted(gaps)[2] < 0.1 and max(gaps) < 0.5, gaps


def test_waiter_wakes_when_holder_expires(locks):
    locks.acquire("expiring", ttl=0.3)  # never released
    started = time.monotonic()
    acq = locks.acquire("expiring", ttl=5, wait=3)
    took = time.monotonic() - started
    assert acq.acquired
    assert took < 0.8, took  # the default 1 s poll would take >= 1 s
    acq.lease.release()


def test_wait_longer_than_socket_timeout(redis_url, prefix):
    c = redis.Redis.from_url(redis_url, socket_timeout=0.3)
    locks = RedisLocks(c, prefix=prefix, poll_interval=5.0)
    holder = locks.acquire("slow", ttl=30).lease
    threading.Timer(1.2, holder.release).start()
    started = time.monotonic()
    acq = locks.acquire("slow", ttl=5, wait=3)
    took = time.monotonic() - started
    assert acq.acquired, acq
    assert 1.1 < took < 2.0, took  # poll_interval is 5 s: only the release signal wakes it this early
    acq.lease.release()
    c.close()


# -- 6. restore and the one-shot claim -------------------------------------------------------------


def test_restore_invents_nothing(locks):
    lease = locks.acquire("persist", ttl=5).lease
    bare = locks.restore("persist", lease.owner_token, ttl=5)
    assert bare.fencing_token is None and bare.expires_at is None
    full = locks.restore(
        "persist", lease.owner_token, ttl=5, expires_at=lease.expires_at, fencing_token=lease.fencing_token
    )
    assert full.fencing_token == lease.fencing_token and full.expires_at == lease.expires_at
    assert bare.renew(8) is True  # Redis checks the token: the real one works
    assert locks.holder("persist").ttl > 7
    assert full.release() is True


@pytest.mark.parametrize("expires_at", [float("nan"), float("inf"), True, "soon", 10**400])
def test_restore_refuses_an_expiry_that_is_no_instant(locks, expires_at):
    """``expires_at=nan`` / ``inf`` were taken, and the restored lease's local deadline never
    came (``ensure_held()`` passed forever); ``"soon"`` was a bare TypeError. As a handle's
    ``expires`` (parse_handle) is checked: a ConfigError."""
    with pytest.raises(ConfigError, match="expires_at must be a finite number"):
        locks.restore("persist", "owner-token-of-some-length", ttl=5, expires_at=expires_at)


def test_forged_owner_token_can_neither_renew_nor_release(locks):
    lease = locks.acquire("forge", ttl=5).lease
    forged = locks.restore("forge", "not-the-owner-token", ttl=60)
    assert forged.renew() is False
    assert forged.release() is False
    info = locks.holder("forge")
    assert info.fencing_token == lease.fencing_token and info.ttl <= 5
    assert lease.release() is True


def test_claim_swaps_owner_keeps_fence_and_is_one_shot(locks):
    original = locks.acquire("retry", ttl=5, holder={"task_id": "t1"}).lease
    persisted = original.owner_token
    outcomes = []
    barrier = threading.Barrier(6)

    def claimer():
        barrier.wait()
        outcomes.append(locks.claim("retry", persisted, ttl=7, holder={"task_id": "t1", "attempt": 2}))

    threads = [threading.Thread(target=claimer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [o for o in outcomes if o.acquired]
    assert len(won) == 1
    assert all(o.reason == "not_owner" for o in outcomes if not o.acquired)
    claimed = won[0].lease
    assert claimed.fencing_token == original.fencing_token
    assert claimed.owner_token != persisted
    assert locks.holder("retry").holder["attempt"] == 2
    assert locks.holder("retry").ttl > 6
    assert original.renew() is False  # the persisted token stopped working at once
    assert claimed.release() is True


def test_claim_of_expired_lease_says_expired(locks):
    lease = locks.acquire("claimgone", ttl=0.1).lease
    time.sleep(0.2)
    acq = locks.claim("claimgone", lease.owner_token, ttl=5)
    assert not acq.acquired and acq.reason == "expired"
    fresh = locks.acquire("claimgone", ttl=5).lease
    assert fresh.fencing_token > lease.fencing_token
    fresh.release()


# -- 7. holder metadata, never the owner token -----------------------------------------------------


def test_holder_reports_metadata_and_ttl_not_owner(locks):
    lease = locks.acquire("who", ttl=5, holder={"task": "sync", "task_id": "abc"}).lease
    info = locks.holder("who")
    assert info.holder["task"] == "sync" and info.holder["task_id"] == "abc"
    assert "host" in info.holder and "pid" in info.holder
    assert info.fencing_token == lease.fencing_token
    assert 4 < info.ttl <= 5
    assert abs(info.since - time.time()) < 5
    assert lease.owner_token not in repr(info)
    assert lease.owner_token not in str(info.holder)
    assert locks.holder("nobody") is None
    lease.release()


def test_bad_arguments_fail_early(locks):
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ConfigError):
            locks.acquire("x", ttl=bad)
    with pytest.raises(ConfigError):
        locks.acquire("x", ttl=1, wait=-1)
    with pytest.raises(ConfigError):
        locks.acquire("", ttl=1)
    with pytest.raises(ConfigError):
        locks.acquire("x", ttl=1, holder={"obj": object()})
    assert locks.holder("x") is None  # nothing was left locked


# -- 9. with_lease ---------------------------------------------------------------------------------


def test_with_lease_returns_value_and_releases(locks):
    assert locks.with_lease("wl", lambda lease: ("ran", lease.fencing_token > 0), ttl=5) == ("ran", True)
    assert locks.holder("wl") is None


def test_with_lease_skips_explicitly(locks):
    holder = locks.acquire("wl-held", ttl=5).lease
    ran = []
    out = locks.with_lease("wl-held", ran.append, ttl=5, task="reports.daily")
    assert isinstance(out, Skipped) and is_skipped(out) and not ran
    assert out.reason == "held" and out.task == "reports.daily" and out.holder_ttl > 4
    out = locks.with_lease("wl-held", ran.append, ttl=5, wait=0.2)
    assert out.reason == "wait_timeout" and not ran
    holder.release()


def test_with_lease_body_longer_than_ttl_keeps_lease(backend, prefix):
    _, c = backend
    locks = RedisLocks(c, prefix=prefix)
    other = RedisLocks(c, prefix=prefix)
    seen = []

    def body(lease):
        for _ in range(6):
            time.sleep(0.2)
            seen.append(other.acquire("long", ttl=1).acquired)
        return "done"

    assert locks.with_lease("long", body, ttl=0.3) == "done"
    assert seen == [False] * 6


def test_with_lease_lost_mid_body_raises_or_warns(locks):
    def body(lease):
        raw_client(locks).delete(lease_key(locks, "lostbody"))
        locks.acquire("lostbody", ttl=5)  # someone else takes over
        return 42

    with pytest.raises(LeaseLost):
        locks.with_lease("lostbody", body, ttl=5)
    raw_client(locks).delete(lease_key(locks, "lostbody"))
    assert locks.with_lease("lostbody", body, ttl=5, on_lost="warn") == 42


def test_with_lease_body_exception_propagates_unchanged(locks):
    class Boom(Exception):
        pass

    def body(lease):
        raw_client(locks).delete(lease_key(locks, "boom"))  # lease lost too: still Boom
        raise Boom("body failed")

    with pytest.raises(Boom, match="body failed"):
        locks.with_lease("boom", body, ttl=5)

    def body2(lease):
        raise Boom("again")

    with pytest.raises(Boom):
        locks.with_lease("boom", body2, ttl=5)
    assert locks.holder("boom") is None  # released after the failure


# -- 10. SCRIPT FLUSH is not "lost" ----------------------------------------------------------------


def test_script_flush_while_leases_held(backend, prefix):
    kind, c = backend
    locks = RedisLocks(c, prefix=prefix, renew_fraction=0.25)
    beating = locks.acquire("flush-hb", ttl=0.8, renew=True).lease
    manual = locks.acquire("flush-manual", ttl=5).lease
    nodes = [c] if kind == "standalone" else [redis.Redis(host=n.host, port=n.port) for n in c.get_primaries()]
    for n in nodes:
        n.script_flush()
    assert manual.renew(5) is True
    time.sleep(1.2)  # heartbeat renewals hit NOSCRIPT and reload
    assert not beating.lost
    assert locks.holder("flush-hb").ttl > 0.3
    for n in nodes:
        n.script_flush()
    assert manual.release() is True
    for n in nodes:
        n.script_flush()
    again = locks.acquire("flush-manual", ttl=5)
    assert again.acquired and again.lease.fencing_token > manual.fencing_token
    for n in nodes:
        n.script_flush()
    assert locks.holder("flush-hb") is not None
    assert beating.release() is True
    again.lease.release()
