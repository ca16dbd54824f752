"""Per-entry ``overlap`` of periodic entries (issue 25, story 4): an entry whose run outlasts its
interval, with ``coalesce``, ``replace`` and ``allow``, under real ``celery beat -S taskguard`` /
``taskguard rq-cron`` processes and real workers, against real Redis. Schedules are scaled down to
seconds: an entry due every 2 s whose body runs 5 s."""

from __future__ import annotations

import json
import time

import pytest
import redis
from rq.job import Job

from taskguard import ConfigError
from taskguard.policy import GuardOptions
from taskguard.schedule.options import apply_entry_options, check_entry_options
from taskguard.values import Overlap
from taskguard_celery.beat import validate_entry_options

from . import test_rq_cron
from .celery_app import make_app
from .celery_support import BeatProcess, WorkerProcess, body_log, leader_pid, wait_for_body
from .test_rq import RQWorker, log, wait_done
from .test_rq_cron import CronProcess, enqueued, entry

cron_env = test_rq_cron.cron_env  # (the fixture)
cron_leader_pid = test_rq_cron.leader_pid

EVERY = 2.0
BODY = 5.0


def say(*parts):
    print("   ", *parts, flush=True)


def _body(tenant):
    return tenant


# -- checked at start, one validator ------------------------------------------------------------------
def test_entry_overlap_is_checked_at_start_with_did_you_mean_and_against_the_tasks_options():
    assert check_entry_options("entry 'e'", {"overlap": "allow"}, _body)["overlap"] == "allow"
    for bad, says in (
        ({"overlap": "coalese"}, r"overlap must be one of .*got 'coalese' \(did you mean 'coalesce'\?\)"),
        ({"overlap": "alow"}, r"did you mean 'allow'\?"),
        ({"overlap": 3}, "overlap must be one of"),
        ({"overlapp": "skip"}, r"unknown option 'overlapp'; did you mean 'overlap'\?"),
        ({"tll": 5}, r"unknown option 'tll'; did you mean 'ttl'\?"),  # (a changed letter in a short name)
        ({"kez": "k"}, r"unknown option 'kez'; did you mean 'key'\?"),
    ):
        with pytest.raises(ConfigError, match=f"entry 'e': .*{says}"):
            check_entry_options("entry 'e'", bad, _body)
    once = GuardOptions.build(_body, name="t", key="k:{tenant}", once=True)
    for value in ("coalesce", "replace", "allow"):
        with pytest.raises(ConfigError, match=f"entry 'e': overlap='{value}' cannot be combined with once=True"):
            check_entry_options("entry 'e'", {"overlap": value}, _body, guard=once)
    retrying = GuardOptions.build(_body, name="t", on_skip="retry")
    with pytest.raises(ConfigError, match="cannot be combined with on_skip='retry'"):
        check_entry_options("entry 'e'", {"overlap": "coalesce"}, _body, guard=retrying)
    check_entry_options("entry 'e'", {"overlap": "allow"}, _body, guard=retrying)  # allow never skips
    # the worker lays a good value over the task's; a bad or conflicting one is logged and dropped
    task = GuardOptions.build(_body, name="t")
    assert apply_entry_options(task, {"overlap": "allow"}, _body, "t").overlap is Overlap.ALLOW
    assert apply_entry_options(task, {"overlap": "bogus", "ttl": 7}, _body, "t").overlap is Overlap.SKIP
    assert apply_entry_options(once, {"overlap": "replace"}, _body, "t").overlap is Overlap.SKIP


def test_entry_options_of_a_task_with_a_total_are_checked_against_it_at_start():
    """A task with ``limit=2, limit_total=3, limit_total_key="exports"``: an entry ``limit`` above
    the total, a ``key`` equal to the total's key, and ``overlap="allow"`` (no lease, so no place
    in the total) are refused when the scheduler starts, as at the task's declaration. Before,
    they passed there and every run then failed, or ran outside the total."""
    guard = GuardOptions.build(
        _body, name="t", key="export:{tenant}", limit=2, limit_total=3, limit_total_key="exports"
    )
    for bad, says in (
        ({"limit": 5}, r"limit \(5\) exceeds the task's limit_total \(3\)"),
        ({"key": "exports"}, "key must differ from the task's limit_total_key"),
        ({"overlap": "allow"}, "overlap='allow' cannot be combined with limit_total"),
    ):
        with pytest.raises(ConfigError, match=f"entry 'e': {says}"):
            check_entry_options("entry 'e'", bad, _body, guard=guard)
    assert check_entry_options("entry 'e'", {"limit": 3, "key": "export:{tenant}:x"}, _body, guard=guard)
    default_total = GuardOptions.build(_body, name="t", key="export:{tenant}", limit=1, limit_total=3)
    with pytest.raises(ConfigError, match="key must differ"):  # the total's key defaults to the task's name
        check_entry_options("entry 'e'", {"key": "t"}, _body, guard=default_total)


