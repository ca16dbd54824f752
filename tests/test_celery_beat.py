"""Singleton periodic tasks: real ``celery beat -S taskguard`` processes, a real worker, real Redis."""

from __future__ import annotations

import json
import math
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

from taskguard import ConfigError, MemoryLocks
from taskguard_celery.beat import TaskguardScheduler, latest_due, slot_id

from .celery_app import make_app
from .celery_support import BeatProcess, WorkerProcess, body_log, embedded_worker, leader_pid
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
    conf = {
        "TG_TEST_CONF": json.dumps(
            {"redbeat_redis_url": redis_url, "redbeat_key_prefix": f"{prefix}:redbeat", "redbeat_lock_key": None}
        )
    }
    with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
        beats = [
            BeatProcess(queue, prefix, tmp, n, env=conf, scheduler="tests.beat_schedulers:SingletonRedBeat").start()
            for n in ("a", "b")
        ]
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
    with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
        beats = [BeatProcess(queue, prefix, tmp, n, env=conf).start() for n in ("a", "b")]
        leader_pid(app)
        time.sleep(2.0)
        pid = leader_pid(app)
        leader = next(b for b in beats if b.proc.pid == pid)
        other = next(b for b in beats if b is not leader)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        say(f"injected: SIGKILL to the leader beat (pid {pid}); leader TTL 3 s")
        time.sleep(9.0)
        stopped = time.time()
        other.stop()
        leader.log.close()
    runs = ticks(app)
    old = {r[1] for r in runs if r[2] <= killed_at}  # the killed leader's fence
    # (a slot it published just before the kill may run just after it, under its fence)
    after = [r for r in runs if r[2] > killed_at and r[1] not in old]
    late = [r for r in runs if r[2] > killed_at and r[1] in old]
    gap = (after[0][2] - killed_at) if after else None
    say(f"observed: first run after the kill {gap and round(gap, 2)} s later; {len(after)} runs since")
    assert after and gap <= 3.0 + 1.5
    assert len({r[1] for r in after}) == 1 and after[0][1] > max(old)  # a new leader, a larger fence
    assert len(late) <= 1 and all(r[2] < after[0][2] for r in late), late  # in flight at the kill only
    check_once_per_slot(runs, runs[0][2], stopped)


