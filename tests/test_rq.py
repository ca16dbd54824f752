"""The RQ adapter with real ``rq worker`` processes on real Redis."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from rq import Queue, Retry
from rq.job import Job, JobStatus

import taskguard_rq
from taskguard import ConfigError, Skipped, TaskSkipped, is_skipped
from taskguard_rq import guarded_job, load_handle, skip_count

from . import rq_jobs

ROOT = Path(__file__).resolve().parent.parent


class RQWorker:
    def __init__(
        self, queue: Queue, *extra: str, worker_class: str = "taskguard_rq.GuardedWorker", url: str | None = None
    ):
        """``url``: the worker's own Redis (``-u``; default the leases' TASKGUARD_REDIS_URL)."""
        self.queue = queue
        self.log_path = Path(tempfile.gettempdir()) / f"tg-rq-{queue.name}-{time.time_ns()}.log"
        self.args = [
            sys.executable,
            "-m",
            "rq.cli",
            "worker",
            "-u",
            url or os.environ["TASKGUARD_REDIS_URL"],
            "-w",
            worker_class,
            "--with-scheduler",
            *extra,
            queue.name,
        ]

    def __enter__(self):
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=dict(os.environ), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 30
        while b"Listening on" not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rq worker did not start:\n{self.output()}")
            time.sleep(0.1)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __exit__(self, *exc):
        # its children now (its work-horse has a process group of its own): a horse the worker
        # leaves behind — one still waiting for a lease when a shutdown gave up on it — must not
        # run its job after the test (it would write RQ's registries after the test's clean-up)
        children = _children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        # and what is left of its session: the scheduler process of ``--with-scheduler`` outlives a
        # worker stopped while it was starting (it then holds the queue's scheduler lock). A horse
        # orphaned *during* the test (its worker killed) is the test's to end.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid, started in children:
            if _started(pid) == started:  # (the same process, not a PID used again)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait()
        self.log.close()


def _started(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/PID/stat`` field 22), or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _children(parent: int) -> list[tuple[int, str]]:
    """``(pid, start time)`` of the live children of process ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append((int(entry), fields[19].decode()))
    return found


def wait_done(job: Job, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = job.get_status(refresh=True)
        if status in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
            return status
        time.sleep(0.05)
    raise AssertionError(f"job {job.id} still {job.get_status()}")


def log(queue: Queue) -> list[str]:
    return [x.decode() for x in queue.connection.lrange("{" + os.environ["TASKGUARD_PREFIX"] + ":log}", 0, -1)]


def locks():
    return taskguard_rq.locks_for()


def test_two_concurrent_jobs_of_one_key_one_runs_one_skipped(rq_env):
    with RQWorker(rq_env) as w1, RQWorker(rq_env) as w2:  # two worker processes
        first = rq_env.enqueue(rq_jobs.slow, 1, seconds=3.0)
        deadline = time.monotonic() + 30  # (holds its lease: a fixed sleep was short on a loaded machine)
        while not any(e.startswith("slow:1:start") for e in log(rq_env)) and time.monotonic() < deadline:
            time.sleep(0.05)
        second = rq_env.enqueue(rq_jobs.slow, 1, meta={"team": "billing"})
        assert wait_done(second) == JobStatus.FINISHED
        assert wait_done(first) == JobStatus.FINISHED
        outputs = w1.output() + w2.output()
    # the skip's log line shows with `rq worker`'s default logging
    assert "skipped, lease 'slow:1' held" in outputs, outputs[-2000:]
    out = second.return_value()
    assert isinstance(out, Skipped) and out.reason == "held" and out.key == "slow:1"
    assert 0 < out.holder_ttl <= 5
    second.refresh()
    assert second.meta["team"] == "billing"  # the user's meta is kept
    assert second.meta["taskguard"]["outcome"] == "skipped" and second.meta["taskguard"]["reason"] == "held"
    first.refresh()
    assert first.meta["taskguard"]["outcome"] == "ran" and first.return_value()["n"] == 1
    assert "owner" not in str(first.meta) and "owner" not in str(second.meta)
    assert skip_count(rq_jobs.slow.taskguard_name) == 1
    counter = "{" + os.environ["TASKGUARD_PREFIX"] + ":rq-skips}:r:" + rq_jobs.slow.taskguard_name
    assert 0 < rq_env.connection.pttl(counter) <= 7 * 86400 * 1000  # a counter that goes when unused
    assert log(rq_env).count("slow:1:end") == 1
    assert locks().holder("slow:1") is None


def test_on_skip_raise_fails_the_job(rq_env):
    held = locks().acquire("raise:1", ttl=10).lease
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.strict, 1)
        assert wait_done(job) == JobStatus.FAILED
    held.release()
    assert "TaskSkipped" in job.latest_result().exc_string


