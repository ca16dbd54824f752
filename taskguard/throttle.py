"""Cluster-wide rates: the :class:`Throttle` answer and the algorithm both backends share.

A rate ``count`` per ``period`` seconds is enforced with the generic cell rate algorithm (GCRA):
one value per rate key, the theoretical arrival time (TAT) of the next call. A call at ``now``
passes when ``max(TAT, now) - tau <= now`` and moves TAT on by one emission interval
(``period / count``); ``tau = (burst - 1) x interval`` lets ``burst`` calls pass at once. Over any
window of ``t`` seconds at most ``burst + t / interval`` calls pass, whatever the number of
callers. Redis runs it in one script against its own clock (:data:`taskguard.scripts.THROTTLE`);
:class:`~taskguard.MemoryLocks` runs :func:`gcra` here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .backend import Backend, RateVerdict
from .validate import check_burst, check_key, check_rate, check_seconds

__all__ = ["Throttle", "Rates", "gcra"]


@dataclasses.dataclass(frozen=True)
class Throttle:
    """The answer of :meth:`taskguard.Locks.throttle`.

    Attributes:
        allowed: ``True`` when this call passed (and counted).
        retry_after: seconds (float) until a call could pass (0 when allowed). When ``booked``,
            the caller's own turn: come back then and go ahead without asking again.
        remaining: further calls that could pass right now (0 when denied).
        booked: the call was denied but its turn was reserved ``retry_after`` from now (see
            ``book_within``), so denied callers get distinct turns instead of coming back at once.
    """

    allowed: bool
    retry_after: float
    remaining: int
    booked: bool = False

    def __bool__(self) -> bool:
        return self.allowed


def gcra(
    tat_us: int | None, now_us: int, interval_us: int, tau_us: int, book_us: int
) -> tuple[int, int, int, int | None]:
    """One GCRA decision. Returns ``(code, wait µs, remaining, new TAT or None)``: code 1 passed,
    0 denied, 2 denied and booked; a new TAT to store, or ``None`` to leave it."""
    tat = max(tat_us or 0, now_us)
    wait = tat - tau_us - now_us
    new_tat = tat + interval_us
    if wait <= 0:
        return 1, 0, max((now_us + tau_us - new_tat) // interval_us + 1, 0), new_tat
    if 0 < book_us and wait <= book_us:
        return 2, wait, 0, new_tat
    return 0, wait, 0, None


class Rates:
    """The rate policy over a :class:`~taskguard.backend.Backend`: :meth:`taskguard.Locks.throttle`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def throttle(
        self,
        key: str,
        *,
        rate: Any,
        burst: int | None = None,
        book_within: float = 0.0,
        consume: bool = True,
        shadow: bool = False,
    ) -> Throttle:
        """See :meth:`taskguard.Locks.throttle`."""
        count, period = check_rate(rate)
        burst = 1 if burst is None else check_burst(burst)
        book = check_seconds("book_within", book_within, allow_zero=True)
        interval_us = max(int(round(period / count * 1e6)), 1)
        reply = self.backend.throttle(
            check_key(key),
            interval_us,
            (burst - 1) * interval_us,
            int(book * 1e6) if consume else 0,
            consume,
            bool(shadow),
        )
        return Throttle(
            allowed=reply.verdict is RateVerdict.ALLOWED,
            retry_after=reply.wait_us / 1e6,
            remaining=reply.remaining,
            booked=reply.verdict is RateVerdict.BOOKED,
        )
