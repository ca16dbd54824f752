"""A guard that never contends is invisible: a call's own errors keep their type, and a direct call
made inside a running guarded task is judged by its own call (real embedded workers, real Redis)."""

from __future__ import annotations

import time

import pytest
import redis

from taskguard import ConfigError
from taskguard_celery import GuardedTask, current_lease

from .celery_app import make_app
from .celery_support import body_log, embedded_worker


@pytest.fixture
def app(redis_url, prefix):
    a = make_app(f"q-{prefix}", prefix)
    yield a
    redis.Redis.from_url(redis_url).delete(a.tg_log, f"q-{prefix}")


def _note(app, entry: str) -> None:
    # with a TTL: another pytest session ending on the shared Redis deletes untimed tgtest- keys
    with redis.Redis.from_url(app.conf.result_backend).pipeline() as pipe:
        pipe.rpush(app.tg_log, entry).expire(app.tg_log, 600).execute()


def _guard_keys(app, prefix: str) -> list[bytes]:
    """Every key under the test's lease prefix (leases, queued marks, records)."""
    r = redis.Redis.from_url(app.conf.result_backend)
    return sorted(r.scan_iter(match="{" + prefix + ":*", count=1000))


# -- 1. the call's own errors keep their type ------------------------------------------------------

KEYS = {
    "template": "add:{x}:{y}",
    "callable": lambda x, y, **_: f"add:{x}:{y}",
}


@pytest.mark.parametrize("kind", sorted(KEYS))
def test_wrong_arguments_raise_type_error_everywhere_and_lock_nothing(app, prefix, kind):
    """``add(5)`` raises ``TypeError`` as the function would (and as Celery's own argument check
    does), for a template key and a key callable: called directly, through ``apply()``, in eager
    mode, through a worker and at a ``unique=True`` publish. Before, the key bound the arguments
    first and raised ``ConfigError`` ("arguments do not match"), a configuration error for the
    caller's mistake."""
    key = KEYS[kind]

    @app.task(base=GuardedTask, shared=False, name="tg.add", key=key)
    def add(x, y, z=None):
        _note(app, f"add:{x}:{y}")
        return x + y

    @app.task(base=GuardedTask, shared=False, name="tg.add_not_typed", key=key, typing=False)
    def add_not_typed(x, y):
        _note(app, f"add_not_typed:{x}:{y}")
        return x + y

    @app.task(base=GuardedTask, shared=False, name="tg.add_unique", key=key, unique=True, typing=False)
    def add_unique(x, y):
        return x + y

    for call in (
        lambda: add(5),
        lambda: add(5, 5, wrong_arg=5),
        lambda: add(1, 2, 3, 4),
        lambda: add.apply((5,)).get(),
        lambda: add_not_typed.apply((5,), {"wrong_arg": 5}).get(),
        lambda: add_unique.delay(5),
        lambda: add_unique.delay(5, 5, wrong_arg=5),
    ):
        with pytest.raises(TypeError) as info:
            call()
        assert not isinstance(info.value, ConfigError), info.value
    with pytest.raises(TypeError, match="missing a required argument: 'y'"):
        add(5)
    app.conf.task_always_eager = True
    with pytest.raises(TypeError):
        add_not_typed.delay(5).get()
    app.conf.task_always_eager = False
    with embedded_worker(app):
        for kwargs in ({}, {"wrong_arg": 5}):
            result = add_not_typed.delay(5, **kwargs)
            with pytest.raises(TypeError):
                result.get(timeout=10)
            assert result.status == "FAILURE"
        assert add_not_typed.delay(2, 3).get(timeout=10) == 5  # and a right call still runs
    assert add(1, 2) == 3
    assert body_log(app) == ["add_not_typed:2:3", "add:1:2"]
    locks = app.conf.taskguard_locks
    assert all(locks.holder(k) is None for k in ("add:5:5", "add:1:2", "add:2:3"))
    # the wrong calls (all of x=5) left no lease, queued mark or record; the right ones nothing untimed
    keys = _guard_keys(app, prefix)
    assert not [k for k in keys if b":add:5" in k], keys
    assert all(redis.Redis.from_url(app.conf.result_backend).ttl(k) > 0 for k in keys), keys