def test_retry_claims_its_lease_same_fence_and_others_are_skipped_meanwhile(rq_env):
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.flaky, "a", fail_times=1, retry=Retry(max=2, interval=2), meta={"k": "v"})
        time.sleep(1.0)  # first attempt failed; the retry waits for its interval
        info = locks().holder("flaky:a")
        assert info is not None and info.ttl > 2  # ttl 2, stretched over the 2 s interval
        intruder = rq_env.enqueue(rq_jobs.flaky, "a", fail_times=0)
        assert wait_done(intruder) == JobStatus.FINISHED
        assert is_skipped(intruder.return_value())
        assert wait_done(job) == JobStatus.FINISHED
    fences = [int(e.split(":")[3]) for e in log(rq_env) if e.startswith("flaky:a:")]
    assert len(fences) == 2 and fences[0] == fences[1] == job.return_value() == info.fencing_token
    job.refresh()
    assert job.meta["k"] == "v" and job.meta["taskguard"]["outcome"] == "ran"
    assert locks().holder("flaky:a") is None and load_handle(locks(), job.id) is None


@pytest.mark.parametrize("how", ["raised", "returned"])
def test_a_job_its_caller_performs_keeps_no_lease_for_a_retry_that_never_comes(rq_env, how):
    """``Queue(is_async=False)`` performs the job in the caller, and RQ retries no such job (only a
    worker does: rq/worker ``handle_job_failure``). A failing body with ``retry=Retry(...)`` (or one
    returning RQ's ``Retry``) kept its lease "for the retry" — interval + TTL, its owner token in a
    handle record — and the key's next job was skipped all that time. Now it is released."""
    sync = Queue(rq_env.name, connection=rq_env.connection, is_async=False)
    if how == "raised":
        job = sync.enqueue(rq_jobs.flaky, "sync", fail_times=1, retry=Retry(max=3, interval=600))
        key, status = "flaky:sync", JobStatus.FAILED
    else:
        job = sync.enqueue(rq_jobs.returns_retry, "sync")
        key, status = "rr:sync", None  # (RQ's own bookkeeping of a returned Retry without a worker varies)
    assert status is None or job.get_status(refresh=True) == status
    assert locks().holder(key) is None and load_handle(locks(), job.id) is None
    assert job.get_meta(refresh=True)["taskguard"]["outcome"] in ("failed", "ran")
    again = (
        sync.enqueue(rq_jobs.flaky, "sync", fail_times=0)
        if how == "raised"
        else sync.enqueue(rq_jobs.returns_retry, "sync")
    )
    assert not is_skipped(again.return_value())


@pytest.mark.parametrize("how", ["ran", "failed", "retrying"])
def test_meta_another_process_saves_while_the_job_runs_is_kept(rq_env, how):
    """rq/rq#784 (the worker saving its own copy of ``job.meta`` over what was written meanwhile),
    brought back by the guard: its outcome mirror after the body saved the work-horse's copy of the
    meta, dropping a progress entry saved through another ``Job`` instance while the body ran."""
    with RQWorker(rq_env):
        retry = Retry(max=1, interval=30) if how == "retrying" else None
        job = rq_env.enqueue(rq_jobs.reports_progress, f"p-{how}", fail=how != "ran", retry=retry)
        if how == "retrying":
            deadline = time.monotonic() + 20
            while job.get_status(refresh=True) != JobStatus.SCHEDULED and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            assert wait_done(job) == (JobStatus.FINISHED if how == "ran" else JobStatus.FAILED)
    meta = job.get_meta(refresh=True)
    assert meta.get("progress") == 100 and meta["taskguard"]["outcome"] == how, meta
    if how == "retrying":
        job.cancel()
        locks().release_run(f"progress:p-{how}", job.id)


