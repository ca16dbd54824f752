"""The durability option (``replicas=``, ``replica_timeout=``) and Sentinel, with real processes.

A primary and a replica whose replication link runs through the suite's TCP proxy, so that it
can be cut (black-holed) while the primary answers: an acquisition with ``replicas=1`` is on the
replica when it returns, and is given back (reason ``"unreplicated"``) when the replica does not
acknowledge it in time — for leases, limit slots, claims, guarded runs and adapter guards.

Then a real failover (one primary, one replica, three sentinels, tests/sentinel_setup.py): with
the link cut, a lease taken with ``replicas=0`` is missing on the replica Sentinel promotes (the
control: this setup does lose leases), while with ``replicas=1`` the acquisition was refused
before the primary was killed. The >= 50-trial version is bench/failover.py.
"""

from __future__ import annotations

import time

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

from taskguard import ConfigError, RedisLocks, Skipped, from_env
from taskguard.cli import doctor_checks
from taskguard.redis_client import client_from_url

from .sentinel_setup import MASTER, PRIMARY_OPTS, acknowledged, run_trial
from .servers import RedisServer
from .tcp_proxy import TcpProxy


class Pair:
    """A primary and its replica, the replication link through a proxy."""

    def __init__(self) -> None:
        self.primary = RedisServer(extra=PRIMARY_OPTS).start()
        self.proxy = TcpProxy(self.primary.port, nodelay=True)
        self.replica = RedisServer(extra=("--replicaof", "127.0.0.1", str(self.proxy.port))).start()
        self.replica_client = redis.Redis(port=self.replica.port, socket_timeout=2)
        self.primary_client = redis.Redis(port=self.primary.port, socket_timeout=2, decode_responses=True)
        deadline = time.monotonic() + 10
        while self.replica_client.info("replication").get("master_link_status") != "up" or not acknowledged(
            self.primary.port
        ):
            assert time.monotonic() < deadline, "the replica did not sync"
            time.sleep(0.05)

    def locks(self, **opts) -> RedisLocks:
        return RedisLocks.from_url(self.primary.url, prefix="tgdurable", shutdown_timeout=0.5, **opts)

    def on_replica(self, locks: RedisLocks, key: str) -> bool:
        return self.replica_client.exists(locks.backend.lease_key(key)) == 1

    def close(self) -> None:
        self.replica_client.close()
        self.primary_client.close()
        self.proxy.close()
        self.replica.close()
        self.primary.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_an_acquisition_with_replicas_is_on_the_replica_when_it_returns(pair):
    locks = pair.locks(replicas=1)
    events = []
    locks.add_listener(events.append)
    try:
        for i in range(20):  # WAIT on the script's own connection: never an early answer
            acq = locks.acquire(f"k{i}", ttl=60)
            assert acq.acquired
            assert pair.on_replica(locks, f"k{i}")  # read on the replica right after: already there
            assert acq.lease.release()
        assert {e.status for e in events if e.kind == "acquire"} == {"acquired"}
    finally:
        locks.close()


def test_an_acquisition_no_replica_acknowledges_is_given_back_and_reported(pair):
    locks = pair.locks(replicas=1, replica_timeout=0.2)
    events = []
    locks.add_listener(events.append)
    try:
        pair.proxy.blackhole = True
        started = time.monotonic()
        acq = locks.acquire("job", ttl=60)
        took = time.monotonic() - started
        assert not acq.acquired and acq.reason == "unreplicated" and acq.lease is None
        assert took >= 0.2  # it waited replica_timeout for the replica
        assert locks.holders("job") == []  # given back on the primary
        assert [e.status for e in events if e.kind == "acquire"] == ["unreplicated"]
        # the same call with replicas=0 does not wait
        plain = locks.acquire("job", ttl=60, replicas=0)
        assert plain.acquired and plain.lease.fencing_token is not None
        assert plain.lease.release()
        # a limit slot is an acquisition too
        slot = locks.acquire("slots", ttl=60, limit=3)
        assert slot.reason == "unreplicated" and locks.holders("slots") == []
    finally:
        pair.proxy.blackhole = False
        locks.close()