def test_a_task_refuses_allow_and_says_where_it_belongs():
    with pytest.raises(ConfigError, match="overlap='allow' is for periodic entries only"):
        GuardOptions.build(_body, name="t", overlap="allow")


def test_celery_beat_checks_the_entry_overlap_against_the_guarded_task(redis_url, prefix):
    app = make_app(f"q-{prefix}", prefix)
    task = app.tasks["tg.overlap_tick"]
    assert validate_entry_options("e", {"overlap": "replace"}, task) == {"overlap": "replace"}
    with pytest.raises(ConfigError, match=r"beat entry 'e': options\['taskguard'\] .*did you mean 'overlap'"):
        validate_entry_options("e", {"overlp": "replace"}, task)
    with pytest.raises(ConfigError, match=r"beat entry 'e': .*did you mean 'replace'"):
        validate_entry_options("e", {"overlap": "replcae"}, task)


# -- Celery beat ----------------------------------------------------------------------------------------------
def _otick(app):
    """``(what, slot, fence or None, time, task id)`` of the overlap_tick bodies, in order."""
    out = []
    for e in body_log(app):
        if e.startswith("otick|"):
            _, what, slot, fence, at, task_id = e.split("|")
            out.append((what, slot, None if fence == "-" else int(fence), float(at), task_id))
    return out


def _spans(events):
    """``{task id: (slot, fence, start, end or None, how it ended)}``."""
    spans: dict[str, list] = {}
    for what, slot, fence, at, task_id in events:
        if what == "start":
            spans[task_id] = [slot, fence, at, None, None]
        elif task_id in spans:
            spans[task_id][3:] = [at, what]
    return {k: tuple(v) for k, v in spans.items()}


def _show(spans):
    return [(s[0], s[1], round(s[2] % 100, 2), round((s[3] or 0) % 100, 2), s[4]) for s in spans]


def _run_beat(redis_url, prefix, tmp_path, overlap, seconds):
    queue = f"q-{prefix}"
    app = make_app(queue, prefix)
    env = {
        "TG_TEST_CONF": json.dumps({"taskguard_beat_leader_ttl": 3}),
        "TG_TEST_BEAT_TASK": "tg.overlap_tick",
        "TG_TEST_BEAT_KWARGS": json.dumps({"seconds": BODY}),
        "TG_TEST_BEAT_OPTIONS": json.dumps({"taskguard": {"overlap": overlap}}),
    }
    try:
        with WorkerProcess(queue, prefix, pool="threads", concurrency=4) as worker:
            beat = BeatProcess(queue, prefix, tmp_path, "a", every=EVERY, env=env).start()
            try:
                leader_pid(app)
                time.sleep(seconds)
            finally:
                beat.stop()
            time.sleep(BODY + 1.5)  # the runs under way end
            output = worker.output() + beat.output()
        return app, _otick(app), output
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, queue)


def test_beat_entry_coalesce_one_follow_up_starts_when_the_run_outlasting_its_interval_ends(
    redis_url, prefix, tmp_path
):
    """Due every 2 s, runs 5 s, ``overlap="coalesce"``: the slots due while a run is active make one
    pending follow-up (the latest slot's run; the earlier one ends ``Skipped("coalesced")``), which
    starts about a second after the active run ends, never beside it."""
    app, events, output = _run_beat(redis_url, prefix, tmp_path, "coalesce", 13.0)
    spans = sorted(_spans(events).values(), key=lambda s: s[2])
    say("observed: runs (slot, fence, start, end, how):", _show(spans))
    assert len(spans) >= 3, output
    for before, after in zip(spans, spans[1:], strict=False):
        assert before[3] is not None and after[2] >= before[3], "two bodies at once"
        assert after[2] - before[3] < 1.5, f"the follow-up started {after[2] - before[3]:.2f} s after the end"
        assert after[1] > before[1]
    assert len({s[0] for s in spans}) == len(spans)  # each slot ran once
    assert "coalesced into the pending follow-up" in output
    assert "Traceback" not in output


