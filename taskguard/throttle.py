"""Cluster-wide rates: the :class:`Throttle` answer and the algorithm both backends share.

A rate ``count`` cost units per ``period`` seconds is enforced with the generic cell rate
algorithm (GCRA), weighted: one value per rate key, the theoretical arrival time (TAT) of the next
cost unit. A call of cost ``c`` at ``now`` passes when ``max(TAT, now) - tau <= now`` and moves TAT
on by ``c`` emission intervals (``period / count`` each); ``tau = (burst - c) x interval`` lets
``burst`` cost units pass at once. Over any window of ``t`` seconds at most ``burst + t / interval``
cost units pass, whatever the number of callers and however the costs are mixed. A call costing
more than ``burst`` could never pass and is refused (ConfigError). With ``cost=1`` (the default)
this is the unweighted GCRA: each call counts 1.

A *back-off pause* (:meth:`taskguard.Locks.back_off`, after an upstream answered 429) is kept in
the same value: until it ends no call passes, and a denied call books its turn after it. A
booked turn is re-checked against the pause before its run starts (``turn=True``).

Redis runs it in one script against its own clock (:data:`taskguard.scripts.THROTTLE`);
:class:`~taskguard.MemoryLocks` runs :func:`gcra` here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .backend import Backend, RateMode, RateVerdict
from .errors import ConfigError
from .validate import MAX_COST, check_burst, check_cost, check_key, check_rate, check_seconds

__all__ = ["Throttle", "Rates", "RateMode", "gcra"]


@dataclasses.dataclass(frozen=True)
class Throttle:
    """The answer of :meth:`taskguard.Locks.throttle`.

    Attributes:
        allowed: ``True`` when this call passed (and counted).
        retry_after: seconds (float) until a call could pass (0 when allowed). When ``booked``,
            the caller's own turn: come back then and go ahead without taking another turn
            (:mod:`taskguard.pacing` re-checks a back-off pause first).
        remaining: further cost units that could pass right now (0 when denied); with
            ``cost=1``, further calls.
        booked: the call was denied but its turn was reserved ``retry_after`` from now (see
            ``book_within``), so denied callers get distinct turns instead of coming back at once.
        paused: the call was denied because a back-off pause is on for the key
            (:meth:`taskguard.Locks.back_off`); ``retry_after`` is at least the pause's remainder.
    """

    allowed: bool
    retry_after: float
    remaining: int
    booked: bool = False
    paused: bool = False

    def __bool__(self) -> bool:
        return self.allowed


def gcra(
    stored: int | None,
    pause: int | None,
    now_us: int,
    interval_us: int,
    tau_us: int,
    book_us: int,
    mode: RateMode = RateMode.CALL,
    cost: int = 1,
) -> tuple[int, int, int, bool, tuple[int, int] | None]:
    """One weighted GCRA decision, as the Redis script makes it (the memory backend's copy).

    ``stored`` the TAT kept for the key (µs or ``None``), ``pause`` when its back-off pause ends
    (µs or ``None``); ``tau_us`` is ``(burst - cost) x interval``; ``book_us`` the booking horizon
    (mode PAUSE: the pause's length). Returns ``(code, wait µs, remaining units, paused, store)``:
    code 1 passed, 0 denied, 2 denied and booked; ``store`` the ``(TAT, pause end)`` to keep, or
    ``None`` to leave the state as it is."""
    stored, pause = stored or 0, pause or 0
    if mode is RateMode.PAUSE:
        end = max(pause, now_us + book_us)
        return 0, end - now_us, 0, True, (max(stored, now_us), end)
    if mode is RateMode.SETTLE:
        return 1, 0, 0, False, (max(max(stored, now_us) + cost * interval_us, now_us), pause)
    paused = pause > now_us
    if mode is RateMode.TURN and not paused:
        return 1, 0, 0, False, None
    tat = max(stored, now_us, pause)
    wait = max(tat - tau_us - now_us, pause - now_us)
    new_tat = tat + interval_us * cost
    if wait <= 0:
        keep = None if mode is RateMode.PEEK else (new_tat, pause)
        return 1, 0, max((now_us + tau_us - tat) // interval_us, 0), False, keep
    if 0 < book_us and wait <= book_us and mode is not RateMode.PEEK:
        return 2, wait, 0, paused, (new_tat, pause)
    return 0, wait, 0, paused, None


class Rates:
    """The rate policy over a :class:`~taskguard.backend.Backend`: :meth:`taskguard.Locks.throttle`,
    :meth:`~taskguard.Locks.settle_cost` and :meth:`~taskguard.Locks.back_off`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def throttle(
        self,
        key: str,
        *,
        rate: Any,
        burst: int | None = None,
        cost: int = 1,
        book_within: float = 0.0,
        consume: bool = True,
        shadow: bool = False,
        turn: bool = False,
    ) -> Throttle:
        """See :meth:`taskguard.Locks.throttle`; ``turn=True`` re-checks a booked turn (it passes,
        counting nothing, unless a back-off pause is on: then it is a call like any other)."""
        count, period = check_rate(rate)
        cost = check_cost(cost)
        burst = cost if burst is None else check_burst(burst)
        if cost > burst:
            raise ConfigError(
                f"a call of cost {cost} can never pass a rate whose burst is {burst} (cost units): "
                f"raise burst to at least {cost} or split the call"
            )
        book = check_seconds("book_within", book_within, allow_zero=True)
        interval_us = max(int(round(period / count * 1e6)), 1)
        reply = self.backend.throttle(
            check_key(key),
            interval_us,
            (burst - cost) * interval_us,
            int(book * 1e6) if consume else 0,
            consume,
            bool(shadow),
            cost,
            RateMode.TURN if turn else RateMode.CALL,
        )
        return Throttle(
            allowed=reply.verdict is RateVerdict.ALLOWED,
            retry_after=reply.wait_us / 1e6,
            remaining=reply.remaining,
            booked=reply.verdict is RateVerdict.BOOKED,
            paused=reply.paused,
        )

    def settle(self, key: str, *, rate: Any, by: int, shadow: bool = False) -> None:
        """See :meth:`taskguard.Locks.settle_cost`."""
        count, period = check_rate(rate)
        if isinstance(by, bool) or not isinstance(by, int) or abs(by) > MAX_COST:
            raise ConfigError(
                f"settle_cost's by must be an int from -{MAX_COST} to {MAX_COST} (cost units), got {by!r}"
            )
        if by:
            self.backend.throttle(
                check_key(key), max(int(round(period / count * 1e6)), 1), 0, 0, True, bool(shadow), by, RateMode.SETTLE
            )

    def back_off(self, key: str, seconds: Any, *, shadow: bool = False) -> float:
        """See :meth:`taskguard.Locks.back_off`."""
        pause = check_seconds("retry_after", seconds)
        reply = self.backend.throttle(
            check_key(key), 1, 0, max(int(pause * 1e6), 1), True, bool(shadow), 1, RateMode.PAUSE
        )
        return reply.wait_us / 1e6