def test_a_leader_beat_paused_past_its_lease_keeps_running_and_publishes_nothing_twice(beat_env):
    """redbeat#230: a beat whose lock expired mid-run (a pause longer than the lock's timeout)
    died with ``LockNotOwnedError`` on its next extend, in a restart loop. Here the leader beat is
    SIGSTOPped for twice its leader TTL (3 s), then SIGCONTinued: the standby leads meanwhile; the
    resumed beat keeps running (logs the lost lease, becomes the standby), no slot runs twice,
    and the ticks go on."""
    app, queue, prefix, tmp = beat_env
    conf = {"TG_TEST_CONF": json.dumps({"taskguard_beat_leader_ttl": 3})}
    with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
        beats = [BeatProcess(queue, prefix, tmp, n, env=conf).start() for n in ("a", "b")]
        leader_pid(app)
        time.sleep(2.0)
        pid = leader_pid(app)
        paused = next(b for b in beats if b.proc.pid == pid)
        os.kill(pid, signal.SIGSTOP)
        say(f"injected: SIGSTOP of the leader beat (pid {pid}) for 6 s; leader TTL 3 s")
        try:
            time.sleep(6.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.time()
        time.sleep(5.0)
        stopped = time.time()
        alive = paused.proc.poll() is None
        new_leader = leader_pid(app)
        for b in beats:
            b.stop()
    runs = ticks(app)
    out = paused.output()
    say(
        f"observed: paused beat alive after resuming: {alive}; leader after: {new_leader}; lost lease logged: "
        f"{'lost the leader lease' in out}"
    )
    assert alive and new_leader != pid, out[-3000:]
    assert "lost the leader lease" in out and "LockNotOwnedError" not in out and "Traceback" not in out, out[-3000:]
    check_once_per_slot(runs, runs[0][2], stopped)
    assert [r for r in runs if r[2] > resumed + 1.5]  # ticks go on after the resume


def test_a_message_from_an_older_leader_runs_and_a_slot_runs_once(beat_env):
    """Slots are claimed in Redis against the leader lease, so the worker no longer drops a message
    because leadership changed after it was published; and every message naming one slot (a slot
    published again after a hand-over) shares one run identity, so the slot runs once."""
    app, queue, prefix, tmp = beat_env
    locks = app.conf.taskguard_locks
    leader = locks.acquire("beat-leader:" + app.main, ttl=30).lease
    header = {
        "leader_key": "beat-leader:" + app.main,
        "leader_fence": leader.fencing_token - 1,
        "entry": "gtick",
        "slot": "every1s:1",
        "keep": 60,
    }
    task = app.tasks["tg.guarded_tick"]
    with embedded_worker(app):
        older = task.apply_async(headers={"taskguard_beat": header}).get(timeout=5)
        again = task.apply_async(headers={"taskguard_beat": dict(header, leader_fence=leader.fencing_token)})
        time.sleep(1.0)
        other_slot = task.apply_async(headers={"taskguard_beat": dict(header, slot="every1s:2")}).get(timeout=5)
    say(
        f"injected: a slot's message from an older leader (fence {leader.fencing_token - 1}), the same slot "
        f"again from the current one, then the next slot; got {older!r}, {again.state}, {other_slot!r}"
    )
    assert older == "gtick" and other_slot == "gtick"
    assert again.state == "PENDING"  # acked without a result: a duplicate of a finished slot
    assert len([e for e in body_log(app) if e.startswith("gtick:")]) == 2
    leader.release()


def test_the_worker_side_imports_no_scheduler():
    """A worker reads a beat message's slot (taskguard_celery.beat_runs) without importing the
    scheduler module."""
    import subprocess
    import sys

    code = "import sys, taskguard_celery; print('taskguard_celery.beat' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


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
    env = {
        "TG_TEST_CONF": json.dumps(
            {"taskguard_redis_url": server.url, "taskguard_locks": None, "taskguard_beat_leader_ttl": 3}
        )
    }
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
    ``last_run_at`` differ, which must not matter); every due instant goes through the slot claims."""
    app = Celery("dst", set_as_current=False)
    app.conf.timezone = "Europe/Berlin"
    for start in (
        datetime(2026, 3, 28, 22, 0, tzinfo=timezone.utc),
        datetime(2026, 10, 24, 22, 0, tzinfo=timezone.utc),
    ):
        locks = MemoryLocks()
        now = [start]
        beats = []
        for offset in (0, 7):
            sched = crontab(minute="*/30", nowfun=lambda now=now: now[0], app=app)
            beats.append(
                [
                    offset,
                    ScheduleEntry(
                        name="half-hourly",
                        task="t",
                        schedule=sched,
                        app=app,
                        last_run_at=start + timedelta(minutes=offset),
                    ),
                ]
            )
        published, fired = [], []
        for minute in range(1, 6 * 60 + 1):  # six hours, one tick a minute
            now[0] = start + timedelta(minutes=minute)
            for beat in beats:
                offset, entry = beat
                if minute < offset:
                    continue
                instant, _next = latest_due(entry, lookback=30.0)
                if instant is not None:
                    slot = slot_id(entry, instant)
                    fired.append(slot)
                    if locks.put_record(f"slot:{slot}", "slot", "1", ttl=90000, if_absent=True):
                        published.append(int(slot.split(":")[1]))
        instants = [datetime.fromtimestamp(t, timezone.utc) for t in published]
        say(
            f"{start:%Y-%m-%d}: {len(fired)} due evaluations, {len(published)} published, "
            f"UTC {[f'{i:%H:%M}' for i in instants]}"
        )
        assert len(published) == len(set(published))  # each UTC instant at most once
        assert all(t % 1800 == 0 for t in published)  # all on the crontab's half hours
        assert len(fired) > len(published)  # both beats fired; claims deduplicated
        # a wildcard-hour entry runs at every real half hour, through a repeated local hour too
        # (Vixie cron's rule; fixed-hour entries: tests/test_beat_dst.py)
        assert len(published) == 12


# -- hand-over: no due run lost, none run twice -------------------------------------------------------
EVERY = 4.0


def slot_runs(app):
    """(slot, leader fence, time, task id) of every run of the guarded beat task, in order."""
    out = []
    for e in body_log(app):
        if e.startswith("stick:"):
            _, slot_a, slot_b, fence, at, task_id = e.split(":", 5)
            out.append((f"{slot_a}:{slot_b}", int(fence), float(at), task_id))
    return out


def window_of(slot):
    return int(slot.split(":")[1])


def sleep_until(ts):
    time.sleep(max(0.0, ts - time.time()))


def check_every_window_once(runs, first, last):
    """Every window from ``first`` to ``last`` (inclusive) ran exactly once."""
    counts = Counter(window_of(r[0]) for r in runs)
    missing = [w for w in range(first, last + 1) if counts[w] == 0]
    doubled = [w for w, n in counts.items() if n > 1]
    say(f"observed: windows {first}..{last}: missing {missing}, run twice {doubled}")
    assert not missing and not doubled


def beat_conf(**conf):
    return {"TG_TEST_CONF": json.dumps({"taskguard_beat_leader_ttl": 3, **conf}), "TG_TEST_BEAT_TASK": "tg.slot_tick"}


@pytest.mark.parametrize(
    "every,leader_ttl,offsets", [(4.0, 3, (-1.5, 0.0, 0.3)), (10.0, 6, (-2.0,))], ids=["every4s-ttl3", "every10s-ttl6"]
)
def test_killing_the_leader_around_window_starts_loses_no_window(beat_env, every, leader_ttl, offsets):
    """Two beats; the leader is SIGKILLed before a window starts, at its start and just after it (a
    replacement standby started each time). Every window runs exactly once, each late by at most
    the leader TTL + one loop + a margin. Before, the window after a kill just before it was never
    published: the standby took over only at the next one. (``every10s-ttl6``: the reported case.)"""
    app, queue, prefix, tmp = beat_env
    env = beat_conf(taskguard_beat_leader_ttl=leader_ttl)
    EVERY = every
    delays = []
    with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
        beats = [BeatProcess(queue, prefix, tmp, n, every=EVERY, env=env).start() for n in ("a", "b")]
        leader_pid(app)
        time.sleep(EVERY)  # both up, a window or so run
        first = math.floor(time.time() / EVERY) + 1
        for i, offset in enumerate(offsets):
            start = (math.floor(time.time() / EVERY) + 2) * EVERY
            sleep_until(start + offset)
            pid = leader_pid(app)
            os.kill(pid, signal.SIGKILL)
            say(f"injected: SIGKILL of the leader beat {offset:+.1f} s from the window starting at {start:.0f}")
            beats.append(BeatProcess(queue, prefix, tmp, f"r{i}", every=EVERY, env=env).start())
            # the bound: the dead leader's lease runs out (up to its TTL after its last renewal),
            # plus one loop of the standby, plus a margin for the publish and the worker
            sleep_until(start + leader_ttl + 1.0 + 1.5)
            runs = {window_of(r[0]): r[2] for r in slot_runs(app)}
            w = round(start / EVERY)
            assert w in runs, f"window {w} not run: {sorted(runs)}"
            delays.append(runs[w] - start)
        last = math.floor(time.time() / EVERY)
        time.sleep(EVERY)
        outputs = [b.output() for b in beats]
        for b in beats:
            b.stop()
    say(f"observed: delay of the windows after each kill (s): {[round(d, 2) for d in delays]}")
    check_every_window_once(slot_runs(app), first, last)
    assert max(delays) <= leader_ttl + 1.0 + 1.5
    assert any("is waiting: beat" in o for o in outputs)  # a follower says it waits, and for whom


@pytest.mark.parametrize("mode", ["claim", "publish"])
def test_a_leader_dying_between_claim_publish_and_confirm_loses_and_doubles_nothing(beat_env, mode):
    """The leader SIGKILLs itself once, after claiming a slot but before publishing it ("claim"),
    or after publishing it but before confirming it ("publish"). The next leader publishes the slot
    again; the worker runs it once (both messages name the slot). The interval (8 s) leaves the
    next leader room to take over (leader TTL 3 s + a loop) before the following slot falls due,
    even on a loaded machine: with 4 s it sometimes came after it, and then rightly published that
    later slot instead."""
    app, queue, prefix, tmp = beat_env
    every = 8.0
    flag = tmp / "crash-once"
    env = {**beat_conf(), "TG_TEST_CRASH_FLAG": str(flag), "TG_TEST_CRASH_MODE": mode}
    with WorkerProcess(queue, prefix, pool="threads", concurrency=4):
        beats = [
            BeatProcess(
                queue, prefix, tmp, n, every=every, env=env, scheduler="tests.beat_schedulers:CrashingScheduler"
            ).start()
            for n in ("a", "b")
        ]
        leader_pid(app)
        time.sleep(every)
        first = math.floor(time.time() / every) + 1
        flag.write_text("1")
        say(f"injected: the leader SIGKILLs itself after the {mode} step of its next publish")
        deadline = time.monotonic() + 2 * every + 5
        while not (tmp / "crash-once.taken").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp / "crash-once.taken").exists()
        time.sleep(2 * every)
        last = math.floor(time.time() / every) - 1
        time.sleep(1.0)
        outputs = "".join(b.output() for b in beats)
        for b in beats:
            b.stop()
    runs = slot_runs(app)
    check_every_window_once(runs, first, last)
    assert "publishing it again" in outputs


def test_runs_queued_across_a_beat_restart_all_execute(beat_env):
    """One beat, an entry every 2 s, no worker while runs queue up; the beat is stopped gracefully
    and started again (a deploy), then a worker (-c 1) starts. Every published run executes once;
    before, the runs published before the restart ended as Skipped(reason="stale_leader"). The
    fresh beat's first run is at the first window start after it started (not an interval later)."""
    app, queue, prefix, tmp = beat_env
    env = beat_conf()
    every = 2.0
    started = time.time()
    beat = BeatProcess(queue, prefix, tmp, "a", every=every, env=env).start()
    time.sleep(7.0)
    beat.stop()
    out1 = beat.output()
    beat2 = BeatProcess(queue, prefix, tmp, "a2", every=every, env=env).start()
    time.sleep(4.0)
    beat2.stop()
    published = [line for line in (out1 + beat2.output()).splitlines() if "publishing tick slot" in line]
    say(f"injected: a graceful beat restart with {len(published)} runs published and queued, no worker")
    with WorkerProcess(queue, prefix, pool="solo", concurrency=1):
        deadline = time.monotonic() + 30
        while len(slot_runs(app)) < len(published) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
    runs = slot_runs(app)
    slots = [r[0] for r in runs]
    say(f"observed: {len(runs)} runs of {len(published)} published; slots {slots}")
    assert len(published) >= 4 and len(runs) == len(published) and len(set(slots)) == len(slots)
    first_window = min(window_of(s) for s in slots)
    assert first_window * every >= started - 0.01  # not the window the beat started in
    assert first_window * every <= started + every + 2.0  # the first window start after it started