def test_what_a_key_or_fingerprint_makes_of_bad_input_keeps_its_type(app):
    """The key and fingerprint are computed from the call's arguments; what they raise on bad input
    is the caller's error, with its own type: a template's missing attribute (``AttributeError``),
    index (``IndexError``) or item (``KeyError``), whatever a key or fingerprint callable raises,
    arguments with no JSON form for ``once`` (``TypeError``, ``ValueError`` for NaN). A callable
    that returns no ``str`` is the guard's configuration: ``ConfigError``."""

    class Order:
        id = 7

    @app.task(base=GuardedTask, shared=False, name="tg.attr", key="order:{order.id}")
    def by_attr(order):
        return current_lease().key

    @app.task(base=GuardedTask, shared=False, name="tg.index", key="first:{ids[0]}")
    def by_index(ids):
        return current_lease().key

    @app.task(base=GuardedTask, shared=False, name="tg.extra", key="extra:{region}")
    def by_extra(**options):
        return current_lease().key

    @app.task(base=GuardedTask, shared=False, name="tg.keyfn", key=lambda order, **_: f"o:{order['id']}")
    def by_callable(order):
        return current_lease().key

    @app.task(base=GuardedTask, shared=False, name="tg.badkey", key=lambda order, **_: None)
    def bad_key(order):
        return order

    @app.task(base=GuardedTask, shared=False, name="tg.once", key="charge:{invoice}", once=True)
    def charge(invoice, amount):
        return amount

    @app.task(
        base=GuardedTask,
        shared=False,
        name="tg.oncefn",
        key="charge:{invoice}",
        once=True,
        fingerprint=lambda amount, **_: f"{amount['cents']}",
    )
    def charge_fn(invoice, amount):
        return amount

    assert by_attr(Order()) == "order:7" and by_index([3, 4]) == "first:3" and by_extra(region="eu") == "extra:eu"
    assert by_callable({"id": 1}) == "o:1"
    cases = [
        (lambda: by_attr(None), AttributeError),
        (lambda: by_index([]), IndexError),
        (lambda: by_extra(), KeyError),
        (lambda: by_callable(None), TypeError),
        (lambda: by_callable({}), KeyError),
        (lambda: charge(1, object()), TypeError),
        (lambda: charge(1, float("nan")), ValueError),
        (lambda: charge_fn(1, 5), TypeError),
        (lambda: charge.apply((1, object())).get(), TypeError),
        (lambda: by_attr.apply((None,)).get(), AttributeError),
    ]
    for call, kind in cases:
        with pytest.raises(kind) as info:
            call()
        assert not isinstance(info.value, ConfigError), info.value
    with pytest.raises(AttributeError, match=r"key template 'order:\{order.id\}'"):
        by_attr(None)
    with pytest.raises(TypeError, match="pass fingerprint="):
        charge(1, object())
    with pytest.raises(ConfigError, match="must return a non-empty str"):
        bad_key({"id": 1})
    locks = app.conf.taskguard_locks
    assert locks.holder("charge:1") is None and locks.holder("o:1") is None


# -- 2. a direct call inside a run is judged by its own call ------------------------------------------


