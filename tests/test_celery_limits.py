"""Celery tasks with ``limit=N`` (at most N runs of a key at once) and ``rate=`` (a cluster-wide
rate; rate-limited runs come back at their booked turn without consuming ``max_retries``), with
embedded and subprocess workers against real Redis."""

from __future__ import annotations

import time

import pytest
import redis
from celery.app.task import Context
from prometheus_client import CollectorRegistry

from taskguard import ConfigError, is_skipped
from taskguard.metrics import Metrics
from taskguard_celery import guarded_task
from taskguard_celery.beat import validate_entry_options
from taskguard_celery.headers import BEAT_HEADER
from taskguard_celery.task import run_options

from . import ledger
from .celery_app import make_app
from .celery_support import EventLog, WorkerProcess, embedded_worker


@pytest.fixture
def app(redis_url, prefix):
    a = make_app(f"q-{prefix}", prefix)
    yield a
    redis.Redis.from_url(redis_url).delete(a.tg_log, f"q-{prefix}")


def _ledger(redis_url, prefix, key):
    return ledger.parse(redis.Redis.from_url(redis_url).lrange(f"{prefix}:ledger:{key}", 0, -1))


def test_limit_admits_n_runs_at_once_and_skips_the_rest_with_reason_limit(app, redis_url, prefix):
    registry = CollectorRegistry()
    remove = app.conf.taskguard_locks.add_listener(Metrics(registry))
    try:
        with EventLog(app, tasks=["tg.export"]) as events, embedded_worker(app, concurrency=6):
            results = [app.tasks["tg.export"].delay("t1", seconds=1.0) for _ in range(5)]
            other = app.tasks["tg.export"].delay("t2", seconds=0)
            values = [r.get(timeout=15) for r in results]
            assert other.get(timeout=15) in (0, 1)  # another tenant has its own slots
            skipped_events = events.wait_for("task-skipped", 3)
    finally:
        remove()
    ran = [v for v in values if not is_skipped(v)]
    skipped = [v for v in values if is_skipped(v)]
    assert sorted(ran) == [0, 1] and len(skipped) == 3
    assert {s["reason"] for s in skipped} == {"limit"}
    assert {e["reason"] for e in skipped_events} == {"limit"} and len(skipped_events) == 3
    assert (
        registry.get_sample_value("taskguard_skips_total", {"task": "tg.export", "reason": "limit", "shadow": "false"})
        == 3
    )
    assert ledger.peak(_ledger(redis_url, prefix, "export:t1"), 2) == 2
    assert app.conf.taskguard_locks.holders("export:t1") == []


def test_limit_holds_across_prefork_worker_processes(app, redis_url, prefix):
    """Two prefork workers (3 children each) run 16 exports of one tenant, limit 2, with
    on_skip="retry": every export runs in the end, never more than 2 at once, fences grow per slot."""
    with (
        WorkerProcess(f"q-{prefix}", prefix, concurrency=3) as w1,
        WorkerProcess(f"q-{prefix}", prefix, concurrency=3) as w2,
    ):
        results = [app.tasks["tg.export_retrying"].delay("t1", seconds=0.2) for _ in range(16)]
        values = [r.get(timeout=60) for r in results]
        output = w1.output() + w2.output()
    assert all(v in (0, 1) for v in values), (values, output)
    entries = _ledger(redis_url, prefix, "export:t1")
    assert len([e for e in entries if e[1] == 1]) == 16
    assert ledger.peak(entries, 2) == 2
    assert "Traceback" not in output


