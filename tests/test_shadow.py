"""Shadow mode (``enforce=False``) reports, for a fixed sequence of arrivals, the first decision
enforcement would have made for each: one arrival sequence per guard (lease, limit, rate, once,
unique), run enforced and in shadow mode, on Redis (standalone and Cluster) and MemoryLocks.

Enforcement then changes the sequence (a deferred run comes back, a skipped one never runs);
shadow mode does not imitate that, so each sequence is chosen so that the compared decisions are
the first ones. Shadow state (rate, once, unique) lives apart from the enforced state: a shadow
sequence on a key leaves the enforced guard of that key untouched.
"""

from __future__ import annotations

import time

import pytest

from taskguard import IdempotencyConflict
from taskguard.once import OncePolicy, fingerprint_of
from taskguard.pacing import pace, shadow_reason
from taskguard.run import GuardedRun


def _run(locks, key, enforce, **kw):
    """Begin a guarded run; returns (run, its first decision: None = runs, else the reason)."""
    run = GuardedRun(locks, key, ttl=5, task="t.guarded", enforce=enforce, **kw)
    try:
        ok = run.begin()
    except IdempotencyConflict:
        return run, "idempotency_conflict"
    return run, (None if ok and (enforce or run.reason is None) else run.reason)


def _end(run):
    if run.state == "running":
        run.finish("value")


def lease_sequence(locks, key, enforce):
    """A holds; B arrives while A holds; A ends; C arrives."""
    a, da = _run(locks, key, enforce)
    b, db = _run(locks, key, enforce)
    _end(b)
    _end(a)
    c, dc = _run(locks, key, enforce)
    _end(c)
    return [da, db, dc]


def limit_sequence(locks, key, enforce):
    """limit=2: A and B hold; C arrives; A ends; D arrives."""
    a, da = _run(locks, key, enforce, limit=2)
    b, db = _run(locks, key, enforce, limit=2)
    c, dc = _run(locks, key, enforce, limit=2)
    _end(c)
    _end(a)
    d, dd = _run(locks, key, enforce, limit=2)
    for r in (b, d):
        _end(r)
    return [da, db, dc, dd]


def once_sequence(locks, key, enforce):
    """once: A (fingerprint 1) holds; B (1) arrives meanwhile; A completes; C (1) and D (2) arrive."""

    def pol(fp):
        return OncePolicy(fingerprint_of(fp))

    a, da = _run(locks, key, enforce, once=pol(1))
    b, db = _run(locks, key, enforce, once=pol(1))
    _end(b)
    _end(a)
    c, dc = _run(locks, key, enforce, once=pol(1))
    _end(c)
    d, dd = _run(locks, key, enforce, once=pol(2))
    _end(d)
    return [da, db, dc, dd]


def unique_sequence(locks, key, enforce):
    """unique: P1 published (queued); P2 published while P1 is queued; P1 starts (its mark cleared,
    it holds the lease); P3 published while P1 runs; P1 ends; P4 published."""
    shadow = not enforce

    def publish(run_id):
        marked, _ = locks.mark_queued(key, run_id, ttl=30, task="t.unique", shadow=shadow)
        return None if marked else "suppressed"

    out = [publish("p1"), publish("p2")]
    locks.clear_queued(key, "p1", "t.unique", shadow)
    run = GuardedRun(locks, key, ttl=5, task="t.unique", enforce=enforce, holder={"task": "t.unique", "task_id": "p1"})
    assert run.begin()
    out.append(publish("p3"))
    run.finish()
    out.append(publish("p4"))
    return out


def rate_sequence(locks, key, enforce, max_wait, gaps=(0, 0, 0, 0)):
    """rate (1, 2 s): a call after each gap (seconds slept before it)."""
    kw = {"rate": (1, 2.0), "burst": None, "max_wait": max_wait, "max_countdown": 30.0}
    out = []
    for gap in gaps:
        time.sleep(gap)
        if enforce:
            out.append(None if pace(locks, key, **kw).go else "rate_limited")
        else:
            out.append(shadow_reason(locks, key, task="t.rated", **kw))
    return out


SEQUENCES = {
    "lease": (lease_sequence, [None, "held", None]),
    "limit": (limit_sequence, [None, None, "limit", None]),
    "once": (once_sequence, [None, "held", "once", "idempotency_conflict"]),
    "unique": (unique_sequence, [None, "suppressed", "suppressed", None]),
}


@pytest.mark.parametrize("guard", list(SEQUENCES))
def test_shadow_mode_reports_the_first_decisions_enforcement_makes(any_locks, guard):
    seq, expected = SEQUENCES[guard]
    shadow = seq(any_locks, f"{guard}-shadow", enforce=False)
    enforced = seq(any_locks, f"{guard}-enforced", enforce=True)
    print(f"    {guard}: enforced {enforced}, shadow {shadow}")
    assert enforced == expected
    assert shadow == enforced


@pytest.mark.parametrize("max_wait", [None, 0.0], ids=["deferred", "skipped"])
def test_shadow_rate_reports_each_would_be_deferral_and_never_consumes_the_enforced_rate(any_locks, max_wait):
    """Issue input: ``enforce=False, rate=(1, 2)``, four calls in one second: three would-be
    ``rate_limited`` (before: none, the check only peeked). The shadow sequence runs first on the
    same rate key; the enforced sequence after it gets the same decisions, its first call
    included: the shadow calls counted in a state of their own."""
    seen = []
    any_locks.add_listener(seen.append)
    shadow = rate_sequence(any_locks, "api", enforce=False, max_wait=max_wait)
    enforced = rate_sequence(any_locks, "api", enforce=True, max_wait=max_wait)
    print(f"    max_wait={max_wait}: enforced {enforced}, shadow {shadow}")
    assert enforced == [None, "rate_limited", "rate_limited", "rate_limited"]
    assert shadow == enforced
    assert [(e.status, e.shadow) for e in seen if e.kind == "skip"] == [("rate_limited", True)] * 3


def test_a_shadow_once_record_is_separate_and_never_returned(any_locks):
    """A shadow completion never reaches enforced callers: an enforced run of the key still runs
    and stores its own value."""
    run = GuardedRun(any_locks, "paid", ttl=5, enforce=False, once=OncePolicy(fingerprint_of(1)))
    assert run.begin() and run.reason is None
    run.finish("shadow value")
    assert any_locks.completions.get("paid") is None
    assert any_locks.once("paid", lambda lease: "real", ttl=5, fingerprint=1) == "real"
    assert any_locks.once("paid", lambda lease: "again", ttl=5, fingerprint=1) == "real"


@pytest.mark.parametrize(
    "max_wait, expected",
    [
        (None, [None, "rate_limited", "rate_limited"]),  # the second call booked the turn at 2 s: the third waits
        (0.0, [None, "rate_limited", None]),  # nothing booked (it may not wait): the third finds room
    ],
    ids=["booked", "not-booked"],
)
def test_a_shadow_deferral_books_its_turn_as_an_enforced_one_does(any_locks, max_wait, expected):
    """Two calls at once, a third 2.6 s later: whether the third finds room depends on whether the
    second, denied, booked its turn. Shadow and enforced sequences agree on it."""
    shadow = rate_sequence(any_locks, "api2", enforce=False, max_wait=max_wait, gaps=(0, 0, 2.6))
    enforced = rate_sequence(any_locks, "api2", enforce=True, max_wait=max_wait, gaps=(0, 0, 2.6))
    print(f"    max_wait={max_wait}: enforced {enforced}, shadow {shadow}")
    assert enforced == expected and shadow == enforced
