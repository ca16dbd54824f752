"""Pacing a run under a cluster-wide rate: run now, come back at a booked turn, or give up.

The task adapters call :func:`pace` before a run takes its lease, with the state its deferred
message carries (Celery: the ``taskguard_rate`` header; RQ: ``job.meta``), and translate the
answer into their framework: a re-published message (Celery) or a job rescheduled through RQ's
scheduler, in both cases without consuming the task's own retries.

* A run whose rate has room goes ahead (the call counts its ``cost`` against the rate).
* A denied run *books* its turn when that turn is no further than the run may wait (the broker's
  tolerance for a delayed message, and what is left of ``rate_max_wait``): the rate key's
  theoretical arrival time moves on for it, so denied runs get distinct turns (no herd).
* A deferred run that comes back at its booked turn re-checks the rate key's back-off pause
  (one round trip, ``throttle(turn=True)``): with no pause on it goes ahead, counting nothing
  (its turn already counted); while a pause is on it is paced like a fresh call and books a turn
  after the pause.
* A turn beyond the broker's tolerance is not booked: the run comes back after that tolerance and
  asks again.
* A run that would wait past ``rate_max_wait`` (counted from its first deferral) is skipped
  (reason ``"rate_limited"``, or ``"backoff"`` when a back-off pause is what it waits for).
* A body that raises :class:`~taskguard.RateLimited` pauses the rate key (:func:`back_off`):
  the run is deferred past the pause (reason ``"backoff"``).
* The body may settle its actual cost (:func:`settle_cost`) while it runs under
  :func:`charging`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any, cast

from .errors import ConfigError, LeaseBackendError
from .locks import Locks
from .skipped import Skipped
from .validate import MAX_COST

__all__ = ["Pace", "pace", "back_off", "charging", "settle_cost", "parse_state", "shadow_reason"]


@dataclasses.dataclass(frozen=True)
class Pace:
    """The answer of :func:`pace`.

    Attributes:
        go: run now — or, when ``countdown`` > 0, wait ``countdown`` seconds in place and call
            :func:`pace` again with the same ``state`` (a deferred run that came back a little
            before its booked turn, e.g. through a scheduler that counts whole seconds; its turn
            is then re-checked against a back-off pause).
        skip: give up: the run would wait past ``max_wait`` (reason: :attr:`reason`).
        countdown: when deferred: seconds (float) until the deferred run comes back.
        state: what the deferred run must carry back (a JSON-safe dict: ``since``, the Unix
            epoch seconds of its first deferral, and ``turn``, the epoch seconds of its booked
            turn or ``None`` when it must ask again).
        reason: why a run is deferred or skipped: ``"rate_limited"``, or ``"backoff"`` while a
            back-off pause is on (:func:`back_off`).
    """

    go: bool
    skip: bool = False
    countdown: float = 0.0
    state: dict[str, Any] | None = None
    reason: str = "rate_limited"


GO = Pace(True)
#: The longest a run that came back before its booked turn waits for it in place, seconds; one
#: that came back earlier than that (its delay read on a clock that runs ahead, e.g. a worker's
#: stepped wall clock) is deferred again to the same turn: the rate counted it at that turn only.
MAX_EARLY = 2.0


def _uncertainty(clock: Any) -> float:
    """``clock.uncertainty()`` (seconds), or 0 for an injected clock without one."""
    of = getattr(clock, "uncertainty", None)
    return 0.0 if of is None else max(0.0, float(of()))


def parse_state(value: Any) -> dict[str, Any] | None:
    """A deferred run's pacing state as it came back (``None`` when absent). Raises ``ValueError``
    saying what is wrong for a malformed one (the caller logs it and paces the run afresh)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping, got {type(value).__name__}")
    since, turn = value.get("since"), value.get("turn")
    for name, v in (("since", since), ("turn", turn)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"{name!r} must be a finite number or null")
    if since is None:
        raise ValueError("'since' is missing")
    return {"since": float(since), "turn": None if turn is None else float(turn)}


