"""A guarded Celery task's ``rate``: run now, re-publish for the booked turn, or skip; and a
body's :class:`taskguard.RateLimited` (an upstream 429): pause the rate and re-publish past it.

The decision is :func:`taskguard.pacing.pace`'s; this module carries it out. A deferred run is
re-published (``signature_from_request`` with the request's own ``retries``, as ``on_skip="retry"``
does, so ``max_retries`` is not consumed) with the ``taskguard_rate`` header, and the execution
ends with ``Retry`` (state RETRY). One deferral never lasts longer than half the broker's
redelivery timeout (Redis ``visibility_timeout``, RabbitMQ ``consumer_timeout``;
:func:`taskguard_celery.identity.redelivery_timeout`): a worker holds a delayed message unacked
until its ETA, and the broker would hand a message held longer to another worker as well. A
longer wait re-checks and defers again. Direct and eager calls wait for their turn in the
calling thread instead.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from celery.exceptions import Retry

from taskguard import Locks, Skipped
from taskguard.handoff import parse_handle, release_handle
from taskguard.keys import KeyTemplate
from taskguard.pacing import back_off, charging, pace, parse_state, shadow_reason
from taskguard.policy import GuardOptions

from .headers import DEFER_HEADER, HEADER, RATE_HEADER, read_header
from .identity import redelivery_timeout

__all__ = ["pace_run", "back_off_run", "max_countdown"]

log = logging.getLogger("taskguard.celery")


def max_countdown(app: Any) -> float:
    """The longest one deferral lasts, seconds: half the broker's redelivery timeout, at least 1 s."""
    return max(1.0, redelivery_timeout(app) / 2)


def pace_run(task: Any, opts: GuardOptions, key: str, args: tuple, kwargs: dict, locks: Locks,
             handle: dict | None, local: bool) -> Skipped | charging:
    """A ``charging`` context for the body (its rate key and the cost it was admitted at, for
    :func:`taskguard.settle_cost`) when the run goes ahead now; the ``Skipped`` (reason
    ``"rate_limited"`` or ``"backoff"``, ``key`` the rate key) when it would wait past
    ``rate_max_wait``. A deferred worker run raises ``Retry`` after re-publishing itself.
    Raises LeaseBackendError when Redis fails (the run neither runs nor is lost: the task fails
    like any run that cannot reach Redis), ConfigError for a cost that could never pass."""
    req = task.request
    try:
        state = parse_state(read_header(req, RATE_HEADER))
    except ValueError as e:
        log.error("task %s[%s]: ignoring a malformed %r header (%s); pacing it afresh", task.name, req.id,
                  RATE_HEADER, e)
        state = None
    rate_key = cast(KeyTemplate, opts.rate_key).render(args, kwargs)  # (a guard with a rate has its key)
    rate = cast("tuple[int, float]", opts.rate)
    cost = opts.cost_of(args, kwargs)
    bound = max_countdown(task.app)
    if not opts.enforce:  # shadow mode: checked, not consumed; reported; the run goes ahead
        reason = shadow_reason(locks, rate_key, rate=rate, burst=opts.rate_burst, max_wait=opts.rate_max_wait,
                               max_countdown=bound, task=task.name, cost=cost)
        if reason is not None:
            from .skipping import send_event

            send_event(task, "task-guard-shadow", key=rate_key, reason=reason, holder_ttl=None, leased=False)
        return charging(locks, rate_key, rate, cost, shadow=True)
    while True:
        p = pace(locks, rate_key, rate=rate, burst=opts.rate_burst, max_wait=opts.rate_max_wait,
                 max_countdown=bound, state=state, cost=cost)
        if p.go:
            if p.countdown > 0:
                time.sleep(p.countdown)  # back a moment before its booked turn: re-checked at it
                continue
            return charging(locks, rate_key, rate, cost)
        if p.skip:
            if handle is not None:
                _release(task, handle)
            return Skipped(key=rate_key, reason=p.reason, task=task.name)
        if not local:
            _defer(task, rate_key, locks, p.countdown, p.state, handle, p.reason)
        time.sleep(p.countdown)  # a direct or eager call waits for its turn here
        state = p.state