def test_a_rate_holds_across_two_worker_processes_and_no_call_is_lost(app, redis_url, prefix):
    """62 calls at once under 6/s with a burst of 2, on two prefork workers: every call runs (the
    task has max_retries=0: a deferral does not count as a retry), over >= 10 s, and in every
    window of w seconds at most 2 + 6 w calls passed the rate (admitted: at once, or at the turn
    they booked; no body starts before its admission, and bodies started within a call of it)."""
    r = redis.Redis.from_url(redis_url)
    with (
        WorkerProcess(f"q-{prefix}", prefix, concurrency=2) as w1,
        WorkerProcess(f"q-{prefix}", prefix, concurrency=2) as w2,
    ):
        started = time.time()
        results = [app.tasks["tg.api_call"].delay(n) for n in range(62)]
        values = [res.get(timeout=90) for res in results]
        output = w1.output() + w2.output()
    assert values == list(range(62)), output
    records = [v.decode().split() for v in r.lrange(f"{prefix}:calls", 0, -1)]
    assert len(records) == 62  # each ran exactly once
    ran = sorted(float(x[0]) for x in records)
    admitted = sorted(float(x[2]) for x in records)
    early = [(x[1], round(float(x[2]) - float(x[0]), 4)) for x in records if float(x[0]) < float(x[2]) - 0.002]
    assert not early, early  # never before its turn: (call, seconds before its turn)
    assert admitted[-1] - started >= 9.5  # (62 - 2) / 6 s = 10 s, less the first turn's share
    for times, slack in ((admitted, 0), (ran, 2)):
        for i, t0 in enumerate(times):
            for w in (0.5, 1.0, 2.0, 5.0):
                n = sum(1 for t in times[i:] if t < t0 + w)
                assert n <= 2 + 6 * w + slack + 1e-9, (w, n, t0 - started, slack)
    assert "Traceback" not in output and "MaxRetriesExceeded" not in output


def test_rate_max_wait_ends_in_a_rate_limited_skip(app):
    with EventLog(app, tasks=["tg.api_bounded"]) as events, embedded_worker(app):
        assert app.tasks["tg.api_bounded"].delay(1).get(timeout=10) == 1
        started = time.monotonic()
        second = app.tasks["tg.api_bounded"].delay(2).get(timeout=10)
        assert time.monotonic() - started < 5  # the next turn is 60 s away: past the 2 s bound at once
        skipped = events.wait_for("task-skipped", 1)
    assert is_skipped(second) and second["reason"] == "rate_limited"
    assert [e["reason"] for e in skipped] == ["rate_limited"]


def test_a_deferred_run_comes_back_at_its_booked_turn(app, redis_url, prefix):
    """Denied runs book distinct turns (1/6 s apart), come back as RETRY then SUCCESS, and report a
    task-skipped event with retrying=True for each deferral."""
    with EventLog(app, tasks=["tg.api_call"]) as events, embedded_worker(app, concurrency=4):
        results = [app.tasks["tg.api_call"].delay(n) for n in range(6)]
        assert [res.get(timeout=20) for res in results] == list(range(6))
        deferrals = events.wait_for("task-skipped", 4)
    assert len(deferrals) >= 4 and all(e["retrying"] and e["reason"] == "rate_limited" for e in deferrals)
    # no herd: each denied call got its own turn, one emission interval (1/6 s) after the other
    turns = sorted(e["turn"] for e in deferrals)
    # distinct turns at least one emission interval (1/6 s) apart (a call that finds the rate with
    # room again passes instead of booking, so a gap may span several intervals); (turn: the
    # worker's clock + the server's wait)
    assert all((b - a) > 1 / 6 - 0.04 for a, b in zip(turns, turns[1:], strict=False)), turns
    assert all(e["retry_after"] > 0 for e in deferrals)
    records = [x.decode().split() for x in redis.Redis.from_url(redis_url).lrange(f"{prefix}:calls", 0, -1)]
    assert all(float(x[0]) >= float(x[2]) - 0.002 for x in records)  # none ran before its turn


def test_direct_calls_wait_for_their_turn(app):
    task = app.tasks["tg.api_call"]
    started = time.monotonic()
    assert [task(n) for n in range(4)] == [0, 1, 2, 3]  # burst 2, then 1/6 s apart
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"limit": "2"}, "limit"),
        ({"rate": "10/w"}, "rate"),
        ({"rate": (0, 1)}, "rate"),
        ({"rate_key": "x"}, "need rate"),
        ({"rate": "1/s", "rate_key": "{nope}"}, "nope"),
        ({"rate": "1/s", "rate_burst": 0}, "burst"),
        ({"rate": "1/s", "rate_max_wait": -1}, "rate_max_wait"),
    ],
)
def test_bad_limit_and_rate_options_fail_at_declaration(opts, match):
    with pytest.raises(ConfigError, match=match):

        @guarded_task(**opts)
        def job(tenant):
            return tenant


