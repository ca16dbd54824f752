"""The Celery adapter's normal path, with real (embedded) workers on real Redis."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

import pytest
import redis
from celery import chain, chord
from celery.exceptions import Retry

from taskguard import ConfigError, LeaseLost, Skipped, TaskSkipped, as_skipped, is_skipped
from taskguard_celery import GuardedTask, guarded_task

from .celery_app import make_app
from .celery_support import EventLog, body_log, embedded_worker, wait_for_body


@pytest.fixture
def app(redis_url, prefix):
    a = make_app(f"q-{prefix}", prefix)
    yield a
    r = redis.Redis.from_url(redis_url)
    r.delete(a.tg_log, f"q-{prefix}")


def concurrent(task, *args, **kwargs):
    """Start one run, wait until it holds its lease, then start a second one of the same key."""
    first = task.apply_async(args, kwargs)
    locks = task.app.conf.taskguard_locks
    key = task.taskguard_options.key.render(args, kwargs)
    deadline = time.monotonic() + 10
    while locks.holder(key) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    second = task.apply_async(args, kwargs)
    return first, second


# -- 1. one runs, the other is an explicit Skipped ----------------------------------------------


def test_two_concurrent_runs_one_skipped_json(app):
    with embedded_worker(app):
        first, second = concurrent(app.tasks["tg.slow"], 1)
        skipped = second.get(timeout=5)
        ran = first.get(timeout=5)
    # JSON results carry the plain tagged dict: any client reads it, taskguard installed or not
    assert isinstance(skipped, dict) and is_skipped(skipped), skipped
    skipped = Skipped.from_dict(skipped)
    assert skipped.key == "slow:1" and skipped.reason == "held" and skipped.task == "tg.slow"
    assert 0 < skipped.holder_ttl <= 5
    assert ran["n"] == 1 and ran["same"] is True
    assert second.state == "SUCCESS"
    assert body_log(app).count("slow:1:end") == 1


def test_a_client_without_taskguard_reads_a_skip_and_the_other_results(app, redis_url):
    """A client process that imports only ``celery`` (never ``taskguard_celery``) sends a slow
    guarded task twice by name over the Redis result backend: both ``.get()`` give plain values
    (the skip: SUCCESS with the tagged dict). Before, a registered kombu type made both results
    ``kombu.exceptions.DecodeError: Unsupported type`` (they come over one pub/sub subscription)."""
    client = f"""
