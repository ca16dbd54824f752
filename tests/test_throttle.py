"""Cluster-wide rates (``Locks.throttle``, GCRA): the same answers from Redis (standalone and
Cluster) and MemoryLocks; bursts, distinct booked turns, bounds across processes, bad input."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from taskguard import ConfigError, MemoryLocks, RedisLocks, Throttle


def test_evenly_spaced_by_default(any_locks):
    first = any_locks.throttle("api", rate="10/s")
    second = any_locks.throttle("api", rate="10/s")
    assert isinstance(first, Throttle) and first.allowed and first.remaining == 0 and first.retry_after == 0
    assert not second.allowed and not second.booked and 0.05 < second.retry_after <= 0.1
    time.sleep(second.retry_after + 0.01)
    assert any_locks.throttle("api", rate="10/s").allowed


def test_a_burst_passes_at_once_then_the_rate_holds(any_locks):
    out = [any_locks.throttle("b", rate=(5, 1.0), burst=5) for _ in range(6)]
    assert [t.allowed for t in out] == [True] * 5 + [False]
    assert [t.remaining for t in out[:5]] == [4, 3, 2, 1, 0]
    assert 0.1 < out[5].retry_after <= 0.2
    assert any_locks.throttle("other", rate=(5, 1.0), burst=5).remaining == 4  # keys are independent


def test_denied_callers_book_distinct_turns(any_locks):
    """Ten callers denied at once each book their own turn, 0.1 s apart (no herd at one instant);
    a turn beyond the booking horizon is not booked."""
    assert any_locks.throttle("q", rate="10/s").allowed
    calls = []  # (sent, answer, got): the turn lies between sent + retry_after and got + retry_after
    for _ in range(10):
        sent = time.monotonic()
        answer = any_locks.throttle("q", rate="10/s", book_within=1.0)
        calls.append((sent, answer, time.monotonic()))
    booked = [(sent + t.retry_after, got + t.retry_after) for sent, t, got in calls if t.booked]
    assert len(booked) >= 9 and not any(t.allowed for _, t, _ in calls)
    for (a_lo, a_hi), (b_lo, b_hi) in zip(booked, booked[1:], strict=False):
        # consecutive turns 0.1 s apart (each known within its call's round trip)
        assert b_lo - a_hi < 0.12 and b_hi - a_lo > 0.08, (b_lo - a_hi, b_hi - a_lo)
    late = any_locks.throttle("q", rate="10/s", book_within=0.2)
    assert not late.booked and late.retry_after > 0.9


@pytest.mark.parametrize(
    "rate, burst",
    [
        ("0/s", None),
        ("5/w", None),
        ("x/s", None),
        ((5, 0), None),
        ((0, 1), None),
        ((1, float("nan")), None),
        (5, None),
        ("10/s", 0),
        ("10/s", True),
        ((10**7, 1), None),
    ],
)
def test_bad_rates_are_config_errors(rate, burst):
    with pytest.raises(ConfigError):
        MemoryLocks().throttle("k", rate=rate, burst=burst)


def test_rate_errors_name_the_value_or_its_type_and_spaces_are_allowed():
    from taskguard.validate import check_rate

    with pytest.raises(ConfigError, match=r"got a value of type int$"):
        check_rate(100)
    with pytest.raises(ConfigError, match=r"got '100/w'$"):
        check_rate("100/w")
    assert check_rate("100 / m") == check_rate("100/m") == (100, 60.0)


def _hammer(url, prefix, until, out):
    locks = RedisLocks.from_url(url, prefix=prefix)
    passed = 0
    while time.time() < until:
        if locks.throttle("shared", rate="50/s", burst=5).allowed:
            passed += 1
    out.put(passed)


def test_the_rate_holds_across_processes(redis_url, prefix):
    """Four processes call as fast as they can for 2.5 s on one rate (50/s, burst 5): at most
    5 + 2.5 x 50 calls pass in all (+1 for the window edges), and the rate is used."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    until = time.time() + 2.5
    procs = [ctx.Process(target=_hammer, args=(redis_url, prefix, until, out)) for _ in range(4)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
    print(f"    observed: {total} calls passed in about 2.5 s at 50/s, burst 5, from 4 processes")
    assert 100 <= total <= 5 + 2.5 * 50 + 1


# -- weighted rates (cost=), settling the actual cost, back-off pauses ---------------------------


def test_a_call_costs_its_units_and_the_default_burst_admits_it(any_locks):
    """rate 100 units/s: a call of cost 30 passes at once (default burst = its cost), the next
    waits 0.3 s (30 units x 10 ms); remaining counts units."""
    first = any_locks.throttle("w", rate="100/s", cost=30)
    assert first.allowed and first.remaining == 0
    second = any_locks.throttle("w", rate="100/s", cost=30)
    assert not second.allowed and 0.25 < second.retry_after <= 0.3
    roomy = any_locks.throttle("roomy", rate="100/s", cost=30, burst=100)
    assert roomy.allowed and roomy.remaining == 70


def test_a_burst_in_cost_units_admits_mixed_costs_up_to_it(any_locks):
    costs = [40, 30, 20, 10, 5]
    # 10 units a second: 100 ms a unit, so the calls' own duration refills nothing measurable
    out = [any_locks.throttle("mix", rate=(10, 1.0), burst=100, cost=c) for c in costs]
    assert [t.allowed for t in out] == [True, True, True, True, False]
    assert [t.remaining for t in out[:4]] == [60, 30, 10, 0]
    assert 0.4 < out[4].retry_after <= 0.5  # 5 units at 100 ms each


@pytest.mark.parametrize("cost, burst", [(11, 10), (2, 1), (10**9, 10)])
def test_a_cost_the_burst_can_never_admit_is_refused(cost, burst, any_locks):
    with pytest.raises(ConfigError, match=rf"cost {cost} can never pass a rate whose burst is {burst}"):
        any_locks.throttle("big", rate="1000/s", burst=burst, cost=cost)
    assert any_locks.throttle("big", rate="1000/s", burst=burst).allowed  # nothing was counted


@pytest.mark.parametrize("cost", [0, -1, 1.5, True, "3", 10**9 + 1])
def test_bad_costs_are_config_errors(cost):
    with pytest.raises(ConfigError, match="cost must be an int from 1"):
        MemoryLocks().throttle("k", rate="10/s", cost=cost)


def _timed_throttle(locks, key, **kw):
    """(the throttle's answer, the earliest and the latest instant, local monotonic seconds, its
    booked turn can stand for): the turn is the backend's "now" at the call plus ``retry_after``,
    and that "now" lies between the clock read before the call and the one after (on a loaded
    machine, successive calls are milliseconds apart, so ``retry_after`` alone shrinks by that)."""
    before = time.monotonic()
    t = locks.throttle(key, **kw)
    after = time.monotonic()
    return t, before + t.retry_after, after + t.retry_after


def _turns_apart(calls, low, high):
    """Whether consecutive booked turns of ``calls`` (``_timed_throttle`` answers) can lie between
    ``low`` and ``high`` seconds apart."""
    return all(
        b_lo - a_hi < high and b_hi - a_lo > low
        for (_, a_lo, a_hi), (_, b_lo, b_hi) in zip(calls, calls[1:], strict=False)
    )


def test_denied_weighted_callers_book_distinct_turns_a_cost_apart(any_locks):
    assert any_locks.throttle("q", rate="100/s", cost=10).allowed
    turns = [_timed_throttle(any_locks, "q", rate="100/s", cost=10, book_within=2.0) for _ in range(5)]
    assert all(t.booked for t, _, _ in turns)
    assert _turns_apart(turns, 0.09, 0.11), turns  # 10 units x 10 ms


def test_settling_the_actual_cost_corrects_the_rate_state(any_locks):
    """Admitted at 10 units, it cost 40: the next call waits for 40 units, not 10. A refund lets
    the next call sooner, but never beyond the burst."""
    assert any_locks.throttle("s", rate="100/s", cost=10).allowed
    any_locks.settle_cost("s", rate="100/s", by=30)
    late = any_locks.throttle("s", rate="100/s", cost=10, consume=False)
    assert not late.allowed and 0.35 < late.retry_after <= 0.4
    any_locks.settle_cost("s", rate="100/s", by=-1000)  # a refund past now is cut at now
    assert any_locks.throttle("s", rate="100/s", cost=10).allowed
    assert not any_locks.throttle("s", rate="100/s", cost=10).allowed  # burst 10: no credit was banked
    with pytest.raises(ConfigError, match="by must be an int"):
        any_locks.settle_cost("s", rate="100/s", by=1.5)


def test_a_back_off_pauses_every_call_then_books_turns_after_it(any_locks):
    assert any_locks.throttle("p", rate="100/s", burst=50).allowed
    assert 0.55 < any_locks.back_off("p", 0.6) <= 0.6
    assert 0.55 < any_locks.back_off("p", 0.1) <= 0.6  # a longer pause already on is kept
    denied = any_locks.throttle("p", rate="100/s", burst=50)
    assert not denied.allowed and denied.paused and not denied.booked and 0.5 < denied.retry_after <= 0.6
    booked = [_timed_throttle(any_locks, "p", rate="100/s", book_within=2.0, cost=c) for c in (1, 1)]
    assert all(b.booked and b.paused for b, _, _ in booked)
    assert booked[0][0].retry_after > 0.5 and _turns_apart(booked, 0.005, 0.015), booked
    assert not any_locks.throttle("p", rate="100/s", burst=50, consume=False).allowed
    time.sleep(0.62)
    after = any_locks.throttle("p", rate="100/s", burst=50)
    assert after.allowed and not after.paused
    with pytest.raises(ConfigError, match="retry_after must be a finite number of seconds"):
        any_locks.back_off("p", 0)


def test_a_booked_turn_passes_unless_a_pause_is_on(any_locks):
    """The re-check of a booked turn (``turn=True``) counts nothing when no pause is on; during a
    pause it is a call like any other and books a new turn after the pause."""
    rates = any_locks.rates
    assert rates.throttle("t", rate="10/s", turn=True).allowed
    assert rates.throttle("t", rate="10/s", turn=True).allowed  # counted nothing
    assert any_locks.throttle("t", rate="10/s").allowed and not any_locks.throttle("t", rate="10/s").allowed
    any_locks.back_off("t", 0.5)
    again = rates.throttle("t", rate="10/s", turn=True, book_within=5.0)
    assert not again.allowed and again.paused and again.booked and 0.45 < again.retry_after <= 0.5


def _weighted_hammer(url, prefix, until, out, seed):
    import random

    rnd = random.Random(seed)
    locks = RedisLocks.from_url(url, prefix=prefix)
    clock = locks.server_clock()
    admitted = []
    while time.time() < until:
        cost = rnd.randint(1, 40)
        before = clock.time() - clock.uncertainty()
        if locks.throttle("tokens", rate=(2000, 1.0), burst=200, cost=cost).allowed:
            after, u = clock.time(), clock.uncertainty()  # (the clock is within u of the server's)
            admitted.append((before - u, after + u, cost))
    out.put(admitted)


def test_the_weighted_rate_holds_across_processes(redis_url, prefix):
    """Four processes with random costs (1-40 units) on 2000 units/s, burst 200, for 2.5 s: the
    units admitted within any window of the Redis clock stay within burst + rate x window, and
    the rate is used. (Each admission is known to lie between the clock read before its call and
    the one after, each widened by the process's clock uncertainty: a window is taken from the
    first call's "before" to the latest "after" of the calls in it.)"""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    until = time.time() + 2.5
    procs = [ctx.Process(target=_weighted_hammer, args=(redis_url, prefix, until, out, i)) for i in range(4)]
    for p in procs:
        p.start()
    admitted = sorted(a for _ in procs for a in out.get(timeout=30))
    for p in procs:
        p.join(10)
    total = sum(c for _, _, c in admitted)
    print(f"    observed: {total} units admitted in about 2.5 s at 2000/s, burst 200, from 4 processes")
    assert total >= 0.6 * 2.5 * 2000
    for i, (start, _, _) in enumerate(admitted):  # every window starting at an admission
        units, end = 0, start
        for _, after, c in admitted[i:]:
            units += c
            end = max(end, after)  # the admissions i..j all lie within [start, end]
            # (+ 5 units, 2.5 ms: the local monotonic clock's drift from the Redis clock's since
            # the reading, NTP slewing at most 500 ppm)
            assert units <= 200 + (end - start) * 2000 + 5, (start, end, units)
