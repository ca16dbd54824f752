"""Run identity: every way a Celery task id or an RQ job id runs again, against real workers.

A redelivered copy of a finished run is a duplicate (never runs, never stores a result); a new
publish of an id runs; a run that handed its message back is not finished; an RQ job runs on
every execution. Each scenario prints what it injected and what it observed (``pytest -s``).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from datetime import timedelta

import pytest
import redis
from celery.result import AsyncResult
from rq import Retry
from rq.job import JobStatus
from rq.registry import StartedJobRegistry

from taskguard import is_skipped
from taskguard_celery.identity import CLOCK_SKEW

from . import rq_jobs
from .celery_app import make_app
from .celery_support import WorkerProcess, body_log, embedded_worker, wait_for_body
from .test_celery_failures import wait_for
from .test_rq import RQWorker, locks as rq_locks, log as rq_log, wait_done

FAST_RESTORE = {"unacked_restore_interval": 1, "unacked_restore_throttle": 1}


def say(*parts):
    print("   ", *parts, flush=True)


def entries(app, start):
    return [e for e in body_log(app) if e.startswith(start)]


def executions(app, prefix, name):
    r = redis.Redis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return [x.decode() for x in r.lrange(f"{prefix}:executions", 0, -1) if x.decode().startswith(name + ":")]


@pytest.fixture
def celery_env(redis_url, prefix):
    made = []

    def make(**conf):
        queue = f"q-{prefix}-{len(made)}"
        app = make_app(queue, prefix, **conf)
        made.append((app, queue))
        return app, queue

    yield make
    r = redis.Redis.from_url(redis_url)
    for app, queue in made:
        r.delete(app.tg_log, queue, f"{prefix}:executions")


# -- Celery: redelivery of a long acks_late body ----------------------------------------------------


def test_long_acks_late_body_with_short_visibility_timeout_runs_once_with_bounded_copies(celery_env, prefix):
    """visibility_timeout=2, acks_late, ttl=6, a 24 s body, prefork -c 2, one delay(): the broker
    hands the unacked message out again every ~2 s. The body runs once, the stored result is its
    value, and executions stay about one per broker redelivery (the guard used to re-publish a
    fresh deferred copy for every copy, each redelivered in turn: ~120 executions, tripling).
    Reported as celery/celery#5935, #5306 and pretix/pretix#2058 (a 4 h task started 4 times)."""
    conf = {"broker_transport_options": {"visibility_timeout": 2, **FAST_RESTORE}}
    app, queue = celery_env(**conf)
    with WorkerProcess(queue, prefix, concurrency=2, conf=conf):
        res = app.tasks["tg.late_long"].delay("x", seconds=24.0)
        value = res.get(timeout=60)
        mid = len(executions(app, prefix, "tg.late_long"))
        time.sleep(8.0)  # copies still pending look again, find the run finished, and stop
        after = len(executions(app, prefix, "tg.late_long"))
        time.sleep(4.0)
        final = len(executions(app, prefix, "tg.late_long"))
    starts = entries(app, "late:x:start")
    say(
        f"injected: visibility_timeout=2 s, body 24 s; observed {len(starts)} body run(s), {mid} executions "
        f"at the end of the body, {final} in all, result {value!r}"
    )
    assert len(starts) == 1
    assert value == "body of x" and AsyncResult(res.id, app=app).get(timeout=1) == "body of x"
    assert mid <= 40, mid  # ~12 broker redeliveries of the original plus one chain of deferred copies
    assert final == after, (after, final)  # no copy is still circulating
    assert final <= 50


