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
    turns = [any_locks.throttle("q", rate="10/s", book_within=1.0) for _ in range(10)]
    booked = [t for t in turns if t.booked]
    assert len(booked) >= 9 and not any(t.allowed for t in turns)
    waits = sorted(t.retry_after for t in booked)
    assert all(0.08 < b - a < 0.12 for a, b in zip(waits, waits[1:], strict=False))
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