class RoundRobinPool(redis.ConnectionPool):
    """Hands out the idle connection released longest ago (redis-py's pool: the latest), as a
    busy multi-threaded client's pool effectively does: a command sent on its own is then not on
    the connection of the command before it."""

    def get_connection(self, *args, **kwargs):
        with self._lock:
            idle = self._available_connections
            if len(idle) > 1:
                idle.insert(0, idle.pop())
        return super().get_connection(*args, **kwargs)


def test_the_wait_rides_the_connection_of_the_acquisition(pair):
    """WAIT counts what the replicas acknowledged of its own connection's writes (Redis 6.2; 7.x
    also waits for what it saw of others): sent apart from the acquisition, on whatever connection
    the pool hands out next, it could answer for another connection's older writes. With a pool
    that hands out the connection released longest ago, each connection's last command shows that
    the script and its WAIT went down one connection."""
    pool = RoundRobinPool(port=pair.primary.port, socket_timeout=2, client_name="tgwaitprobe")
    client = redis.Redis(connection_pool=pool)
    locks = RedisLocks(client, prefix="tgdurable", replicas=1)
    try:
        first, second = pool.get_connection(), pool.get_connection()
        for conn in (first, second):
            conn.send_command("PING")
            conn.read_response()
        pool.release(first)
        pool.release(second)
        held = []
        for i in range(4):  # (no release in between: a release is a script of its own)
            acq = locks.acquire(f"rr{i}", ttl=60)
            assert acq.acquired
            held.append(acq.lease)
            last = sorted(c["cmd"] for c in pair.primary_client.client_list() if c["name"] == "tgwaitprobe")
            assert not {"evalsha", "eval"} & set(last) and "wait" in last, last  # each script followed by WAIT
        for lease in held:
            assert lease.release()
        pair.proxy.blackhole = True
        acq = locks.acquire("rr-cut", ttl=60)
        assert not acq.acquired and acq.reason == "unreplicated"
    finally:
        pair.proxy.blackhole = False
        locks.close()
        client.close()


def test_a_claim_no_replica_acknowledges_is_given_back(pair):
    locks = pair.locks(replicas=1)
    try:
        lease = locks.acquire("handed", ttl=60).lease
        assert lease is not None
        pair.proxy.blackhole = True
        claim = locks.claim("handed", lease.owner_token, ttl=60)
        assert not claim.acquired and claim.reason == "unreplicated"
        assert locks.holders("handed") == []  # the claimed lease was released, not left behind
        assert locks.claim("handed", lease.owner_token, ttl=60, replicas=0).reason == "expired"  # the token is spent
        pair.proxy.blackhole = False
        again = locks.acquire("handed", ttl=60)
        assert again.acquired and pair.on_replica(locks, "handed")
        assert again.lease.fencing_token > lease.fencing_token
        assert again.lease.release()
    finally:
        pair.proxy.blackhole = False
        locks.close()


def test_a_slot_claim_is_a_lease_record_waited_for_like_an_acquisition(pair):
    """Beat's and rq-cron's slot claims are lease records of the leader lease: with replicas=1 a
    claim the replica did not acknowledge raises (the scheduler tries again in a second, and
    publishes only once a claim is on the replica)."""
    from taskguard import LeaseBackendError, Unreplicated
    from taskguard.schedule.claims import claim, read_record

    locks = pair.locks(replicas=1)
    try:
        leader = locks.acquire("beat-leader:failover", ttl=60).lease
        assert leader is not None
        first = claim(leader, "report", 100.0, "beat-a", read_record(locks, "beat-leader:failover", "report"))
        assert first is not None
        assert pair.replica_client.hget(locks.backend.lease_key("beat-leader:failover"), "d:slot:report") is not None
        pair.proxy.blackhole = True
        with pytest.raises(Unreplicated, match=r"not replicated in time.*acknowledged by 0 of the 1 replicas"):
            claim(leader, "report", 160.0, "beat-a", read_record(locks, "beat-leader:failover", "report"))
        assert issubclass(Unreplicated, LeaseBackendError)  # (what callers catching outages reach)
        pair.proxy.blackhole = False
        plain = pair.locks()  # replicas=0: records are not waited for
        try:
            pair.proxy.blackhole = True
            held = plain.acquire("beat-leader:plain", ttl=60).lease
            assert held.put_record("slot:report", "1.0 claimed 1 beat-b")
        finally:
            pair.proxy.blackhole = False
            plain.close()
    finally:
        pair.proxy.blackhole = False
        locks.close()


