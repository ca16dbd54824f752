"""The durability option's checks and reports, with a primary and a replica whose replication
link can be cut: ``replica_timeout`` against the client's socket timeout (where ``WAIT`` is sent,
when locks are made, when a guard is declared with its locks), the default socket timeout redis-py 8
applies to a client made from a URL, and what a periodic scheduler reports when the replicas do not
acknowledge its claims or its leader lease. Redis ends a ``WAIT`` on its event-loop tick (``hz`` 10:
up to ~100 ms late; measured 453-502 ms for ``WAIT 1 450``), hence the margin."""

from __future__ import annotations

import pytest

from taskguard import ConfigError, LeaseBackendError, MemoryLocks, RedisLocks, Skipped

from .test_failover import Pair


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def _locks(pair: Pair, **opts) -> RedisLocks:
    return RedisLocks.from_url(pair.primary.url, prefix="tgdurable", shutdown_timeout=0.5, **opts)


def test_a_replica_timeout_within_the_margin_of_the_socket_timeout_is_refused_and_one_outside_answers_unreplicated(
    pair,
):
    """socket_timeout=0.5, replica_timeout=0.49: before, accepted, and with the link cut each
    acquisition raised a socket timeout and left its lease held to its TTL. Now refused when the
    locks are made (and per call); with socket_timeout=1.0 and replica_timeout=0.5 (the margin
    kept), each of 5 acquisitions answers "unreplicated" with nothing held."""
    with pytest.raises(ConfigError, match=r"below the client's socket_timeout \(0.5 s\) by at least 0.5 s"):
        _locks(pair, socket_timeout=0.5, replicas=1, replica_timeout=0.49)
    plain = _locks(pair, socket_timeout=0.5)  # no replicas asked for: no check
    try:
        with pytest.raises(ConfigError, match="by at least 0.5 s"):
            plain.acquire("near", ttl=60, replicas=1, replica_timeout=0.49)
        assert plain.holders("near") == []
    finally:
        plain.close()
    locks = _locks(pair, socket_timeout=1.0, replicas=1, replica_timeout=0.5)
    outcomes = []
    try:
        warm = locks.acquire("warm", ttl=5)  # (the script cached, as on a server that has served a while)
        assert warm.acquired and warm.lease.release()
        pair.proxy.blackhole = True
        for i in range(5):
            try:
                acq = locks.acquire(f"near{i}", ttl=60)
                outcomes.append((acq.reason, len(locks.holders(f"near{i}"))))
            except LeaseBackendError as e:
                outcomes.append((f"error: {e}", len(locks.holders(f"near{i}"))))
    finally:
        pair.proxy.blackhole = False
        locks.close()
    assert outcomes == [("unreplicated", 0)] * 5


def test_a_guard_whose_replica_timeout_keeps_the_margin_skips_and_leaves_its_key_free(pair):
    """The per-guard option through the RQ adapter's pipeline, with the margin kept
    (socket_timeout 1.0, replica_timeout 0.5): with the link cut each run is skipped with reason
    "unreplicated" and the key left free. (0.49 against 0.5 raised a socket timeout and left the
    key locked for the lease's TTL; it is now refused when the job is declared with its locks.)"""
    from taskguard_rq import guarded_job

    locks = _locks(pair, socket_timeout=1.0)
    try:
        tight = _locks(pair, socket_timeout=0.5)
        try:
            with pytest.raises(ConfigError, match="job 'failover.near': replica_timeout"):
                guarded_job(name="failover.near", locks=tight, replicas=1, replica_timeout=0.49)(lambda: "ran")
        finally:
            tight.close()
        durable = guarded_job(name="failover.near", locks=locks, ttl=60, replicas=1, replica_timeout=0.5)(lambda: "ran")
        assert durable() == "ran"  # (the scripts cached, as on a server that has served a while)
        pair.proxy.blackhole = True
        outcomes = []
        for _ in range(3):
            try:
                out = durable()
            except LeaseBackendError as e:
                out = f"error: {e}"
            held = [h.holder for h in locks.holders("failover.near")]
            outcomes.append((out if not isinstance(out, Skipped) else out.reason, held))
        assert outcomes == [("unreplicated", [])] * 3
    finally:
        pair.proxy.blackhole = False
        locks.close()


def test_a_guard_declared_with_locks_refuses_a_replica_timeout_at_or_above_their_socket_timeout_when_declared(
    redis_url, prefix
):
    """``@guarded_job(locks=..., replicas=1, replica_timeout=2.0)`` on locks whose client has a
    1 s socket timeout: the locks are known at declaration, so the option can be refused there
    (as RedisLocks' own replica_timeout is refused when the locks are made). Before, it was
    accepted and every call of the job failed with the ConfigError at run time."""
    import redis

    from taskguard_rq import guarded_job

    client = redis.Redis.from_url(redis_url, socket_timeout=1)
    locks = RedisLocks(client, prefix=prefix)
    try:
        with pytest.raises(ConfigError, match="below the client's socket_timeout"):
            guarded_job(name="decl.too_long", locks=locks, replicas=1, replica_timeout=2.0)(lambda: "ran")
    finally:
        client.close()


