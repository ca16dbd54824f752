"""Pacing a run under a cluster-wide rate: run now, come back at a booked turn, or give up.

The task adapters call :func:`pace` before a run takes its lease, with the state its deferred
message carries (Celery: the ``taskguard_rate`` header; RQ: ``job.meta``), and translate the
answer into their framework: a re-published message (Celery) or a job rescheduled through RQ's
scheduler, in both cases without consuming the task's own retries.

* A run whose rate has room goes ahead (the call counts against the rate).
* A denied run *books* its turn when that turn is no further than the run may wait (the broker's
  tolerance for a delayed message, and what is left of ``rate_max_wait``): the rate key's
  theoretical arrival time moves on for it, so denied runs get distinct turns (no herd), and the
  deferred run goes ahead at its turn without asking again.
* A turn beyond the broker's tolerance is not booked: the run comes back after that tolerance and
  asks again.
* A run that would wait past ``rate_max_wait`` (counted from its first deferral) is skipped
  (reason ``"rate_limited"``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from .errors import LeaseBackendError
from .locks import Locks
from .skipped import Skipped

__all__ = ["Pace", "pace", "parse_state", "shadow_check"]


@dataclasses.dataclass(frozen=True)
class Pace:
    """The answer of :func:`pace`.

    Attributes:
        go: run now — after ``countdown`` seconds when it is > 0 (a deferred run that came back
            a little before its booked turn, e.g. through a scheduler that counts whole seconds).
        skip: give up: the run would wait past ``max_wait`` (reason ``"rate_limited"``).
        countdown: when deferred: seconds (float) until the deferred run comes back.
        state: what the deferred run must carry back (a JSON-safe dict: ``since``, the Unix
            epoch seconds of its first deferral, and ``turn``, the epoch seconds of its booked
            turn or ``None`` when it must ask again).
    """

    go: bool
    skip: bool = False
    countdown: float = 0.0
    state: dict[str, Any] | None = None


GO = Pace(True)
#: The longest a run that came back before its booked turn waits for it in place, seconds; one
#: that came back earlier than that (a clock step) goes at once: its turn is booked either way.
MAX_EARLY = 2.0


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
) -> Pace:
    """Decide whether a run under ``rate`` for the rate key ``key`` goes now (see the module doc).

    Args:
        locks: the :class:`~taskguard.Locks` holding the rate (:meth:`Locks.throttle`).
        key: the rate key (``str``).
        rate: ``(count, period seconds)``, validated (:func:`taskguard.validate.check_rate`).
        burst: calls that may pass at once (``None``: 1).
        max_wait: longest a run may wait for its turn, seconds, counted from its first deferral
            (``None``: no bound).
        max_countdown: the longest one deferral may last, seconds (what the broker tolerates for
            a delayed message).
        state: what the deferred run carried back (:func:`parse_state`), or ``None`` for a
            fresh run.
        now: Unix epoch seconds (default: the backend's clock, :meth:`Locks.server_clock`, so that a
            deferred run's booked turn means the same on every host, whatever their wall clocks).
        consume: ``False``: only check — the answer says what would happen, nothing is counted
            or booked.
        shadow: count (and book) in the rate's shadow state (:meth:`Locks.throttle`), never in
            the enforced one: shadow mode.

    Returns a :class:`Pace`. Raises LeaseBackendError when Redis fails.
    """
    now = locks.server_clock().time() if now is None else now
    if state is not None and state.get("turn") is not None:
        # its turn was booked when it was deferred: the rate already counted it
        early = state["turn"] - now
        return Pace(True, countdown=early) if 0 < early <= MAX_EARLY else GO
    since = now if state is None else state["since"]
    waited = max(0.0, now - since)
    horizon = max(0.0, max_countdown if max_wait is None else min(max_countdown, max_wait - waited))
    # (horizon 0: the run may not wait any longer, e.g. rate_max_wait=0: it goes when the rate has
    # room now and is skipped when not; nothing is booked)
    answer = locks.throttle(key, rate=rate, burst=burst, book_within=horizon, consume=consume, shadow=shadow)
    if answer.allowed:
        return GO
    if horizon <= 0:
        return Pace(False, skip=True)
    if answer.booked or (not consume and answer.retry_after <= horizon):
        return Pace(False, countdown=answer.retry_after, state={"since": since, "turn": now + answer.retry_after})
    if max_wait is not None and waited + answer.retry_after > max_wait:
        return Pace(False, skip=True)
    return Pace(False, countdown=min(answer.retry_after, max_countdown), state={"since": since, "turn": None})


def shadow_check(
    locks: Locks,
    key: str,
    *,
    rate: tuple[int, float],
    burst: int | None,
    max_wait: float | None,
    max_countdown: float,
    task: str | None,
) -> bool:
    """Shadow mode (``enforce=False``): would a run under ``rate`` for the rate key ``key`` have been
    deferred or skipped now? Decided by :func:`pace` exactly as for an enforced run, but counted in
    the rate's *shadow state* (a separate key: ``throttle(..., shadow=True)``), so that for a given
    sequence of arrivals each run's answer is the first decision enforcement would have made for
    it (a would-be deferral books its turn there, as an enforced one does), while the enforced
    rate is never consumed. (Enforcement would then bring deferred runs back, changing the
    sequence; shadow mode does not imitate that.) A would-be deferral or skip is reported
    (``skip`` event, reason ``"rate_limited"``, ``shadow=True``). Never raises: a Redis error is
    logged and answers ``False`` (the run goes ahead either way)."""
    import logging

    try:
        answer = pace(locks, key, rate=rate, burst=burst, max_wait=max_wait, max_countdown=max_countdown, shadow=True)
    except LeaseBackendError as e:
        logging.getLogger("taskguard").warning(
            "%s: shadow mode: the rate %r could not be checked (%s)", task or "run", key, e
        )
        return False
    if answer.go:
        return False
    locks.report_skip(Skipped(key=key, reason="rate_limited", task=task), shadow=True)
    return True