def test_a_scheduler_reports_an_unacknowledged_claim_or_lead_as_unreplicated_not_as_an_outage(pair, caplog):
    """A periodic scheduler (beat's and rq-cron's core) with replicas=1: a slot claim, then the
    leader lease itself, that the replica does not acknowledge is logged as such and counted in
    ``stats["unreplicated"]``, the slot tried again in a second and published once the replica is
    back. Before, both read "Redis unreachable" (an outage Redis never had) and "unknown leads"."""
    import logging

    from taskguard.clock import FixedClock
    from taskguard.schedule import PeriodicEntry, PeriodicScheduler, schedule_settings
    from taskguard.schedule.slots import Interval

    from .test_schedule_core import NAMES, ListAdapter

    locks = pair.locks(replicas=1)
    now = [1_000_000.5]
    settings = schedule_settings(NAMES, leader_ttl=30, default_name="durable", loop_interval=1.0)
    adapter = ListAdapter([PeriodicEntry("e", Interval(10))])
    s = PeriodicScheduler(locks, settings, adapter=adapter, clock=FixedClock(lambda: now[0]), role="sched")
    caplog.set_level(logging.INFO, logger="taskguard")
    try:
        s.tick()  # leads; the start's window is not published
        assert s.lease is not None
        now[0] = 1_000_010.2
        pair.proxy.blackhole = True
        s.tick()
        assert adapter.published == [] and s.stats["unreplicated"] == 1 and s.stats["redis_errors"] == 0
        assert "slot every10s:100001 was not acknowledged by the replicas in time" in caplog.text
        assert "unreachable" not in caplog.text
        pair.proxy.blackhole = False
        deadline = time.monotonic() + 10
        while not adapter.published and time.monotonic() < deadline:
            now[0] += 0.5  # (the scheduler's clock) tried again in a second, within the catch-up window
            s.tick()
            time.sleep(0.2)
        assert [h["slot"] for h in adapter.published] == ["every10s:100001"]
        s.lease.release()
        s.lease = None
        pair.proxy.blackhole = True
        caplog.clear()
        s.tick()
        assert s.lease is None and s.stats["unreplicated"] == 2
        assert "the replicas did not acknowledge it in time" in caplog.text and "unknown" not in caplog.text
    finally:
        pair.proxy.blackhole = False
        s.close()
        locks.close()


def test_a_guarded_run_is_skipped_with_reason_unreplicated(pair):
    locks = pair.locks(replicas=1)
    skips = []
    locks.add_listener(lambda e: skips.append(e.status) if e.kind == "skip" else None)
    try:
        assert locks.with_lease("body", lambda lease: "ran", ttl=30) == "ran"
        pair.proxy.blackhole = True
        out = locks.with_lease("body", lambda lease: "ran", ttl=30)
        assert isinstance(out, Skipped) and out.reason == "unreplicated"
        assert skips == ["unreplicated"]
    finally:
        pair.proxy.blackhole = False
        locks.close()


def test_an_rq_guard_takes_its_own_replicas_option(pair):
    """The per-guard option, through the adapter's pipeline: the locks ask for none, the guard
    for one."""
    from taskguard_rq import guarded_job

    locks = pair.locks()
    try:
        durable = guarded_job(name="failover.durable", locks=locks, replicas=1, replica_timeout=0.05)(lambda: "ran")
        plain = guarded_job(name="failover.plain", locks=locks)(lambda: "ran")
        assert durable() == "ran" and plain() == "ran"
        pair.proxy.blackhole = True
        skipped = durable()
        assert isinstance(skipped, Skipped) and skipped.reason == "unreplicated"
        assert plain() == "ran"
        raising = guarded_job(name="failover.raising", locks=locks, replicas=1, on_skip="raise")(lambda: "ran")
        with pytest.raises(Exception, match="unreplicated"):
            raising()
    finally:
        pair.proxy.blackhole = False
        locks.close()


