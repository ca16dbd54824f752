"""Celery tasks with ``once=True`` (complete once per business key, the stored value returned to
every later call) and ``enforce=False`` (shadow mode), with embedded and subprocess workers."""

from __future__ import annotations

import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from taskguard import ConfigError, IdempotencyConflict
from taskguard.metrics import Metrics
from taskguard_celery import guarded_task

from .celery_app import make_app
from .celery_support import EventLog, WorkerProcess, body_log, embedded_worker


@pytest.fixture
def app(redis_url, prefix):
    a = make_app(f"q-{prefix}", prefix)
    yield a
    redis.Redis.from_url(redis_url).delete(a.tg_log, f"q-{prefix}")


def _attempts(redis_url, prefix, invoice):
    return int(redis.Redis.from_url(redis_url).get(f"{prefix}:attempt:charge:{invoice}") or 0)


def test_the_first_success_is_stored_and_returned_across_workers_and_restarts(app, redis_url, prefix):
    charge = app.tasks["tg.charge"]
    with EventLog(app, tasks=["tg.charge"]) as events, embedded_worker(app):
        first = charge.delay(1, 100).get(timeout=10)
        again = charge.delay(1, 100, seconds=5).get(timeout=10)  # would sleep 5 s if it ran
        # a new publish of an id
        same_id = charge.apply_async((1, 100), task_id=charge.delay(1, 100).id).get(timeout=10)
        hits = events.wait_for("task-skipped", 3)
    assert first["n"] == 1 and again == first == same_id
    assert {e["reason"] for e in hits} == {"once"}
    for _ in range(2):  # a second worker process, then that worker restarted
        with WorkerProcess(f"q-{prefix}", prefix, concurrency=2) as worker:
            assert charge.delay(1, 100).get(timeout=20) == first, worker.output()
    assert _attempts(redis_url, prefix, 1) == 1  # the body ran once in all
    assert app.conf.taskguard_locks.holder("charge:1") is None


def test_a_failure_stores_nothing_then_a_success_is_stored(app, redis_url, prefix):
    charge = app.tasks["tg.charge"]
    with embedded_worker(app):
        failed = charge.delay(2, 50, fail=True)
        with pytest.raises(Exception, match="declined 2"):
            failed.get(timeout=10)
        ok = charge.delay(2, 50).get(timeout=10)
        assert charge.delay(2, 50, fail=True).get(timeout=10) == ok  # fail= is not in the fingerprint
    assert ok["n"] == 2 and _attempts(redis_url, prefix, 2) == 2


def test_another_fingerprint_fails_with_idempotency_conflict(app):
    charge = app.tasks["tg.charge"]
    with embedded_worker(app):
        charge.delay(3, 70).get(timeout=10)
        conflicting = charge.delay(3, 71)
        with pytest.raises(IdempotencyConflict) as info:
            conflicting.get(timeout=10)
    assert conflicting.state == "FAILURE" and info.value.key == "charge:3" and "71" not in str(info.value)


def test_a_direct_call_and_a_worker_call_share_one_fingerprint(app, redis_url, prefix):
    charge = app.tasks["tg.charge"]
    direct = charge(4, amount=(1, 2))  # a tuple here, a JSON list through the broker
    with embedded_worker(app):
        assert charge.delay(4, [1, 2]).get(timeout=10) == {**direct, "amount": [1, 2]}
    assert _attempts(redis_url, prefix, 4) == 1


def test_while_a_once_run_is_in_flight_others_are_skipped_as_for_a_held_lease(app):
    charge = app.tasks["tg.charge"]
    with embedded_worker(app, concurrency=4):
        slow = charge.delay(5, 10, seconds=1.0)
        time.sleep(0.3)
        busy = charge.delay(5, 10).get(timeout=10)
        done = slow.get(timeout=10)
        after = charge.delay(5, 10).get(timeout=10)
    assert busy["reason"] == "held" and after == done


def test_shadow_mode_runs_every_contended_call_and_reports_the_would_be_skips(app):
    registry = CollectorRegistry()
    remove = app.conf.taskguard_locks.add_listener(Metrics(registry))
    try:
        with EventLog(app, tasks=["tg.shadowed"]) as events, embedded_worker(app, concurrency=4):
            results = [app.tasks["tg.shadowed"].delay("s1", seconds=1.0) for _ in range(4)]
            values = [r.get(timeout=10) for r in results]
            shadow = events.wait_for("task-guard-shadow", 2)
            skipped = events.of("task-skipped")
    finally:
        remove()
    assert len(values) == 4 and sorted(v["leased"] for v in values) == [False, False, True, True]
    assert [e["reason"] for e in shadow] == ["limit", "limit"] and not skipped
    assert (
        registry.get_sample_value("taskguard_skips_total", {"task": "tg.shadowed", "reason": "limit", "shadow": "true"})
        == 2
    )
    assert all(r.state == "SUCCESS" for r in results)


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"once": True}, "needs key="),
        ({"fingerprint": ("a",)}, "needs once=True"),
        ({"once": True, "key": "k:{a}", "fingerprint": ("b",)}, "'b'"),
        ({"once": "yes", "key": "k:{a}"}, "once"),
        ({"once": True, "key": "k:{a}", "once_ttl": 0}, "once_ttl"),
        ({"enforce": 0}, "enforce"),
        ({"once": True, "key": "k:{a}", "once_max_bytes": 0}, "once_max_bytes"),
    ],
)
def test_bad_once_and_shadow_options_fail_at_declaration(opts, match):
    with pytest.raises(ConfigError, match=match):

        @guarded_task(**opts)
        def job(a):
            return a