def _worker_guard(task, entry_options):
    """The guard options a worker applies to a slot message of a beat entry with ``entry_options``
    (its ``taskguard_beat`` header, read as ``GuardedTask`` reads it)."""
    header = {"entry": "e", "slot": "s1", "keep": 60, **entry_options}
    guard, slot = run_options(task, Context(headers={BEAT_HEADER: header}), task.taskguard_options)
    assert slot == ("beat:e:s1", 60.0)
    return guard


def test_beat_entries_carry_limit_and_rate(app):
    task = app.tasks["tg.export"]
    opts = validate_entry_options("e", {"limit": 3, "rate": (5, 60), "rate_key": "tenant:{tenant}"})
    guard = _worker_guard(task, opts)
    assert guard.limit == 3 and guard.rate == (5, 60.0) and guard.rate_key.render(("t9",), {}) == "tenant:t9"
    for bad in ({"limit": 0}, {"rate": "x"}, {"rate_key": "k"}, {"rate": "1/s", "rate_key": ""}):
        with pytest.raises(ConfigError, match="beat entry 'e'"):
            validate_entry_options("e", bad)


def test_a_long_rate_wait_never_holds_a_message_past_the_visibility_timeout(redis_url, prefix):
    """celery/celery#4766, kombu#337: an ETA beyond the Redis visibility timeout is delivered again
    to another worker. With visibility_timeout=4 s a run whose turn is an hour away is deferred
    at most 2 s at a time (it asks again each time, unbooked), and never runs twice."""
    app = make_app(f"q-{prefix}", prefix, broker_transport_options={"visibility_timeout": 4})
    try:
        with EventLog(app, tasks=["tg.api_hourly"]) as events, embedded_worker(app):
            assert app.tasks["tg.api_hourly"].delay(1).get(timeout=10) == 1
            started = time.monotonic()
            waiting = app.tasks["tg.api_hourly"].delay(2)
            deferrals = events.wait_for("task-skipped", 3, timeout=12)
            elapsed = time.monotonic() - started
        assert len(deferrals) >= 3 and elapsed < 8, (len(deferrals), elapsed)  # every <= 2 s, not in an hour
        assert all(e["reason"] == "rate_limited" and e["retrying"] for e in deferrals)
        assert waiting.state == "RETRY"
        ran = redis.Redis.from_url(redis_url).lrange(f"{prefix}:hourly", 0, -1)
        assert ran == [b"1"]  # the deferred run never ran beside its copies
    finally:
        redis.Redis.from_url(redis_url).delete(app.tg_log, f"q-{prefix}")


def test_a_copy_of_a_finished_delivery_deferred_by_the_rate_is_still_refused(app, redis_url, prefix):
    """A broker's second copy of a delivery (same task id, same publish stamp) that the rate defers
    keeps the delivery's stamp, so at its turn it is refused as a copy of the finished run instead
    of running the body again."""
    from taskguard_celery.headers import new_publish_stamp

    r = redis.Redis.from_url(redis_url)
    with embedded_worker(app):
        stamp = new_publish_stamp()
        first = app.send_task("tg.api_call", args=(99,), task_id="copy-99", headers={"taskguard_publish": stamp})
        assert first.get(timeout=10) == 99
        for n in range(3):  # the rate (6/s, burst 2) has no room now
            app.tasks["tg.api_call"].delay(n)
        app.send_task("tg.api_call", args=(99,), task_id="copy-99", headers={"taskguard_publish": stamp})
        time.sleep(3)
    runs = [x.decode().split()[1] for x in r.lrange(f"{prefix}:calls", 0, -1)]
    assert runs.count("99") == 1, runs


