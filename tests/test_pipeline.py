"""The guard pipeline's decision table (taskguard.pipeline.decide), row by row, against real Redis
(standalone and Cluster) and MemoryLocks; the adapters' own suites cover what each decision
becomes in Celery and RQ."""

from __future__ import annotations

import logging
import pickle
import time

import pytest

from taskguard import ConfigError, RateLimited, Skipped
from taskguard.overlap import pending
from taskguard.pipeline import Defer, Duplicate, Execution, Pend, Run, Skip, Stored, decide
from taskguard.policy import GuardOptions
from taskguard.values import OnLost, OnSkip, Reason, RunState


def charge(invoice_id, amount=1):
    return invoice_id


class Hooks:
    """A framework's side, recording what the pipeline asked of it."""

    def __init__(self, handle=None, finished=False, state=None):
        self.handle, self._finished, self.state = handle, finished, state
        self.calls = []

    def persisted_handle(self):
        return self.handle

    def release_handle(self, handle):
        self.calls.append(("release_handle", handle["key"]))

    def finished(self):
        self.calls.append(("finished",))
        return self._finished

    def clear_mark(self):
        self.calls.append(("clear_mark",))

    def queued_mark(self):
        return getattr(self, "mark", None)

    def result_codec(self):
        return None, None  # JSON

    def rate_state(self):
        return self.state

    def rate_bound(self):
        return 30.0

    def rate_go(self):
        self.calls.append(("rate_go",))

    def shadow(self, key, reason, holder_ttl, leased, rate):
        assert type(reason) is str  # a plain string for events and records
        self.calls.append(("shadow", key, reason, leased, rate))

    def lost(self, run, reason):
        self.calls.append(("lost", reason))

    def pending_message(self):
        return {"msg": len(self.calls)}

    def supersede(self, prev, skipped):
        self.calls.append(("supersede", prev.run_id, skipped.reason, skipped.follow_up))

    def wake(self, p):
        self.calls.append(("wake", p.run_id))

    def coalesced_into(self):
        return getattr(self, "into", None)


def opts(**kw):
    kw.setdefault("key", "inv:{invoice_id}")
    return GuardOptions.build(charge, name="t.charge", **kw)


def ex(**kw):
    kw.setdefault("task", "t.charge")
    kw.setdefault("run_id", "id-1")
    kw.setdefault("local", False)
    return Execution(**kw)


def go(locks, o, hooks, args=(7,), **kw):
    return decide(o, o.key.render(args, {}), args, {}, ex(**kw), hooks, locks)


def test_a_free_key_runs_and_the_queued_mark_is_cleared(any_locks):
    h = Hooks()
    d = go(any_locks, opts(), h)
    assert isinstance(d, Run) and d.run.state == RunState.RUNNING and d.run.lease is not None
    assert d.run.state == "running"  # a str enum: plain strings keep comparing
    assert h.calls == [("clear_mark",)]
    d.run.finish(None)


def test_a_run_that_takes_its_lease_clears_its_queued_mark_in_the_same_step(any_locks):
    """The execution was published with ``unique=True``: its acquisition deletes the mark (one
    script), so no separate clear is sent and no crash after the lease can leave it behind. A
    mark on another key than the lease's is cleared the separate way."""
    assert any_locks.mark_queued("inv:7", "id-1", ttl=60, task="t.charge").marked
    h = Hooks()
    h.mark = ("inv:7", "id-1", "t.charge")
    d = go(any_locks, opts(), h)
    assert isinstance(d, Run) and d.run.unmarked and h.calls == []
    d.run.finish(None)
    assert any_locks.mark_queued("inv:7", "id-2", ttl=60, task="t.charge") == (True, "id-2")
    h = Hooks()
    h.mark = ("elsewhere", "id-3", "t.charge")
    d = go(any_locks, opts(), h, run_id="id-3", args=(8,))
    assert isinstance(d, Run) and not d.run.unmarked and h.calls == [("clear_mark",)]
    d.run.finish(None)


def test_a_skipped_run_clears_its_mark_after_the_refusal(any_locks):
    any_locks.acquire("inv:7", ttl=5)
    assert any_locks.mark_queued("inv:7", "id-1", ttl=60, task="t.charge").marked
    h = Hooks()
    h.mark = ("inv:7", "id-1", "t.charge")
    d = go(any_locks, opts(), h)
    assert isinstance(d, Skip) and not d.run.unmarked
    assert h.calls == [("clear_mark",)]  # (the refused acquisition left the mark to this clear)
    assert any_locks.mark_queued("inv:7", "id-2", ttl=60, task="t.charge") == (False, "id-1")