def test_eta_task_longer_than_the_visibility_timeout_runs_once(celery_env, prefix):
    """celery/celery#2599, #3270: an ETA (countdown) message held unacked past the Redis
    visibility timeout is handed to another worker too, and both execute it at its ETA. With the
    guard the body runs once; the other copies are dropped as duplicates of the finished run or
    deferred while it runs."""
    conf = {"broker_transport_options": {"visibility_timeout": 1, **FAST_RESTORE}}
    app, queue = celery_env(**conf)
    with WorkerProcess(queue, prefix, concurrency=1, conf=conf), WorkerProcess(queue, prefix, concurrency=1, conf=conf):
        res = app.tasks["tg.counted"].apply_async(("eta",), countdown=6)
        assert res.get(timeout=30) == 1
        time.sleep(5.0)
    copies = executions(app, prefix, "tg.counted")
    say(
        f"injected: countdown 6 s, visibility_timeout 1 s, two workers; observed {len(copies)} executions, "
        f"bodies {entries(app, 'counted:eta:')}"
    )
    assert len(entries(app, "counted:eta:")) == 1 and len(copies) >= 2  # copies did arrive
    assert AsyncResult(res.id, app=app).get(timeout=1) == 1


def test_redelivered_copy_of_a_finished_run_never_overwrites_its_result(celery_env, redis_url, prefix):
    """The broker delivers a finished run's message again (as kombu's Redis transport restores
    it: the same payload with ``delivery_info["redelivered"]`` set) while another run of the key
    holds the lease: it is a duplicate, acked quietly, and never a skip whose ``Skipped`` would
    overwrite the stored result."""
    import json

    app, queue = celery_env()
    r = redis.Redis.from_url(redis_url)
    task = app.tasks["tg.counted"]
    first = task.delay("dup")
    raw = json.loads(r.lindex(queue, 0))  # the message as published, before any worker took it
    with embedded_worker(app, pool="threads", concurrency=2):
        assert first.get(timeout=10) == 1
        holder = app.conf.taskguard_locks.acquire("counted:dup", ttl=10).lease  # the key is busy now
        raw["properties"]["delivery_info"]["redelivered"] = True
        raw["headers"]["redelivered"] = True
        r.lpush(queue, json.dumps(raw))
        assert wait_for(lambda: len(executions(app, prefix, "tg.counted")) == 2, timeout=10)
        time.sleep(0.5)
        holder.release()
    value = AsyncResult(first.id, app=app).get(timeout=1)
    say(
        f"injected: a redelivered copy of a finished run; observed result {value!r}, "
        f"bodies {entries(app, 'counted:dup:')}"
    )
    assert value == 1 and len(entries(app, "counted:dup:")) == 1


def _redelivered(raw: dict) -> str:
    import json

    raw = json.loads(json.dumps(raw))
    raw["properties"]["delivery_info"]["redelivered"] = True
    raw["headers"]["redelivered"] = True
    return json.dumps(raw)


@pytest.mark.parametrize("result_expires", [600, 86400], ids=["finished-marker", "result-backend"])
def test_redelivery_of_a_new_publish_of_a_finished_id_runs(celery_env, redis_url, prefix, result_expires):
    """``apply_async`` with the id of a finished task, whose message the broker then delivers
    again before it ran (the worker that prefetched it died): that publish never finished, so its
    redelivery runs. Finished runs are recorded per publish (the ``taskguard_publish`` stamp),
    not per task id."""
    import json

    app, queue = celery_env(result_expires=result_expires)
    r = redis.Redis.from_url(redis_url)
    task_id = str(uuid.uuid4())
    with embedded_worker(app, pool="threads", concurrency=2):
        assert app.tasks["tg.counted"].apply_async(("rp",), task_id=task_id).get(timeout=10) == 1
    # a publish within CLOCK_SKEW of the stored result's date_done cannot be told apart from the
    # publish that result came from (the hosts' clocks may differ by that much): publish after it
    time.sleep(CLOCK_SKEW + 0.2)
    app.tasks["tg.counted"].apply_async(("rp",), task_id=task_id)
    raw = json.loads(r.lpop(queue))
    r.lpush(queue, _redelivered(raw))
    with embedded_worker(app, pool="threads", concurrency=2):
        assert wait_for(lambda: len(entries(app, "counted:rp:")) == 2, timeout=10), entries(app, "counted:rp:")


