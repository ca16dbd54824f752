"""Singleton periodic tasks: real ``celery beat -S taskguard`` processes, a real worker, real Redis."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab

from taskguard import MemoryLocks, Skipped
from taskguard_celery.beat import slot_of

from .celery_app import make_app
from .celery_support import BeatProcess, WorkerProcess, body_log, embedded_worker
from .servers import RedisServer


def say(*parts):
    print("   ", *parts, flush=True)


@pytest.fixture
def beat_env(redis_url, prefix, tmp_path):
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    yield app, queue, prefix, tmp_path
    redis.Redis.from_url(redis_url).delete(app.tg_log, queue)


def ticks(app):
    """(slot, leader fence, time) of every tick run, in order."""
    out = []
    for e in body_log(app):
        if e.startswith("tick:"):
            _, slot_a, slot_b, fence, at = e.split(":")
            out.append((f"{slot_a}:{slot_b}", int(fence), float(at)))
    return out


def check_once_per_slot(runs, started, stopped, every=1.0):
    slots = [s for s, _, _ in runs]
    duplicates = [s for s, n in Counter(slots).items() if n > 1]
    due = int(stopped // every) - int(started // every)
    say(f"observed: {len(runs)} runs for about {due} due slots; duplicates: {duplicates}")
    assert not duplicates
    return due


@pytest.mark.parametrize("stagger", [0.0, 3.0])
def test_two_beats_publish_each_slot_once(beat_env, stagger):
    app, queue, prefix, tmp = beat_env
    with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
        a = BeatProcess(queue, prefix, tmp, "a").start()
        time.sleep(stagger)
        b = BeatProcess(queue, prefix, tmp, "b").start()
        say(f"injected: two beats, an entry every 1 s, the second started {stagger:.0f} s later")
        time.sleep(3.0)  # both up
        started = time.time()
        time.sleep(10.0)
        stopped = time.time()
        time.sleep(1.0)
        a.stop(), b.stop()
    runs = [r for r in ticks(app) if started <= r[2] <= stopped]
    due = check_once_per_slot(runs, started, stopped)
    assert abs(len(runs) - due) <= 1
    assert "is the leader" in a.output() + b.output()


def test_redbeat_with_the_mixin_publishes_each_slot_once(beat_env, redis_url):
    """RedBeat keeps the schedule in Redis and publishes through ``apply_async`` (not
    ``apply_entry``); its own lock is turned off so that only taskguard's checks keep the beats
    from publishing twice."""
    app, queue, prefix, tmp = beat_env
    conf = {"TG_TEST_CONF": json.dumps({"redbeat_redis_url": redis_url, "redbeat_key_prefix": f"{prefix}:redbeat",
                                        "redbeat_lock_key": None})}
    with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
        beats = [BeatProcess(queue, prefix, tmp, n, env=conf, scheduler="tests.beat_schedulers:SingletonRedBeat").start()
                 for n in ("a", "b")]
        time.sleep(4.0)
        started = time.time()
        time.sleep(8.0)
        stopped = time.time()
        time.sleep(1.0)
        for b in beats:
            b.stop()
    runs = [r for r in ticks(app) if started <= r[2] <= stopped]
    say("injected: two RedBeat beats (RedBeat's own lock off) with the taskguard mixin")
    due = check_once_per_slot(runs, started, stopped)
    assert abs(len(runs) - due) <= 1, [b.output()[-2000:] for b in beats]
    keys = list(redis.Redis.from_url(redis_url).scan_iter(match=f"{prefix}:redbeat*"))
    if keys:
        redis.Redis.from_url(redis_url).delete(*keys)


def test_sigkill_of_the_leader_beat_hands_over_within_the_leader_ttl(beat_env):
    app, queue, prefix, tmp = beat_env
    conf = {"TG_TEST_CONF": json.dumps({"taskguard_beat_leader_ttl": 3})}
    locks = app.conf.taskguard_locks
    with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
        beats = [BeatProcess(queue, prefix, tmp, n, env=conf).start() for n in ("a", "b")]
        deadline = time.monotonic() + 20
        while locks.holder("beat-leader:" + app.main) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)
        leader_pid = locks.holder("beat-leader:" + app.main).holder["pid"]
        leader = next(b for b in beats if b.proc.pid == leader_pid)
        other = next(b for b in beats if b is not leader)
        killed_at = time.time()
        os.kill(leader_pid, signal.SIGKILL)
        say(f"injected: SIGKILL to the leader beat (pid {leader_pid}); leader TTL 3 s")
        time.sleep(9.0)
        stopped = time.time()
        other.stop()
        leader.log.close()
    runs = ticks(app)
    after = [r for r in runs if r[2] > killed_at]
    gap = (after[0][2] - killed_at) if after else None
    say(f"observed: first run after the kill {gap and round(gap, 2)} s later; {len(after)} runs since")
    assert after and gap <= 3.0 + 1.5
    assert len({r[1] for r in after}) == 1 and after[0][1] > runs[0][1]  # a new leader, a larger fence
    check_once_per_slot(runs, runs[0][2], stopped)


def test_a_message_from_a_stale_leader_is_dropped(beat_env):
    app, queue, prefix, tmp = beat_env
    locks = app.conf.taskguard_locks
    leader = locks.acquire("beat-leader:" + app.main, ttl=30).lease
    header = {"leader_key": "beat-leader:" + app.main, "leader_fence": leader.fencing_token - 1,
              "entry": "gtick", "slot": "every1s:1"}
    with embedded_worker(app):
        stale = app.tasks["tg.guarded_tick"].apply_async(headers={"taskguard_beat": header}).get(timeout=5)
        header["leader_fence"] = leader.fencing_token
        current = app.tasks["tg.guarded_tick"].apply_async(headers={"taskguard_beat": header}).get(timeout=5)
    say(f"injected: a message with leader fence {leader.fencing_token - 1} < {leader.fencing_token}; got {stale!r}")
    assert isinstance(stale, Skipped) and stale.reason == "stale_leader"
    assert current == "gtick"
    assert len([e for e in body_log(app) if e.startswith("gtick:")]) == 1
    leader.release()


def test_entry_options_set_the_runs_key_and_ttl(beat_env):
    app, queue, prefix, tmp = beat_env
    header = {"entry": "nightly", "slot": "at:1", "key": "nightly-report", "ttl": 7}
    with embedded_worker(app):
        out = app.tasks["tg.guarded_tick"].apply_async(headers={"taskguard_beat": header}).get(timeout=5)
    assert out == "nightly-report"
    assert "gtick:nightly-report:7.0" in body_log(app)


def test_beat_survives_a_redis_restart_without_duplicates(beat_env, redis_url):
    app, queue, prefix, tmp = beat_env
    server = RedisServer().start()
    env = {"TG_TEST_CONF": json.dumps({"taskguard_redis_url": server.url, "taskguard_locks": None,
                                       "taskguard_beat_leader_ttl": 3})}
    try:
        with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
            beat = BeatProcess(queue, prefix, tmp, "a", env=env).start()
            time.sleep(5.0)
            server.stop()
            say("injected: the lease store (a suite-owned redis-server) stopped for 3 s, then restarted empty")
            time.sleep(3.0)
            server.start()
            time.sleep(6.0)
            alive = beat.alive()
            beat.stop()
        runs = ticks(app)
        output = beat.output()
        say(f"observed: beat alive {alive}; {len(runs)} runs; log says unreachable: {'unreachable' in output}")
        assert alive and "Traceback" not in output
        assert "Redis unreachable" in output and "Redis is back" in output
        check_once_per_slot(runs, runs[0][2], runs[-1][2])
        assert runs[-1][2] > time.time() - 4  # publishing resumed
    finally:
        server.close()


def test_crontab_across_daylight_saving_changes_each_utc_instant_once():
    """A frozen, simulated clock walks a crontab entry (every 30 min, Europe/Berlin) through both
    2026 DST changes, evaluated by two beats (the second started 7 minutes later, so their
    ``last_run_at`` differ); every due run goes through the slot claims."""
    from zoneinfo import ZoneInfo

    berlin = ZoneInfo("Europe/Berlin")
    app = Celery("dst", set_as_current=False)
    app.conf.timezone = "Europe/Berlin"
    for start in (datetime(2026, 3, 28, 22, 0, tzinfo=timezone.utc), datetime(2026, 10, 24, 22, 0, tzinfo=timezone.utc)):
        locks = MemoryLocks()
        now = [start]
        beats = []
        for offset in (0, 7):
            sched = crontab(minute="*/30", nowfun=lambda: now[0], app=app)
            beats.append([offset, ScheduleEntry(name="half-hourly", task="t", schedule=sched, app=app,
                                                last_run_at=start + timedelta(minutes=offset))])
        published, fired = [], []
        for minute in range(1, 6 * 60 + 1):  # six hours, one tick a minute
            now[0] = start + timedelta(minutes=minute)
            for beat in beats:
                offset, entry = beat
                if minute < offset:
                    continue
                due, _next = entry.is_due()
                if due:
                    slot, keep = slot_of(entry)
                    fired.append(slot)
                    if locks.put_record(f"slot:{slot}", "slot", "1", ttl=keep, if_absent=True):
                        published.append(int(slot.split(":")[1]))
                    beat[1] = next(entry)
        instants = [datetime.fromtimestamp(t, timezone.utc) for t in published]
        local_times = {f"{datetime.fromtimestamp(t, berlin):%H:%M}" for t in published}
        say(f"{start:%Y-%m-%d}: {len(fired)} due evaluations, {len(published)} published, "
            f"UTC {[f'{i:%H:%M}' for i in instants]}")
        assert len(published) == len(set(published))           # each UTC instant at most once
        assert all(t % 1800 == 0 for t in published)             # all on the crontab's half hours
        assert len(fired) > len(published)                       # both beats fired; claims deduplicated
        assert len(local_times) == len(published)                # a repeated local hour runs once
        expected = 12 if start.month == 3 else 10                # 12 UTC half-hours; autumn repeats two local ones
        assert len(published) == expected
