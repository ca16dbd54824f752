"""Run once per business key (``Locks.once``, ``GuardedRun(once=...)``) and shadow mode
(``GuardedRun(enforce=False)``, ``throttle(consume=False)``), on Redis (standalone and Cluster)
and MemoryLocks."""

from __future__ import annotations

import pytest

from taskguard import ConfigError, IdempotencyConflict, LeaseEvent, Skipped, is_skipped
from taskguard.keys import KeyTemplate
from taskguard.once import Fingerprint, OncePolicy, fingerprint_of
from taskguard.run import GuardedRun


def test_the_first_completion_is_stored_and_returned_to_later_calls(any_locks):
    calls = []

    def charge(lease):
        calls.append(lease.fencing_token)
        return {"charged": 4200, "fence": lease.fencing_token}

    first = any_locks.once("charge:inv-1", charge, ttl=5, fingerprint={"amount": 4200})
    again = any_locks.once("charge:inv-1", charge, ttl=5, fingerprint={"amount": 4200})
    assert first == again == {"charged": 4200, "fence": calls[0]} and len(calls) == 1
    assert any_locks.holder("charge:inv-1") is None  # released with the store


def test_another_fingerprint_is_a_conflict_naming_the_key_never_the_arguments(any_locks):
    any_locks.once("charge:inv-2", lambda lease: "ok", ttl=5, fingerprint={"amount": 10, "card": "4111-secret"})
    with pytest.raises(IdempotencyConflict) as info:
        any_locks.once("charge:inv-2", lambda lease: "ok", ttl=5, fingerprint={"amount": 99, "card": "4111-secret"})
    assert info.value.key == "charge:inv-2" and "4111" not in str(info.value) and "99" not in str(info.value)


def test_a_failed_run_stores_nothing_and_the_next_call_runs(any_locks):
    def fail(lease):
        raise RuntimeError("card declined")

    with pytest.raises(RuntimeError):
        any_locks.once("charge:inv-3", fail, ttl=5)
    assert any_locks.once("charge:inv-3", lambda lease: "paid", ttl=5) == "paid"
    assert any_locks.once("charge:inv-3", lambda lease: "twice?", ttl=5) == "paid"


def test_while_a_run_is_in_flight_others_are_skipped_as_for_a_held_lease(any_locks):
    held = any_locks.acquire("charge:inv-4", ttl=5).lease
    out = any_locks.once("charge:inv-4", lambda lease: "x", ttl=5)
    assert is_skipped(out) and out.reason == "held"
    held.release()
    assert any_locks.once("charge:inv-4", lambda lease: "x", ttl=5) == "x"


def test_a_completion_between_the_check_and_the_lease_is_found(any_locks, monkeypatch):
    """The first look finds no record; a run completes before this one takes the lease; the look
    made under the lease finds it: the body does not run, the stored value comes back."""
    any_locks.once("charge:inv-5", lambda lease: "done-by-other", ttl=5)
    real = any_locks.completions.get
    looks = []

    def first_look_misses(key):
        looks.append(key)
        return None if len(looks) == 1 else real(key)

    monkeypatch.setattr(any_locks.completions, "get", first_look_misses)
    assert any_locks.once("charge:inv-5", lambda lease: pytest.fail("ran twice"), ttl=5) == "done-by-other"
    assert len(looks) == 2 and any_locks.holder("charge:inv-5") is None


def test_the_record_expires_after_once_ttl(any_locks):
    import time

    assert any_locks.once("charge:inv-6", lambda lease: 1, ttl=5, once_ttl=0.3) == 1
    time.sleep(0.4)
    assert any_locks.once("charge:inv-6", lambda lease: 2, ttl=5) == 2


def test_values_are_capped_and_must_have_a_stored_form(any_locks):
    run = GuardedRun(any_locks, "big", ttl=5, once=OncePolicy(fingerprint_of(None), max_bytes=100))
    assert run.begin()
    with pytest.raises(ConfigError, match="over the 100-byte bound"):
        run.finish("x" * 200)
    assert any_locks.holder("big") is None and any_locks.completions.get("big") is None
    with pytest.raises(ConfigError, match="cannot be stored as JSON"):
        any_locks.once("unjson", lambda lease: object(), ttl=5)
    assert any_locks.holder("unjson") is None


