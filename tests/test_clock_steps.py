"""Wall-clock steps (NTP correcting a drifted host) on every host that holds or judges a lease:
a step forward or back neither declares a held lease lost nor keeps a lost one, and beat goes on
publishing each slot once, on time. Real processes have their wall clock stepped with libfaketime
(:mod:`tests.faketime`); in-process tests step ``time.time``."""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter

import pytest
import redis
from rq.job import JobStatus

from taskguard import RedisLocks

from . import rq_jobs
from .celery_app import make_app
from .celery_support import BeatProcess, WorkerProcess, body_log, leader_pid
from .faketime import SteppedClock
from .tcp_proxy import TcpProxy
from .test_rq import RQWorker, log as rq_log, wait_done

STEPS = [90, -90]
_REAL_TIME = time.time


def say(*parts):
    print("   ", *parts, flush=True)


@pytest.fixture
def wall_step(monkeypatch):
    """Step this process's wall clock (``time.time``) by ``offset`` seconds; monotonic stays."""

    def step(offset: float) -> None:
        monkeypatch.setattr(time, "time", lambda: _REAL_TIME() + offset)

    return step


# -- the core: handles and the heartbeat ------------------------------------------------------------
def test_a_wall_clock_step_neither_ends_a_held_lease_nor_keeps_a_lost_one(redis_url, prefix, wall_step):
    """Before, ``Lease.lost`` compared ``time.time()`` with ``expires_at``: +90 s made a held lease
    lost at once, -90 s kept a lease presumed held for 90 s after it expired in Redis."""
    locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    lease = locks.acquire("held", ttl=3).lease
    wall_step(+90)
    assert not lease.lost
    lease.ensure_held()
    wall_step(-90)
    assert not lease.lost
    time.sleep(3.3)  # the TTL passes without a renewal: gone in Redis
    assert lease.lost and lease.lost_reason == "expired without renewal"
    assert locks.holder("held") is None and lease.renew() is False


def test_a_handle_follows_an_injected_clock():
    """``Locks.clock`` measures how long a handle presumes its lease held (here a simulated one)."""
    from taskguard import MemoryLocks
    from taskguard.clock import FixedClock

    now = [5000.0]
    locks = MemoryLocks()
    locks.clock = FixedClock(lambda: now[0])
    lease = locks.acquire("k", ttl=10).lease
    assert lease.expires_at == 5010.0 and not lease.lost
    now[0] += 9.9
    assert not lease.lost
    now[0] += 0.2
    assert lease.lost


