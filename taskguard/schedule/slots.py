"""Slots: which instant of a periodic schedule is due, and its name.

A *slot* is one due run of one entry: the entry's name and the instant (Unix seconds, the same on
every host) it fell due at. Every scheduler process computes the slot from the schedule and the
clock alone, never from its own memory of the last run, so that schedulers started at different
moments (or a follower taking over) name the same slot:

* :class:`Interval`: every ``seconds``, on window starts aligned to the epoch
  (``floor(now / seconds) * seconds``); slot ``"every<seconds>s:<window number>"``.
* :class:`Cron`: a crontab's instants in one configured time zone (:mod:`taskguard.schedule.cron`,
  Vixie cron's rules at daylight-saving changes); slot ``"at:<Unix second>"``.
* :class:`Search`: any schedule that can say when it is next due after a given instant (Celery's
  solar events); slot ``"at:<Unix second>"``, with a slack within which two answers name one slot.

Each implements :class:`Schedule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import tzinfo
from typing import Protocol

from .cron import CronFields, cron_instants, cron_next

__all__ = ["Schedule", "Interval", "Cron", "Search", "MAX_WALK", "SEARCH_SLACK", "SLOT_KEEP_MIN", "DAY_KEEP"]

#: Most schedule instants walked to find the latest due one (a week of an every-minute schedule).
MAX_WALK = 20000
#: Seconds within which two instants of a searched schedule (solar events) name one slot: the
#: numeric search answers a second apart from different starts.
SEARCH_SLACK = 60.0
#: Seconds a finished slot's run is remembered by the worker, at least.
SLOT_KEEP_MIN = 300.0
#: Seconds a finished slot's run of a cron or searched schedule is remembered (25 h).
DAY_KEEP = 90000.0


class Schedule(Protocol):
    """The slot arithmetic of one entry's schedule. Instants are Unix seconds (float)."""

    #: Seconds within which two instants name one slot (0: exact instants).
    slack: float
    #: Seconds a worker remembers that a slot's run finished (so that a slot published again
    #: after a hand-over runs once).
    keep: float

    def latest(self, now: float, lookback: float) -> tuple[float | None, float]:
        """``(instant, next_in)``: the latest instant at which the schedule fell due, at most
        ``lookback`` seconds before ``now`` (``None`` when none did), and the seconds until the
        next one. May raise ``NotImplementedError`` (a schedule that cannot name its instants)."""
        ...

    def count_between(self, after: float, before: float, cap: int = 10000) -> int:
        """How many instants fell due strictly between ``after`` and ``before``, at most ``cap``."""
        ...

    def slot_id(self, instant: float) -> str:
        """The slot name of the run due at ``instant``."""
        ...


class Interval:
    """Every ``seconds`` (float, > 0; below 1 ms counts as 1 ms), on epoch-aligned window starts."""

    slack = 0.0

    def __init__(self, seconds: float) -> None:
        self.seconds = max(float(seconds), 0.001)
        self.keep = max(2 * self.seconds, SLOT_KEEP_MIN)

    def latest(self, now: float, lookback: float) -> tuple[float | None, float]:
        window = math.floor(now / self.seconds)
        instant = window * self.seconds
        return (instant if now - instant <= lookback else None), (window + 1) * self.seconds - now

    def count_between(self, after: float, before: float, cap: int = 10000) -> int:
        if before <= after:
            return 0
        return max(min(round((before - after) / self.seconds) - 1, cap), 0)

    def slot_id(self, instant: float) -> str:
        return f"every{self.seconds:g}s:{round(instant / self.seconds)}"

    def __repr__(self) -> str:
        return f"Interval({self.seconds:g})"


class Cron:
    """A crontab (:class:`~taskguard.schedule.cron.CronFields`) read in the time zone ``tz``."""

    slack = 0.0
    keep = DAY_KEEP

    def __init__(self, fields: CronFields, tz: tzinfo) -> None:
        self.fields, self.tz = fields, tz

    def latest(self, now: float, lookback: float) -> tuple[float | None, float]:
        due = cron_instants(self.fields, self.tz, now - lookback, now)
        nxt = cron_next(self.fields, self.tz, now)
        return (due[-1] if due else None), (3600.0 if nxt is None else nxt - now)

    def count_between(self, after: float, before: float, cap: int = 10000) -> int:
        if before <= after:
            return 0
        return min(len(cron_instants(self.fields, self.tz, after, before - 0.5)), cap)

    def slot_id(self, instant: float) -> str:
        return f"at:{int(round(instant))}"

    def __repr__(self) -> str:
        return f"Cron({self.fields!r}, {self.tz!r})"


class Search:
    """A schedule known by ``next_after(t) -> float``: its first instant after ``t`` (both Unix
    seconds; whole seconds, so that repeated searches agree); it may raise
    ``NotImplementedError``. ``slack``: seconds within which two instants name one slot."""

    keep = DAY_KEEP

    def __init__(self, next_after: Callable[[float], float], slack: float = 0.0) -> None:
        self.next_after, self.slack = next_after, float(slack)

    def latest(self, now: float, lookback: float) -> tuple[float | None, float]:
        t, latest, nxt = now - lookback, None, None
        for _ in range(MAX_WALK):
            nxt = self.next_after(t)
            if nxt > now or nxt <= t:
                break
            latest, t = nxt, nxt
        next_in = max(nxt - now, 0.0) if nxt is not None and nxt > now else 1.0
        return latest, next_in

    def count_between(self, after: float, before: float, cap: int = 10000) -> int:
        if before <= after:
            return 0
        t, n = after, 0
        while n < cap:
            nxt = self.next_after(t)
            if nxt <= t or nxt >= before - 0.5:
                break
            n, t = n + 1, nxt
        return n

    def slot_id(self, instant: float) -> str:
        return f"at:{int(round(instant))}"