def test_a_held_key_is_a_skip_not_yet_reported(any_locks):
    any_locks.acquire("inv:7", ttl=5)
    h = Hooks()
    d = go(any_locks, opts(), h)
    assert isinstance(d, Skip) and d.skipped.reason == Reason.HELD and d.skipped.key == "inv:7"
    assert type(d.skipped.reason) is str  # stored results hold the plain string
    assert pickle.loads(pickle.dumps(d.skipped)) == d.skipped and b"values" not in pickle.dumps(d.skipped)
    assert h.calls == [("clear_mark",)]


def test_another_execution_of_the_same_run_id_defers_it(any_locks):
    any_locks.acquire("inv:7", ttl=5, run_id="id-1", holder={"host": "elsewhere", "pid": 1})
    d = go(any_locks, opts(), Hooks())
    assert isinstance(d, Defer) and d.why == Reason.RUNNING and d.why == "running"
    assert 0.5 <= d.countdown <= 5.0 and d.run is not None


def test_a_redelivered_copy_of_a_finished_run_is_a_duplicate(any_locks):
    h = Hooks(finished=True)
    d = go(any_locks, opts(), h, redelivered=True)
    assert isinstance(d, Duplicate) and d.run is None and d.key == "inv:7"
    assert h.calls == [("finished",), ("clear_mark",)]
    # without the framework's record, the lease's own record of the finished delivery decides
    first = go(any_locks, opts(), Hooks(), stamp="s1")
    first.run.finish(None)
    again = go(any_locks, opts(), Hooks(), redelivered=True, stamp="s1")
    assert isinstance(again, Duplicate) and again.run is not None


def test_once_hands_back_the_stored_value(any_locks):
    o = opts(once=True)
    first = go(any_locks, o, Hooks())
    assert isinstance(first, Run)
    first.run.finish({"charged": 7})
    d = go(any_locks, o, Hooks(), run_id="id-2")
    assert isinstance(d, Stored) and d.value == {"charged": 7} and d.key == "inv:7"


def test_over_the_rate_a_worker_execution_defers_and_keeps_its_mark(any_locks):
    o = opts(rate=(1, 60.0), rate_key="api")
    assert isinstance(go(any_locks, o, Hooks()), Run)
    h = Hooks(handle={"key": "inv:7", "owner": "x", "fence": 1, "expires": None})
    d = go(any_locks, o, h, args=(8,))
    assert isinstance(d, Defer) and d.why == Reason.RATE_LIMITED and d.key == "api"
    assert d.state is not None and d.skipped.reason == "rate_limited" and d.countdown > 0
    assert h.calls == [("release_handle", "inv:7")]  # a kept lease is not held through the wait; still queued
    # (both adapters log it) past the longest deferral (30 s here) the turn is not booked: it asks again
    assert d.describe() == f"rate-limited; it asks again in {d.countdown:.2f}s" and d.state.get("turn") is None


@pytest.mark.parametrize("carried", [{"since": "soon"}, ["since", 1.0], {"turn": 1.0}, {"since": float("nan")}])
def test_a_malformed_carried_pacing_state_is_logged_and_the_run_paced_afresh(any_locks, caplog, carried):
    """What a deferred run carries back (a Celery header, an RQ job's meta) is checked once, in
    the pipeline, for every adapter: a malformed one never fails the run."""
    o = opts(rate=(1, 60.0), rate_key="api")
    with caplog.at_level(logging.ERROR, logger="taskguard"):
        d = go(any_locks, o, Hooks(state=carried))
    assert isinstance(d, Run)  # paced afresh: the rate had room
    d.run.finish(None)
    assert "t.charge[id-1]: ignoring a malformed carried pacing state" in caplog.text
    d = go(any_locks, o, Hooks(state=carried), run_id="id-2", args=(8,))
    assert isinstance(d, Defer) and d.state is not None and isinstance(d.state["since"], float)


def test_past_rate_max_wait_it_is_a_rate_limited_skip(any_locks):
    o = opts(rate=(1, 60.0), rate_key="api", rate_max_wait=0)
    assert isinstance(go(any_locks, o, Hooks()), Run)
    h = Hooks()
    d = go(any_locks, o, h, args=(8,))
    assert isinstance(d, Skip) and d.skipped.reason == "rate_limited" and d.skipped.key == "api" and d.run is None
    assert h.calls == [("clear_mark",)]