def _body():  # (Celery makes a task of a named function: a lambda has no name to call it by)
    return "ran"


def test_a_celery_task_declared_with_locks_refuses_the_same_replica_timeout_when_declared(redis_url, prefix):
    """The same declaration on Celery — ``@guarded_task(locks=...)`` and
    ``@app.task(base=GuardedTask, locks=...)`` — was accepted (only the RQ adapter checked it),
    and every run failed with the ConfigError. Now the core's option check does it for both."""
    import redis
    from celery import Celery

    from taskguard_celery import GuardedTask, guarded_task

    client = redis.Redis.from_url(redis_url, socket_timeout=1)
    locks = RedisLocks(client, prefix=prefix)
    app = Celery("decl-durability", set_as_current=False)
    try:
        with pytest.raises(ConfigError, match="task 'decl.too_long': .*below the client's socket_timeout"):
            guarded_task(name="decl.too_long", locks=locks, replicas=1, replica_timeout=2.0)(_body)
        declare = app.task(  # (not shared: a task added to every app made later in this process)
            base=GuardedTask, name="decl.too_long_base", shared=False, locks=locks, replicas=1, replica_timeout=2.0
        )(_body)
        with pytest.raises(ConfigError, match="task 'decl.too_long_base': .*below the client's socket_timeout"):
            declare.name  # noqa: B018  (the app's task is made when first used)
        fits = app.task(base=GuardedTask, name="decl.fits", shared=False, locks=locks, replicas=1, replica_timeout=0.5)
        assert fits(_body).taskguard_options.replicas == 1
    finally:
        client.close()


@pytest.mark.parametrize("framework", ["celery", "rq"])
def test_a_guard_declared_with_locks_that_are_not_locks_is_refused_when_declared(framework):
    """``locks="redis://..."`` (a URL where a Locks object belongs) was accepted at declaration
    and failed on every run with an AttributeError; now a ConfigError naming the task."""
    if framework == "celery":
        from taskguard_celery import guarded_task as declare
    else:
        from taskguard_rq import guarded_job as declare
    with pytest.raises(ConfigError, match="decl.url_locks.*locks must be a taskguard.Locks, got str"):
        declare(name="decl.url_locks", locks="redis://127.0.0.1:6379/0")(_body)
    # the class where an instance belongs: a TypeError from inside the check before
    with pytest.raises(ConfigError, match="decl.class_locks.*must be a taskguard.Locks, got the class MemoryLocks"):
        declare(name="decl.class_locks", locks=MemoryLocks)(_body)


def test_a_celery_worker_stops_at_start_for_a_tasks_replica_timeout_its_apps_redis_cannot_wait(redis_url, prefix):
    """A task declared without ``locks=`` (the app's Redis, unknown at declaration) whose
    ``replica_timeout`` is at or above that client's socket timeout: the worker refuses to start
    (``worker_init``), naming the task — not a ConfigError on each of its runs."""
    import redis
    from celery import Celery

    from taskguard_celery import GuardedTask
    from taskguard_celery.pools import check_settings

    client = redis.Redis.from_url(redis_url, socket_timeout=1)
    app = Celery("start-durability", set_as_current=False)
    app.conf.taskguard_locks = RedisLocks(client, prefix=prefix)
    try:
        fits = app.task(base=GuardedTask, name="start.fits", shared=False, replicas=1, replica_timeout=0.5)(_body)
        assert fits.taskguard_options.replica_timeout == 0.5
        check_settings(app)  # every task fits
        app.task(base=GuardedTask, name="start.too_long", shared=False, replicas=1, replica_timeout=2.0)(_body)
        with pytest.raises(SystemExit, match="task 'start.too_long': .*below the client's socket_timeout"):
            check_settings(app)
    finally:
        client.close()


def test_the_check_sees_the_socket_timeout_redis_py_applies_to_a_client_made_from_a_url(pair):
    """``redis.Redis.from_url(url)`` with no ``socket_timeout``: redis-py 8 leaves it out of the
    pool's ``connection_kwargs`` but its connections time out reads after 5 s all the same.
    ``socket_timeout_of`` read ``None`` there, so ``replica_timeout=6`` passed the check (on the
    call, a guard or RedisLocks itself), and with the replication link cut the acquisition failed
    with "Timeout reading from socket" after 5 s, its lease held to its TTL. Now redis-py's default
    is seen and the call refused before anything is sent."""
    import redis

    client = redis.Redis.from_url(pair.primary.url)
    locks = RedisLocks(client, prefix="tgdurable", shutdown_timeout=0.5)
    try:
        assert client.connection_pool.get_connection().socket_timeout == 5  # what the connections use
        warm = locks.acquire("warm", ttl=5)
        assert warm.acquired and warm.lease.release()
        pair.proxy.blackhole = True
        try:
            acq = locks.acquire("url-client", ttl=120, replicas=1, replica_timeout=6.0)
            outcome = acq.reason
        except ConfigError:
            outcome = "refused"
        except LeaseBackendError as e:
            outcome = f"error: {e}"
        assert (outcome, locks.holders("url-client")) == ("refused", [])
    finally:
        pair.proxy.blackhole = False
        locks.close()
        client.close()