@pytest.mark.parametrize("value", [-5, float("nan"), float("inf"), 0, 0.5, "30", 1e9, True])
def test_a_bad_leader_ttl_is_refused_when_the_scheduler_is_set_up(value, tmp_path):
    app = Celery("badttl", set_as_current=False)
    app.conf.taskguard_locks = MemoryLocks()
    app.conf.taskguard_beat_leader_ttl = value
    with pytest.raises(ConfigError, match="taskguard_beat_leader_ttl"):
        TaskguardScheduler(app, schedule_filename=str(tmp_path / "s"))


def test_beat_settings_defaults_and_catch_up(tmp_path):
    from taskguard_celery.config import BEAT_SKEW, beat_settings

    app = Celery("settings", set_as_current=False)
    s = beat_settings(app, 1.0)
    assert (s.leader_ttl, s.catch_up, s.name) == (30.0, 30.0 + 1.0 + BEAT_SKEW, "settings")
    app.conf.taskguard_beat_catch_up = 0
    assert beat_settings(app, 1.0).allowed_lateness == 1.0 + BEAT_SKEW  # 0 = no catch-up, a loop's lateness
    app.conf.beat_max_loop_interval = 20
    app.conf.taskguard_beat_leader_ttl = 30
    with pytest.raises(ConfigError, match="beat_max_loop_interval"):
        TaskguardScheduler(app, schedule_filename=str(tmp_path / "s"))
    app.conf.taskguard_beat_catch_up = -1
    app.conf.beat_max_loop_interval = 0
    with pytest.raises(ConfigError, match="taskguard_beat_catch_up"):
        TaskguardScheduler(app, schedule_filename=str(tmp_path / "s2"))
    app.conf.taskguard_beat_catch_up = None
    for name in ("", 0, False, "  "):
        app.conf.taskguard_beat_name = name
        with pytest.raises(ConfigError, match="taskguard_beat_name"):
            beat_settings(app, 1.0)