def test_the_heartbeat_keeps_a_held_lease_through_a_blip_after_a_step_forward(redis_url, prefix, wall_step):
    """Renewals fail for 1 s (a partition) on a host whose clock just stepped +90 s; the lease
    (ttl 3) is still held in Redis and must not be given up. Before, the first failed renewal
    compared the stepped ``time.time()`` with ``expires_at`` and marked it lost."""
    proxy = TcpProxy(redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"])
    locks = RedisLocks.from_url(proxy.url, prefix=prefix, socket_timeout=0.3, connect_timeout=0.3, retries=0)
    lost, errors = [], []
    locks.add_listener(lambda ev: errors.append(ev) if ev.kind == "renew" and ev.status == "error" else None)
    try:
        lease = locks.acquire("blip", ttl=3, renew=True).lease
        lease.on_lost(lambda _lease, reason: lost.append(reason))
        wall_step(+90)
        proxy.blackhole = True
        time.sleep(1.2)  # renewals (every 1 s) fail meanwhile
        proxy.blackhole = False
        proxy.cut()
        time.sleep(1.5)  # renewed again
        say(f"observed: lost reports {lost}; lease lost={lease.lost}; failed renewals {len(errors)}")
        assert errors and not lost and not lease.lost
        assert lease.release() is True
    finally:
        locks.close()
        proxy.close()


def test_the_heartbeat_gives_up_an_unrenewable_lease_after_its_ttl_despite_a_step_back(redis_url, prefix, wall_step):
    """Renewals fail for good (a partition) on a host whose clock just stepped -90 s: the lease
    (ttl 1.5) expires in Redis, and the heartbeat marks it lost within its TTL plus a retry.
    Before, it kept it for 90 s more (``time.time() >= expires_at`` on the stepped clock)."""
    proxy = TcpProxy(redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"])
    locks = RedisLocks.from_url(proxy.url, prefix=prefix, socket_timeout=0.3, connect_timeout=0.3, retries=0)
    lost = []
    try:
        lease = locks.acquire("gone", ttl=1.5, renew=True).lease
        lease.on_lost(lambda _lease, reason: lost.append((time.monotonic(), reason)))
        wall_step(-90)
        cut_at = time.monotonic()
        proxy.blackhole = True
        deadline = cut_at + 6.0
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        say(f"observed: lost reports {[(round(t - cut_at, 2), r) for t, r in lost]}")
        assert lost and lost[0][0] - cut_at <= 1.5 + 1.5
        assert "renewal failed until the lease expired" in lost[0][1] and lease.lost
    finally:
        proxy.blackhole = False
        locks.close(timeout=0.5)
        proxy.close()


def test_the_server_clock_ignores_a_local_step(redis_url, wall_step):
    """:class:`ServerClock` reads the Redis server's ``TIME`` and advances by the monotonic clock:
    a step of the local wall clock does not move it."""
    from taskguard.clock import ServerClock

    locks = RedisLocks(redis.Redis.from_url(redis_url))
    clock = ServerClock(locks.server_time)
    before = clock.time()
    wall_step(+90)
    assert abs(clock.time() - before) < 1.0
    clock.refresh()
    assert abs(clock.time() - _REAL_TIME()) < 1.0  # the server and this host share a clock here
    wall_step(-90)
    assert abs(clock.time() - _REAL_TIME()) < 1.0 and abs(locks.server_time() - _REAL_TIME()) < 1.0


def test_a_booked_turn_waits_out_the_server_clocks_uncertainty(redis_url, prefix):
    """A slow reading of the server's clock (here: the server reads its ``TIME`` 40 ms into the
    round trip, as on a loaded worker) puts :class:`ServerClock` up to half the round trip ahead
    of the server. A run back at its booked turn waits out that uncertainty too, so it never
    starts before its turn on the server's clock. Before, it started up to half a round trip
    early (seen as runs a few ms before their turn on loaded workers)."""
    from taskguard.clock import ServerClock
    from taskguard.pacing import pace

    client = redis.Redis.from_url(redis_url)

    def slow_reading() -> float:
        time.sleep(0.04)  # the request's slow way there: the server reads its clock at the end
        secs, micros = client.time()
        return secs + micros / 1e6

    clock = ServerClock(slow_reading)

    class SlowClockLocks(RedisLocks):
        def server_clock(self):
            return clock

    locks = SlowClockLocks(client, prefix=prefix)
    clock.refresh()
    assert 0.02 <= clock.uncertainty() < 0.2
    secs, micros = client.time()
    turn = secs + micros / 1e6 + 0.3
    for _ in range(3):
        asked = time.monotonic()
        secs, micros = client.time()
        server_then = secs + micros / 1e6
        p = pace(
            locks,
            "api",
            rate=(1, 10.0),
            burst=None,
            max_wait=None,
            max_countdown=60.0,
            state={"since": turn - 5.0, "turn": turn},
        )
        assert p.go
        starts = server_then + (time.monotonic() - asked) + p.countdown  # on the server's clock
        assert starts >= turn, (starts - turn, clock.uncertainty())
        assert starts - turn < 0.25  # (and not much later)


@pytest.mark.parametrize("offset", STEPS, ids=lambda o: f"{o:+d}s")
def test_a_deferred_runs_booked_turn_is_read_on_the_server_clock(redis_url, prefix, wall_step, offset):
    """A run deferred by a rate carries its booked turn (epoch seconds, booked on another host);
    back 1.5 s early on a worker whose clock stepped ``offset`` seconds, it waits for the turn.
    Before, ``pace`` compared the turn with the stepped ``time.time()`` and ran at once."""
    from taskguard.pacing import pace

    locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    turn = _REAL_TIME() + 1.5
    wall_step(offset)
    p = pace(
        locks,
        "api",
        rate=(1, 10.0),
        burst=None,
        max_wait=None,
        max_countdown=60.0,
        state={"since": turn - 5.0, "turn": turn},
    )
    say(f"observed: go={p.go} countdown={p.countdown:.2f}")
    assert p.go and 1.0 < p.countdown <= 1.6


# -- beat: the leader's clock steps ------------------------------------------------------------------
EVERY = 2.0
LEADER_TTL = 3


def slot_runs(app):
    """{window: [run times]} of the guarded beat task (worker clock: true time)."""
    out: dict[int, list[float]] = {}
    for e in body_log(app):
        if e.startswith("stick:"):
            _, _slot_a, window, _fence, at, _task_id = e.split(":", 5)
            out.setdefault(int(window), []).append(float(at))
    return out


def keep_log(r, key):
    """Give the bodies' log a TTL from the start: the suite's clean-up of keys without one (run at
    the end of any test session on the shared Redis) must not empty it while this test runs."""
    r.rpush(key, "log")
    r.expire(key, 900)


@pytest.mark.parametrize("offset", STEPS, ids=lambda o: f"{o:+d}s")
def test_a_clock_step_on_the_leader_beat_publishes_each_slot_once_on_time(redis_url, prefix, tmp_path, offset):
    """Two ``celery beat -S taskguard`` (leader TTL 3 s, an entry every 2 s); the leader's wall
    clock steps ``offset`` seconds. Every window from before the step to the end runs exactly
    once, none before it starts and none later than the leader TTL + one loop (+ a margin for the
    publish and the worker). Before: +90 s, the leader took its own lease for lost, dropped it
    without releasing it while the heartbeat kept renewing it, and nothing was published again;
    -90 s, the leader named slots from 90 s ago, found them handled and published nothing."""
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    env = {"TG_TEST_CONF": json.dumps({"taskguard_beat_leader_ttl": LEADER_TTL}), "TG_TEST_BEAT_TASK": "tg.slot_tick"}
    clocks = {n: SteppedClock(tmp_path) for n in ("a", "b")}
    keep_log(redis.Redis.from_url(redis_url), app.tg_log)
    try:
        with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
            beats = {
                n: BeatProcess(queue, prefix, tmp_path, n, every=EVERY, env={**env, **clocks[n].env}).start()
                for n in ("a", "b")
            }
            pid = leader_pid(app)
            time.sleep(2 * EVERY)  # both up, a window or two run
            name = next(n for n, b in beats.items() if b.proc.pid == pid)
            first = math.floor(time.time() / EVERY)  # the window running now: before the step
            clocks[name].step(offset)
            stepped_at = time.time()
            say(f"injected: the leader beat's ({name}) wall clock steps {offset:+d} s")
            time.sleep(16.0)
            last = math.floor(time.time() / EVERY) - 1  # the latest window surely run by now
            time.sleep(1.0)
            outputs = {n: b.output() for n, b in beats.items()}
            for b in beats.values():
                b.stop()
        runs = slot_runs(app)
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, queue)
    windows = range(first, last + 1)
    missing = [w for w in windows if w not in runs]
    doubled = [w for w, ts in runs.items() if len(ts) > 1]
    delays = {w: round(runs[w][0] - w * EVERY, 2) for w in windows if w in runs}
    say(
        f"observed: windows {first}..{last} (step at {stepped_at - first * EVERY:.1f} s into window {first}): "
        f"missing {missing}, run twice {doubled}, delays {delays}, future windows "
        f"{[w for w in runs if w * EVERY > time.time()]}"
    )
    assert not missing and not doubled, {n: o[-3000:] for n, o in outputs.items()}
    assert all(run >= w * EVERY - 0.05 for w, ts in runs.items() for run in ts)  # none early
    assert max(delays.values()) <= LEADER_TTL + 1.0 + 1.5  # none later than TTL + one loop
    assert Counter(n for n, o in outputs.items() if "lost the leader lease" in o) == Counter()


# -- workers: a Celery worker's and an RQ work horse's clock steps mid-run ----------------------------
@pytest.mark.parametrize("offset", STEPS, ids=lambda o: f"{o:+d}s")
def test_a_clock_step_on_a_celery_worker_keeps_a_running_tasks_lease(redis_url, prefix, tmp_path, offset):
    """A guarded task (ttl 2) checks its lease every 0.1 s for 6 s; 1.5 s in, its worker's wall
    clock steps ``offset`` seconds. It keeps its lease and ends SUCCESS. Before, +90 s made
    ``ensure_held`` raise LeaseLost at once."""
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    clock = SteppedClock(tmp_path)
    keep_log(redis.Redis.from_url(redis_url), app.tg_log)
    try:
        with WorkerProcess(queue, prefix, pool="prefork", concurrency=1, env=clock.env) as _w:
            result = app.signature("tg.clock_held", kwargs={"seconds": 6.0}).apply_async(queue=queue)
            deadline = time.monotonic() + 20
            while not any(e.startswith("clock_held:start") for e in body_log(app)) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.5)
            clock.step(offset)
            say(f"injected: the worker's wall clock steps {offset:+d} s mid-run")
            value = result.get(timeout=30, propagate=False)
            say(f"observed: {result.status} {value!r}")
            assert result.status == "SUCCESS" and isinstance(value, int)
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, queue)