def test_a_job_its_caller_performs_is_never_deferred_to_a_worker_that_never_comes(rq_env):
    """A rate turn or a 429 back-off defers a worker's job through RQ's scheduler (a returned
    ``Retry``). A job its caller performs (``Queue(is_async=False)``) is run by no worker again: it
    ended FINISHED with that ``Retry`` as its value, its body never run, the 429 swallowed. It is
    settled as a direct call is: the rate turn waited for here (or skipped past
    ``rate_max_wait``), the ``RateLimited`` raised (the job FAILED)."""
    sync = Queue(rq_env.name, connection=rq_env.connection, is_async=False)
    first = sync.enqueue(rq_jobs.api_bounded, 1)
    assert first.return_value() == 1
    second = sync.enqueue(rq_jobs.api_bounded, 2)  # the rate (1/m) full: its turn is past rate_max_wait
    value = second.return_value()
    assert is_skipped(value) and value.reason == "rate_limited", value
    upstream = sync.enqueue(rq_jobs.upstream, 7, fail_on=7, pause=300)
    assert upstream.get_status(refresh=True) == JobStatus.FAILED
    assert "RateLimited" in (upstream.latest_result().exc_string or "")


def test_sigkilled_work_horse_with_retry_claims_the_kept_lease(rq_env):
    with RQWorker(rq_env) as worker:
        job = rq_env.enqueue(rq_jobs.killed, "k", retry=Retry(max=1, interval=1))
        assert wait_done(job) == JobStatus.FINISHED, worker.output()
        output = worker.output()
    entries = [e for e in log(rq_env) if e.startswith("kill:k:")]
    fences = [int(e.split(":")[3]) for e in entries]
    assert len(fences) == 2 and fences[0] == fences[1] == job.return_value()
    assert "lease 'kill:k' kept" in output
    assert locks().holder("kill:k") is None


def test_sigkilled_work_horse_without_retry_releases_promptly(rq_env):
    with RQWorker(rq_env) as worker:
        job = rq_env.enqueue(rq_jobs.killed, "n")
        assert wait_done(job) == JobStatus.FAILED
        time.sleep(0.3)
        assert locks().holder("kill:n") is None  # released by the main process, not by its TTL
        again = rq_env.enqueue(rq_jobs.slow, 3, seconds=0)
        assert wait_done(again) == JobStatus.FINISHED
        assert "lease 'kill:n' released" in worker.output()
    job.refresh()
    mirrored = job.meta["taskguard"]
    assert mirrored["outcome"] == "ended" and mirrored["ended"] == "work-horse killed" and "fence" in mirrored


def test_job_timeout_releases_the_lease(rq_env):
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.overrun, seconds=5, job_timeout=1)
        assert wait_done(job) == JobStatus.FAILED
    assert "JobTimeoutException" in job.latest_result().exc_string
    assert locks().holder("timeout") is None


def test_heartbeat_renews_in_the_work_horse(rq_env):
    with RQWorker(rq_env), RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.short_ttl, seconds=2.0)
        time.sleep(1.3)  # two TTLs in
        other = rq_env.enqueue(rq_jobs.short_ttl, seconds=0)
        assert wait_done(other) == JobStatus.FINISHED and is_skipped(other.return_value())
        assert wait_done(job) == JobStatus.FINISHED and isinstance(job.return_value(), int)


def test_direct_calls_are_guarded(rq_env):
    held = locks().acquire("slow:9", ttl=10).lease
    out = rq_jobs.slow(9, seconds=0)
    assert isinstance(out, Skipped) and out.reason == "held"
    with pytest.raises(TaskSkipped):
        held2 = locks().acquire("raise:9", ttl=10).lease
        try:
            rq_jobs.strict(9)
        finally:
            held2.release()
    held.release()
    assert rq_jobs.slow(9, seconds=0)["n"] == 9
    assert locks().holder("slow:9") is None


def test_bad_options_fail_at_declaration():
    with pytest.raises(ConfigError, match="missing"):

        @guarded_job(key="x:{missing}")
        def f(present):
            pass

    with pytest.raises(ConfigError, match="on_skip"):

        @guarded_job(on_skip="ignore")  # RQ has no way to record nothing
        def g():
            pass


def _wait_running(job: Job, key: str, timeout: float = 20.0) -> None:
    """Until ``job`` holds ``key`` *and* has stored its handle: the work-horse saves the handle one
    round trip after its lease, so a test that injects an end right after seeing the lease could
    otherwise strike between the two."""
    from taskguard_rq import load_handle

    def running() -> bool:
        return locks().holder(key) is not None and load_handle(locks(), job.id) is not None

    deadline = time.monotonic() + timeout
    while not running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(), f"job {job.id} never held {key} with its handle stored"