def test_a_finished_deferral_chain_does_not_drop_a_later_deliverys_copy(celery_env, redis_url, prefix):
    """A deferral chain of one delivery ends when its copy runs or is dropped, and takes its record
    along; a later publish of the same id, redelivered while it runs, starts a chain of its own (it
    used to find the old record and be dropped, leaving no copy to run the work if that run died)."""
    import json

    app, queue = celery_env()
    r = redis.Redis.from_url(redis_url)
    task_id = str(uuid.uuid4())
    slow = app.tasks["tg.slow"]
    records = lambda: list(r.scan_iter(match="{" + prefix + ":slow:9}:r:defer:*"))  # noqa: E731
    for n, seconds in ((1, 2.0), (2, 3.0)):
        slow.apply_async((9,), {"seconds": seconds}, task_id=task_id)
        raw = json.loads(r.lindex(queue, 0))
        before = len(executions(app, prefix, "tg.slow"))
        with embedded_worker(app, pool="threads", concurrency=2):
            assert wait_for(lambda n=n: len(entries(app, "slow:9:start")) == n, timeout=10)
            r.lpush(queue, _redelivered(raw))  # the broker hands this delivery out again while it runs
            assert wait_for(lambda n=n: len(entries(app, "slow:9:end")) == n, timeout=15)
            # the copy was deferred (a second copy came back) and then dropped as a duplicate
            assert wait_for(lambda before=before: len(executions(app, prefix, "tg.slow")) - before >= 3, timeout=15)
            assert wait_for(lambda: records() == [], timeout=5), records()
    assert len(entries(app, "slow:9:start")) == 2


def test_a_redelivered_copy_deferred_while_its_own_run_ran_stays_a_duplicate_after_the_keys_next_run(
    celery_env, redis_url, prefix
):
    """The broker hands a delivery out again while its own run runs (a visibility timeout): the
    copy is deferred. By the time it looks again that run has finished, and so has another task
    id's run of the same key, so the lease no longer names this run as the key's last finished
    one. Results outlive the redelivery window, so the result backend's SUCCESS — this delivery's
    own outcome — tells the copy it is a duplicate: the body does not run again. (A deferred copy
    of a *publish* is told by its finished marker instead; a copy of the broker's redelivery keeps
    the backend, since it may be waiting for its own delivery's run.)"""
    import json

    app, queue = celery_env(result_expires=86400, broker_transport_options={"visibility_timeout": 60})
    r = redis.Redis.from_url(redis_url)
    slow = app.tasks["tg.slow"]
    slow.apply_async((5,), {"seconds": 1.5}, task_id=str(uuid.uuid4()))
    raw = json.loads(r.lindex(queue, 0))
    seen = lambda: (entries(app, "slow:5:"), executions(app, prefix, "tg.slow"))  # noqa: E731
    with embedded_worker(app, pool="threads", concurrency=2):
        assert wait_for(lambda: len(entries(app, "slow:5:start")) == 1, timeout=20), seen()
        r.lpush(queue, _redelivered(raw))  # handed out again while it runs: deferred
        assert wait_for(lambda: len(executions(app, prefix, "tg.slow")) >= 2, timeout=20), seen()
        assert wait_for(lambda: len(entries(app, "slow:5:end")) >= 1, timeout=20), seen()
        slow.apply_async((5,), {"seconds": 0.1})  # another task id, the same key, runs next
        assert wait_for(lambda: len(entries(app, "slow:5:end")) >= 2, timeout=20), seen()
        # the deferred copy looks again (within the first run's 5 s TTL) and is dropped
        assert wait_for(lambda: len(executions(app, prefix, "tg.slow")) >= 4, timeout=20), seen()
        time.sleep(1.0)
    log, runs = seen()
    say(f"observed: {log}, executions {runs}")
    assert len([e for e in log if e.startswith("slow:5:start")]) == 2, (log, runs)


def _deferred_copy(r, task_id):
    """The deferred copy of ``task_id`` a worker holds unacknowledged (kombu's ``unacked`` hash)."""
    import json

    for raw in r.hvals("unacked"):
        message = json.loads(raw)[0]
        if message["headers"].get("id") == task_id and "taskguard_defer" in message["headers"]:
            return message
    return None


