"""The per-process heartbeat: pipelined renewals, fork, lost leases, max_hold."""

from __future__ import annotations

import os
import time

import redis

from taskguard import RedisLocks, scripts
from taskguard.heartbeat import get_heartbeat


class CountingRedis(redis.Redis):
    """A real client that counts direct commands and pipeline executions by the heartbeat."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.direct: list[str] = []
        self.pipelines: list[list[str]] = []

    def execute_command(self, *args, **options):
        self.direct.append(str(args[0]))
        return super().execute_command(*args, **options)

    def pipeline(self, transaction=True, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        outer = self
        original = pipe.execute

        def execute(raise_on_error=True):
            outer.pipelines.append([str(c[0][0]) for c in pipe.command_stack])
            return original(raise_on_error)

        pipe.execute = execute
        return pipe


def test_heartbeat_renews_all_leases_in_one_pipelined_round_trip(redis_url, prefix):
    c = CountingRedis.from_url(redis_url, client_name=f"hb-{prefix}")
    c.script_load(scripts.RENEW.source)  # cached, as after any earlier renewal (a flush is tested elsewhere)
    locks = RedisLocks(c, prefix=prefix, renew_fraction=0.25)
    # (TTL 2.4 s: renewed every 0.6 s, and leases falling due within 0.15 s share a round; the 40
    # acquisitions must fit in that even on a loaded machine, for all 40 to share every round)
    leases = [locks.acquire(f"hb{i}", ttl=2.4, renew=True).lease for i in range(40)]
    c.direct.clear()
    beats_before = get_heartbeat().beats
    mon = redis.Redis.from_url(redis_url)
    script_exists = 0
    with mon.monitor() as m:
        time.sleep(3.0)  # > 1 TTL: without renewal every lease would be gone
        c.ping()  # the end marker (sent on whichever pooled connection is free: a new one while a
        # heartbeat round holds the other, so the connections are listed after it)
        ours = {f"{x['addr']}" for x in mon.client_list() if x.get("name") == f"hb-{prefix}"}
        for cmd in m.listen():
            mine = f"{cmd.get('client_address')}:{cmd.get('client_port')}" in ours
            if mine and cmd["command"].upper().startswith("SCRIPT"):
                script_exists += 1
            if mine and cmd["command"].upper() == "PING":
                break
    mon.close()
    assert ours  # the filter saw our connections
    assert [d for d in c.direct if d != "PING"] == []  # no renewal sent outside a pipeline
    assert all(locks.holder(f"hb{i}") is not None for i in range(40))
    assert not any(lease.lost for lease in leases)
    assert script_exists == 0
    rounds = get_heartbeat().beats - beats_before
    assert len(c.pipelines) >= 4
    # one pipeline per heartbeat round, each carrying every due lease (leases acquired together
    # fall due together), all EVALSHA
    assert len(c.pipelines) <= rounds
    assert all(set(p) == {"EVALSHA"} for p in c.pipelines)
    assert max(len(p) for p in c.pipelines) == 40
    for lease in leases:
        assert lease.release()


def test_failed_renewal_marks_one_lease_lost_and_keeps_serving_others(redis_url, prefix):
    c = redis.Redis.from_url(redis_url)
    events = []
    locks = RedisLocks(c, prefix=prefix, renew_fraction=0.25, listeners=[events.append])
    a = locks.acquire("a", ttl=0.6, renew=True).lease
    b = locks.acquire("b", ttl=0.6, renew=True).lease
    victim = locks.acquire("victim", ttl=0.6, renew=True).lease
    called = []
    victim.on_lost(lambda lease, reason: called.append(reason))
    c.hset("{" + prefix + ":victim}", "o", "taken-over")  # another owner now
    time.sleep(0.6)
    assert victim.lost and called
    assert [e for e in events if e.kind == "lost" and e.key == "victim"]
    time.sleep(1.5)
    assert not a.lost and not b.lost
    assert locks.holder("a") is not None and locks.holder("b") is not None
    assert get_heartbeat().alive
    assert a.release() and b.release()
    assert victim.release() is False


def test_max_hold_stops_renewing_a_hung_body(redis_url, prefix):
    c = redis.Redis.from_url(redis_url)
    events = []
    locks = RedisLocks(c, prefix=prefix, renew_fraction=0.25, listeners=[events.append])
    hung = locks.acquire("hung", ttl=0.4, renew=True, max_hold=0.6).lease
    healthy = locks.acquire("healthy", ttl=0.4, renew=True).lease
    time.sleep(0.5)
    assert locks.holder("hung") is not None  # renewed past its first TTL
    time.sleep(1.0)
    assert locks.holder("hung") is None
    assert hung.lost
    assert any(e.kind == "renew" and e.status == "max_hold" and e.key == "hung" for e in events)
    assert locks.holder("healthy") is not None
    healthy.release()


def test_fork_child_drops_inherited_leases_and_runs_its_own_heartbeat(redis_url, prefix):
    c = redis.Redis.from_url(redis_url)
    locks = RedisLocks(c, prefix=prefix, renew_fraction=0.25)
    parent_lease = locks.acquire("inherited", ttl=0.6, renew=True).lease
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            hb = get_heartbeat()
            checks = [
                len(hb) == 0,  # fresh heartbeat, inherited leases dropped
                parent_lease.inherited,
                parent_lease.release() is False,  # never releases the parent's lease
                parent_lease.renew() is False,  # nor renews it
            ]
            own = locks.acquire("child-own", ttl=0.6, renew=True).lease
            time.sleep(1.5)  # child's own heartbeat keeps it alive
            checks.append(locks.holder("child-own") is not None and not own.lost)
            checks.append(get_heartbeat().alive)
            checks.append(own.release() is True)
            os.write(w, bytes(int(x) for x in checks))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    checks = list(os.read(r, 64))
    os.close(r)
    assert status == 0 and checks == [1] * 7, checks
    # the parent's lease survived the child and is still renewed by the parent
    time.sleep(0.7)
    assert not parent_lease.lost
    assert locks.holder("inherited") is not None
    assert parent_lease.release() is True


def test_renewals_go_out_in_batches_of_at_most_1000(redis_url, prefix):
    """10,000 leases must not hold Redis in one burst: a round is split into pipelines of 1000."""
    c = CountingRedis.from_url(redis_url)
    locks = RedisLocks(c, prefix=prefix)
    leases = [locks.acquire(f"b{i}", ttl=30).lease for i in range(2500)]
    c.pipelines.clear()
    outcomes = locks.backend.renew_many([(lease.key, lease.owner_token, 30.0) for lease in leases])
    assert outcomes == [True] * 2500
    assert [len(p) for p in c.pipelines] == [1000, 1000, 500]
    for lease in leases:
        lease.release()


def test_short_leases_do_not_wake_the_heartbeat_thread_each(redis_url, prefix):
    """A lease taken and released long before its first renewal (a short task) must not cost a
    thread wake-up: the idle thread sleeps as long as the latest lease's renew interval."""
    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix)
    hb = get_heartbeat()
    locks.acquire("warm", ttl=60, renew=True).lease.release()
    time.sleep(0.2)  # the thread has woken for the first lease and gone idle
    before = hb.wakeups
    for i in range(200):  # a no-op body: released before the woken thread could see the lease
        lease = locks.acquire(f"short{i}", ttl=60, renew=True).lease
        assert lease.release()
    assert hb.wakeups - before <= 2, hb.wakeups - before
    # a lease with a shorter interval than the idle sleep still wakes it, and is renewed in time
    lease = locks.acquire("quick", ttl=0.9, renew=True).lease
    time.sleep(2.0)  # > 2 TTLs
    assert not lease.lost and locks.holder("quick") is not None
    assert lease.release()
    locks.close()
    client.close()