@pytest.mark.parametrize("setting, value", [("taskguard_beat_leader_ttl", -5), ("taskguard_beat_catch_up", -1)])
def test_a_bad_setting_stops_celery_beat_at_start_naming_it(beat_env, setting, value):
    app, queue, prefix, tmp = beat_env
    beat = BeatProcess(queue, prefix, tmp, "bad", env={"TG_TEST_CONF": json.dumps({setting: value})})
    beat.start()
    beat.proc.wait(30)
    out = beat.output()
    beat.stop()
    say(f"observed: beat exited {beat.proc.returncode}, {len(out.splitlines())} lines of output")
    assert beat.proc.returncode == 78 and setting in out  # EX_CONFIG
    # one clear line, not Celery's traceback written one character per log line (stderr is a logger)
    assert out.count("taskguard beat cannot start:") == 1 and "Traceback" not in out, out[-3000:]
    assert len(out.splitlines()) < 40, out[-3000:]


class _Recorder:
    """Below the mixin: records what would be published (entry, slot) instead of publishing."""

    published: list

    def apply_async(self, entry, producer=None, advance=True, **kwargs):
        header = (entry.options.get("headers") or {}).get("taskguard_beat") or {}
        self.published.append((entry.name, header.get("slot")))
        return None


class _FakeTime:
    def __init__(self, now):
        self.now = now

    def time(self):
        return self.now