def test_the_retry_of_a_publish_that_waited_for_another_run_of_its_id_runs(celery_env, redis_url, prefix):
    """The same task id published while its first run runs: the publish waits (deferred), then
    its run retries (``self.retry()``). The retry runs. Results outlive the redelivery window, and
    the retry — a copy carrying its kept lease's handle — used to read the result backend's
    SUCCESS under the task id, the *first* run's, stored less than the publish stamps' clock
    tolerance (1 s) before the retry was published (the deferred copy looks again every 0.5-0.8 s),
    and end as a duplicate: the retried work was lost."""
    app, queue = celery_env(result_expires=86400, broker_transport_options={"visibility_timeout": 60})
    r = redis.Redis.from_url(redis_url)
    task_id = str(uuid.uuid4())
    task = app.tasks["tg.slow_or_retry"]
    with embedded_worker(app, pool="threads", concurrency=2):
        task.apply_async((8,), {"seconds": 1.5}, task_id=task_id)
        assert wait_for(lambda: entries(app, "sr:8:start"), timeout=20)
        task.apply_async((8,), {"retry_once": True}, task_id=task_id)  # published again while it runs
        assert wait_for(lambda: _deferred_copy(r, task_id), timeout=20), "the publish was not deferred"
        assert wait_for(lambda: len(entries(app, "sr:8:end")) == 2, timeout=30), entries(app, "sr:8:")
        time.sleep(0.5)
    log = entries(app, "sr:8:")
    say(f"observed: {log}")
    steps = [e.split(":")[2:4] for e in log]
    assert steps == [["start", "0"], ["end", "0"], ["start", "0"], ["start", "1"], ["end", "1"]], log
    assert app.conf.taskguard_locks.holder("sr:8") is None


@pytest.mark.parametrize("ends", ["returns", "retries"])
def test_a_deferred_copy_of_a_publish_that_ran_stays_a_duplicate_after_the_keys_next_run(
    celery_env, redis_url, prefix, ends
):
    """The same task id published while its first run runs: its deferred copy runs after it
    (returns; or retries, and its retry returns). The broker then hands that copy out again, after
    another task id's run of the key finished (so the lease no longer names the copy's run as the
    key's last finished one). Results outlive the redelivery window, yet the backend cannot tell
    the copy's delivery from the first one: the copy's run (or its retry, which keeps the
    delivery's publish stamp) left a finished marker, and the copy handed out again is a
    duplicate. (A skip retry or rate turn of the copy's run passes the same headers on:
    ``test_a_skip_retry_or_rate_turn_of_a_publish_that_waited_stays_that_delivery``.)"""
    app, queue = celery_env(result_expires=86400, broker_transport_options={"visibility_timeout": 60})
    r = redis.Redis.from_url(redis_url)
    task_id = str(uuid.uuid4())
    name, tag = "tg.slow_or_retry", "sr"
    task = app.tasks[name]
    again = {"retry_once": True} if ends == "retries" else {}
    with embedded_worker(app, pool="threads", concurrency=2):
        task.apply_async((6,), {"seconds": 1.5}, task_id=task_id)
        assert wait_for(lambda: entries(app, f"{tag}:6:start"), timeout=20)
        task.apply_async((6,), again, task_id=task_id)  # published again while it runs
        copy = wait_for(lambda: _deferred_copy(r, task_id), timeout=20)
        assert copy, "the publish was not deferred"
        assert wait_for(lambda: len(entries(app, f"{tag}:6:end")) == 2, timeout=30), entries(app, f"{tag}:6:")
        task.apply_async((6,))  # another task id, the same key
        assert wait_for(lambda: len(entries(app, f"{tag}:6:end")) == 3, timeout=20), entries(app, f"{tag}:6:")
        markers = [k for k in r.scan_iter(match="{" + prefix + f":{tag}:6}}:done:*") if task_id.encode() in k]
        before = len(executions(app, prefix, name))
        r.lpush(queue, _redelivered(copy))  # the deferred copy, handed out again
        assert wait_for(lambda: len(executions(app, prefix, name)) > before, timeout=20)
        time.sleep(1.0)
    log = entries(app, f"{tag}:6:")
    say(f"observed: {log}; the delivery's finished marker: {markers}")
    assert len(markers) == 1, markers  # the copy's delivery's (the first run's outcome is the backend's)
    assert len([e for e in log if e.startswith(f"{tag}:6:start")]) == (4 if ends == "retries" else 3), log