def test_doctor_reports_the_replicas_and_whether_the_option_can_be_met(pair):
    locks = pair.locks(replicas=1)
    try:
        checks = {c["name"]: c for c in doctor_checks(locks)}
        assert checks["replicas"]["status"] == "ok" and checks["replicas"]["detail"].startswith("1 connected")
        assert checks["durability"]["status"] == "ok", checks["durability"]
        pair.proxy.blackhole = True
        checks = {c["name"]: c for c in doctor_checks(locks)}
        assert checks["durability"]["status"] == "fail" and "cannot be met" in checks["durability"]["detail"]
    finally:
        pair.proxy.blackhole = False
        locks.close()
    two = pair.locks(replicas=2)
    try:
        assert {c["name"]: c for c in doctor_checks(two)}["durability"]["status"] == "fail"
    finally:
        two.close()


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"replicas": -1}, "replicas must be an int from 0 to 16"),
        ({"replicas": True}, "replicas must be an int"),
        ({"replicas": 1, "replica_timeout": 0}, "replica_timeout"),
        ({"replicas": 1, "replica_timeout": 61}, "at most 60"),
        ({"replicas": 1, "replica_timeout": 5}, "below the client's socket_timeout"),
    ],
)
def test_bad_durability_options_are_config_errors(redis_url, opts, match):
    with pytest.raises(ConfigError, match=match):
        RedisLocks(redis.Redis.from_url(redis_url, socket_timeout=5), **opts)


def test_a_replica_timeout_per_call_or_per_guard_is_checked_against_the_socket_timeout(redis_url, prefix):
    """A ``replica_timeout`` given to one call (or a guard's, which reaches the call) above the
    client's socket timeout would let the socket time out during ``WAIT``: a Redis error instead
    of ``"unreplicated"``, with the lease left held to its TTL. It is refused before anything is
    sent, on the acquisition, a claim and a guarded run."""
    from taskguard.run import GuardedRun

    client = redis.Redis.from_url(redis_url, socket_timeout=1)
    locks = RedisLocks(client, prefix=prefix)
    try:
        with pytest.raises(ConfigError, match=r"replica_timeout \(2.0 s\) must be below the client's socket_timeout"):
            locks.acquire("k", ttl=5, replicas=1, replica_timeout=2.0)
        assert locks.holder("k") is None
        lease = locks.acquire("k", ttl=5).lease
        with pytest.raises(ConfigError, match="below the client's socket_timeout"):
            locks.claim("k", lease.owner_token, ttl=5, replicas=1, replica_timeout=1.0)
        assert locks.claim("k", lease.owner_token, ttl=5).acquired  # the token was not spent
        run = GuardedRun(locks, "g", ttl=5, replicas=1, replica_timeout=1.5)
        with pytest.raises(ConfigError, match="below the client's socket_timeout"):
            run.begin()
        assert locks.holder("g") is None
    finally:
        client.close()


def test_a_guard_checks_its_durability_options_at_declaration():
    from taskguard_rq import guarded_job

    with pytest.raises(ConfigError, match=r"unknown option 'replica'; did you mean 'replicas'\?"):
        guarded_job(name="failover.j", replica=1)(lambda: None)
    with pytest.raises(ConfigError, match=r"job 'failover.j': replicas must be an int from 0 to 16"):
        guarded_job(name="failover.j", replicas=17)(lambda: None)
    with pytest.raises(ConfigError, match=r"job 'failover.j': replica_timeout"):
        guarded_job(name="failover.j", replica_timeout=-1)(lambda: None)


def test_replicas_on_a_cluster_client_are_a_config_error(cluster, prefix):
    client = ClusterClient(host="127.0.0.1", port=cluster.ports[0])
    try:
        with pytest.raises(ConfigError, match="RedisCluster sends WAIT to an arbitrary node"):
            RedisLocks(client, prefix=prefix, replicas=1)
        locks = RedisLocks(client, prefix=prefix)
        with pytest.raises(ConfigError, match="RedisCluster sends WAIT to an arbitrary node"):
            locks.acquire("k", ttl=5, replicas=1)
        assert locks.acquire("k", ttl=5).lease.release()
    finally:
        client.close()