def pace(
    locks: Locks,
    key: str,
    *,
    rate: tuple[int, float],
    burst: int | None,
    max_wait: float | None,
    max_countdown: float,
    state: Mapping[str, Any] | None = None,
    now: float | None = None,
    consume: bool = True,
    shadow: bool = False,
    cost: int = 1,
) -> Pace:
    """Decide whether a run under ``rate`` for the rate key ``key`` goes now (see the module doc).

    Args:
        locks: the :class:`~taskguard.Locks` holding the rate (:meth:`Locks.throttle`).
        key: the rate key (``str``).
        rate: ``(count, period seconds)``, validated (:func:`taskguard.validate.check_rate`).
        burst: cost units that may pass at once (``None``: ``cost``).
        max_wait: longest a run may wait for its turn, seconds, counted from its first deferral
            (``None``: no bound).
        max_countdown: the longest one deferral may last, seconds (what the broker tolerates for
            a delayed message).
        state: what the deferred run carried back (:func:`parse_state`), or ``None`` for a
            fresh run.
        now: Unix epoch seconds (default: the backend's clock, :meth:`Locks.server_clock`, so that a
            deferred run's booked turn means the same on every host, whatever their wall clocks;
            a booked turn is then reached once the clock, less its ``uncertainty()``, passes it).
        consume: ``False``: only check — the answer says what would happen, nothing is counted
            or booked.
        shadow: count (and book) in the rate's shadow state (:meth:`Locks.throttle`), never in
            the enforced one: shadow mode.
        cost: the run's cost in cost units (``int`` >= 1, default 1).

    Returns a :class:`Pace`. Raises ConfigError for a ``cost`` above ``burst`` (the run could
    never pass), LeaseBackendError when Redis fails.
    """
    margin = 0.0
    if now is None:
        clock = locks.server_clock()
        now = clock.time()
        margin = _uncertainty(clock)
    turn = state is not None and state.get("turn") is not None
    if turn:
        # its turn was booked when it was deferred: the rate already counted it. It goes when the
        # server's clock has surely reached its turn: the clock's reading may run ahead of the
        # server's by its uncertainty (half a round trip), so that much is waited out too
        booked = cast(Mapping[str, Any], state)
        early = cast(float, booked["turn"]) - (now - margin)
        if 0 < early <= MAX_EARLY:
            return Pace(True, countdown=early)
        if early > MAX_EARLY:  # far too early: deferred again to the turn it holds (nothing re-booked)
            return Pace(False, countdown=min(early, max_countdown), state=dict(booked), reason="rate_limited")
    since = now if state is None else state["since"]
    waited = max(0.0, now - since)
    horizon = max(0.0, max_countdown if max_wait is None else min(max_countdown, max_wait - waited))
    # (horizon 0: the run may not wait any longer, e.g. rate_max_wait=0: it goes when the rate has
    # room now and is skipped when not; nothing is booked)
    if turn:  # a booked turn: goes unless a back-off pause is on (then paced like a fresh call)
        answer = locks.rates.throttle(
            key, rate=rate, burst=burst, cost=cost, book_within=horizon, consume=consume, shadow=shadow, turn=True
        )
    else:
        answer = locks.throttle(
            key, rate=rate, burst=burst, cost=cost, book_within=horizon, consume=consume, shadow=shadow
        )
    if answer.allowed:
        return GO
    reason = "backoff" if answer.paused else "rate_limited"
    if horizon <= 0:
        return Pace(False, skip=True, reason=reason)
    if answer.booked or (not consume and answer.retry_after <= horizon):
        # the turn the server booked, as the latest instant the clock's reading allows for it (so
        # that the run, which waits for its turn's earliest instant, never goes before it)
        turn_at = now + margin + answer.retry_after
        return Pace(False, countdown=answer.retry_after, state={"since": since, "turn": turn_at}, reason=reason)
    if max_wait is not None and waited + answer.retry_after > max_wait:
        return Pace(False, skip=True, reason=reason)
    return Pace(
        False, countdown=min(answer.retry_after, max_countdown), state={"since": since, "turn": None}, reason=reason
    )


def back_off(
    locks: Locks,
    key: str,
    retry_after: Any,
    *,
    max_wait: float | None,
    max_countdown: float,
    state: Mapping[str, Any] | None = None,
    now: float | None = None,
    shadow: bool = False,
) -> Pace:
    """A run's body raised :class:`~taskguard.RateLimited` (an upstream's 429): pause the rate
    key ``key`` cluster-wide for ``retry_after`` seconds (:meth:`Locks.back_off`) and decide what
    becomes of the run: deferred past the pause (it asks the rate again then; ``state`` carries
    its first deferral, so ``max_wait`` counts from there), or skipped when the pause outlasts
    ``max_wait``. Reason ``"backoff"`` either way. ``shadow=True`` pauses the shadow state only.
    Raises ConfigError for a ``retry_after`` that is not a positive number of seconds,
    LeaseBackendError when Redis fails."""
    now = locks.server_clock().time() if now is None else now
    since = now if state is None else state["since"]
    pause = locks.back_off(key, retry_after, shadow=shadow)
    if max_wait is not None and max(0.0, now - since) + pause > max_wait:
        return Pace(False, skip=True, reason="backoff")
    return Pace(False, countdown=min(pause, max_countdown), state={"since": since, "turn": None}, reason="backoff")