def test_a_retry_after_a_rate_deferral_asks_the_rate_again(app, redis_url, prefix):
    """The retry of a run that came back at its booked turn carries no turn of its own: it waits
    for the next one (1/s here), it does not pass at once. The rate spaces admissions 1 s apart on
    the server's clock; the bodies log their own start, which adds each run's latency from its
    admission (a few hundred ms on a loaded machine), so two starts may be 0.8 s apart. A retry
    passing at once (countdown 0.05 s) starts within about 0.1 s of its first try."""
    r = redis.Redis.from_url(redis_url)
    with embedded_worker(app):
        results = [app.tasks["tg.rated_retry"].delay(0), app.tasks["tg.rated_retry"].delay(1, retry_first=True)]
        assert [res.get(timeout=20) for res in results] == [0, 1]
    starts = sorted(float(x.decode().split()[0]) for x in r.lrange(f"{prefix}:rr", 0, -1))
    assert len(starts) == 3
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(gap >= 0.5 for gap in gaps), [round(gap, 2) for gap in gaps]
    assert starts[-1] - starts[0] >= 1.5, [round(gap, 2) for gap in gaps]  # three admissions, two turns apart


def test_rate_max_wait_zero_runs_when_the_rate_has_room_and_skips_when_not(any_locks):
    from taskguard.pacing import pace

    kw = dict(rate=(1, 60.0), burst=None, max_wait=0.0, max_countdown=30)
    assert pace(any_locks, "rmw", **kw).go
    second = pace(any_locks, "rmw", **kw)
    assert second.skip and not second.go
    assert pace(any_locks, "rmw2", **kw, state={"since": time.time() - 5, "turn": None}).go  # waited, room now


def test_a_beat_entry_with_guard_options_for_a_task_that_is_not_guarded_is_refused_at_start(app):
    """``options["taskguard"]`` on an entry whose task this beat knows and is a plain task: refused
    when the scheduler starts (as rq-cron refuses it for a plain function), not silently unused."""

    @app.task(name="tg.plain_for_beat", shared=False)
    def plain():
        return 1

    with pytest.raises(ConfigError, match="beat entry 'e3': .*'tg.plain_for_beat' is not a GuardedTask"):
        validate_entry_options("e3", {"overlap": "coalesce"}, app.tasks["tg.plain_for_beat"])
    assert validate_entry_options("e3", {"limit": 2})  # a task this process does not know: checked alone


def test_a_beat_entry_template_is_bound_to_its_task_at_start_and_a_bad_field_drops_only_itself(app, caplog):
    task = app.tasks["tg.export"]
    with pytest.raises(ConfigError, match="beat entry 'e2': rate_key"):
        validate_entry_options("e2", {"rate": "1/m", "rate_key": "per:{nope}"}, task)
    guard = _worker_guard(task, {"limit": 3, "rate": [1, 60], "rate_key": "per:{nope}"})
    assert guard.limit == 3 and guard.rate == (1, 60.0) and guard.rate_key.render(("t",), {}) == "tg.export"
    assert "ignoring the beat entry's rate_key option" in caplog.text


# -- weighted rates (cost=) and back-off on 429 (RateLimited) -----------------------------------


def _rows(redis_url, key):
    return [x.decode().split() for x in redis.Redis.from_url(redis_url).lrange(key, 0, -1)]


def test_a_weighted_rate_holds_in_cost_units_across_two_worker_processes(app, redis_url, prefix):
    """40 calls of 5-60 tokens (1,410 in all) under 400 tokens/s with a burst of 100, on two
    prefork workers: every call runs once (max_retries=0: deferrals are not retries), over at
    least (1410 - 100) / 400 s, and the tokens admitted in any window of w seconds stay within
    100 + 400 w (+ one call's cost for the edges of the measurement)."""
    import random

    rnd = random.Random(26)
    tokens = [rnd.randint(5, 60) for _ in range(40)]
    with (
        WorkerProcess(f"q-{prefix}", prefix, concurrency=2) as w1,
        WorkerProcess(f"q-{prefix}", prefix, concurrency=2) as w2,
    ):
        started = redis.Redis.from_url(redis_url).time()
        started = started[0] + started[1] / 1e6
        results = [app.tasks["tg.llm"].delay(n, t) for n, t in enumerate(tokens)]
        values = [res.get(timeout=90) for res in results]
        output = w1.output() + w2.output()
    assert values == list(range(40)), output
    rows = _rows(redis_url, f"{prefix}:llm")
    assert sorted(int(x[1]) for x in rows) == list(range(40))  # each ran exactly once
    admitted = sorted((float(x[2]), int(x[3])) for x in rows)
    total = sum(tokens)
    assert admitted[-1][0] - started >= (total - 100) / 400 - 0.1
    for i, (t0, _) in enumerate(admitted):
        for w in (0.25, 0.5, 1.0, 2.0):
            units = sum(c for t, c in admitted[i:] if t < t0 + w)
            assert units <= 100 + 400 * w + 60, (w, units, t0 - started)
    # (0.02 s: a worker's estimate of the Redis clock, which its booked turn is on, against TIME)
    early = [round(float(x[2]) - float(x[0]), 4) for x in rows if float(x[0]) < float(x[2]) - 0.02]
    assert not early, early  # no body before its admission
    assert "Traceback" not in output and "MaxRetriesExceeded" not in output