@pytest.mark.parametrize("offset", STEPS, ids=lambda o: f"{o:+d}s")
def test_a_clock_step_in_an_rq_work_horse_keeps_a_running_jobs_lease(rq_env, tmp_path, monkeypatch, offset):  # noqa: F811
    """The RQ twin: a guarded job (ttl 2) checking its lease every 0.1 s for 6 s; its work horse's
    wall clock steps ``offset`` seconds 1.5 s in. It keeps its lease and finishes. Before, +90 s
    made ``ensure_held`` raise LeaseLost at once."""
    clock = SteppedClock(tmp_path)
    keep_log(rq_env.connection, "{" + os.environ["TASKGUARD_PREFIX"] + ":log}")
    for k, v in clock.env.items():
        monkeypatch.setenv(k, v)  # the worker (and its work horses) start under libfaketime
    with RQWorker(rq_env) as worker:
        for k in clock.env:
            monkeypatch.delenv(k)
        job = rq_env.enqueue(rq_jobs.clock_held, "j", seconds=6.0)
        deadline = time.monotonic() + 20
        while not any(e.startswith("clock_held:j:start") for e in rq_log(rq_env)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)
        clock.step(offset)
        say(f"injected: the work horse's wall clock steps {offset:+d} s mid-run")
        status = wait_done(job, timeout=30)
        say(f"observed: {status} {job.return_value()!r}")
        assert status == JobStatus.FINISHED and isinstance(job.return_value(), int), worker.output()[-3000:]