def test_a_task_as_its_own_errback_runs_both_bodies(app):
    """``fail.si(1).on_error(fail.si(2))``: Celery calls a new-style errback (one taking the
    request, exception and traceback) directly in the worker while the failed run's request is
    still pushed (celery/backends/base.py). Before, the guard read that request, took the errback
    for a redelivered copy of the finished run, skipped it as a duplicate and raised ``Ignore``:
    the errback's body never ran. Also with another guarded task as the errback."""

    @app.task(base=GuardedTask, shared=False, name="tg.fail", key=lambda args: f"fail:{args[0]}")
    def fail(*args):
        _note(app, f"fail:{args[0]}:{len(args)}:{current_lease().key}")
        raise RuntimeError(f"expected failure {args[0]}")

    @app.task(base=GuardedTask, shared=False, name="tg.errback", key="errback:{tag}")
    def errback(request, exc, traceback, tag):  # Celery puts the failure's arguments first
        _note(app, f"errback:{tag}:{type(exc).__name__}")

    with embedded_worker(app):
        first = fail.si(1).on_error(fail.si(1)).delay()  # the same key: its own errback
        with pytest.raises(RuntimeError, match="expected failure 1"):
            first.get(timeout=10)
        second = fail.si(3).on_error(errback.s("e")).delay()
        with pytest.raises(RuntimeError, match="expected failure 3"):
            second.get(timeout=10)
        # the error callback runs in the worker after the failure is stored: wait for its note
        deadline = time.monotonic() + 10
        while len(body_log(app)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    log = body_log(app)
    assert log.count("fail:1:1:fail:1") == 2, log
    assert "fail:3:1:fail:3" in log and "errback:e:RuntimeError" in log, log
    assert len(log) == 4, log
    locks = app.conf.taskguard_locks
    assert all(locks.holder(f"fail:{n}") is None for n in (1, 3)) and locks.holder("errback:e") is None


def test_direct_calls_inside_a_worker_run_are_judged_by_their_own_call(app):
    """Recursion (a new key each level, and the same key: nested under the caller's lease), a
    direct call of another guarded task that calls back (A -> B -> A), and ``apply()`` inside a
    run, in a worker and in eager mode: each body runs once per call and the results are the bodies' own.
    Before, a direct call of the running task read the enclosing run's request and was taken for
    that run (skipped, or deferred as a copy of it)."""

    @app.task(base=GuardedTask, shared=False, name="tg.down", key="down:{n}", bind=True)
    def down(self, n):
        _note(app, f"down:{n}:{current_lease().key}")
        return [n] + (down(n - 1) if n else [])

    @app.task(base=GuardedTask, shared=False, name="tg.same", key="same:{tag}", bind=True)
    def same(self, tag, n):
        _note(app, f"same:{n}:{current_lease().fencing_token}")
        return [n] + (same(tag, n - 1) if n else [])

    @app.task(base=GuardedTask, shared=False, name="tg.ping", key="ping:{n}")
    def ping(n):
        _note(app, f"ping:{n}")
        return ["ping", n] + (pong(n - 1) if n else [])

    @app.task(base=GuardedTask, shared=False, name="tg.pong", key="pong:{n}")
    def pong(n):
        _note(app, f"pong:{n}")
        return ["pong", n] + (ping(n - 1) if n else [])

    @app.task(base=GuardedTask, shared=False, name="tg.applies", key="applies:{n}")
    def applies(n):
        _note(app, f"applies:{n}")
        if not n:
            return [0]
        inner = applies.apply((n - 1,))
        return [n] + inner.get()

    # eager: apply()'s request is pushed by Celery's tracer as a worker's is
    assert down.apply((1,)).get() == [1, 0] and same.apply(("e", 1)).get() == [1, 0]
    redis.Redis.from_url(app.conf.result_backend).delete(app.tg_log)
    with embedded_worker(app):
        assert down.delay(3).get(timeout=10) == [3, 2, 1, 0]
        assert same.delay("t", 2).get(timeout=10) == [2, 1, 0]
        assert ping.delay(3).get(timeout=10) == ["ping", 3, "pong", 2, "ping", 1, "pong", 0]
        assert applies.delay(2).get(timeout=10) == [2, 1, 0]
    log = body_log(app)
    assert [e for e in log if e.startswith("down:")] == [f"down:{n}:down:{n}" for n in (3, 2, 1, 0)]
    fences = {e.split(":")[2] for e in log if e.startswith("same:")}
    assert len([e for e in log if e.startswith("same:")]) == 3 and len(fences) == 1  # under the caller's lease
    assert [e for e in log if e.startswith(("ping:", "pong:"))] == ["ping:3", "pong:2", "ping:1", "pong:0"]
    assert [e for e in log if e.startswith("applies:")] == ["applies:2", "applies:1", "applies:0"]
    locks = app.conf.taskguard_locks
    assert all(locks.holder(k) is None for k in ("down:3", "down:0", "same:t", "ping:3", "pong:0", "applies:2"))