@pytest.mark.parametrize("catch_up", [None, 0])
def test_the_catch_up_window_decides_what_a_new_leader_publishes(catch_up, tmp_path):
    """Two schedulers in-process on one simulated clock, an entry every 10 s, leader TTL 6 s. The
    leader dies 1.5 s before window 102; the follower takes over about 4.5 s after that window
    started. With the default window (6 + 1 + 2 = 9 s) it publishes window 102 late; with
    ``taskguard_beat_catch_up = 0`` (a loop + 2 s of lateness only) it logs it as missed. Both
    publish window 103 on time, and neither publishes the window the beats started in."""
    from celery.beat import PersistentScheduler

    from taskguard.heartbeat import get_heartbeat
    from taskguard_celery.beat import SingletonBeatMixin

    clock = _FakeTime(1000.5)
    app = Celery("catchup", set_as_current=False, broker="memory://")
    app.now = lambda: datetime.fromtimestamp(clock.time(), timezone.utc)  # the scheduler's clock
    app.conf.taskguard_locks = MemoryLocks(clock=clock.time)
    app.conf.taskguard_beat_leader_ttl = 6
    if catch_up is not None:
        app.conf.taskguard_beat_catch_up = catch_up
    app.conf.beat_schedule = {"e": {"task": "t", "schedule": 10.0}}
    published: list = []

    class Sched(SingletonBeatMixin, _Recorder, PersistentScheduler):
        pass

    Sched.published = published
    a = Sched(app, schedule_filename=str(tmp_path / "a"))
    b = Sched(app, schedule_filename=str(tmp_path / "b"))

    def step(s, at):
        clock.now = at
        if s.taskguard_periodic.lease is not None:
            s.taskguard_periodic.lease.renew()  # what the heartbeat thread does on the real clock
        s.taskguard_leader()
        entry = s.schedule["e"]
        due, _ = s.is_due(entry)
        if due:
            s.apply_entry(entry)

    def run(beats, start, until):
        t = start
        while t < until:
            for s in beats:
                step(s, t)
            t = round(t + 0.5, 3)

    run([a, b], 1000.5, 1018.5)  # both tick (and renew) every 0.5 s
    get_heartbeat().discard(a.taskguard_periodic.lease)  # the leader dies at 1018.5: its lease runs out at ~1024.5
    run([b], 1018.5, 1031.0)
    windows = [int(slot.split(":")[1]) for _, slot in published]
    say(f"catch_up={catch_up}: published windows {windows}; b's stats {dict(b.taskguard_stats)}")
    if catch_up is None:
        assert windows == [101, 102, 103]
        assert b.taskguard_stats["leadership_lost"] == 0
    else:
        assert windows == [101, 103] and b.taskguard_stats["missed_slots"] == 1
    # a longer gap: nobody leads from 1031 to 1066 (b dies, a comes back late); a publishes the
    # latest slot only if it is within the window, and counts the ones that fell due meanwhile
    get_heartbeat().discard(b.taskguard_periodic.lease)
    run([a], 1066.0, 1071.0)
    windows = [int(slot.split(":")[1]) for _, slot in published]
    say(f"after a gap: published windows {windows}; a's stats {dict(a.taskguard_stats)}")
    if catch_up is None:
        assert windows[-2:] == [106, 107] and a.taskguard_stats["missed_slots"] == 2  # 104, 105
    else:
        assert windows[-1] == 107 and 106 not in windows and a.taskguard_stats["missed_slots"] == 3
    for s in (a, b):
        s.close()