def test_fingerprints_are_json_normalised_and_validated():
    def charge(invoice_id, amount, currency="EUR", note=None):
        return amount

    tpl = KeyTemplate("charge:{invoice_id}", charge)
    every = Fingerprint(None, tpl)
    assert every.of((7, 10), {}) == every.of((), {"invoice_id": 7, "amount": 10, "currency": "EUR"})
    assert every.of((7, (1, 2)), {}) == every.of((7, [1, 2]), {})  # a tuple and its JSON list agree
    assert every.of((7, 10), {}) != every.of((7, 11), {})
    named = Fingerprint(("invoice_id", "amount"), tpl)
    assert named.of((7, 10), {"note": "a"}) == named.of((7, 10), {"note": "b"})
    by_fn = Fingerprint(lambda invoice_id, amount, **_: f"{invoice_id}/{amount}", tpl)
    assert by_fn.of((7, 10), {}) == by_fn.of((7, 10), {"note": "x"})
    with pytest.raises(TypeError, match="cannot fingerprint") as info:  # the arguments' error, not the guard's
        every.of((7, object()), {})
    assert not isinstance(info.value, ConfigError)
    with pytest.raises(ConfigError, match="'nope'"):
        Fingerprint(("nope",), tpl)
    with pytest.raises(ConfigError, match="fingerprint must be"):
        Fingerprint("amount", tpl)


def test_the_record_never_holds_the_owner_token(redis_url, prefix):
    import redis

    from taskguard import RedisLocks

    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix)
    tokens = []
    locks.once("tok", lambda lease: tokens.append(lease.owner_token) or "v", ttl=5)
    record_key = locks.backend.completion_key("tok")
    raw = client.get(record_key)
    assert raw and tokens[0].encode() not in raw and 0 < client.pttl(record_key) <= 86400 * 1000


# -- shadow mode ------------------------------------------------------------------------------------


def _events(locks):
    seen: list[LeaseEvent] = []
    locks.add_listener(seen.append)
    return seen


def test_shadow_mode_runs_the_body_and_reports_the_would_be_skip(any_locks):
    held = any_locks.acquire("busy", ttl=5).lease
    seen = _events(any_locks)
    run = GuardedRun(any_locks, "busy", ttl=5, task="t.shadow", enforce=False)
    assert run.begin() is True and run.lease is None and run.reason == "held"
    skips = [e for e in seen if e.kind == "skip"]
    assert [(e.status, e.shadow, e.task) for e in skips] == [("held", True, "t.shadow")]
    run.finish("value")  # nothing to release
    held.release()
    free = GuardedRun(any_locks, "busy", ttl=5, enforce=False)
    assert free.begin() and free.lease is not None and free.reason is None  # a free lease is taken
    free.finish()
    assert any_locks.holder("busy") is None


def test_shadow_mode_never_waits_and_never_stores_a_completion(any_locks):
    any_locks.once("paid", lambda lease: "first", ttl=5, fingerprint=1)
    run = GuardedRun(any_locks, "paid", ttl=5, wait=30, enforce=False, once=OncePolicy(fingerprint_of(2)))
    assert run.begin() and run.reason == "idempotency_conflict" and run.lease is not None
    run.finish("second")
    assert any_locks.once("paid", lambda lease: "third", ttl=5, fingerprint=1) == "first"  # record untouched
    fresh = GuardedRun(any_locks, "unpaid", ttl=5, enforce=False, once=OncePolicy(fingerprint_of(1)))
    assert fresh.begin() and fresh.reason is None
    fresh.finish("shadow value")
    assert any_locks.completions.get("unpaid") is None  # shadow runs store nothing


def test_a_shadow_throttle_is_checked_not_consumed(any_locks):
    for _ in range(5):
        assert any_locks.throttle("api", rate="1/m", consume=False).allowed
    assert any_locks.throttle("api", rate="1/m").allowed
    peek = any_locks.throttle("api", rate="1/m", consume=False, book_within=120)
    assert not peek.allowed and not peek.booked and peek.retry_after > 50
    assert any_locks.throttle("api", rate="1/m", book_within=120).booked  # the peek booked nothing


def test_skipped_reason_once_is_reported(any_locks):
    seen = _events(any_locks)
    any_locks.once("k", lambda lease: 1, ttl=5)
    any_locks.once("k", lambda lease: 2, ttl=5)
    assert [(e.status, e.shadow) for e in seen if e.kind == "skip"] == [("once", False)]
    assert Skipped(key="k", reason="once").describe()


def test_a_shadow_rate_check_reports_without_consuming_and_never_raises(any_locks):
    from taskguard import RedisLocks
    from taskguard.pacing import shadow_reason

    from .servers import free_port

    seen = _events(any_locks)
    kw = dict(rate=(1, 60.0), burst=None, max_wait=None, max_countdown=30, task="t.api")
    assert shadow_reason(any_locks, "api", **kw) is None  # room: nothing to report, nothing counted
    assert any_locks.throttle("api", rate=(1, 60.0)).allowed  # the check took no turn
    assert shadow_reason(any_locks, "api", **kw) == "rate_limited"
    assert [(e.status, e.shadow, e.key) for e in seen if e.kind == "skip"] == [("rate_limited", True, "api")]
    down = RedisLocks.from_url(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.3, retries=0)
    assert shadow_reason(down, "api", **kw) is None
