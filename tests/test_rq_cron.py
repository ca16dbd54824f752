"""Singleton periodic jobs for RQ: real ``taskguard rq-cron`` processes (and, as the control, real
``rq cron`` processes) on one ``rq cron`` configuration (tests/rq_cron_config.py), real ``rq
worker`` processes, real Redis. Schedules are scaled down to seconds."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from datetime import timezone
from pathlib import Path

import pytest
from rq.job import Job, JobStatus

from taskguard import ConfigError
from taskguard.schedule.periodic import Slot
from taskguard_rq import locks_for
from taskguard_rq.cron import RQCronScheduler, slot_job_id

from .test_rq import RQWorker, log, wait_done

ROOT = Path(__file__).resolve().parent.parent
LEADER_TTL = 3.0


def say(*parts):
    print("   ", *parts, flush=True)


class CronProcess:
    """A real ``taskguard rq-cron tests.rq_cron_config`` (or, ``plain=True``, RQ's own ``rq cron``)."""

    def __init__(
        self,
        queue,
        entries,
        *args: str,
        plain: bool = False,
        env: dict | None = None,
        config: str = "tests.rq_cron_config",
    ):
        self.log_path = Path(tempfile.gettempdir()) / f"tg-rqcron-{queue.name}-{time.time_ns()}.log"
        url = os.environ["TASKGUARD_REDIS_URL"]
        if plain:
            self.args = [sys.executable, "-m", "rq.cli", "cron", "-u", url, config]
        else:
            self.args = [
                sys.executable,
                "-m",
                "taskguard.cli",
                "rq-cron",
                "--leader-ttl",
                str(LEADER_TTL),
                *args,
                config,
            ]
        self.env = {**os.environ, "TG_TEST_QUEUE": queue.name, "TG_TEST_CRON": json.dumps(entries), **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> CronProcess:
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, text: str = "cron time zone", timeout: float = 20.0) -> CronProcess:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if not self.alive() or time.monotonic() > deadline:
                raise AssertionError(f"scheduler did not start:\n{self.output()}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


@pytest.fixture
def cron_env(rq_env, prefix):
    """The test's queue; afterwards, RQ's cron registry forgets the test's entries (their history
    and job keys contain the prefix and go with it)."""
    yield rq_env
    conn = rq_env.connection
    ours = [m for m in conn.zrange("rq:cron_jobs", 0, -1) if prefix.encode() in m]
    if ours:
        conn.zrem("rq:cron_jobs", *ours)


def entry(name, prefix, job="tick", **register):
    return {"job": job, "name": f"{name}-{prefix}", "kwargs": {"entry": name}, **register}


def runs(queue):
    """(entry, slot, job id, time) of every periodic job run, in order."""
    out = []
    for e in log(queue):
        if e.startswith("cron|"):
            _, name, slot, job_id, at = e.split("|")
            out.append((name, slot, job_id, float(at)))
    return out


def window(slot):
    return int(slot.rsplit(":", 1)[1])


def sleep_until(ts):
    time.sleep(max(0.0, ts - time.time()))


def leader_pid(prefix, timeout=20.0, name="default"):
    locks = locks_for()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = locks.holder(f"rq-cron-leader:{name}")
        if info is not None:
            return int(info.holder["rq-cron"].split(":")[1])
        time.sleep(0.05)
    raise AssertionError("no rq-cron scheduler became the leader")


def enqueued(queue, name):
    """Job ids RQ's cron history holds for the entry ``name`` (every job it spawned)."""
    from rq.cron import get_cron_job_ids

    return get_cron_job_ids(name, queue.connection)


# -- 1. two schedulers, one config --------------------------------------------------------------------
EVERY = 2.0


def test_two_schedulers_enqueue_each_interval_window_once(cron_env, prefix):
    """Issue input 1, scaled (interval 2 s, 12 s): two schedulers of one config. Each epoch-aligned
    window is enqueued once, as a job named after its slot carrying the slot in its meta; RQ's
    cron history and registry show the jobs; a follower says once who leads."""
    e = entry("tick", prefix, interval=EVERY)
    with RQWorker(cron_env):
        scheds = [CronProcess(cron_env, [e]).start() for _ in range(2)]
        for s in scheds:
            s.wait_ready()
        started = time.time()
        time.sleep(12.0)
        stopped = time.time()
        from rq.cron import CronScheduler

        shown = [s for s in CronScheduler.all(cron_env.connection) if e["name"] in [j.name for j in s.get_jobs()]]
        outputs = [s.output() for s in scheds]
        for s in scheds:
            s.stop()
        time.sleep(1.0)
    got = runs(cron_env)
    windows = Counter(window(slot) for _, slot, _, _ in got)
    first, last = math.floor(started / EVERY) + 1, math.floor(stopped / EVERY)
    say(f"observed: {len(got)} runs for windows {first}..{last}; run twice: {[w for w, n in windows.items() if n > 1]}")
    assert not [w for w, n in windows.items() if n > 1]
    assert all(windows[w] == 1 for w in range(first, last + 1))
    for _name, slot, job_id, at in got:
        assert job_id == slot_job_id("default", e["name"], f"every{EVERY:g}s-{window(slot)}")
        assert 0 <= at - window(slot) * EVERY < 2.0  # at the window start (plus the worker's pickup)
    history = enqueued(cron_env, e["name"])
    assert sorted(history) == sorted(j for _, _, j, _ in got)  # RQ's own history shows each job once
    assert e["name"].encode() in cron_env.connection.zrange("rq:cron_jobs", 0, -1)
    assert len(shown) == 2  # both in RQ's scheduler registry while running, with the entry
    assert sum("is waiting: rq-cron" in o for o in outputs) == 1  # the follower, once
    assert sum(o.count("is waiting: rq-cron") for o in outputs) == 1
    job = Job.fetch(got[0][2], connection=cron_env.connection)
    assert job.meta["taskguard_cron"]["slot"] == got[0][1] and job.meta["taskguard_cron"]["entry"] == e["name"]


def test_control_two_plain_rq_cron_enqueue_every_interval_twice(cron_env, prefix):
    """The control for input 1: RQ's own ``rq cron``, two processes, one config: each enqueues every
    interval (and once at its start), so the jobs are about twice the windows."""
    e = entry("tick", prefix, interval=EVERY)
    e.pop("job")
    scheds = [CronProcess(cron_env, [e], plain=True).start() for _ in range(2)]
    time.sleep(7.0)
    for s in scheds:
        s.stop()
    jobs = enqueued(cron_env, e["name"])
    say(f"observed: plain rq cron enqueued {len(jobs)} jobs in about 7 s at interval {EVERY:g} s")
    assert len(jobs) >= 2 * (7.0 / EVERY) - 1  # each window at least twice (one per process)


# -- 2. restarted every 2 s with interval=6 (the 20 s / 60 s, scaled) --------------------------
RESTART_EVERY, LONG = 2.0, 6.0


def restart_loop(queue, entries, seconds, plain=False):
    """One scheduler at a time, stopped (SIGTERM) 2 s after it is up and started again (a deploy
    loop; counted from the process's start-up, which takes seconds on a loaded machine, so that
    every process gets its 2 s of scheduling)."""
    end, outputs, starts = time.time() + seconds, [], 0
    while time.time() < end:
        s = CronProcess(queue, entries, plain=plain).start()
        starts += 1
        s.wait_ready("registering birth")  # (RQ's CronScheduler, in both schedulers)
        time.sleep(RESTART_EVERY)
        s.stop()
        outputs.append(s.output())
    return outputs, starts


def test_a_scheduler_restarted_every_2s_enqueues_only_at_window_starts(cron_env, prefix):
    """Issue input 2, scaled: interval 6 s; a scheduler that has run the entry is then restarted
    every 2 s for 14 s (the only scheduler). Each window start from its first run on is enqueued
    once (including a start that fell between two processes, caught up by the next: the entry's
    slot record says it runs); a restart enqueues nothing that was enqueued already. (A slot that
    fell due before any scheduler ran the entry is not caught up: the first run of an entry is
    its first slot after a start.)"""
    e = entry("long", prefix, interval=LONG)
    with RQWorker(cron_env):
        first_run = CronProcess(cron_env, [e]).start()
        deadline = time.monotonic() + 3 * LONG
        while not runs(cron_env) and time.monotonic() < deadline:
            time.sleep(0.1)
        first_run.stop()
        assert runs(cron_env), first_run.output()
        outputs, starts = restart_loop(cron_env, [e], 14.0)
        stopped = time.time()
        time.sleep(1.0)
    got = runs(cron_env)
    windows = Counter(window(slot) for _, slot, _, _ in got)
    first, last = min(windows), math.floor((stopped - 1.0) / LONG)
    say(f"observed: {starts} restarts, {len(got)} runs, windows {sorted(windows)} (expected {first}..{last})")
    assert not [w for w, n in windows.items() if n > 1]
    assert set(windows) >= set(range(first, last + 1)), "\n---\n".join(outputs)  # (their logs)
    assert set(windows) <= set(range(first, last + 2))
    assert len(got) - 1 < starts
    assert len(enqueued(cron_env, e["name"])) == len(got)


def test_control_plain_rq_cron_restarted_every_2s_enqueues_at_every_start(cron_env, prefix):
    """The control for input 2: ``rq cron`` enqueues an interval job at every start. (An interval
    five times input 2's, so that the restarts outnumber the windows they span however long each
    start-up takes on a loaded machine: with 6 s, four slow starts spanned four windows.)"""
    interval = 5 * LONG
    e = entry("long", prefix, interval=interval)
    e.pop("job")
    started = time.time()
    _, starts = restart_loop(cron_env, [e], 12.0, plain=True)
    windows = math.floor(time.time() / interval) - math.floor(started / interval) + 1  # the windows it spanned
    jobs = enqueued(cron_env, e["name"])
    say(f"observed: plain rq cron, {starts} starts over {windows} windows of {interval:g} s: {len(jobs)} jobs")
    assert len(jobs) >= starts > windows


# -- 3. the leader SIGKILLed 1 s before a window (interval and cron) -----------------------------------
def test_sigkill_of_the_leader_1s_before_a_window_hands_over_once(cron_env, prefix):
    """Issue input 3: two schedulers with an interval entry (6 s) and a ``cron="*/1 * * * *"``
    entry; the leader is SIGKILLed 1 s before a minute starts (a window of both). The standby
    enqueues that slot of each entry late by at most the leader TTL + one loop (+ margin), never
    twice, never lost; every other window runs once too. (Lateness is the job's ``enqueued_at``,
    the scheduler's part; the worker may take longer to run it on a loaded machine.)"""
    entries = [entry("iv", prefix, interval=LONG), entry("cr", prefix, cron="*/1 * * * *")]
    with RQWorker(cron_env):
        scheds = [CronProcess(cron_env, entries).start() for _ in range(2)]
        for s in scheds:
            s.wait_ready()
        boundary = (math.floor(time.time() / 60) + 1) * 60
        if boundary - time.time() < 4:
            boundary += 60
        first = math.floor(time.time() / LONG) + 1
        sleep_until(boundary - 1.0)
        pid = leader_pid(prefix)
        os.kill(pid, signal.SIGKILL)
        say(f"injected: SIGKILL of the leader (pid {pid}) 1 s before {boundary:.0f}")
        standby = [s for s in scheds if s.proc.pid != pid][0]
        sleep_until(boundary + LEADER_TTL + 1.0 + 1.5)
        last = math.floor(time.time() / LONG) - 1

        def at_the_kill(got):
            return {
                name: job_id
                for name, slot, job_id, _ in got
                if (name == "iv" and window(slot) * LONG == boundary) or (name == "cr" and slot == f"at:{boundary}")
            }

        def all_ran():
            got = runs(cron_env)
            ran = Counter(window(slot) for name, slot, _, _ in got if name == "iv")
            return set(at_the_kill(got)) == {"iv", "cr"} and all(ran[w] for w in range(first, last + 1))

        deadline = time.monotonic() + 30
        while not all_ran() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        outputs = standby.output()
        for s in scheds:
            s.stop()
    got = runs(cron_env)
    late = {}
    for name, job_id in at_the_kill(got).items():
        enqueued_at = Job.fetch(job_id, connection=cron_env.connection).enqueued_at
        if enqueued_at.tzinfo is None:  # (RQ < 2 stores naive UTC)
            enqueued_at = enqueued_at.replace(tzinfo=timezone.utc)
        late[name] = enqueued_at.timestamp() - boundary
    say(f"observed: the slot at the kill enqueued late by (s): { {k: round(v, 2) for k, v in late.items()} }")
    assert set(late) == {"iv", "cr"}, outputs
    assert max(late.values()) <= LEADER_TTL + 1.0 + 1.5, outputs
    iv = Counter(window(slot) for name, slot, _, _ in got if name == "iv")
    cr = Counter(slot for name, slot, _, _ in got if name == "cr")
    assert not [w for w, n in iv.items() if n > 1] and not [s for s, n in cr.items() if n > 1]
    assert all(iv[w] == 1 for w in range(first, last + 1))
    assert cr[f"at:{boundary}"] == 1
    assert "is the leader" in outputs


# -- a leader paused past its lease (rq-scheduler#312: a cycle longer than the lock's TTL let a second
# instance enqueue beside the first) ------------------------------------------------------------------
def test_a_leader_paused_past_its_lease_enqueues_nothing_when_it_resumes(cron_env, prefix):
    """The leader is SIGSTOPped for twice its leader TTL (a GC pause, a throttled container, a cycle
    that outlasts the lock: rq-scheduler#312) while windows of an interval entry fall due, then
    SIGCONTinued. The standby leads meanwhile; the resumed process, whose lease was taken over,
    enqueues nothing (its claims are fenced): no window runs twice, and every window from the
    resume on runs once."""
    e = entry("pause", prefix, interval=EVERY)
    with RQWorker(cron_env):
        scheds = [CronProcess(cron_env, [e]).start() for _ in range(2)]
        for s in scheds:
            s.wait_ready()
        time.sleep(EVERY + 0.5)
        pid = leader_pid(prefix)
        os.kill(pid, signal.SIGSTOP)
        say(f"injected: SIGSTOP of the leader (pid {pid}) for {2 * LEADER_TTL:g} s")
        try:
            time.sleep(2 * LEADER_TTL)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.time()
        time.sleep(3 * EVERY)
        stopped = time.time()
        new_leader = leader_pid(prefix)
        for s in scheds:
            s.stop()
        time.sleep(1.0)
    got = runs(cron_env)
    windows = Counter(window(slot) for _, slot, _, _ in got)
    say(f"observed: {len(got)} runs; run twice: {[w for w, n in windows.items() if n > 1]}; leader after: {new_leader}")
    assert new_leader != pid  # the standby took over while the old leader was stopped
    assert not [w for w, n in windows.items() if n > 1]
    first, last = math.floor(resumed / EVERY) + 1, math.floor(stopped / EVERY)
    assert all(windows[w] == 1 for w in range(first, last + 1))
    assert len(enqueued(cron_env, e["name"])) == len(got)  # no job was enqueued that did not run


# -- 4. a slot enqueued twice makes one job ------------------------------------------------------------
def test_a_leader_dying_between_enqueue_and_confirm_makes_no_second_job(cron_env, prefix, tmp_path):
    """Issue input 4: the leader SIGKILLs itself once right after enqueuing a slot's job, before
    confirming the slot. The next leader enqueues that slot again: RQ's ``unique=True`` on the
    slot's job id makes no second job, and every window runs once."""
    flag = tmp_path / "crash-once"
    e = entry("long", prefix, interval=LONG)  # longer than the hand-over: the slot is still the latest
    env = {"TG_TEST_CRASH_FLAG": str(flag)}
    with RQWorker(cron_env):
        scheds = [CronProcess(cron_env, [e], env=env).start() for _ in range(2)]
        for s in scheds:
            s.wait_ready()
        time.sleep(1.0)
        first = math.floor(time.time() / LONG) + 1
        flag.write_text("1")
        deadline = time.monotonic() + 20
        while not (tmp_path / "crash-once.taken").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "crash-once.taken").exists()
        time.sleep(LEADER_TTL + 2 * LONG)
        last = math.floor(time.time() / LONG) - 1
        time.sleep(1.0)
        outputs = "".join(s.output() for s in scheds)
        for s in scheds:
            s.stop()
    got = runs(cron_env)
    windows = Counter(window(slot) for _, slot, _, _ in got)
    say(
        f"observed: windows {first}..{last}: run twice {[w for w, n in windows.items() if n > 1]}, "
        f"missing {[w for w in range(first, last + 1) if not windows[w]]}"
    )
    assert "publishing it again" in outputs and "is already there; not enqueued again" in outputs
    assert all(windows[w] == 1 for w in range(first, last + 1))
    assert not [w for w, n in windows.items() if n > 1]
    assert len(enqueued(cron_env, e["name"])) == len(got)


def write_config(tmp_path, body):
    """A config file: :data:`CONFIG_HEAD` and ``body`` (its own lines, unindented)."""
    path = tmp_path / f"cron_config_{time.time_ns()}.py"
    path.write_text(textwrap.dedent(CONFIG_HEAD) + textwrap.dedent(body) + "\n")
    return str(path)


CONFIG_HEAD = """
    import os
    from rq import cron
    from tests import rq_jobs
    Q = os.environ["TG_TEST_QUEUE"]
"""


def scheduler(queue, path, **settings):
    return RQCronScheduler(queue.connection, locks_for(), path, leader_ttl=LEADER_TTL, **settings)


def test_a_slot_published_twice_makes_one_job_and_its_retry_still_runs(cron_env, prefix, tmp_path, monkeypatch):
    """The enqueue of one slot, twice (what a second leader does for a slot claimed but not
    confirmed): one job; the second enqueue returns it. The job failing with a ``Retry`` runs again
    under the same id."""
    monkeypatch.setenv("TG_TEST_QUEUE", cron_env.name)
    path = write_config(
        tmp_path,
        f"""
    cron.register(rq_jobs.flaky, Q, args=("cron-{prefix}",), kwargs={{"fail_times": 1}}, interval=60,
                  name="flaky-{prefix}")
    """,
    )
    sched = scheduler(cron_env, path)
    entry_ = sched.periodic_entries[0]
    slot = Slot(entry=entry_.name, id="every60s:7", instant=420.0, keep=300.0, leader_key="k", leader_fence=1)
    first = sched.enqueue(entry_, slot)
    second = sched.enqueue(entry_, slot)
    assert first.id == second.id == slot_job_id("default", entry_.name, "every60s:7")
    assert cron_env.count == 1 and sched.stats["already_enqueued"] == 1
    assert enqueued(cron_env, entry_.name) == [first.id]
    # RQ's Retry of that job id: the failed first attempt runs again
    first.retries_left = 1
    first.retry_intervals = [0]
    first.save()
    with RQWorker(cron_env):
        assert wait_done(first, 30) == JobStatus.FINISHED
    assert first.latest_result().return_value is not None


@pytest.mark.parametrize("timeout", [7, -1])
def test_an_entrys_job_options_reach_its_job_and_never_its_arguments(cron_env, prefix, tmp_path, monkeypatch, timeout):
    """rq/rq#2316: RQ's cron stored ``timeout`` where ``enqueue`` reads ``job_timeout``, and the
    value landed in the function's keyword arguments. Each of ``register()``'s job options
    (``job_timeout`` — ``-1``, no limit, included —, ``result_ttl``, ``ttl``, ``failure_ttl``)
    reaches the job as RQ's own, and the function gets only its own arguments."""
    monkeypatch.setenv("TG_TEST_QUEUE", cron_env.name)
    path = write_config(
        tmp_path,
        f"""
    cron.register(rq_jobs.flaky, Q, args=("opts-{prefix}",), kwargs={{"fail_times": 0}}, interval=60,
                  job_timeout={timeout}, result_ttl=100, ttl=300, failure_ttl=200, name="opts-{prefix}")
    """,
    )
    sched = scheduler(cron_env, path)
    entry_ = sched.periodic_entries[0]
    slot = Slot(entry=entry_.name, id="every60s:9", instant=540.0, keep=300.0, leader_key="k", leader_fence=1)
    job = Job.fetch(sched.enqueue(entry_, slot).id, connection=cron_env.connection)
    assert (job.timeout, job.result_ttl, job.ttl, job.failure_ttl) == (timeout, 100, 300, 200)
    assert job.args == (f"opts-{prefix}",) and job.kwargs == {"fail_times": 0}


# -- entry options, the time zone, the configuration checked at start ----------------------------------
def test_entry_guard_options_travel_in_the_slot_and_set_the_runs_key_and_ttl(cron_env, prefix):
    """``meta={"taskguard": {"key": ..., "ttl": ...}}`` of a guarded job: checked at start, removed
    from the job's meta (the user's other meta kept), carried in the slot, applied by the worker."""
    e = entry(
        "g",
        prefix,
        job="guarded",
        interval=EVERY,
        meta={"team": "ops", "taskguard": {"key": "cronkey:{entry}", "ttl": 7}},
    )
    with RQWorker(cron_env):
        s = CronProcess(cron_env, [e]).start().wait_ready()
        deadline = time.monotonic() + 15
        while not runs(cron_env) and time.monotonic() < deadline:
            time.sleep(0.1)
        s.stop()
        got = runs(cron_env)
        assert got, s.output()
        job = Job.fetch(got[0][2], connection=cron_env.connection)
        assert wait_done(job) == JobStatus.FINISHED
    assert job.return_value()["key"] == "cronkey:g" and job.return_value()["ttl"] == 7
    assert job.meta["team"] == "ops"
    assert job.meta["taskguard_cron"]["key"] == "cronkey:{entry}" and job.meta["taskguard_cron"]["ttl"] == 7
    # the guard options went from the job's meta (the worker's mirror shows the rendered key only)
    assert "{entry}" not in json.dumps(job.meta["taskguard"]) and job.meta["taskguard"]["key"] == "cronkey:g"


def test_a_scheduler_whose_time_zone_differs_refuses_to_start(cron_env, prefix):
    """Cron instants are read in one zone: a second scheduler of the same name with another
    ``--timezone`` exits 78 naming both zones; one with the same zone runs."""
    e = entry("cr", prefix, cron="0 3 * * *")
    a = CronProcess(cron_env, [e], "--timezone", "Europe/Berlin").start().wait_ready()
    b = CronProcess(cron_env, [e], "--timezone", "America/New_York").start()
    assert b.proc.wait(30) == 78
    out = b.output()
    c = CronProcess(cron_env, [e], "--timezone", "Europe/Berlin").start().wait_ready()
    a.stop()
    c.stop()
    b.log.close()
    assert "'America/New_York'" in out and "'Europe/Berlin'" in out and "same --timezone" in out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    "body,message",
    [
        ("cron.register(rq_jobs.cron_tick, Q, intervall=5)", "unknown option 'intervall'; did you mean 'interval'?"),
        # (a keyword far from every one: listed as register's keywords, not as guard options)
        ('cron.register(rq_jobs.cron_tick, Q, interval=5, queue="x")', "unknown option 'queue' (its keywords: args, "),
        (
            'cron.register(rq_jobs.cron_guarded, Q, interval=5, meta={"taskguard": {"ttll": 5}})',
            "unknown option 'ttll'; did you mean 'ttl'?",
        ),
        (
            'cron.register(rq_jobs.cron_guarded, Q, interval=5, meta={"taskguard": {"once": True}})',
            "'once' is not supported here: set it on the @guarded_job function",
        ),
        (  # (not "set it on the @guarded_job function": @guarded_job refuses it too)
            'cron.register(rq_jobs.cron_guarded, Q, interval=5, meta={"taskguard": {"skip_max_retries": 5}})',
            "'skip_max_retries' is not supported here: it tunes on_skip='retry', which RQ jobs do not have",
        ),
        ('cron.register(rq_jobs.cron_tick, Q, interval=5, meta={"taskguard": {"ttl": 5}})', "not a @guarded_job"),
        ('cron.register(rq_jobs.cron_guarded, Q, interval=5, meta={"taskguard": {"key": "k:{nope}"}})', "nope"),
        ('cron.register(rq_jobs.cron_tick, Q, cron="61 * * * *")', "bad minute field '61'"),
        ('cron.register(rq_jobs.cron_tick, Q, interval=5, cron="* * * * *")', "interval or cron, not both"),
        ("cron.register(rq_jobs.cron_tick, Q)", "give interval=seconds or cron="),
        ("cron.register(rq_jobs.cron_tick, Q, interval=-1)", "interval must be"),
        (
            "cron.register(rq_jobs.cron_tick, Q, interval=5)\ncron.register(rq_jobs.cron_tick, Q, interval=9)",
            "two rq cron entries are named 'tests.rq_jobs.cron_tick'",
        ),
    ],
)
def test_a_bad_configuration_is_refused_at_start(cron_env, tmp_path, monkeypatch, body, message):
    monkeypatch.setenv("TG_TEST_QUEUE", cron_env.name)
    path = write_config(tmp_path, body)
    with pytest.raises(ConfigError, match=None) as info:
        scheduler(cron_env, path)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"leader_ttl": 0.5}, "--leader-ttl must be at least twice"),
        ({"timezone": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
        ({"catch_up": -1}, "--catch-up"),
        ({"name": ""}, "--name must be a non-empty str"),
    ],
)
def test_bad_settings_are_refused_at_start(cron_env, tmp_path, monkeypatch, settings, message):
    monkeypatch.setenv("TG_TEST_QUEUE", cron_env.name)
    path = write_config(tmp_path, "cron.register(rq_jobs.cron_tick, Q, interval=5)")
    with pytest.raises(ConfigError) as info:
        RQCronScheduler(cron_env.connection, locks_for(), path, **{"leader_ttl": LEADER_TTL, **settings})
    assert message in str(info.value)