def test_renewal_cadence_does_not_drift_by_the_round_trip(redis_url, prefix):
    """Renewals fall due one interval after the previous round was sent, not after its answer
    came back: behind a slow link (80 ms each way) the gaps stay at the interval."""
    from urllib.parse import urlsplit

    from .tcp_proxy import TcpProxy

    parts = urlsplit(redis_url)
    proxy = TcpProxy(parts.port or 6379, parts.hostname or "127.0.0.1")
    client = redis.Redis.from_url(proxy.url.replace("/0", parts.path or "/0"))
    renewed: list[float] = []
    locks = RedisLocks(
        client,
        prefix=prefix,
        renew_fraction=0.5,
        listeners=[lambda e: renewed.append(time.monotonic()) if e.kind == "renew" and e.status == "renewed" else None],
    )
    client.ping()  # the pool's connection (the heartbeat's pipelines use it) is set up before the delay
    lease = locks.acquire("cadence", ttl=2.0, renew=True).lease  # renewed every 1 s
    proxy.delay = 0.08
    time.sleep(5.5)
    proxy.delay = 0.0
    assert not lease.lost, (lease.lost_reason, renewed)
    assert lease.release()
    gaps = sorted(b - a for a, b in zip(renewed, renewed[1:], strict=False))
    assert len(gaps) >= 3, renewed
    median = gaps[len(gaps) // 2]
    # anchored at the answer instead, each gap would be 1 s + the round trip (>= 0.16 s here)
    assert median < 1.1, gaps
    locks.close()
    client.close()
    proxy.close()


def test_an_on_lost_callback_that_cannot_take_lease_and_reason_is_refused_when_registered(redis_url, prefix):
    """A one-argument callback used to register, then fail unseen (a TypeError logged by the
    heartbeat) when the lease was lost. Now it is a ConfigError at once; a callback taking
    ``(lease, reason)`` (or ``*args``) is called with this lease and a reason string."""
    import pytest

    from taskguard import ConfigError

    c = redis.Redis.from_url(redis_url)
    locks = RedisLocks(c, prefix=prefix, renew_fraction=0.25)
    lease = locks.acquire("cb", ttl=0.6, renew=True).lease
    for bad in (lambda lease: None, lambda: None, lambda a, b, c: None, "not callable"):
        with pytest.raises(ConfigError, match="on_lost callback"):
            lease.on_lost(bad)
    seen = []
    lease.on_lost(lambda got, reason: seen.append((got, reason)))
    lease.on_lost(lambda *args: seen.append(args))
    c.hset("{" + prefix + ":cb}", "o", "taken-over")  # another owner now
    deadline = time.monotonic() + 3
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(got is lease, isinstance(reason, str) and reason != "") for got, reason in seen] == [(True, True)] * 2