import json, sys, time
from celery import Celery
app = Celery("client", broker={redis_url!r}, backend={redis_url!r})
first = app.send_task("tg.slow", (7,), {{"seconds": 3}}, queue={app.conf.task_default_queue!r})
time.sleep(1.0)
second = app.send_task("tg.slow", (7,), {{"seconds": 0}}, queue={app.conf.task_default_queue!r})
out = [second.get(timeout=20), second.state, first.get(timeout=20), first.state]
assert not any(m.startswith("taskguard") for m in sys.modules), "the client imported taskguard"
print(json.dumps(out))
"""
    with embedded_worker(app):
        proc = subprocess.run(
            [sys.executable, "-c", client], capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir()
        )
    assert proc.returncode == 0, proc.stderr[:3000]
    skipped, skipped_state, ran, ran_state = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"    observed: a client without taskguard got {skipped!r} ({skipped_state}) and {ran!r} ({ran_state})")
    assert skipped_state == ran_state == "SUCCESS"
    assert is_skipped(skipped) and as_skipped(skipped).reason == "held" and as_skipped(skipped).key == "slow:7"
    assert ran["n"] == 7


@pytest.mark.parametrize("serializer", ["pickle", "msgpack"])
def test_skipped_through_other_result_serializers(redis_url, prefix, serializer):
    app = make_app(
        f"q-{prefix}",
        prefix,
        result_serializer=serializer,
        task_serializer=serializer,
        accept_content=["json", "pickle", "msgpack"],
        result_accept_content=["json", "pickle", "msgpack"],
    )
    with embedded_worker(app):
        first, second = concurrent(app.tasks["tg.slow"], 2)
        out = second.get(timeout=5)
        first.get(timeout=5)
    assert is_skipped(out)
    if serializer == "pickle":
        assert isinstance(out, Skipped) and out.reason == "held"
    else:
        assert isinstance(out, dict) and out["reason"] == "held" and Skipped.from_dict(out).key == "slow:2"


def test_ignore_result_task_skips_without_writing(app):
    r = redis.Redis.from_url(app.conf.result_backend)
    with embedded_worker(app):
        holder = app.tasks["tg.slow"].delay(7, seconds=1.0)
        wait_for_body(app, "slow:7:start")
        res = app.tasks["tg.noresult"].delay(7)
        time.sleep(1.0)
        holder.get(timeout=5)
    assert r.exists(f"celery-task-meta-{res.id}") == 0
    assert res.state == "PENDING"


def test_different_keys_run_in_parallel_on_threads_pool(app):
    with embedded_worker(app, pool="threads", concurrency=4):
        results = [app.tasks["tg.slow"].delay(n, seconds=1.0) for n in range(4)]
        started = time.monotonic()
        outs = [r.get(timeout=10) for r in results]
        took = time.monotonic() - started
    assert [o["n"] for o in outs] == [0, 1, 2, 3]
    assert all(o["same"] for o in outs)  # each body saw its own lease
    assert len({o["fence"] for o in outs}) == 4
    assert took < 3.0


# -- 2. task-skipped events, also without -E -----------------------------------------------------


def test_skip_sends_task_skipped_event_with_events_otherwise_off(app):
    app.conf.worker_send_task_events = False
    with EventLog(app) as events, embedded_worker(app):
        first, second = events.track(*concurrent(app.tasks["tg.slow"], 3))
        second.get(timeout=5)
        first.get(timeout=5)
        got = events.wait_for("task-skipped")
    assert len(got) == 1
    ev = got[0]
    assert ev["uuid"] == second.id and ev["name"] == "tg.slow"
    assert ev["reason"] == "held" and "held" in ev["result"] and ev["key"] == "slow:3"
    assert events.of("task-succeeded") == []  # worker events really were off
    assert all("owner" not in str(e) for e in events.events)


# -- 3. on_skip modes ----------------------------------------------------------------------------


def test_chord_with_skipped_member_completes(app):
    with embedded_worker(app):
        holder = app.tasks["tg.slow"].delay(9, seconds=2.0)
        time.sleep(0.2)
        c = chord(
            [app.tasks["tg.slow"].s(9, seconds=0), app.tasks["tg.slow"].s(10, seconds=0)], app.tasks["tg.collect"].s()
        )()
        values = c.get(timeout=10)
        holder.get(timeout=5)
    assert len(values) == 2
    assert sum(is_skipped(v) for v in values) == 1
    assert any(isinstance(v, dict) and v.get("n") == 10 for v in values)


def test_chain_stops_after_a_skip_unless_asked_to_continue(app):
    with embedded_worker(app):
        holder = app.tasks["tg.slow"].delay(11, seconds=2.5)
        wait_for_body(app, "slow:11:start")
        stopped = chain(app.tasks["tg.slow"].s(11, seconds=0), app.tasks["tg.after"].s())()
        linked = app.tasks["tg.slow"].apply_async((11,), {"seconds": 0}, link=app.tasks["tg.after"].s())
        continued = chain(app.tasks["tg.continuing"].s(11), app.tasks["tg.after"].s())()
        assert continued.get(timeout=5) == "after ran"
        assert is_skipped(stopped.parent.get(timeout=5))
        assert is_skipped(linked.get(timeout=5))
        holder.get(timeout=5)
        time.sleep(0.5)
    afters = [e for e in body_log(app) if e.startswith("after:")]
    assert len(afters) == 1 and "held" in afters[0]  # only the continuing chain went on
    assert stopped.state == "PENDING"


def test_on_skip_ignore_records_nothing_and_sends_event(app):
    with EventLog(app) as events, embedded_worker(app):
        first, second = events.track(*concurrent(app.tasks["tg.on_skip_ignore"], seconds=1.5))
        first.get(timeout=5)
        time.sleep(0.3)
        got = events.wait_for("task-skipped")
    assert second.state == "PENDING"  # Ignore: no state written
    assert [e["uuid"] for e in got] == [second.id]
    assert body_log(app).count("ignore:0:ran") == 1


def test_on_skip_ignore_is_refused_inside_a_chord(app):
    with embedded_worker(app):
        c = chord([app.tasks["tg.on_skip_ignore"].s()], app.tasks["tg.collect"].s())()
        with pytest.raises(Exception) as err:
            c.get(timeout=10)
    assert "chord" in str(err.value)
    assert not any(e.startswith("ignore:") for e in body_log(app))


def test_on_skip_raise_fails_with_task_skipped_through_json(app):
    with embedded_worker(app):
        first, second = concurrent(app.tasks["tg.on_skip_raise"], seconds=1.5)
        with pytest.raises(TaskSkipped) as err:
            second.get(timeout=5)
        first.get(timeout=5)
    assert second.state == "FAILURE"
    assert err.value.key == "modes" and err.value.reason == "held"
    assert err.value.skipped.task == "tg.on_skip_raise"


def test_on_skip_retry_is_bounded_and_does_not_consume_max_retries(app):
    with EventLog(app) as events, embedded_worker(app):
        holder = app.tasks["tg.on_skip_retry"].delay(seconds=4.0)  # holds through all skip retries
        wait_for_body(app, "retry:0:ran")
        waiting = events.track(app.tasks["tg.on_skip_retry"].delay(n=1))  # max_retries=0, skip_max_retries=2
        out = waiting.get(timeout=10)
        holder.get(timeout=10)
        skips = events.wait_for("task-skipped", 3)
    assert is_skipped(out) and out["reason"] == "retry_exhausted"
    assert [e["reason"] for e in skips if e["uuid"] == waiting.id] == ["held", "held", "retry_exhausted"]
    assert "retry:1:ran" not in body_log(app)


def test_on_skip_retry_runs_once_the_holder_is_done(app):
    with embedded_worker(app):
        holder = app.tasks["tg.on_skip_retry"].delay(seconds=0.6)
        wait_for_body(app, "retry:0:ran")
        waiting = app.tasks["tg.on_skip_retry"].delay(n=2)
        assert waiting.get(timeout=10) == "retry ran"
        holder.get(timeout=5)
    assert body_log(app) == ["retry:0:ran", "retry:2:ran"]


# -- 4. held for the whole body, released on every exit ------------------------------------------


def lease_holder(app, key):
    return app.conf.taskguard_locks.holder(key)


def test_body_longer_than_ttl_keeps_lease_then_releases(app):
    with embedded_worker(app):
        res = app.tasks["tg.short_ttl"].delay(seconds=2.0)
        time.sleep(1.2)  # two TTLs in
        assert lease_holder(app, "short") is not None
        other = app.tasks["tg.short_ttl"].delay(seconds=0)
        assert is_skipped(other.get(timeout=5))
        fence = res.get(timeout=5)
    assert isinstance(fence, int)
    assert lease_holder(app, "short") is None


def test_released_after_exception_and_soft_time_limit(app):
    with embedded_worker(app, pool="prefork", concurrency=1):
        with pytest.raises(ValueError):
            app.tasks["tg.boom"].delay().get(timeout=10)
        assert lease_holder(app, "boom") is None
        with pytest.raises(Exception) as err:
            app.tasks["tg.soft"].delay().get(timeout=10)
        assert "SoftTimeLimit" in type(err.value).__name__
        assert lease_holder(app, "soft") is None
    assert "soft:limit" in body_log(app)


def test_lease_lost_mid_body_is_reported(app):
    with EventLog(app) as events, embedded_worker(app):
        with pytest.raises(LeaseLost):
            events.track(app.tasks["tg.loses"].delay()).get(timeout=5)
        app.conf.taskguard_locks.client.delete("{" + app.conf.taskguard_locks.prefix + ":loses}")
        assert events.track(app.tasks["tg.loses_warn"].delay()).get(timeout=5) == "finished"
        lost = events.wait_for("task-lease-lost", 2)
    assert len(lost) == 2 and all(e["key"] == "loses" for e in lost)


# -- 5. retries restore their lease --------------------------------------------------------------


def test_retry_keeps_lease_same_fence_and_merges_headers(app):
    with embedded_worker(app):
        res = app.tasks["tg.retrying"].apply_async(("a",), headers={"tenant": "acme"})
        fence = res.get(timeout=15)
    runs = [e for e in body_log(app) if e.startswith("retrying:a:")]
    assert len(runs) == 3
    fences = {int(e.split(":")[3]) for e in runs}
    assert fences == {fence}
    # the user's header survived every retry, and the retry's own header joined it
    assert "'tenant'" in runs[0] and "'tenant'" in runs[1] and "'attempt_note'" in runs[1] and "'tenant'" in runs[2]


def test_autoretry_keeps_lease(app):
    with embedded_worker(app):
        fence = app.tasks["tg.autoretry"].delay().get(timeout=15)
    runs = [e for e in body_log(app) if e.startswith("auto:")]
    assert [int(e.split(":")[2]) for e in runs] == [fence] * 3


def test_lease_covers_the_countdown_and_others_are_skipped_meanwhile(app):
    with embedded_worker(app):
        res = app.tasks["tg.retrying"].apply_async(("b",), {"fail_times": 1, "countdown": 3.0})
        time.sleep(1.0)
        info = lease_holder(app, "retry:b")
        assert info is not None and info.ttl > 2.5  # ttl=2, stretched to cover the countdown
        intruder = app.tasks["tg.retrying"].apply_async(("b",), {"fail_times": 0})
        assert is_skipped(intruder.get(timeout=5))
        fence = res.get(timeout=15)
    assert info.fencing_token == fence
    assert lease_holder(app, "retry:b") is None


def test_retry_after_lease_lost_acquires_larger_fence(app):
    locks = app.conf.taskguard_locks
    with embedded_worker(app):
        res = app.tasks["tg.retrying"].apply_async(("c",), {"fail_times": 1, "countdown": 1.0})
        time.sleep(0.5)
        first = lease_holder(app, "retry:c")
        locks.client.delete("{" + locks.prefix + ":retry:c}")  # expired/evicted during the countdown
        fence = res.get(timeout=15)
    assert fence > first.fencing_token


def test_retry_never_runs_beside_a_new_holder(app):
    locks = app.conf.taskguard_locks
    with embedded_worker(app):
        res = app.tasks["tg.retrying"].apply_async(("d",), {"fail_times": 1, "countdown": 1.0})
        time.sleep(0.5)
        locks.client.delete("{" + locks.prefix + ":retry:d}")
        squatter = locks.acquire("retry:d", ttl=10).lease  # someone else took it
        out = res.get(timeout=15)
        squatter.release()
    assert is_skipped(out) and as_skipped(out).reason == "held"
    assert len([e for e in body_log(app) if e.startswith("retrying:d:")]) == 1


def test_two_copies_of_one_retry_message_run_one_body(app):
    """The retry message sent twice, byte for byte (as a broker that delivers a message again
    would): exactly one body runs; the second copy neither claims the lease nor runs after it."""
    sent = []
    amqp = app.amqp
    real_send = amqp.send_task_message

    def send_retry_twice(producer, name, message, **kwargs):
        headers = kwargs.get("headers")  # custom headers, merged into the message by the sender
        if isinstance(headers, dict) and isinstance(headers.get("taskguard"), dict) and "owner" in headers["taskguard"]:
            sent.append(1)
            real_send(producer, name, message, **kwargs)  # the same message, once more
        return real_send(producer, name, message, **kwargs)

    amqp.send_task_message = send_retry_twice
    try:
        with embedded_worker(app, pool="threads", concurrency=4):
            res = app.tasks["tg.retrying"].apply_async(("e",), {"fail_times": 1, "countdown": 0.5})
            res.get(timeout=15)
            time.sleep(1.5)
    finally:
        del amqp.send_task_message
    runs = [e for e in body_log(app) if e.startswith("retrying:e:1:")]
    assert sent and len(runs) == 1, runs


# -- direct calls, eager mode, send_task --------------------------------------------------------------


def test_direct_call_eager_and_send_task_are_guarded(app):
    locks = app.conf.taskguard_locks
    held = locks.acquire("slow:5", ttl=10).lease
    assert is_skipped(app.tasks["tg.slow"](5, seconds=0))
    assert is_skipped(app.tasks["tg.slow"].apply((5,), {"seconds": 0}).get())
    with embedded_worker(app):
        assert is_skipped(app.send_task("tg.slow", (5,), {"seconds": 0}).get(timeout=5))
    held.release()
    assert app.tasks["tg.slow"](5, seconds=0)["n"] == 5
    app.conf.task_always_eager = True
    assert app.tasks["tg.slow"].delay(5, seconds=0).get()["n"] == 5
    assert lease_holder(app, "slow:5") is None


def test_eager_retry_restores_lease(app):
    app.conf.task_always_eager = True
    fence = app.tasks["tg.retrying"].delay("eager", fail_times=2, countdown=0).get()
    runs = [e for e in body_log(app) if e.startswith("retrying:eager:")]
    assert len(runs) == 3 and {int(e.split(":")[3]) for e in runs} == {fence}


# -- declaration-time validation ---------------------------------------------------------------------


def test_bad_options_fail_at_declaration():
    with pytest.raises(ConfigError, match="customer_id"):

        @guarded_task(key="report:{customer_id}")
        def report(account_id):
            pass

    with pytest.raises(ConfigError, match="on_skip"):

        @guarded_task(on_skip="sometimes")
        def f():
            pass

    with pytest.raises(ConfigError, match="ttl"):

        @guarded_task(ttl=0)
        def g():
            pass

    with pytest.raises(ConfigError, match="blocking_wait"):

        @guarded_task(wait=5)
        def h():
            pass

    from celery import Celery

    app = Celery("decl", set_as_current=False)
    with pytest.raises(ConfigError, match="missing"):

        @app.task(base=GuardedTask, key="x:{missing}", shared=False, lazy=False)
        def k(present):
            pass


def test_key_template_binds_defaults_and_bad_calls_fail_clearly(app):
    @app.task(base=GuardedTask, name="tg.kw", key="kw:{region}:{day}", shared=False)
    def kw(day, region="eu"):
        from taskguard_celery import current_lease

        return current_lease().key

    assert kw("mon") == "kw:eu:mon"
    assert kw(day="tue", region="us") == "kw:us:tue"
    with pytest.raises(TypeError, match="missing a required argument: 'day'") as info:  # as kw() would
        kw()
    assert not isinstance(info.value, ConfigError)


def test_user_base_class_composes(app):
    calls = []

    class Audited(app.Task):
        def __call__(self, *args, **kwargs):
            calls.append(self.name)
            return super().__call__(*args, **kwargs)

    @guarded_task(base=Audited, name="tg.audited", ttl=5, bind=True)
    def audited(self):
        return self.lease.fencing_token

    task = app.tasks["tg.audited"]
    assert isinstance(task, GuardedTask) and isinstance(task, Audited)
    assert isinstance(task(), int) and calls == ["tg.audited"]


def test_retry_outside_worker_raises_like_celery(app):
    with pytest.raises(Retry):
        app.tasks["tg.retrying"]("direct", fail_times=1)
    assert lease_holder(app, "retry:direct") is None  # released: no retry was published


# -- retry corner cases --------------------------------------------------------------------------------


def test_retry_with_throw_false_never_runs_beside_the_original(app):
    with embedded_worker(app, pool="threads", concurrency=4):
        res = app.tasks["tg.retry_nothrow"].delay()
        res.get(timeout=15)
        deadline = time.monotonic() + 15
        while len([e for e in body_log(app) if ":end:" in e]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    entries = body_log(app)
    first_end = float(next(e for e in entries if e.startswith("nothrow:0:end:")).split(":")[3])
    retry_start = float(next(e for e in entries if e.startswith("nothrow:1:start:")).split(":")[3])
    assert retry_start >= first_end  # the retry waited for the original body to finish
    assert lease_holder(app, "nothrow") is None


def test_retry_with_negative_countdown_or_iso_eta(app):
    with embedded_worker(app):
        assert app.tasks["tg.retry_odd_times"].delay("negative").get(timeout=10) == "ok"
        assert app.tasks["tg.retry_odd_times"].delay("iso").get(timeout=10) == "ok"


def test_retry_after_the_lease_was_lost_still_runs(app):
    with embedded_worker(app):
        assert app.tasks["tg.hung_then_retry"].delay().get(timeout=15) == "second run"
    assert [e for e in body_log(app) if e.startswith("hung:")] == ["hung:0", "hung:1"]


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        {"owner": 123},
        {"key": "slow:4", "owner": "forged", "fence": "x", "expires": 10**400},
        {"key": "slow:4", "owner": "forged", "fence": 1, "expires": 1.0},
        {"skips": "abc"},
        {"skips": -40},
    ],
)
def test_malformed_taskguard_header_is_ignored_not_fatal(app, header):
    with embedded_worker(app):
        out = app.tasks["tg.slow"].apply_async((4,), {"seconds": 0}, headers={"taskguard": header}).get(timeout=5)
    assert out["n"] == 4
    assert lease_holder(app, "slow:4") is None


def test_a_retry_that_is_not_published_releases_the_kept_lease_at_once(app):
    """The run's last retry fails with MaxRetriesExceededError: the lease it had stretched for that
    retry is released when the task fails (not left for the countdown plus the TTL), and the run is
    recorded as finished."""
    locks = app.conf.taskguard_locks
    with embedded_worker(app, pool="threads", concurrency=2):
        res = app.tasks["tg.retrying"].apply_async(("maxed",), {"fail_times": 99, "countdown": 0.1})
        with pytest.raises(Exception) as err:
            res.get(timeout=20)
        gone_at = time.monotonic()
        assert locks.holder("retry:maxed") is None
    assert "MaxRetries" in type(err.value).__name__ or "Retries" in str(err.value)
    assert len([e for e in body_log(app) if e.startswith("retrying:maxed:")]) == 6  # the run and 5 retries
    assert time.monotonic() - gone_at < 5