@pytest.mark.parametrize("handle_saved", [True, False], ids=["handle", "no_handle"])
@pytest.mark.parametrize("how", ["stop_job", "kill_horse", "cold_shutdown"])
def test_every_outside_end_of_a_running_job_settles_its_lease_and_handle(rq_env, how, handle_saved):
    """A guarded job (ttl=30) runs 20 s; then ``send_stop_job_command`` (the reported case),
    ``send_kill_horse_command`` or a cold shutdown of its ``rq worker`` (two SIGTERMs). Its lease is
    released and its stored handle (it holds the owner token) deleted at once, so the next job of
    the key runs. Before, a stopped job's lease stayed for its TTL (the next call was skipped) and
    its handle for a day. ``no_handle``: the work-horse ended in the one round trip between taking
    its lease and saving its handle (the handle is deleted to stand for it): the lease is released
    by the job id, its holder process being dead (before, it waited for its TTL)."""
    from rq.command import send_kill_horse_command, send_stop_job_command

    from taskguard import handle_records
    from taskguard_rq.job import handle_record, load_handle

    conn = rq_env.connection
    with RQWorker(rq_env) as worker:
        job = rq_env.enqueue(rq_jobs.long_running, how, seconds=20.0, job_timeout=60)
        _wait_running(job, f"long:{how}")
        assert load_handle(locks(), job.id) is not None
        if not handle_saved:
            handle_records.drop(locks(), handle_record(job.id))
        if how == "stop_job":
            send_stop_job_command(conn, job.id)
        elif how == "kill_horse":
            workers = [w for w in rq_env.connection.smembers(f"rq:workers:{rq_env.name}")]
            assert workers
            send_kill_horse_command(conn, workers[0].decode().rsplit(":", 1)[-1])
        else:
            worker.proc.send_signal(signal.SIGTERM)
            time.sleep(1.5)  # RQ ignores a second signal within 1 s of the first
            worker.proc.send_signal(signal.SIGTERM)
            worker.proc.wait(20)
        deadline = time.monotonic() + 5  # (the lease goes first, the handle one round trip later)
        while (
            locks().holder(f"long:{how}") is not None or load_handle(locks(), job.id) is not None
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        held = locks().holder(f"long:{how}")
        handle = load_handle(locks(), job.id)
        output = worker.output()
    print(
        f"    injected: {how} of a job holding long:{how} (ttl 30 s); lease held after: {held is not None}, "
        f"handle kept: {handle is not None}"
    )
    assert held is None, output[-3000:]
    assert handle is None
    with RQWorker(rq_env):
        nxt = rq_env.enqueue(rq_jobs.long_running, how, seconds=0)
        assert wait_done(nxt) == JobStatus.FINISHED and nxt.return_value() == how


def test_a_warm_shutdown_lets_the_job_end_and_settle_itself(rq_env):
    """One SIGTERM while a guarded job runs: RQ lets it finish; its lease is released and its
    handle deleted by the job itself."""
    from taskguard_rq import load_handle

    with RQWorker(rq_env) as worker:
        job = rq_env.enqueue(rq_jobs.long_running, "warm", seconds=2.0)
        _wait_running(job, "long:warm")
        worker.proc.send_signal(signal.SIGTERM)
        worker.proc.wait(20)
    assert job.get_status(refresh=True) == JobStatus.FINISHED and job.return_value() == "warm"
    assert locks().holder("long:warm") is None and load_handle(locks(), job.id) is None


@pytest.mark.parametrize("handle_saved", [True, False], ids=["handle", "no_handle"])
@pytest.mark.parametrize("horse", ["dead", "orphaned"])
def test_the_abandoned_job_cleanup_settles_a_dead_workers_lease_and_handle(rq_env, horse, handle_saved):
    """A worker's main process is SIGKILLed while a guarded job runs; later another GuardedWorker's
    maintenance finds the job abandoned (``StartedJobRegistry.cleanup``). If its work-horse died
    too, the lease is released and the handle deleted then, not left to their TTLs; if the
    work-horse lives on (orphaned: RQ's horse has a process group of its own), its body still
    runs and keeps its lease. ``no_handle``: as if the horse had not saved its handle yet (the
    lease is found by the job id)."""
    from rq.registry import StartedJobRegistry

    from taskguard import handle_records
    from taskguard_rq import GuardedWorker
    from taskguard_rq.job import handle_record, load_handle

    conn = rq_env.connection
    with RQWorker(rq_env) as worker:
        job = rq_env.enqueue(rq_jobs.long_running, f"abandoned-{horse}", seconds=20.0, job_timeout=60)
        _wait_running(job, f"long:abandoned-{horse}")
        if not handle_saved:
            handle_records.drop(locks(), handle_record(job.id))
        horse_pid = locks().holder(f"long:abandoned-{horse}").holder["pid"]
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(10)
        if horse == "dead":
            os.kill(horse_pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while os.path.exists(f"/proc/{horse_pid}") and time.monotonic() < deadline:
                time.sleep(0.05)
    why = f"job {job.id}, horse {horse_pid}:\n{worker.output()[-3000:]}"  # (what the worker said, on failure)
    try:
        assert locks().holder(f"long:abandoned-{horse}") is not None, why
        assert (load_handle(locks(), job.id) is not None) == handle_saved, why
        registry = StartedJobRegistry(queue=rq_env)
        members = conn.zrange(registry.key, 0, -1)
        assert members, (job.get_status(refresh=True), why)
        conn.zadd(registry.key, {m: 1 for m in members})  # its time is up (RQ waits for the heartbeat TTL)
        GuardedWorker([rq_env], connection=conn).clean_registries()
        assert job.get_status(refresh=True) == JobStatus.FAILED, why
        held = locks().holder(f"long:abandoned-{horse}")
        if horse == "dead":
            assert held is None and load_handle(locks(), job.id) is None, (held, why)
        else:
            assert held is not None and held.holder["pid"] == horse_pid  # the live body keeps it
    finally:
        if horse == "orphaned":
            os.kill(horse_pid, signal.SIGKILL)


@pytest.mark.parametrize("retries", [1, 2], ids=["no_retry_left", "retry_left"])
@pytest.mark.parametrize("how", ["stop_job", "kill_horse", "cold_shutdown"])
def test_ending_a_retry_that_waits_for_an_orphaned_work_horse_leaves_that_horses_lease(rq_env, how, retries):
    """A worker is SIGKILLed while its job's body runs; its work-horse lives on (a process group of
    its own) and keeps the lease. The abandoned-job cleanup retries the job (``Retry``); another
    GuardedWorker takes the retry, which waits for the live body's lease (same job id) without a
    handle of its own. That waiting execution is then stopped (``send_stop_job_command``), its
    work-horse killed (``send_kill_horse_command``) or its worker shut down cold (two SIGTERMs):
    its worker must leave the lease and stored
    handle of the *live* work-horse alone. Before, it settled the stored handle as its own: with no
    retry left it released the live body's lease (a third call would run beside it), with one left
    it kept it for the next retry, which claimed it: two bodies under one fencing token."""
    from rq.command import send_kill_horse_command, send_stop_job_command
    from rq.registry import StartedJobRegistry

    from taskguard_rq import GuardedWorker, load_handle

    conn = rq_env.connection
    key = f"long:orphan-{how}-{retries}"
    with RQWorker(rq_env) as first:
        job = rq_env.enqueue(
            rq_jobs.long_running, key.split(":", 1)[1], seconds=25.0, job_timeout=60, retry=Retry(max=retries)
        )
        _wait_running(job, key)
        held = locks().holder(key)
        horse_pid, handle = held.holder["pid"], load_handle(locks(), job.id)
        os.killpg(first.proc.pid, signal.SIGKILL)  # the worker; its work-horse lives on
        first.proc.wait(10)
    try:
        assert os.path.exists(f"/proc/{horse_pid}")
        registry = StartedJobRegistry(queue=rq_env)
        conn.zadd(registry.key, {m: 1 for m in conn.zrange(registry.key, 0, -1)})  # its time is up
        GuardedWorker([rq_env], connection=conn).clean_registries()  # abandoned: retried
        assert job.get_status(refresh=True) == JobStatus.QUEUED
        with RQWorker(rq_env) as second:
            deadline = time.monotonic() + 20
            while not (job.get_status(refresh=True) == JobStatus.STARTED and job.refresh() is None and job.worker_name):
                assert time.monotonic() < deadline, second.output()[-3000:]
                time.sleep(0.05)
            time.sleep(0.5)  # the retry's body waits for the live lease of its job id
            if how == "stop_job":
                send_stop_job_command(conn, job.id)
            elif how == "kill_horse":
                send_kill_horse_command(conn, job.worker_name)
            else:  # two SIGTERMs: the worker kills the horse and exits
                second.proc.send_signal(signal.SIGTERM)
                time.sleep(1.5)  # RQ ignores a second signal within 1 s of the first
                second.proc.send_signal(signal.SIGTERM)
                second.proc.wait(20)
            deadline = time.monotonic() + 10  # until the worker has settled the job: one of its three lines
            while not re.search(rf"job {job.id}: .*(left to that holder|released|kept)", second.output()):
                assert time.monotonic() < deadline, second.output()[-3000:]
                time.sleep(0.05)
            after = locks().holder(key)
            stored = load_handle(locks(), job.id)
            output = second.output()
        print(f"    injected: {how} of a retry waiting for a live orphaned work-horse (retries {retries})")
        assert after is not None, output[-3000:]
        assert (after.holder["pid"], after.fencing_token) == (horse_pid, held.fencing_token)
        assert stored == handle  # neither deleted nor kept (re-saved) for another retry
        assert os.path.exists(f"/proc/{horse_pid}")
    finally:
        os.kill(horse_pid, signal.SIGKILL)


def test_a_job_cancelled_while_waiting_for_its_retry_releases_the_kept_lease(rq_env):
    """A job fails, its retry (interval 30 s) keeps the lease; the job is cancelled meanwhile. The
    next GuardedWorker maintenance releases the kept lease and deletes the handle, so the key is
    free long before the 30 s stretch would have ended."""
    from taskguard_rq import GuardedWorker, load_handle

    conn = rq_env.connection
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.flaky, "c", fail_times=1, retry=Retry(max=1, interval=30))
        deadline = time.monotonic() + 15
        while load_handle(locks(), job.id) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    assert locks().holder("flaky:c") is not None and load_handle(locks(), job.id) is not None  # kept
    job.cancel()
    GuardedWorker([rq_env], connection=conn).clean_registries()
    assert locks().holder("flaky:c") is None
    assert load_handle(locks(), job.id) is None


def test_maintenance_never_settles_a_live_job_whose_reused_id_is_still_listed_as_cancelled(rq_env):
    """A job id cancelled once stays in RQ's CanceledJobRegistry when a job of that id is enqueued
    again. That job failed, and its retry (interval 30 s) kept its lease: the maintenance released
    it as a cancelled job's, and another job of the key ran inside the retry interval."""
    from taskguard_rq import GuardedWorker, load_handle

    conn = rq_env.connection
    job_id = f"reused-{uuid.uuid4().hex}"
    rq_env.enqueue(rq_jobs.flaky, "r", fail_times=1, job_id=job_id).cancel()
    assert job_id in rq_env.canceled_job_registry.get_job_ids()
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.flaky, "r", fail_times=1, retry=Retry(max=1, interval=30), job_id=job_id)
        deadline = time.monotonic() + 15
        while load_handle(locks(), job.id) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    held = locks().holder("flaky:r")
    assert held is not None and load_handle(locks(), job_id) is not None  # kept for the retry
    assert job.get_status(refresh=True) == JobStatus.SCHEDULED and job_id in rq_env.canceled_job_registry.get_job_ids()
    GuardedWorker([rq_env], connection=conn).clean_registries()
    after = locks().holder("flaky:r")
    assert after is not None and after.fencing_token == held.fencing_token
    assert load_handle(locks(), job_id) is not None
    locks().release_run("flaky:r", job_id)


