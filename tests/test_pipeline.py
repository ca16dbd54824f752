"""The guard pipeline's decision table (taskguard.pipeline.decide), row by row, against real Redis
(standalone and Cluster) and MemoryLocks; the adapters' own suites cover what each decision
becomes in Celery and RQ."""

from __future__ import annotations

import pickle

import pytest

from taskguard import Skipped
from taskguard.pipeline import Defer, Duplicate, Execution, Run, Skip, Stored, decide
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


def test_past_rate_max_wait_it_is_a_rate_limited_skip(any_locks):
    o = opts(rate=(1, 60.0), rate_key="api", rate_max_wait=0)
    assert isinstance(go(any_locks, o, Hooks()), Run)
    h = Hooks()
    d = go(any_locks, o, h, args=(8,))
    assert isinstance(d, Skip) and d.skipped.reason == "rate_limited" and d.skipped.key == "api" and d.run is None
    assert h.calls == [("clear_mark",)]


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