def test_a_leader_that_gives_its_lease_up_releases_it_and_leads_again(redis_url, prefix, tmp_path):
    """The leader's handle presumes its lease gone (its monotonic deadline passed: here a
    simulated handle clock) while Redis still holds it: beat releases it and takes it afresh at
    once. Before, it dropped the handle without releasing it, and every acquire — its own and a
    standby's — was refused as held while the heartbeat kept renewing the dropped lease."""
    from celery import Celery
    from celery.beat import PersistentScheduler

    from taskguard.clock import FixedClock
    from taskguard_celery.beat import SingletonBeatMixin

    now = [_REAL_TIME()]
    locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    locks.clock = FixedClock(lambda: now[0])
    app = Celery("giveup", set_as_current=False, broker="memory://")
    app.conf.taskguard_locks = locks
    app.conf.taskguard_beat_leader_ttl = 30
    app.conf.beat_schedule = {"e": {"task": "t", "schedule": 10.0}}

    class Sched(SingletonBeatMixin, PersistentScheduler):
        pass

    s = Sched(app, schedule_filename=str(tmp_path / "g"))
    try:
        first = s.taskguard_leader()
        assert first is not None
        now[0] += 31.0  # the handle's clock: past the TTL without a renewal it knows of
        assert first.lost
        again = s.taskguard_leader()
        say(
            f"observed: first released={first.released}, leader again={again is not None}, "
            f"stats {dict(s.taskguard_stats)}"
        )
        assert first.released and again is not None and not again.lost
        assert locks.holder("beat-leader:giveup").fencing_token == again.fencing_token
    finally:
        s.close()