def test_beat_entry_replace_the_new_slots_run_takes_the_lease_over(redis_url, prefix, tmp_path):
    """Due every 2 s, runs 5 s, ``overlap="replace"``: each slot's run starts at once with a larger
    fencing token; the run it replaces sees its lease lost within a renewal interval and ends
    ``Skipped("replaced")``."""
    app, events, output = _run_beat(redis_url, prefix, tmp_path, "replace", 9.0)
    spans = sorted(_spans(events).values(), key=lambda s: s[2])
    say("observed: runs (slot, fence, start, end, how):", _show(spans))
    assert len(spans) >= 3, output
    for before, after in zip(spans, spans[1:], strict=False):
        assert after[1] > before[1]
        assert after[2] - before[2] == pytest.approx(EVERY, abs=0.9)  # started at its slot, not after the old run
        assert before[4] == "lost", before
        assert 0 <= before[3] - after[2] < 1.5, "the old run's lease was not lost within a renewal interval"
    assert spans[-1][4] == "end"
    assert "taken over from beat:" in output
    assert "Traceback" not in output


def test_beat_entry_allow_runs_overlap_without_a_lease_each_slot_once(redis_url, prefix, tmp_path):
    """Due every 2 s, runs 5 s, ``overlap="allow"``: no lease; the slots' runs run side by side,
    each slot once."""
    app, events, output = _run_beat(redis_url, prefix, tmp_path, "allow", 7.0)
    spans = sorted(_spans(events).values(), key=lambda s: s[2])
    say("observed: runs (slot, fence, start, end, how):", _show(spans))
    assert len(spans) >= 3, output
    assert all(s[1] is None and s[4] == "end" for s in spans)  # no lease, every body ran to its end
    assert any(after[2] < before[3] for before, after in zip(spans, spans[1:], strict=False))  # side by side
    assert len({s[0] for s in spans}) == len(spans)
    assert "Traceback" not in output


# -- RQ cron --------------------------------------------------------------------------------------------------
def _ocron(queue):
    """``(what, slot, fence or None, time, job id)`` of the cron_overlap bodies, in order."""
    out = []
    for e in log(queue):
        if e.startswith("ocron|"):
            _, what, slot, fence, at, job_id = e.split("|")
            out.append((what, slot, None if fence == "-" else int(fence), float(at), job_id))
    return out


def _run_cron(queue, prefix, overlap, seconds, workers):
    e = entry(
        "o",
        prefix,
        job="overlap",
        interval=EVERY,
        kwargs={"entry": "o", "seconds": BODY},
        meta={"taskguard": {"overlap": overlap}},
    )
    ws = [RQWorker(queue) for _ in range(workers)]
    for w in ws:
        w.__enter__()
    try:
        s = CronProcess(queue, [e]).start().wait_ready()
        try:
            cron_leader_pid(prefix)
            time.sleep(seconds)
        finally:
            s.stop()
        time.sleep(BODY + 2.5)  # the runs under way end
        output = s.output() + "".join(w.output() for w in ws)
    finally:
        for w in ws:
            w.__exit__(None, None, None)
    return _ocron(queue), output


def test_rq_cron_entry_coalesce_one_follow_up_starts_when_the_run_outlasting_its_interval_ends(cron_env, prefix):
    """RQ: due every 2 s, runs 5 s, ``overlap="coalesce"``: one pending follow-up job at a time
    (held by RQ's scheduler, not a worker), started promptly once the active job ends; never two
    bodies at once; each superseded slot's job ends ``Skipped("coalesced")``."""
    events, output = _run_cron(cron_env, prefix, "coalesce", 13.0, workers=2)
    spans = sorted(_spans(events).values(), key=lambda s: s[2])
    say("observed: runs (slot, fence, start, end, how):", _show(spans))
    assert len(spans) >= 3, output
    for before, after in zip(spans, spans[1:], strict=False):
        assert before[3] is not None and after[2] >= before[3], "two bodies at once"
        # RQ's scheduler enqueues a moved job within about a second (it polls every second)
        assert after[2] - before[3] < 2.5, f"the follow-up started {after[2] - before[3]:.2f} s after the end"
        assert after[1] > before[1]
    coalesced = []
    ran = set(_spans(events))
    for job_id in enqueued(cron_env, f"o-{prefix}"):
        if job_id not in ran:
            job = Job.fetch(job_id, connection=cron_env.connection)
            assert wait_done(job) == "finished"
            coalesced.append(getattr(job.return_value(), "reason", None))
    say(f"observed: superseded slots' jobs ended {coalesced}")
    assert coalesced and set(coalesced) == {"coalesced"}
    assert "Traceback" not in output