def test_the_command_exits_78_on_a_refused_configuration_and_names_the_keyword(cron_env, tmp_path):
    path = write_config(tmp_path, "cron.register(rq_jobs.cron_tick, Q, intervall=5)")
    s = CronProcess(cron_env, [], config=path).start()
    assert s.proc.wait(30) == 78
    out = s.output()
    s.log.close()
    assert "taskguard rq-cron cannot start" in out and "did you mean 'interval'?" in out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    "env, says",
    [
        ({"TASKGUARD_RQ_CRON_CATCH_UP": "soon"}, "TASKGUARD_RQ_CRON_CATCH_UP (--catch-up): must be a number"),
        ({"TASKGUARD_RQ_CRON_TIMEZONE": "Mars/X"}, "TASKGUARD_RQ_CRON_TIMEZONE (--timezone): unknown time zone"),
    ],
)
def test_a_bad_setting_from_the_environment_exits_78_naming_the_variable(cron_env, tmp_path, env, says):
    """Settings given in the environment are checked at start like the options: exit 78, one line
    naming the variable (before, a non-number exited 2 with click's own message, naming the option).
    (The leader TTL is read the same way as the catch-up window; these processes pass --leader-ttl.)"""
    path = write_config(tmp_path, "cron.register(rq_jobs.cron_tick, Q, interval=5)")
    s = CronProcess(cron_env, [], config=path, env=env).start()
    assert s.proc.wait(30) == 78
    out = s.output()
    s.log.close()
    assert says in out and "Traceback" not in out, out