def test_beat_takes_its_time_source_from_the_injected_clock(tmp_path):
    """``taskguard_clock=`` (or the class attribute) replaces the server clock: slot instants and
    lateness follow it (here a simulated clock, as a DST test drives the scheduler)."""
    from celery import Celery
    from celery.beat import PersistentScheduler

    from taskguard import MemoryLocks
    from taskguard.clock import FixedClock
    from taskguard_celery.beat import SingletonBeatMixin

    now = [1_000_000.5]
    app = Celery("clocked", set_as_current=False, broker="memory://")
    app.conf.taskguard_locks = MemoryLocks()
    app.conf.beat_schedule = {"e": {"task": "t", "schedule": 10.0}}

    class Sched(SingletonBeatMixin, PersistentScheduler):
        pass

    s = Sched(app, schedule_filename=str(tmp_path / "s"), taskguard_clock=FixedClock(lambda: now[0]))
    try:
        assert s.taskguard_periodic.now() == now[0] and s.taskguard_leader() is not None
        entry = s.schedule["e"]
        due, next_in = s.is_due(entry)
        assert due and abs(next_in - 9.5) < 1e-6  # the window 1000000.0 (0.5 s late), the next in 9.5 s
        core = s.taskguard_periodic
        assert core.latest(s.taskguard_entry(entry), core.now())[0] == 1_000_000.0
        now[0] += 123.0
        due, next_in = s.is_due(entry)
        assert due and abs(next_in - 6.5) < 1e-6 and core.latest(s.taskguard_entry(entry), core.now())[0] == 1_000_120.0
    finally:
        s.close()


def test_a_run_back_far_too_early_is_deferred_again_to_the_same_turn(redis_url, prefix):
    """Under 1 call per 5 s, one call goes and three book turns 5, 10 and 15 s ahead. Back at
    once (their delays read on a clock running ahead: more than MAX_EARLY before their turns),
    each is deferred again to the turn it holds, nothing booked anew. Before, each went at once:
    4 runs within a millisecond under a rate of 1 per 5 s."""
    from taskguard.pacing import MAX_EARLY, pace

    locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    common = dict(rate=(1, 5.0), burst=1, max_wait=None, max_countdown=60.0)
    assert pace(locks, "api", **common).go
    booked = [pace(locks, "api", **common) for _ in range(3)]
    assert not any(p.go for p in booked) and all(p.state and p.state["turn"] for p in booked)
    for n, p in enumerate(booked, start=1):
        again = pace(locks, "api", state=p.state, **common)
        assert not again.go and not again.skip, again
        assert again.state == p.state  # the same turn, not a new booking
        assert 5.0 * n - 1.0 < again.countdown <= 5.0 * n + 0.1 and again.countdown > MAX_EARLY
    # nothing was booked by the early returns: the next fresh call's turn follows the three
    fresh = pace(locks, "api", **common)
    assert not fresh.go and fresh.state["turn"] > booked[-1].state["turn"] + 4.0