def test_a_body_settles_its_actual_cost_and_the_rate_follows(app, redis_url, prefix):
    """Admitted at 10 tokens, the call reports 300: the rate state moves on by 290 tokens, so a
    call costing 1 must wait about (300 - 99) / 400 s after it, not pass at once."""
    locks = app.conf.taskguard_locks
    with embedded_worker(app):
        assert app.tasks["tg.llm"].delay(0, 10, actual=300).get(timeout=10) == 0
        after = locks.throttle("llm", rate=(400, 1.0), burst=100, consume=False)
    assert not after.allowed and 0.2 < after.retry_after <= 0.51, after
    time.sleep(after.retry_after + 0.3)
    with embedded_worker(app):
        bad = app.tasks["tg.llm"].delay(1, 10, actual=-1)
        with pytest.raises(ConfigError, match="settle_cost: the actual cost must be an int"):
            bad.get(timeout=10)


def test_a_429_pauses_the_rate_cluster_wide_and_defers_the_run_without_consuming_retries(app, redis_url, prefix):
    """30 calls under 10/s (burst 2) on two prefork workers; call 8 raises RateLimited(retry_after=2)
    the first time. With autoretry_for=(Exception,) and max_retries=0 every call still ends with
    its value (the 429 consumed no retry and autoretry did not catch it); on the Redis clock no
    body starts between the 429 (plus 0.3 s for runs already admitted when it was raised) and the
    end of the pause, although booked turns fell inside it; the deferral is reported as
    task-skipped with reason "backoff"."""
    with (
        EventLog(app, tasks=["tg.upstream"]) as events,
        WorkerProcess(f"q-{prefix}", prefix, concurrency=2) as w1,
        WorkerProcess(f"q-{prefix}", prefix, concurrency=2) as w2,
    ):
        results = [app.tasks["tg.upstream"].delay(n, fail_on=8) for n in range(30)]
        values = [res.get(timeout=90) for res in results]
        output = w1.output() + w2.output()
        backoffs = [e for e in events.wait_for("task-skipped", 1) if e["reason"] == "backoff"]
    assert values == list(range(30)), output
    rows = _rows(redis_url, f"{prefix}:up")
    raised = [float(x[0]) for x in rows if x[1] == "429"]
    assert len(raised) == 1
    t429 = raised[0]
    starts = [(float(x[0]), int(x[1]), int(x[2])) for x in rows if x[1] != "429"]
    inside = [s for s in starts if t429 + 0.3 <= s[0] < t429 + 2.0]
    assert inside == [], (inside, t429)
    assert any(s[0] >= t429 + 2.0 for s in starts)  # the rest ran after the pause
    assert [s[1] for s in starts].count(8) == 2 and all(s[2] == 0 for s in starts)  # no retry was counted
    assert backoffs and backoffs[0]["retrying"], events
    assert "Traceback" not in output and "MaxRetriesExceeded" not in output


# -- a limit that depends on the call (limit= a callable) --------------------------------------