@dataclasses.dataclass(slots=True)
class _Charge:
    locks: Locks
    key: str
    rate: tuple[int, float]
    cost: int  # what the rate has been charged for this run so far
    shadow: bool


_charges: contextvars.ContextVar[tuple[_Charge, ...]] = contextvars.ContextVar("taskguard_charges", default=())


class charging:
    """``with charging(locks, key, rate, cost):`` — the body run inside was admitted under
    ``rate`` for the rate key ``key`` at ``cost`` units; :func:`settle_cost` corrects that.
    Adapters wrap a paced body in it (context-local: a thread or asyncio task sees its own)."""

    __slots__ = ("charge", "_token")

    def __init__(self, locks: Locks, key: str, rate: tuple[int, float], cost: int, shadow: bool = False) -> None:
        self.charge = _Charge(locks, key, rate, cost, shadow)

    def __enter__(self) -> None:
        self._token = _charges.set((*_charges.get(), self.charge))

    def __exit__(self, *exc: Any) -> None:
        _charges.reset(self._token)


def settle_cost(actual: int) -> int:
    """From a guarded body with ``rate=`` (and ``cost=``): report the call's actual cost (``int``
    >= 0, cost units; e.g. the tokens an LLM response reports) when it differs from the cost the
    run was admitted with. The rate state is corrected by the difference
    (:meth:`Locks.settle_cost`): an overrun delays later runs, a refund lets them sooner. Settling
    twice corrects against the last settled value. Returns the difference applied (``int``).

    Raises ConfigError outside a body paced under a rate, or for an ``actual`` that is not an
    ``int`` from 0 to 10**9; LeaseBackendError when Redis fails."""
    charges = _charges.get()
    if not charges:
        raise ConfigError(
            "settle_cost() is called from the body of a guarded task with rate= (or inside "
            "taskguard.pacing.charging); use Locks.settle_cost elsewhere"
        )
    if isinstance(actual, bool) or not isinstance(actual, int) or not 0 <= actual <= MAX_COST:
        raise ConfigError(f"settle_cost: the actual cost must be an int from 0 to {MAX_COST}, got {actual!r}")
    c = charges[-1]
    by = actual - c.cost
    if by:
        c.locks.settle_cost(c.key, rate=c.rate, by=by, shadow=c.shadow)
        c.cost = actual
    return by


def shadow_reason(
    locks: Locks,
    key: str,
    *,
    rate: tuple[int, float],
    burst: int | None,
    max_wait: float | None,
    max_countdown: float,
    task: str | None,
    cost: int = 1,
) -> str | None:
    """Shadow mode (``enforce=False``): would a run under ``rate`` for the rate key ``key`` have been
    deferred or skipped now? Decided by :func:`pace` exactly as for an enforced run, but counted in
    the rate's *shadow state* (a separate key: ``throttle(..., shadow=True)``), so that for a given
    sequence of arrivals each run's answer is the first decision enforcement would have made for
    it (a would-be deferral books its turn there, as an enforced one does), while the enforced
    rate is never consumed. (Enforcement would then bring deferred runs back, changing the
    sequence; shadow mode does not imitate that.) A would-be deferral or skip is reported
    (``skip`` event, reason ``"rate_limited"`` or ``"backoff"``, ``shadow=True``) and its reason
    returned; ``None`` when the run would have gone ahead. Never raises for Redis: an error is
    logged and answers ``None`` (the run goes ahead either way); a ``cost`` above the burst is
    reported as ``"rate_limited"``."""
    try:
        answer = pace(
            locks, key, rate=rate, burst=burst, max_wait=max_wait, max_countdown=max_countdown, shadow=True, cost=cost
        )
    except LeaseBackendError as e:
        logging.getLogger("taskguard").warning(
            "%s: shadow mode: the rate %r could not be checked (%s)", task or "run", key, e
        )
        return None
    except ConfigError as e:  # a cost that could never pass: enforcement would fail the run
        logging.getLogger("taskguard").warning("%s: shadow mode: %s", task or "run", e)
        answer = Pace(False, skip=True)
    if answer.go:
        return None
    locks.report_skip(Skipped(key=key, reason=answer.reason, task=task), shadow=True)
    return answer.reason