def test_the_cli_imports_no_rq():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, taskguard.cli; print('rq' in sys.modules)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "False"


def test_a_scheduler_stops_on_sigterm_and_hands_over_at_once(cron_env, prefix):
    """A stopped leader releases its lease: the standby leads within a loop, not a leader TTL."""
    e = entry("tick", prefix, interval=60)
    a = CronProcess(cron_env, [e]).start().wait_ready()
    pid = leader_pid(prefix)
    b = CronProcess(cron_env, [e]).start().wait_ready()
    leader, standby = (a, b) if a.proc.pid == pid else (b, a)
    t0 = time.monotonic()
    leader.stop()
    while leader_pid(prefix) == pid:
        time.sleep(0.05)
    took = time.monotonic() - t0
    standby.stop()
    say(f"observed: hand-over after a graceful stop took {took:.2f} s")
    assert took < 2.5


def test_cron_entries_name_instants_in_the_configured_zone_not_the_hosts(cron_env, tmp_path, monkeypatch):
    """``cron="0 3 * * *"`` with ``--timezone Europe/Berlin`` is due at 03:00 Berlin time (01:00
    UTC in summer, 02:00 in winter) whatever the host's own zone (``TZ`` set elsewhere here)."""
    from datetime import datetime, timezone

    monkeypatch.setenv("TG_TEST_QUEUE", cron_env.name)
    monkeypatch.setenv("TZ", "America/Los_Angeles")
    time.tzset()
    try:
        path = write_config(tmp_path, 'cron.register(rq_jobs.cron_tick, Q, cron="0 3 * * *")')
        sched = scheduler(cron_env, path, timezone="Europe/Berlin")
        cron = sched.periodic_entries[0].schedule
        for now, due in [
            ("2026-07-01T12:00:00", "2026-07-01T01:00:00"),
            ("2026-12-01T12:00:00", "2026-12-01T02:00:00"),
        ]:
            now_ts = datetime.fromisoformat(now).replace(tzinfo=timezone.utc).timestamp()
            instant, _ = cron.latest(now_ts, 86400)
            assert datetime.fromtimestamp(instant, timezone.utc).isoformat() == due + "+00:00"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