def test_rq_cron_entry_replace_the_new_slots_job_takes_the_lease_over(cron_env, prefix):
    """RQ: due every 2 s, runs 5 s, ``overlap="replace"``: each slot's job starts at once with a
    larger fencing token; the job it replaces sees its lease lost and ends ``Skipped("replaced")``."""
    events, output = _run_cron(cron_env, prefix, "replace", 9.0, workers=3)
    spans = sorted(_spans(events).items(), key=lambda kv: kv[1][2])
    say("observed: runs (slot, fence, start, end, how):", _show([s for _, s in spans]))
    assert len(spans) >= 3, output
    for (old_id, before), (_, after) in zip(spans, spans[1:], strict=False):
        assert after[1] > before[1]
        assert after[2] - before[2] == pytest.approx(EVERY, abs=1.2)  # at its slot, not after the old job
        assert before[4] == "lost", before
        assert 0 <= before[3] - after[2] < 1.5
        value = Job.fetch(old_id, connection=cron_env.connection).return_value()
        assert getattr(value, "reason", None) == "replaced", value
    assert spans[-1][1][4] == "end"


def test_rq_cron_entry_allow_jobs_overlap_without_a_lease_each_slot_once(cron_env, prefix):
    """RQ: due every 2 s, runs 5 s, ``overlap="allow"``: no lease; the slots' jobs run side by side
    (one worker each), each slot once."""
    events, output = _run_cron(cron_env, prefix, "allow", 7.0, workers=3)
    spans = sorted(_spans(events).values(), key=lambda s: s[2])
    say("observed: runs (slot, fence, start, end, how):", _show(spans))
    assert len(spans) >= 3, output
    assert all(s[1] is None and s[4] == "end" for s in spans)
    assert any(after[2] < before[3] for before, after in zip(spans, spans[1:], strict=False))
    assert len({s[0] for s in spans}) == len(spans)
    assert "Traceback" not in output


# -- one slot's messages under allow and replace (an embedded worker) ---------------------------------------
def _slot_header(slot, overlap):
    return {"entry": "tick", "slot": slot, "keep": 60, "leader_key": "beat-leader:x", "overlap": overlap}


def test_allow_a_second_message_of_one_slot_does_not_run_again(redis_url, prefix):
    """Under ``allow`` there is no lease, yet a slot published twice (a new leader publishing a
    slot claimed but not confirmed) runs once: its first run records that it started."""
    from .celery_support import embedded_worker

    app = make_app(f"q-{prefix}", prefix)
    task = app.tasks["tg.overlap_tick"]
    try:
        with embedded_worker(app, concurrency=3):
            header = {"taskguard_beat": _slot_header("every2s:1", "allow")}
            first = task.apply_async(kwargs={"seconds": 1.0}, headers=header)
            wait_for_body(app, "otick|start|every2s:1|")
            second = task.apply_async(kwargs={"seconds": 1.0}, headers=header)
            other = task.apply_async(
                kwargs={"seconds": 0.2}, headers={"taskguard_beat": _slot_header("every2s:2", "allow")}
            )
            assert first.get(timeout=10) == "-" and other.get(timeout=10) == "-"
            time.sleep(1.0)
            assert second.state == "PENDING"  # dropped as a duplicate (Ignore): no result
        starts = [e for e in _otick(app) if e[0] == "start"]
        assert sorted(e[1] for e in starts) == ["every2s:1", "every2s:2"]
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, f"q-{prefix}")


def test_replace_a_copy_of_a_replaced_slot_never_takes_the_lease_back(redis_url, prefix):
    """Under ``replace``, a slot's run is named by its slot: a copy of a replaced slot's message
    (another task id) ends ``Skipped("replaced")`` without running, and the newer slot keeps the
    lease."""
    from taskguard import as_skipped

    from .celery_support import embedded_worker

    app = make_app(f"q-{prefix}", prefix)
    task = app.tasks["tg.overlap_tick"]
    try:
        with embedded_worker(app, concurrency=3):
            old_header = {"taskguard_beat": _slot_header("every2s:1", "replace")}
            old = task.apply_async(kwargs={"seconds": 30}, headers=old_header)
            wait_for_body(app, "otick|start|every2s:1|")
            new = task.apply_async(
                kwargs={"seconds": 2.0}, headers={"taskguard_beat": _slot_header("every2s:2", "replace")}
            )
            assert as_skipped(old.get(timeout=10)).reason == "replaced"
            copy = task.apply_async(kwargs={"seconds": 0.1}, headers=old_header)
            s = as_skipped(copy.get(timeout=10))
            assert s is not None and s.reason == "replaced"
            assert new.get(timeout=10) != "-"
        starts = [e[1] for e in _otick(app) if e[0] == "start"]
        assert starts == ["every2s:1", "every2s:2"]  # the copy did not run
        assert app.conf.taskguard_locks.holders("otick") == []
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, f"q-{prefix}")