@pytest.mark.parametrize("how", ["skip-retry", "rate-turn"])
@pytest.mark.parametrize("chain", ["of-a-publish", "of-a-redelivery", "none"])
def test_a_skip_retry_or_rate_turn_of_a_publish_that_waited_stays_that_delivery(celery_env, how, chain):
    """A run re-published without running its body (``on_skip="retry"``, a ``rate`` turn) passes
    a publish's deferral header on — the message keeps the delivery's publish stamp and stays told
    finished by its own marker — and only a publish's: a copy of the broker's own redelivery, or a
    message that never waited, carries none."""
    from celery.exceptions import Retry

    from taskguard_celery import skipping
    from taskguard_celery.headers import DEFER_HEADER, PUBLISH_HEADER, RATE_HEADER

    app, queue = celery_env()
    task = app.tasks["tg.slow_or_retry"]
    stamp = "1a242efa62b.3b395430"
    headers = {PUBLISH_HEADER: stamp, "custom": 1}
    if chain != "none":
        name = "c0ffee" if chain == "of-a-publish" else "r:" + stamp
        headers[DEFER_HEADER] = {"chain": name, "nonce": "n1", "redelivered": False}
    task.push_request(id=str(uuid.uuid4()), args=(1,), kwargs={}, headers=headers, is_eager=True, retries=0)
    try:
        with pytest.raises(Retry) as caught:
            if how == "skip-retry":
                skipping.republish(task, 1.0, "held; retry 1", 1)
            else:
                skipping.republish(task, 1.0, "rate; deferred", None, rate={"since": 1.0, "turn": 2.0})
    finally:
        task.pop_request()
    sent = caught.value.sig.options["headers"]
    assert sent["custom"] == 1 and sent[PUBLISH_HEADER] == stamp
    assert (DEFER_HEADER in sent) == (chain == "of-a-publish"), sent
    assert (RATE_HEADER in sent) == (how == "rate-turn"), sent


# -- Celery: publishes of an existing id run -----------------------------------------------------------


def test_apply_async_with_the_id_of_a_finished_task_runs_again(celery_env):
    app, queue = celery_env()
    task_id = str(uuid.uuid4())
    with embedded_worker(app, pool="threads", concurrency=2):
        assert app.tasks["tg.counted"].apply_async(("again",), task_id=task_id).get(timeout=10) == 1
        app.tasks["tg.counted"].apply_async(("again",), task_id=task_id)  # the same id, published again
        # (Celery's backend keeps the first SUCCESS: the body's second run is the evidence)
        assert wait_for(lambda: len(entries(app, "counted:again:")) == 2, timeout=10)


def test_apply_async_with_the_id_of_a_running_task_runs_after_it(celery_env, prefix):
    app, queue = celery_env()
    task_id = str(uuid.uuid4())
    with embedded_worker(app, pool="threads", concurrency=2):
        app.tasks["tg.slow"].apply_async((7,), {"seconds": 1.5}, task_id=task_id)
        wait_for_body(app, "slow:7:start")
        app.tasks["tg.slow"].apply_async((7,), {"seconds": 0.1}, task_id=task_id)  # a new publish of the id
        assert wait_for(lambda: len(entries(app, "slow:7:end")) == 2, timeout=20)
    log = entries(app, "slow:7:")
    say(f"observed: {log}")
    assert log[0].startswith("slow:7:start") and log[1] == "slow:7:end"  # never beside the first
    assert log[2].startswith("slow:7:start") and log[3] == "slow:7:end"