def back_off_run(task: Any, opts: GuardOptions, args: tuple, kwargs: dict, locks: Locks, exc: Any,
                 local: bool) -> Skipped | None:
    """The body raised :class:`taskguard.RateLimited` (its run handed back): pause the rate key
    cluster-wide (:func:`taskguard.pacing.back_off`) and defer this run past the pause
    (re-published like a rate deferral: ``max_retries`` is not consumed; raises ``Retry``), or
    return the ``Skipped`` (reason ``"backoff"``) when the pause outlasts ``rate_max_wait``.
    ``None`` for a direct or eager call (the caller gets the ``RateLimited``) and in shadow mode
    (the pause goes to the shadow state, reported; the exception is the body's). Raises
    ConfigError for a bad ``retry_after``, LeaseBackendError when Redis fails."""
    req = task.request
    rate_key = exc.key if exc.key is not None else (
        cast(KeyTemplate, opts.rate_key).render(args, kwargs) if opts.rate is not None else None)
    bound = max_countdown(task.app)
    if rate_key is None:  # no rate to pause: only this run waits
        from taskguard.validate import check_seconds

        wait = check_seconds("retry_after", exc.retry_after)
        rate_key = opts.key.render(args, kwargs)
        if local or not opts.enforce:
            return None
        _defer(task, rate_key, locks, min(wait, bound), {"since": time.time(), "turn": None}, None, "backoff")
    try:
        state = parse_state(read_header(req, RATE_HEADER))
    except ValueError:
        state = None
    p = back_off(locks, rate_key, exc.retry_after, max_wait=opts.rate_max_wait, max_countdown=bound, state=state,
                 shadow=not opts.enforce)
    if not opts.enforce:
        from .skipping import send_event

        locks.report_skip(Skipped(key=rate_key, reason="backoff", task=task.name), shadow=True)
        send_event(task, "task-guard-shadow", key=rate_key, reason="backoff", holder_ttl=None, leased=True)
        return None
    if local:
        return None
    if p.skip:
        return Skipped(key=rate_key, reason="backoff", task=task.name)
    _defer(task, rate_key, locks, p.countdown, p.state, None, "backoff")
    return None  # (not reached: _defer raises Retry)


def _defer(task: Any, key: str, locks: Locks, countdown: float, state: dict | None, handle: dict | None,
           reason: str = "rate_limited") -> None:
    req = task.request
    if handle is not None:  # a retry's kept lease is not held through a rate wait: it acquires at its turn
        _release(task, handle)
    header = read_header(req)
    skips = header.get("skips") if isinstance(header, dict) else None
    headers = {**(req.headers or {}), RATE_HEADER: state}
    headers.pop(DEFER_HEADER, None)
    headers.pop(HEADER, None)
    if skips:
        headers[HEADER] = {"skips": skips}
    skipped = Skipped(key=key, reason=reason, task=task.name, holder_ttl=None)
    locks.report_skip(skipped)
    from .skipping import send_skip_event

    send_skip_event(task, skipped, retrying=True, retry_after=round(countdown, 3),
                    turn=None if state is None else state.get("turn"))
    booked = state is not None and state.get("turn") is not None
    what = "rate-limited" if reason == "rate_limited" else "backing off (upstream rate limit)"
    log.info("task %s[%s]: %s; %s in %.2fs", task.name, req.id, what,
             "its turn is booked" if booked else "it asks again", countdown)
    sig = task.signature_from_request(req, countdown=countdown, retries=req.retries, headers=headers)
    sig.apply_async()
    raise Retry(f"{what}; deferred {countdown:.2f}s", when=countdown, sig=sig)


def _release(task: Any, handle: dict) -> None:
    try:
        release_handle(task.taskguard_locks, parse_handle(handle))
    except Exception as e:  # (a Redis error, a malformed handle) the kept lease's TTL bounds it
        log.warning("task %s: could not release its kept lease before a rate wait: %s", task.name, e)