def test_a_per_call_limit_applies_per_run_and_lowering_it_admits_nobody_beside_the_holders(app, redis_url, prefix):
    """limit=lambda tenant: the tenant's plan, read per run. 20 exports of one tenant on two
    prefork workers (3 children each) under a limit of 4; after 0.8 s the plan drops to 1: no run
    starts after that while another holds the key (the ledger's occupancy at every later entry is
    1), and every export runs in the end. A tenant whose plan says 0 fails with ConfigError."""
    r = redis.Redis.from_url(redis_url)
    r.set(f"{prefix}:limit:acme", 4, ex=600)
    r.set(f"{prefix}:limit:broken", 0, ex=600)
    with (
        WorkerProcess(f"q-{prefix}", prefix, concurrency=3) as w1,
        WorkerProcess(f"q-{prefix}", prefix, concurrency=3) as w2,
    ):
        results = [app.tasks["tg.export_tiered"].delay("acme", seconds=0.4) for _ in range(20)]
        time.sleep(0.8)
        lowered = time.time()
        r.set(f"{prefix}:limit:acme", 1, ex=600)
        values = [res.get(timeout=90) for res in results]
        broken = app.tasks["tg.export_tiered"].delay("broken")
        with pytest.raises(ConfigError, match=r"tg.export_tiered': the limit callable's value .* 1 to 100 .*got 0"):
            broken.get(timeout=20)
        output = w1.output() + w2.output()
    assert all(v in (0, 1, 2, 3) for v in values), (values, output)
    entries = _ledger(redis_url, prefix, "export:acme")
    assert len([e for e in entries if e[1] == 1]) == 20
    assert ledger.peak(entries, 4) >= 3  # the first limit was used
    inside = 0
    late = 0
    for at, step, _slot, _fence in entries:
        inside += step
        if step == 1 and at > lowered + 0.3:  # (a run whose limit was read just before the change)
            late += 1
            assert inside == 1, (at - lowered, inside)
    assert late >= 5


def test_shadow_mode_reports_a_weighted_rate_and_a_429_without_enforcing_them(app):
    """enforce=False: two calls of cost 60 under 100/s (burst 60) run at once, the second reported
    as would-be rate_limited; a body's RateLimited pauses the shadow state only (reported as
    would-be backoff) and fails the call as the body's own exception; the enforced rate is untouched."""
    from taskguard import RateLimited

    locks = app.conf.taskguard_locks
    task = app.tasks["tg.upstream_shadow"]
    with EventLog(app, tasks=["tg.upstream_shadow"]) as events, embedded_worker(app):
        calls = [events.track(task.delay(n)) for n in (1, 2)]
        assert [c.get(timeout=10) for c in calls] == [1, 2]
        with pytest.raises(RateLimited):
            events.track(task.delay(3, pause=30)).get(timeout=10)
        shadow = events.wait_for("task-guard-shadow", 3)
    # calls 2 and 3 find the shadow state without room (60 units each, 100/s); call 3 then backs off
    assert sorted(e["reason"] for e in shadow) == ["backoff", "rate_limited", "rate_limited"], shadow
    assert not events.of("task-skipped")
    assert locks.throttle("ups", rate=(100, 1.0), cost=60).allowed  # the enforced state: never consumed
    paused = locks.throttle("ups", rate=(100, 1.0), cost=60, shadow=True, consume=False)
    assert paused.paused and paused.retry_after > 25


# -- a limit per key and a total (limit_total=) ------------------------------------------------


def test_a_limit_per_key_and_a_total_hold_across_two_worker_processes(app, redis_url, prefix):
    """Two prefork workers (3 children each) run 24 exports of 4 tenants under limit=2 per tenant
    and limit_total=3, with on_skip="retry": every export runs in the end; the ledgers show at
    most 2 inside per tenant and 3 inside in all (both reached), each slot's fences growing; the
    refusals were reported as "limit" and "limit_total"; nothing is left held."""
    tenants = ["t1", "t1", "t1", "t2", "t2", "t3", "t4"] * 3 + ["t1", "t2", "t3"]
    with (
        EventLog(app, tasks=["tg.export_total"]) as events,
        WorkerProcess(f"q-{prefix}", prefix, concurrency=3) as w1,
        WorkerProcess(f"q-{prefix}", prefix, concurrency=3) as w2,
    ):
        results = [app.tasks["tg.export_total"].delay(t, seconds=0.3) for t in tenants]
        values = [res.get(timeout=120) for res in results]
        output = w1.output() + w2.output()
        skips = events.wait_for("task-skipped", 2)
    assert all(v in (0, 1, 2) for v in values), (values, output)
    total = _ledger(redis_url, prefix, "exports")
    assert len([e for e in total if e[1] == 1]) == len(tenants)
    assert ledger.peak(total, 3) == 3
    per_key = {t: _ledger(redis_url, prefix, f"export:{t}") for t in set(tenants)}
    assert sum(len([e for e in entries if e[1] == 1]) for entries in per_key.values()) == len(tenants)
    assert ledger.peak(per_key["t1"], 2) == 2
    for entries in per_key.values():
        ledger.peak(entries, 2)
    assert "limit_total" in {e["reason"] for e in skips}, skips
    locks = app.conf.taskguard_locks
    assert locks.holders("exports") == [] and all(locks.holders(f"export:{t}") == [] for t in per_key)
    assert "Traceback" not in output