def test_a_job_without_a_time_limit_keeps_its_handle_while_it_runs(rq_env):
    """``job_timeout=-1`` (RQ runs it for as long as it takes): the running job's handle record
    lasts days, not the 180 s default plus the TTL, so a work-horse killed after that still finds
    its handle (its lease kept for its retry). A job with a limit keeps its limit plus the TTL."""
    conn = rq_env.connection
    with RQWorker(rq_env):
        ttls = {}
        for name, timeout in (("unlimited", -1), ("limited", 60)):
            job = rq_env.enqueue(rq_jobs.long_running, name, seconds=2.0, job_timeout=timeout)
            _wait_running(job, f"long:{name}")
            keys = list(conn.scan_iter(match=f"*rq-job:{job.id}*"))
            assert len(keys) == 1, keys
            ttls[name] = conn.pttl(keys[0]) / 1000
            assert wait_done(job) == JobStatus.FINISHED
    assert ttls["unlimited"] > 86400, ttls
    assert 60 < ttls["limited"] <= 60 + rq_jobs.long_running.taskguard_options.ttl, ttls


def test_maintenance_never_releases_a_lease_whose_body_may_still_run(rq_env):
    """Cancelling a job while its body runs (RQ allows it; the work-horse goes on) does not let
    GuardedWorker's maintenance release the lease that body holds; a cancelled job whose function
    cannot be imported any more does not stop the maintenance."""
    from taskguard_rq import GuardedWorker

    conn = rq_env.connection
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.long_running, "live", seconds=4.0, job_timeout=60)
        _wait_running(job, "long:live")
        job.cancel()
        ghost = rq_env.enqueue("no_such_module.sync", 1)
        ghost.cancel()
        GuardedWorker([rq_env], connection=conn).clean_registries()  # no exception
        held = locks().holder("long:live")
        assert held is not None and held.run_id == job.id  # the running body keeps its lease
        time.sleep(4.5)
    assert locks().holder("long:live") is None  # released by the body itself when it ended