def test_a_slot_whose_claim_was_unreplicated_is_not_reported_as_republished(pair, caplog):
    """A claim the replica did not acknowledge raised Unreplicated and the slot was not
    published. When the scheduler tries again it finds its own claim record ("claimed") and
    reports "claimed but not confirmed published; publishing it again", counting
    ``stats["republished_slots"]`` — for a slot that was never published (the message is sent
    once): the operator reading the log or the stats was told of a double publish that did not
    happen. Now the scheduler knows its own unacknowledged claim and publishes it as a first
    publish."""
    import logging
    import time

    from taskguard.clock import FixedClock
    from taskguard.schedule import PeriodicEntry, PeriodicScheduler, schedule_settings
    from taskguard.schedule.slots import Interval

    from .test_schedule_core import NAMES, ListAdapter

    locks = _locks(pair, replicas=1)
    now = [1_000_000.5]
    settings = schedule_settings(NAMES, leader_ttl=30, default_name="durable-rep", loop_interval=1.0)
    adapter = ListAdapter([PeriodicEntry("e", Interval(10))])
    s = PeriodicScheduler(locks, settings, adapter=adapter, clock=FixedClock(lambda: now[0]), role="sched")
    caplog.set_level(logging.INFO, logger="taskguard")
    try:
        s.tick()
        assert s.lease is not None
        now[0] = 1_000_010.2
        pair.proxy.blackhole = True
        s.tick()
        assert adapter.published == [] and s.stats["unreplicated"] == 1
        pair.proxy.blackhole = False
        deadline = time.monotonic() + 10
        while not adapter.published and time.monotonic() < deadline:
            now[0] += 0.5
            s.tick()
            time.sleep(0.2)
        assert [h["slot"] for h in adapter.published] == ["every10s:100001"]
        assert (s.stats["republished_slots"], "publishing it again" in caplog.text) == (0, False)
    finally:
        pair.proxy.blackhole = False
        s.close()
        locks.close()


def test_an_unreplicated_acquisition_took_the_lease_so_its_queued_mark_is_gone(pair):
    """As ``Locks.acquire`` documents: an acquisition given back as "unreplicated" had taken the
    lease, and its mark went with it (a refusal for a held key leaves the mark; the pipeline
    clears it after any refusal of a run that will not start anyway)."""
    locks = _locks(pair, replicas=1, replica_timeout=0.2)
    try:
        assert locks.mark_queued("m", "r1", ttl=60, task="t") == (True, "r1")
        pair.proxy.blackhole = True
        acq = locks.acquire("m", ttl=30, run_id="r1", queued_mark=("t", "r1"))
        assert not acq.acquired and acq.reason == "unreplicated"
        pair.proxy.blackhole = False
        assert locks.mark_queued("m", "r2", ttl=60, task="t") == (True, "r2")
        assert locks.holders("m") == []
    finally:
        pair.proxy.blackhole = False
        locks.close()


def test_a_scheduler_whose_leader_lease_stays_unreplicated_logs_it_once_not_every_loop(pair, caplog):
    """A standby (or restarted) scheduler while the replication link is down: every loop takes
    the leader lease, has it refused as unreplicated and gives it back. An outage is logged once
    ("Redis unreachable", then "Redis is back"); this was logged at WARNING on every loop (once a
    second with the default loop interval) for as long as the link was down. Now once, counted
    every time."""
    import logging

    from taskguard.clock import FixedClock
    from taskguard.schedule import PeriodicEntry, PeriodicScheduler, schedule_settings
    from taskguard.schedule.slots import Interval

    from .test_schedule_core import NAMES, ListAdapter

    locks = _locks(pair, replicas=1)
    settings = schedule_settings(NAMES, leader_ttl=30, default_name="durable-spam", loop_interval=1.0)
    s = PeriodicScheduler(
        locks,
        settings,
        adapter=ListAdapter([PeriodicEntry("e", Interval(10))]),
        clock=FixedClock(lambda: 1_000_000.5),
        role="sched",
    )
    caplog.set_level(logging.INFO, logger="taskguard")
    try:
        pair.proxy.blackhole = True
        for _ in range(5):
            s.tick()
        assert s.lease is None and s.stats["unreplicated"] == 5
        warnings = [r for r in caplog.records if "did not acknowledge it in time" in r.getMessage()]
        assert len(warnings) == 1, f"{len(warnings)} warnings in 5 loops"
    finally:
        pair.proxy.blackhole = False
        s.close()
        locks.close()