_DRIFTING: dict = {"now": 0.0, "rng": __import__("random").Random(7)}


class _DriftingClock:
    @staticmethod
    def time():
        _DRIFTING["now"] += _DRIFTING["rng"].uniform(1e-6, 5e-5)  # every read moves on, by a varying bit
        return _DRIFTING["now"]


def _drifting_now():
    return datetime.fromtimestamp(_DriftingClock.time(), timezone.utc)


def test_a_crontab_entry_is_published_once_per_instant_by_a_ticking_leader(tmp_path):
    """One leader ticking every second through five minutes of an every-minute crontab on a
    simulated clock that moves on at every read: each minute is published exactly once. Before, the instant
    drifted by microseconds between calls (``remaining_estimate`` reads the clock again), so a
    minute could be published twice."""
    from celery.beat import PersistentScheduler

    from taskguard_celery.beat import SingletonBeatMixin

    start = datetime(2026, 12, 1, 9, 0, 30, tzinfo=timezone.utc)
    clock = _DRIFTING
    clock["now"] = start.timestamp()
    Clock = _DriftingClock
    app = Celery("cron1", set_as_current=False, broker="memory://")
    app.now = _drifting_now  # the scheduler's clock
    app.conf.taskguard_locks = MemoryLocks(clock=Clock.time)
    app.conf.taskguard_beat_leader_ttl = 30
    app.conf.beat_schedule = {"m": {"task": "t", "schedule": crontab(minute="*", nowfun=_drifting_now)}}
    published: list = []

    class Sched(SingletonBeatMixin, _Recorder, PersistentScheduler):
        pass

    Sched.published = published
    s = Sched(app, schedule_filename=str(tmp_path / "c"))
    for _ in range(300):
        clock["now"] += 1.0
        s.taskguard_leader()
        entry = s.schedule["m"]
        due, _ = s.is_due(entry)
        if due:
            s.apply_entry(entry)
    s.close()
    slots = [slot for _, slot in published]
    say(f"published: {slots}")
    assert len(slots) == len(set(slots)) == 5
    assert all(int(x.split(":")[1]) % 60 == 0 for x in slots)


class _FailFirstPublish(_Recorder):
    failures = 1

    def apply_async(self, entry, producer=None, advance=True, **kwargs):
        if type(self).failures > 0:
            type(self).failures -= 1
            raise ConnectionError("broker unreachable (injected)")
        return super().apply_async(entry, producer, advance, **kwargs)


def test_a_failed_publish_is_tried_again_within_a_second_not_at_the_next_slot(tmp_path):
    """Celery's own tick loop, an entry every 4 s; the first publish raises (a broker blip). The
    slot is published a second later. Before, Celery re-heaped the entry at its next slot, and
    the failed slot was never published."""
    from celery.beat import PersistentScheduler

    from taskguard_celery.beat import SingletonBeatMixin

    app = Celery("blip", set_as_current=False, broker="memory://")
    app.conf.taskguard_locks = MemoryLocks()
    app.conf.taskguard_beat_leader_ttl = 5
    app.conf.beat_schedule = {"e": {"task": "t", "schedule": 4.0}}
    published: list = []

    class Sched(SingletonBeatMixin, _FailFirstPublish, PersistentScheduler):
        pass

    Sched.published = published
    Sched.failures = 1
    s = Sched(app, schedule_filename=str(tmp_path / "b"))
    # the scheduler is up well before the window starts (a loaded machine took over 0.3 s to
    # make it; it then started after the window's start, whose slot is by design not its to run)
    start = math.floor(time.time() / 4.0) * 4.0 + 4.0
    if start - time.time() < 1.5:
        start += 4.0
    window = round(start / 4.0)
    sleep_until(start - 1.0)
    end = start + 3.0  # (the failed publish at the start, its retry a second later; not the next slot)
    while time.time() < end:
        time.sleep(min(max(s.tick(), 0.0), 0.2))
    s.close()
    slots = [slot for _, slot in published]
    say(f"published after a failed first publish: {slots}; stats {dict(s.taskguard_stats)}")
    assert slots == [f"every4s:{window}"] and s.taskguard_stats["unpublished_slots"] == 1