def test_a_retry_keeps_both_holds_and_claims_them_with_the_same_fences(app, redis_url, prefix):
    """self.retry() keeps the run's lease on its key and its place in the total: the retried
    run claims both from its taskguard header (one handle, the total's nested), with the same
    fencing tokens; meanwhile the kept place counts against the total."""
    locks = app.conf.taskguard_locks
    with embedded_worker(app):
        res = app.tasks["tg.export_total"].delay("t1", seconds=0.0, retry_first=True)
        assert res.get(timeout=15) in (0, 1, 2)
    fences = redis.Redis.from_url(redis_url).lrange(f"{prefix}:fences:{res.id}", 0, -1)
    assert len(fences) == 2 and fences[0] == fences[1], fences
    assert locks.holders("exports") == [] and locks.holders("export:t1") == []


def test_shadow_mode_reports_a_would_be_limit_total_and_runs_holding_nothing(app, redis_url, prefix):
    """enforce=False, limit_total=1: a second tenant's run while the first runs goes ahead
    without a lease (its key's slot given back), reported as a task-guard-shadow event with
    reason limit_total, never as task-skipped."""
    locks = app.conf.taskguard_locks
    task = app.tasks["tg.export_total_shadow"]
    with EventLog(app, tasks=["tg.export_total_shadow"]) as events, embedded_worker(app, concurrency=2):
        first = events.track(task.delay("t1", seconds=1.5))
        deadline = time.monotonic() + 10
        while not locks.holders("exports-shadow") and time.monotonic() < deadline:
            time.sleep(0.05)
        second = events.track(task.delay("t2", seconds=0.0))
        assert second.get(timeout=10) == "t2"
        assert locks.holders("export:t2") == []
        assert first.get(timeout=10) == "t1"
        shadow = events.wait_for("task-guard-shadow", 1)
    assert [e["reason"] for e in shadow] == ["limit_total"], shadow
    assert not events.of("task-skipped")
    runs = sorted(x.decode() for x in redis.Redis.from_url(redis_url).lrange(f"{prefix}:shadow-runs", 0, -1))
    assert runs == ["t1 1", "t2 0"]


def test_a_hard_time_limit_releases_both_holds_from_the_main_process(app, prefix):
    """A prefork child killed by the hard time limit runs no finally: the worker's main process
    releases the run's lease and its place in the total by task id, well before their 30 s TTL."""
    locks = app.conf.taskguard_locks
    with WorkerProcess(f"q-{prefix}", prefix, concurrency=1):
        res = app.tasks["tg.export_total_overrun"].delay("t1")
        deadline = time.monotonic() + 10
        while not locks.holders("exports") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert locks.holders("exports")
        with pytest.raises(Exception, match="TimeLimitExceeded|time limit"):
            res.get(timeout=15)
        deadline = time.monotonic() + 3
        while (locks.holders("exports") or locks.holders("export:t1")) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert locks.holders("exports") == [] and locks.holders("export:t1") == []


def test_total_options_fail_at_declaration_with_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'limit_total'"):

        @guarded_task(key="export:{tenant}", limit_totl=3)
        def job(tenant):
            return tenant

    with pytest.raises(ConfigError, match=r"limit \(4\) exceeds limit_total \(3\)"):

        @guarded_task(key="export:{tenant}", limit=4, limit_total=3)
        def job2(tenant):
            return tenant