def test_a_value_the_result_serializer_cannot_encode_fails_the_run_and_releases_the_lease(app):
    with embedded_worker(app):
        bad = app.tasks["tg.setvalue"].delay("x")
        with pytest.raises(Exception, match="cannot be stored"):
            bad.get(timeout=10)
    time.sleep(0.3)
    assert app.conf.taskguard_locks.holder("sv:x") is None  # not left to the heartbeat
    assert app.conf.taskguard_locks.completions.get("sv:x") is None


def test_a_conflict_clears_the_unique_mark_so_the_right_call_gets_the_stored_value(app):
    task = app.tasks["tg.ucharge"]
    with embedded_worker(app):
        stored = task.delay("u1", 1).get(timeout=10)
        with pytest.raises(IdempotencyConflict):
            task.delay("u1", 2).get(timeout=10)
        again = task.delay("u1", 1)
        assert again.get(timeout=10) == stored


def test_a_shadow_retry_claims_its_kept_lease(app):
    with embedded_worker(app):
        assert app.tasks["tg.shadow_retry"].delay("a").get(timeout=10) is True
    runs = [e for e in body_log(app) if e.startswith("sr:a:")]
    fences = {e.split(":")[3] for e in runs}
    assert len(runs) == 2 and len(fences) == 1 and "None" not in fences  # the same lease, claimed
    assert app.conf.taskguard_locks.holder("sr:a") is None


def test_shadow_mode_runs_the_body_when_the_lease_redis_is_down(redis_url, prefix):
    from taskguard import RedisLocks

    from .servers import free_port

    app = make_app(
        f"q-{prefix}",
        prefix,
        taskguard_locks=RedisLocks.from_url(
            f"redis://127.0.0.1:{free_port()}/0", prefix=prefix, connect_timeout=0.5, retries=0
        ),
    )
    assert app.tasks["tg.shadowed"]("down", seconds=0) == {"leased": False, "slot": None}


def test_shadow_rate_reports_each_would_be_deferral_with_a_worker(app):
    """Issue input: ``enforce=False, rate=(1, 2)``, four calls in one second. Before, zero would-be
    ``rate_limited`` (the check only peeked); now three, as enforcement would have deferred three.
    Every call runs at once, and the enforced rate is not consumed."""
    locks = app.conf.taskguard_locks
    with EventLog(app, tasks=["tg.shadow_rated"]) as events, embedded_worker(app, concurrency=4):
        results = [app.tasks["tg.shadow_rated"].delay(n) for n in range(4)]
        started = time.monotonic()
        values = [r.get(timeout=10) for r in results]
        elapsed = time.monotonic() - started
        shadow = events.wait_for("task-guard-shadow", 3)
        skipped = events.of("task-skipped")
    print(f"    4 shadow calls ran in {elapsed:.2f}s; would-be: {[e['reason'] for e in shadow]}")
    assert sorted(v["n"] for v in values) == [0, 1, 2, 3] and elapsed < 5
    assert [e["reason"] for e in shadow] == ["rate_limited"] * 3 and not skipped
    assert locks.throttle("srate", rate=(1, 2.0)).allowed  # the enforced rate: untouched


def test_shadow_rate_logs_a_would_be_rate_limit_as_a_held_lease_is_logged(app, caplog):
    """A direct call over the rate in shadow mode logged nothing (only a held lease's was logged;
    RQ logged both): the same line from both adapters now (:func:`taskguard.pipeline.shadow_line`)."""
    import logging

    task = app.tasks["tg.shadow_rated"]
    with caplog.at_level(logging.INFO, logger="taskguard.celery"):
        assert [task(n)["n"] for n in range(2)] == [0, 1]
    assert "shadow mode: would have been rate-limited (rate key 'srate'); running it" in caplog.text


def test_shadow_unique_publishes_every_call_and_reports_the_would_be_suppressions(app):
    """``enforce=False, unique=True``: three publishes while the first run is queued or running. Before,
    the second and third were suppressed (uniqueness was enforced in shadow mode); now all three
    are published and run, and two would-be suppressions are reported."""
    locks = app.conf.taskguard_locks
    seen: list = []
    remove = locks.add_listener(seen.append)
    try:
        with embedded_worker(app, concurrency=4):
            results = [app.tasks["tg.shadow_unique"].delay("a", seconds=0.5) for _ in range(3)]
            values = [r.get(timeout=10) for r in results]
    finally:
        remove()
    suppressed = [e for e in seen if e.kind == "publish" and e.status == "suppressed"]
    print(f"    {len(values)} runs; would-be suppressed publishes: {len(suppressed)}")
    assert len({r.id for r in results}) == 3 and all(v["name"] == "a" for v in values)
    assert len(suppressed) == 2 and all(e.shadow for e in suppressed)
    assert locks.mark_queued("su:a", "probe", ttl=1, task="tg.shadow_unique") == (True, "probe")  # enforced: untouched