@pytest.mark.parametrize("how", ["task", "chain", "group"])
def test_replace_runs_the_replacement_on_a_worker(celery_env, how):
    """replace() publishes the replacement under the same task id: it is a publish and runs
    (it used to be taken for a duplicate of the finished original and dropped)."""
    app, queue = celery_env()
    with embedded_worker(app, pool="threads", concurrency=4):
        res = app.tasks["tg.replacing"].delay(f"w{how}", how=how)
        value = res.get(timeout=15)
    say(f"replace({how}): {value!r}, bodies {entries(app, 'repl:')}")
    expected = {"task": f"w{how}:single", "chain": f"w{how}:b", "group": [f"w{how}-1:g1", f"w{how}-2:g2"]}[how]
    assert value == expected


def test_eager_replace_runs_inside_the_callers_lease(celery_env):
    app, queue = celery_env()
    value = app.tasks["tg.replacing"].apply(("eager",), {"how": "task"}).get()
    log = entries(app, "repl:eager:")
    say(f"eager replace: {value!r}, bodies {log}")
    assert value == "eager:single"
    fences = {e.rsplit(":", 1)[1] for e in log}
    assert len(log) == 2 and len(fences) == 1  # the replacement ran under the caller's lease
    assert app.conf.taskguard_locks.holder("repl:eager") is None


def test_chain_steps_of_one_key_each_run(celery_env):
    from celery import chain

    app, queue = celery_env()
    t = app.tasks["tg.counted"]
    with embedded_worker(app, pool="threads", concurrency=2):
        assert chain(t.si("ch"), t.si("ch"), t.si("ch")).delay().get(timeout=15) == 3
    assert len(entries(app, "counted:ch:")) == 3


# -- Celery: a run that hands its message back is not finished ----------------------------------------


def test_reject_with_requeue_runs_again(celery_env):
    app, queue = celery_env(broker_transport_options=FAST_RESTORE)
    with embedded_worker(app, pool="threads", concurrency=2):
        res = app.tasks["tg.rejecting"].delay("rq")
        assert wait_for(lambda: len(entries(app, "reject:rq:")) == 2, timeout=20)
        assert res.get(timeout=10) == 2
    assert app.conf.taskguard_locks.holder("reject:rq") is None


@pytest.mark.parametrize("result_expires", [600, 86400], ids=["finished-marker", "result-backend"])
def test_hard_time_limit_without_acks_on_timeout_runs_again(celery_env, prefix, result_expires):
    """acks_late + time_limit + acks_on_timeout=False: Celery stores FAILURE and requeues the
    message (celery/worker/request.py, on_timeout then on_failure). The redelivery runs, whether
    finished runs are told by taskguard's marker (results kept less than the redelivery window)
    or by the result backend."""
    conf = {"broker_transport_options": FAST_RESTORE, "result_expires": result_expires}
    app, queue = celery_env(**conf)
    with WorkerProcess(queue, prefix, concurrency=1, conf=conf):
        res = app.tasks["tg.timed_out"].delay("tl")
        assert wait_for(lambda: len(entries(app, "timed:tl:")) == 2, timeout=30), entries(app, "timed:tl:")
        assert wait_for(lambda: AsyncResult(res.id, app=app).state == "SUCCESS", timeout=15)
    fences = [int(e.rsplit(":", 1)[1]) for e in entries(app, "timed:tl:")]
    say(f"injected: hard time limit on the first run; observed runs with fences {fences}")
    assert fences[1] > fences[0] and AsyncResult(res.id, app=app).get(timeout=1) == 2


def test_retry_on_worker_lost_runs_the_retry(celery_env, prefix):
    """task_retry_on_worker_lost: the main process publishes a retry (no task_failure, no
    release); the retry finds the dead child's lease, releases it and runs."""
    app, queue = celery_env()
    with WorkerProcess(queue, prefix, concurrency=1):
        res = app.tasks["tg.lost_retried"].delay("wl")
        assert res.get(timeout=30) == 2
    fences = [int(e.rsplit(":", 1)[1]) for e in entries(app, "lostr:wl:")]
    say(f"injected: SIGKILL of the child; observed runs with fences {fences}")
    assert len(fences) == 2 and fences[1] > fences[0]