@pytest.mark.timeout(330)  # five worker runs, each bounded to 60 s below
def test_a_guarded_worker_with_a_malformed_lease_configuration_refuses_to_start_and_warns_when_it_is_unset(rq_env):
    """A malformed TASKGUARD_REDIS_URL: ``rq worker -w taskguard_rq.GuardedWorker`` exits 78 before
    taking a job, saying why in one line (no traceback), and the queued job is left for a worker
    that can run it (before, it started and failed every guarded job). Unset: it starts (its jobs
    may all bring their own ``locks=``) and says at start that jobs without them will fail."""
    job = rq_env.enqueue(rq_jobs.long_running, "unconfigured", seconds=0)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TASKGUARD_")}
    cmd = [sys.executable, "-m", "rq.cli", "worker", "-u", os.environ["TASKGUARD_REDIS_URL"], "-w"]
    cmd += ["taskguard_rq.GuardedWorker", "--burst", rq_env.name]
    bad = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**base, "TASKGUARD_REDIS_URL": "http://127.0.0.1:6379"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    text = bad.stdout + bad.stderr
    assert bad.returncode == 78, text
    assert "GuardedWorker cannot start" in text and "TASKGUARD_REDIS_URL" in text and "Traceback" not in text, text
    assert job.get_status(refresh=True) == JobStatus.QUEUED
    # an empty URL is a malformed one (it started, as if unset); with the URL unset, the other
    # variables are checked all the same (a misspelt or malformed one went unnoticed)
    for env, named in (
        ({"TASKGUARD_REDIS_URL": ""}, "TASKGUARD_REDIS_URL"),
        ({"TASKGUARD_PREFX": "billing"}, "did you mean TASKGUARD_PREFIX?"),
        ({"TASKGUARD_SOCKET_TIMEOUT": "soon"}, "TASKGUARD_SOCKET_TIMEOUT"),
    ):
        refused = subprocess.run(cmd, cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=60)
        text = refused.stdout + refused.stderr
        assert refused.returncode == 78 and named in text and "Traceback" not in text, (env, text)
    assert job.get_status(refresh=True) == JobStatus.QUEUED
    own = rq_env.enqueue(rq_jobs.with_own_locks, "x")
    own_env = {
        "TG_OWN_LOCKS_URL": os.environ["TASKGUARD_REDIS_URL"],
        "TG_OWN_LOCKS_PREFIX": os.environ["TASKGUARD_PREFIX"],
    }
    try:  # (a GuardedWorker exits at once after its burst: the pubsub stop is bounded)
        unset = subprocess.run(cmd, cwd=ROOT, env={**base, **own_env}, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:  # what it was doing, whole
        raise AssertionError(f"the worker did not end: {e.stdout!r} {e.stderr!r}") from None
    text = unset.stdout + unset.stderr
    assert unset.returncode == 0, text
    assert "TASKGUARD_REDIS_URL is not set: guarded jobs declared without locks= will fail" in text
    assert job.get_status(refresh=True) == JobStatus.FAILED  # (no locks= of its own)
    assert own.get_status(refresh=True) == JobStatus.FINISHED and isinstance(own.return_value(), int), text


_DYING_HOLDER = """
import sys, taskguard
locks = taskguard.from_env()
how, key, run_id = sys.argv[1:4]
holder = {"job": "tests.rq_jobs.long_running", "job_id": run_id}
if how == "claim":  # a retry's horse claims the kept lease (new owner token, same fencing token)
    acq = locks.claim(key, sys.argv[4], ttl=60, run_id=run_id, holder=holder)
else:  # it takes a fresh lease
    acq = locks.acquire(key, ttl=60, run_id=run_id, holder=holder)
assert acq.acquired, acq
print(acq.lease.fencing_token, flush=True)
import os; os._exit(0)  # dies before saving its own handle (no finally runs)
"""


@pytest.mark.parametrize("how", ["claimed_the_kept_lease", "took_a_fresh_lease"])
def test_a_dead_horse_whose_stored_handle_is_another_executions_has_its_own_lease_released(rq_env, how):
    """The stored handle is not the lease the dead work-horse held: a retry's horse claimed the
    kept lease (CLAIM gives it a new owner token) or took a fresh one, and died before saving its
    own handle. Settling the stored handle releases nothing; the dead horse's lease, found by the
    job id and released by its fencing token, is released instead. (Before, the worker logged
    "released" and the lease stayed for its TTL.)"""
    from taskguard import handle_records
    from taskguard.handoff import handle_of
    from taskguard_rq.job import handle_record
    from taskguard_rq.worker import settle_killed_job

    job = rq_env.enqueue(rq_jobs.long_running, how, seconds=0)
    key, lk = f"long:{how}", locks()
    holder = {"job": "tests.rq_jobs.long_running", "job_id": job.id}
    earlier = lk.acquire(key, ttl=60, run_id=job.id, holder=holder).lease
    if how == "claimed_the_kept_lease":
        handle_records.save(
            lk, handle_record(job.id), {**handle_of(earlier), "running": False}, ttl=60
        )  # kept for the retry
        args = ["claim", key, job.id, earlier.owner_token]
    else:  # an earlier execution's handle, its lease released by the dead-holder rule
        handle_records.save(lk, handle_record(job.id), {**handle_of(earlier), "running": True}, ttl=60)
        assert lk.release_run(key, job.id, fencing_token=earlier.fencing_token)
        args = ["fresh", key, job.id]
    out = subprocess.run(
        [sys.executable, "-c", _DYING_HOLDER, *args], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert [h.fencing_token for h in lk.holders(key)] == [int(out.stdout)]  # the dead horse's lease
    assert settle_killed_job(job, retry=False) == "released"
    assert lk.holders(key) == [] and load_handle(lk, job.id) is None


def test_a_guarded_worker_given_its_locks_with_use_locks_does_not_warn(rq_env, monkeypatch, caplog):
    """Without TASKGUARD_REDIS_URL a GuardedWorker warns at start that jobs without ``locks=``
    will fail — unless the process gave them locks with ``use_locks()``."""
    import logging

    from taskguard import MemoryLocks
    from taskguard_rq import GuardedWorker, use_locks

    monkeypatch.delenv("TASKGUARD_REDIS_URL")
    said = "TASKGUARD_REDIS_URL is not set"
    with caplog.at_level(logging.WARNING, logger="rq.worker.taskguard"):
        GuardedWorker([rq_env], connection=rq_env.connection).work(burst=True)
        assert said in caplog.text
        caplog.clear()
        use_locks(MemoryLocks())
        try:
            GuardedWorker([rq_env], connection=rq_env.connection).work(burst=True)
        finally:
            use_locks(None)
        assert said not in caplog.text


def test_a_guarded_worker_exits_at_once_when_its_pubsub_thread_read_the_unsubscribe_first(rq_env):
    """A worker's shutdown (burst end, warm shutdown) unsubscribes its command channel and stops
    its pubsub thread. A thread that read the unsubscribe reply before the stop waits for a new
    subscription for RQ's ``sleep_time`` of 60 s (rq/worker/base.py ``subscribe``), and from
    redis-py 8.2 ``PubSubWorkerThread.stop()`` joins the thread (redis/client.py): an ``rq worker
    --burst`` took a minute to exit after its last job, now and then, on a loaded machine. The
    race, forced: the thread reads the unsubscribe first, then the worker shuts down."""
    from taskguard_rq import GuardedWorker

    worker = GuardedWorker([rq_env], connection=rq_env.connection)
    worker.subscribe()
    deadline = time.monotonic() + 10
    while not worker.pubsub.subscribed and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.pubsub.unsubscribe()  # the reply, read by the thread before any stop
    while worker.pubsub.subscribed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not worker.pubsub.subscribed
    time.sleep(0.3)  # the thread now waits for a subscription
    started = time.monotonic()
    worker.unsubscribe()
    took = time.monotonic() - started
    assert took < 10, f"the worker's unsubscribe took {took:.1f} s"