def test_a_call_whose_cost_exceeds_rate_burst_is_refused_naming_the_task_and_the_option(any_locks):
    """A callable cost is known per call: a call costing more than ``rate_burst`` could never pass,
    and the error says which task and which of its options (before: the throttle's own words,
    "raise burst", naming neither)."""
    o = opts(rate=(10, 1.0), rate_key="api", rate_burst=5, cost=lambda invoice_id, **_: invoice_id)
    with pytest.raises(ConfigError, match=r"task 't.charge': a call of cost 7 .* raise rate_burst to at least 7"):
        go(any_locks, o, Hooks())
    assert isinstance(go(any_locks, o, Hooks(), args=(5,)), Run)


def test_shadow_mode_runs_and_reports_what_it_would_have_done(any_locks):
    any_locks.acquire("inv:7", ttl=5)
    h = Hooks()
    d = go(any_locks, opts(enforce=False), h)
    assert isinstance(d, Run) and d.run.lease is None
    assert h.calls == [("clear_mark",), ("shadow", "inv:7", "held", False, False)]


def test_an_error_while_deciding_clears_the_mark_and_raises(any_locks):
    h = Hooks()
    with pytest.raises(TypeError):
        go(any_locks, opts(once=True), h, args=(object(),))  # no JSON form to fingerprint
    assert h.calls == [("clear_mark",)]


def test_modes_are_str_enums_once_validated():
    o = opts(on_skip="raise", on_lost="warn")
    assert o.on_skip is OnSkip.RAISE and o.on_skip == "raise" and f"{o.on_skip}" == "raise"
    assert o.on_lost is OnLost.WARN and str(o.on_lost) == "warn"
    assert Skipped("k", Reason.LIMIT).describe().endswith("held (limit)")


def test_coalesce_a_held_key_pends_supersedes_the_previous_and_the_end_wakes_the_last(any_locks):
    o = opts(overlap="coalesce")
    holder = go(any_locks, o, Hooks(), run_id="id-0")
    assert isinstance(holder, Run)
    h1, h2 = Hooks(), Hooks()
    first = go(any_locks, o, h1, run_id="id-1")
    assert isinstance(first, Pend) and first.backstop and not first.woken and first.countdown >= 1.0
    second = go(any_locks, o, h2, run_id="id-2")
    assert isinstance(second, Pend) and not second.backstop  # one backstop per key
    assert ("supersede", "id-1", "coalesced", "id-2") in h2.calls
    assert pending(any_locks, "inv:7").run_id == "id-2"
    holder.run.finish(None)  # the holder ends: it wakes the pending follow-up, the latest
    assert pending(any_locks, "inv:7") is None
    follow_up = go(any_locks, o, Hooks(), run_id="id-2")
    assert isinstance(follow_up, Run)
    follow_up.run.finish(None)


def test_coalesce_a_superseded_execution_is_a_coalesced_skip(any_locks):
    h = Hooks()
    h.into = "id-9"
    d = go(any_locks, opts(overlap="coalesce"), h)
    assert isinstance(d, Skip) and d.skipped.reason == Reason.COALESCED and d.skipped.follow_up == "id-9"


def test_coalesce_a_backstop_wakes_the_follow_up_once_the_lease_is_free(any_locks):
    o = opts(overlap="coalesce")
    holder = go(any_locks, o, Hooks(), run_id="id-0")
    assert isinstance(go(any_locks, o, Hooks(), run_id="id-1"), Pend)
    h = Hooks()
    looked = go(any_locks, o, h, run_id="id-1", backstop=True)  # the holder lives: look again later
    assert isinstance(looked, Pend) and looked.backstop and not any(c[0] == "wake" for c in h.calls)
    holder.run.on_end = None  # the holder dies without ending: its lease goes, nobody wakes the follow-up
    holder.run.hand_back()
    h = Hooks()
    woke = go(any_locks, o, h, run_id="id-1", backstop=True)
    assert isinstance(woke, Pend) and woke.woken and ("wake", "id-1") in h.calls
    assert pending(any_locks, "inv:7") is None
    h = Hooks()
    assert isinstance(go(any_locks, o, h, run_id="id-1", backstop=True), Pend) and h.calls == [("clear_mark",)]


def test_coalesce_direct_calls_skip_as_held(any_locks):
    o = opts(overlap="coalesce")
    holder = go(any_locks, o, Hooks(), run_id="id-0")
    d = go(any_locks, o, Hooks(), run_id=None, local=True)
    assert isinstance(d, Skip) and d.skipped.reason == Reason.HELD
    holder.run.finish(None)