def test_a_sentinel_url_needs_its_master_name_and_never_shows_a_password():
    url = "sentinel://:Q9secretpw@127.0.0.1:26379;sentinel://127.0.0.1:26380"
    with pytest.raises(ConfigError, match="TASKGUARD_SENTINEL_MASTER") as info:
        from_env({"TASKGUARD_REDIS_URL": url})
    assert "Q9secretpw" not in str(info.value) and "***" in str(info.value)
    with pytest.raises(ConfigError, match="not a sentinel:// URL"):
        from_env({"TASKGUARD_REDIS_URL": "redis://127.0.0.1:6379/0", "TASKGUARD_SENTINEL_MASTER": "m"})
    client = client_from_url(url, sentinel_master="tgm", sentinel_password="Q9sentinelpw")
    pool = client.connection_pool
    assert pool.service_name == "tgm" and pool.connection_kwargs["password"] == "Q9secretpw"
    assert [(c.connection_pool.connection_kwargs["port"]) for c in pool.sentinel_manager.sentinels] == [26379, 26380]
    assert pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs["password"] == "Q9sentinelpw"
    assert "Q9secretpw" not in repr(RedisLocks(client))


@pytest.mark.parametrize("replicas", [0, 1])
def test_a_failover_loses_a_lease_unless_a_replica_acknowledged_it(replicas):
    """Cut the link, acquire, SIGKILL the primary, let Sentinel promote the replica, look on it."""
    trial, _ = run_trial(replicas)
    assert trial.control_on_promoted  # a lease WAITed for before the cut survives: the setup replicates
    if replicas == 0:
        # the control: the body would have started, and the promoted primary has no such lease,
        assert trial.acquired and not trial.on_promoted and trial.lost
        # so a second holder gets in through Sentinel (the next command reaches the new primary);
        # the fence floor still gives it a larger token
        assert trial.second and trial.fences[1] > trial.fences[0]
    else:
        # refused before the kill: no body ran on a lease that is now gone
        assert not trial.acquired and trial.reason == "unreplicated" and not trial.lost
        assert not trial.on_promoted
        # the promoted primary has no replica: its own WAIT refuses a new durable acquisition
        assert not trial.second and trial.second_reason == "unreplicated"
    assert MASTER  # (the sentinels' name for the primary, used by the trial)


def _body():
    return None


def test_celery_reads_the_sentinel_and_durability_settings():
    from celery import Celery

    from taskguard_celery import GuardedTask, guarded_task
    from taskguard_celery.config import locks_for

    app = Celery("failover", set_as_current=False)
    app.conf.taskguard_redis_url = "sentinel://:Q9secretpw@127.0.0.1:26379;sentinel://127.0.0.1:26380"
    with pytest.raises(ConfigError, match="app.conf.taskguard_sentinel_master") as info:
        locks_for(app)
    assert "Q9secretpw" not in str(info.value)
    app.conf.taskguard_sentinel_master = "tgm"
    app.conf.taskguard_sentinel_password = "Q9sentinelpw"
    app.conf.taskguard_replicas = 1
    app.conf.taskguard_replica_timeout = 0.25
    locks = locks_for(app)
    assert (locks.replicas, locks.replica_timeout) == (1, 0.25)
    assert locks.client.connection_pool.service_name == "tgm"
    bad = Celery("failover-bad", set_as_current=False)
    bad.conf.taskguard_redis_url = "redis://127.0.0.1:6379/0"
    bad.conf.taskguard_replicas = 99
    with pytest.raises(ConfigError, match=r"app.conf.taskguard_replicas must be an int from 0 to 16"):
        locks_for(bad)
    with pytest.raises(ConfigError, match=r"unknown option 'replica_timout'; did you mean 'replica_timeout'\?"):
        guarded_task(name="failover.t", replica_timout=1)(_body)
    # (not shared: a shared task joins every app made later in the process, whose worker start
    # would check its replicas against that app's Redis)
    task = app.task(base=GuardedTask, shared=False, name="failover.t2", replicas=2, replica_timeout=0.5)(_body)
    assert (task.taskguard_options.replicas, task.taskguard_options.replica_timeout) == (2, 0.5)