# -- Celery: what a finished run costs in Redis --------------------------------------------------------


def _keys_of(prefix):
    r = redis.Redis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return {k.decode(): r.pttl(k) for k in r.scan_iter(match="{" + prefix + ":*", count=1000)}


def test_finished_runs_leave_no_record_when_the_result_backend_holds_them(celery_env, prefix):
    """400 runs of a default guarded task (early ack, no ETA, one key): with the result backend
    keeping outcomes, nothing but the key's fence record stays (it used to be 400 keys kept a day)."""
    app, queue = celery_env(broker_transport_options={"visibility_timeout": 60})
    with embedded_worker(app, pool="threads", concurrency=1):  # one key: one run at a time
        results = [app.tasks["tg.default_noop"].delay() for _ in range(400)]
        assert [r.get(timeout=60) for r in results] == [1] * 400
    keys = _keys_of(prefix)
    say(f"400 finished runs (result backend): keys left {sorted(keys)}")
    base = "{" + prefix + ":tg.default_noop}"
    # per guard key, not per run: the lease hash (its fence, release mark, the last release's record
    # for a re-sent release, and last finished run)
    assert set(keys) == {base}, sorted(keys)
    r = redis.Redis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    assert r.hlen(base) <= 4, r.hgetall(base)


def test_finished_runs_without_a_result_backend_are_kept_only_while_redeliverable(celery_env, prefix):
    """ignore_result: a finished marker per run, kept for the broker's redelivery window
    (visibility_timeout 60 s + 60 s sweep margin), not a day."""
    app, queue = celery_env(broker_transport_options={"visibility_timeout": 60})
    with embedded_worker(app, pool="threads", concurrency=1):  # one key: one run at a time
        for _ in range(400):
            app.tasks["tg.default_noop_noresult"].delay()
        assert wait_for(lambda: len([k for k in _keys_of(prefix) if ":done:" in k]) == 400, timeout=60)
    keys = _keys_of(prefix)
    markers = [ttl for k, ttl in keys.items() if ":done:" in k]
    say(f"400 finished runs (no result backend): {len(markers)} markers, longest TTL {max(markers)} ms")
    assert len(markers) == 400 and 0 < max(markers) <= 120_000


# -- RQ: every execution is a run ---------------------------------------------------------------------


def test_rq_returned_retry_runs_the_body_again(rq_env):
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.returns_retry, "a")
        assert wait_done(job) == JobStatus.FINISHED
    runs = [e for e in rq_log(rq_env) if e.startswith("rr:a:")]
    say(f"returned Retry: runs {runs}, value {job.return_value()!r}")
    assert len(runs) == 2 and job.return_value() == "second run"
    assert runs[0].rsplit(":", 1)[1] == runs[1].rsplit(":", 1)[1]  # the retry kept the lease (same fence)
    assert rq_locks().holder("rr:a") is None


def test_rq_requeue_of_a_failed_job_runs_again(rq_env):
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.flaky, "rq", fail_times=1)
        assert wait_done(job) == JobStatus.FAILED
        job.requeue()
        assert wait_done(job) == JobStatus.FINISHED
    assert not is_skipped(job.return_value()) and isinstance(job.return_value(), int)
    assert len([e for e in rq_log(rq_env) if e.startswith("flaky:rq:")]) == 2


def test_rq_reused_job_id_and_scheduled_job_run_again(rq_env):
    with RQWorker(rq_env):
        job = rq_env.enqueue(rq_jobs.slow, 3, seconds=0.1, job_id="reused-id")
        assert wait_done(job) == JobStatus.FINISHED
        job = rq_env.enqueue(rq_jobs.slow, 3, seconds=0.1, job_id="reused-id")
        assert wait_done(job) == JobStatus.FINISHED and not is_skipped(job.return_value())
        job = rq_env.enqueue_in(timedelta(seconds=1), rq_jobs.slow, 3, seconds=0.1, job_id="reused-id")
        assert wait_done(job, timeout=30) == JobStatus.FINISHED and not is_skipped(job.return_value())
    assert len([e for e in rq_log(rq_env) if e == "slow:3:end"]) == 3