@pytest.mark.parametrize("how", ["local", "not_stoppable", "stoppable"])
def test_replace_terminate_stops_only_a_holder_its_framework_can_stop(any_locks, how):
    """A holder that is a local call (Celery's eager ``apply()``) or runs in its worker's own
    process (RQ's ``SimpleWorker``) is taken over but not handed to the adapter to stop: it runs
    on without its lease and reports itself replaced when it ends (handed over too, its skip was
    reported twice)."""
    o = opts(overlap="replace", replace_terminate=True)
    old = go(any_locks, o, Hooks(), run_id="id-1", local=how == "local", stoppable=how != "not_stoppable")
    h = Hooks()
    h.replaced = lambda holder: h.calls.append(("replaced", holder.run_id))
    new = go(any_locks, o, h, run_id="id-2")
    assert isinstance(new, Run)
    assert (("replaced", "id-1") in h.calls) == (how == "stoppable"), h.calls
    assert not old.run.lease.renew()  # taken over either way
    new.run.finish(None)


def test_replace_takes_the_lease_over_from_the_oldest_holder_and_its_retry_is_a_replaced_skip(any_locks):
    from taskguard.pipeline import replaced_skip

    h = Hooks()
    h.replaced = lambda holder: h.calls.append(("replaced", holder.run_id))
    o = opts(overlap="replace", limit=2)
    oldest = go(any_locks, o, Hooks(), run_id="id-1")
    time.sleep(0.01)
    younger = go(any_locks, o, Hooks(), run_id="id-2")
    new = go(any_locks, o, h, run_id="id-3")
    assert isinstance(new, Run) and ("replaced", "id-1") in h.calls
    assert sorted(i.run_id for i in any_locks.holders("inv:7")) == ["id-2", "id-3"]
    assert not oldest.run.lease.renew()  # taken over: its renewal finds another owner, or none
    s = replaced_skip(o, oldest.run)
    assert s is not None and s.reason == Reason.REPLACED and s.follow_up == "id-3"
    assert replaced_skip(o, younger.run) is None
    again = go(any_locks, o, Hooks(), run_id="id-1")  # a retry of the replaced run
    assert isinstance(again, Skip) and again.skipped.reason == Reason.REPLACED
    new.run.finish(None)
    younger.run.finish(None)


class EndingHooks(Hooks):
    """:class:`Hooks` with the body's end recorded (as :func:`taskguard.pipeline.perform` asks)."""

    def failed(self, exc):
        return isinstance(exc, Exception)

    def settle(self, run, exc):
        self.calls.append(("settle", type(exc).__name__))
        run.fail()

    def returned(self, run, value):
        return False


def _raise(exc):
    raise exc


@pytest.mark.parametrize("bad", [RateLimited("soon"), RateLimited(-1), RateLimited(5, key="")])
def test_a_bad_back_off_fails_the_run_with_config_error_and_shadow_mode_keeps_the_bodys_exception(any_locks, bad):
    """``RateLimited`` with no usable pause: enforced, the run is settled as a failure (not handed
    back) and ends with ConfigError; in shadow mode the body's own ``RateLimited`` is what the
    caller gets (before: a ConfigError replaced it, after the run was settled for it)."""
    from taskguard.pipeline import perform

    o = opts(rate=(100, 1.0), rate_key="api")
    h = EndingHooks()
    d = go(any_locks, o, h)
    with pytest.raises(ConfigError, match="retry_after must be a number of seconds"):
        perform(d, lambda: _raise(bad), o, "inv:7", (7,), {}, ex(), h, any_locks)
    assert ("settle", "RateLimited") in h.calls and d.run.state == RunState.FINISHED
    shadow = opts(rate=(100, 1.0), rate_key="api", enforce=False)
    h = EndingHooks()
    d = go(any_locks, shadow, h, args=(8,))
    with pytest.raises(RateLimited):
        perform(d, lambda: _raise(bad), shadow, "inv:8", (8,), {}, ex(), h, any_locks)
    assert ("settle", "RateLimited") in h.calls


@pytest.mark.parametrize("reason", ["held", "rate_limited", "debounced", "replaced", "coalesced"])
def test_on_skip_retry_never_retries_a_skip_the_retry_cannot_help(any_locks, reason):
    """``on_skip="retry"`` retries a call that found the key busy. A rate skip came past
    ``rate_max_wait``, and a superseded call (debounced into a newer window: its arguments are the
    newer window's to run; replaced; coalesced) has its work done by the call that superseded it —
    retried, the debounced call ran its old arguments after all. Those end as ``"result"``."""
    from taskguard.settlement import settle

    o = opts(on_skip="retry")
    skipped = Skipped(key="inv:7", reason=reason, task="t.charge")
    s = settle(o, Skip(skipped), any_locks, "t.charge", can_retry=True)
    assert s.ending == ("retry" if reason == "held" else "result"), s
    assert s.skipped.reason == reason  # (not "retry_exhausted": none was made)
