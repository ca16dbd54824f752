"""Celery's schedules as slot schedules of the periodic core (:mod:`taskguard.schedule.slots`).

* ``celery.schedules.schedule`` (every N seconds): :class:`~taskguard.schedule.slots.Interval`,
  epoch-aligned windows.
* ``crontab``: :class:`~taskguard.schedule.slots.Cron`, its fields read in its own zone (the app's
  ``timezone``, or its ``nowfun``'s), Vixie cron's rules at daylight-saving changes; an entry whose
  hour field is a wildcard runs at every real instant its fields match.
* anything else with ``remaining_estimate`` (solar): :class:`~taskguard.schedule.slots.Search`
  over it, UTC instants throughout (a solar entry's instants within 60 s name one slot).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery.schedules import schedule, solar

from taskguard.schedule.cron import CronFields
from taskguard.schedule.slots import SEARCH_SLACK, Cron, Interval, Schedule, Search

__all__ = ["slot_schedule", "latest_due", "slot_id"]


def _zone(sched: Any) -> Any:
    """The zone a non-interval schedule reads its fields in: its own clock's."""
    return sched.maybe_make_aware(sched.now()).tzinfo


def _is_crontab(sched: Any) -> bool:
    return all(hasattr(sched, f) for f in ("hour", "minute", "day_of_week", "day_of_month", "month_of_year"))


def slot_schedule(sched: Any) -> Schedule:
    """The core schedule of a Celery schedule, as of now (a crontab's zone and a searched
    schedule's base instant are read from the schedule's clock once, here)."""
    if isinstance(sched, schedule):
        return Interval(sched.run_every.total_seconds())
    if _is_crontab(sched):
        wild = str(getattr(sched, "_orig_hour", "*")).strip().startswith("*")
        fields = CronFields(
            frozenset(sched.minute),
            frozenset(sched.hour),
            frozenset(sched.day_of_month),
            frozenset(sched.month_of_year),
            frozenset(sched.day_of_week),
            wildcard_hour=wild,
        )
        return Cron(fields, _zone(sched))
    base = sched.maybe_make_aware(sched.now())  # remaining_estimate counts from the schedule's clock
    base_ts = base.timestamp()

    def next_after(t_ts: float) -> float:
        # in UTC seconds (an aware local datetime plus a timedelta is wall-clock arithmetic, an hour
        # off across a DST change), whole seconds (remaining_estimate reads the clock again)
        t = datetime.fromtimestamp(t_ts, timezone.utc).astimezone(base.tzinfo)  # the schedule's own zone
        return float(round(base_ts + sched.remaining_estimate(t).total_seconds()))

    return Search(next_after, SEARCH_SLACK if isinstance(sched, solar) else 0.0)


def latest_due(entry: Any, lookback: float, now_ts: float | None = None) -> tuple[float | None, float]:
    """``(instant, next_in)``: the latest instant (Unix seconds) at which the beat ``entry`` fell
    due, at most ``lookback`` seconds before ``now_ts`` (``None`` when none did), and the seconds
    until its next one. ``now_ts`` default: the schedule's own clock. Raises what the schedule
    raises (``NotImplementedError`` for one without ``remaining_estimate``)."""
    sched = entry.schedule
    if now_ts is None:
        now_ts = sched.maybe_make_aware(sched.now()).timestamp()
    return slot_schedule(sched).latest(now_ts, lookback)


def slot_id(entry: Any, instant: float) -> str:
    """The slot name of the beat ``entry``'s run due at ``instant`` (Unix seconds)."""
    return slot_schedule(entry.schedule).slot_id(instant)