def test_rq_abandoned_job_recovery_runs_it(rq_env):
    """The whole worker is SIGKILLed mid-job (a plain rq worker: nothing settles the lease);
    abandoned-job cleanup retries the job; the new execution finds its own job id holding the
    lease of a dead work-horse, releases it and runs (it used to finish as Skipped)."""
    with RQWorker(rq_env, worker_class="rq.Worker") as w:
        job = rq_env.enqueue(rq_jobs.stalls_once, "ab", retry=Retry(max=1))
        # killed once the body counted its attempt (the lease is taken before the body starts)
        assert wait_for(lambda: [e for e in rq_log(rq_env) if e.startswith("stall:ab:1:")], timeout=20)
        holder = rq_locks().holder("stall:ab")
        os.killpg(w.proc.pid, signal.SIGKILL)  # the worker...
        os.kill(holder.holder["pid"], signal.SIGKILL)  # ...and its work-horse (a session of its own)
        w.proc.wait()
    StartedJobRegistry(queue=rq_env).cleanup(timestamp=time.time() + 10_000)
    with RQWorker(rq_env):
        assert wait_done(job, timeout=30) == JobStatus.FINISHED
    say(f"abandoned job: value {job.return_value()!r}, runs {[e for e in rq_log(rq_env) if e.startswith('stall:')]}")
    assert not is_skipped(job.return_value()) and job.return_value()["attempt"] == 2
    assert job.return_value()["fence"] > holder.fencing_token


def test_rq_second_execution_waits_for_a_live_earlier_one_then_runs(rq_env):
    """An earlier execution of the same job id holds the lease on another host (not known dead):
    the new execution waits for it (bounded by its TTL), then runs; it never ends as Skipped."""
    job_id = f"held-{uuid.uuid4().hex[:8]}"
    with RQWorker(rq_env):  # (the earlier execution's lease taken once the worker is up: its TTL counts from here)
        acquired = time.monotonic()
        rq_locks().acquire("slow:5", ttl=2.0, run_id=job_id, holder={"host": "another-host", "pid": 1})
        job = rq_env.enqueue(rq_jobs.slow, 5, seconds=0.1, job_id=job_id)
        assert wait_done(job, timeout=30) == JobStatus.FINISHED
        took = time.monotonic() - acquired
    say(f"waited for the earlier execution: {took:.1f}s after it took the lease, value {job.return_value()!r}")
    # (counted from the earlier execution's acquire, not from the worker's start-up, which takes
    # a varying part of the lease's 2 s: the run goes only once the lease expired)
    assert not is_skipped(job.return_value()) and took >= 1.9


# -- settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "conf, expected",
    [
        ({}, 3600.0 + 60),
        ({"broker_transport_options": {"visibility_timeout": 60}}, 120.0),
        ({"taskguard_redelivery_timeout": 900}, 960.0),
    ],
)
def test_redelivery_window_comes_from_the_apps_settings(celery_env, conf, expected):
    from taskguard_celery.identity import redelivery_window

    app, _queue = celery_env(**conf)
    assert redelivery_window(app) == expected


def test_redelivery_window_of_rabbitmq_is_its_consumer_timeout(prefix):
    from taskguard_celery.identity import redelivery_window

    app = make_app(f"q-{prefix}", prefix, broker="amqp://guest:guest@127.0.0.1:5672//")
    assert redelivery_window(app) == 1800.0 + 60


@pytest.mark.parametrize(
    "conf, name",
    [
        ({"broker_transport_options": {"visibility_timeout": -1}}, "visibility_timeout"),
        ({"taskguard_redelivery_timeout": float("nan")}, "taskguard_redelivery_timeout"),
    ],
)
def test_a_bad_redelivery_setting_stops_the_worker_at_start_naming_it(celery_env, conf, name):
    from taskguard_celery.pools import check_settings

    app, _queue = celery_env(**conf)
    with pytest.raises(SystemExit, match=name):
        check_settings(app)
