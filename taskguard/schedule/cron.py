"""Cron expressions in a time zone: which UTC instants a crontab names, by Vixie cron's rules.

A crontab names *local* times (minute, hour, day of month, month, day of week) in one zone;
a periodic schedule needs *instants* (Unix seconds), the same on every host. At a daylight-saving
change the mapping is not one to one, and this module follows Vixie cron (for changes of less
than 3 hours):

* a local time that occurs once fires once;
* a repeated local time (autumn) fires at both instants for a *wildcard-hour* entry (hour field
  ``*`` or ``*/n``: it runs at every real instant whose local time matches) and at the first only
  for a fixed-hour one;
* a skipped local time (the spring gap) does not fire for a wildcard-hour entry, and fires at the
  first instant after the gap for a fixed-hour one.

:class:`CronFields` holds the expanded fields; :func:`parse_cron` reads a five-field expression
(``"*/15 9-17 * * mon-fri"``). :func:`cron_instants` and :func:`cron_next` do the arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from datetime import date, datetime, timedelta, timezone, tzinfo

from ..errors import ConfigError

__all__ = ["CronFields", "parse_cron", "cron_instants", "cron_next", "CRON_SEARCH_DAYS"]

#: Days searched for a crontab's next instant (a crontab that never fires, e.g. 31 February).
CRON_SEARCH_DAYS = 5 * 366


@dataclasses.dataclass(frozen=True)
class CronFields:
    """The expanded fields of a crontab.

    Attributes:
        minute: minutes 0-59. hour: hours 0-23. day_of_month: 1-31. month_of_year: 1-12.
        day_of_week: 0-6, 0 = Sunday.
        wildcard_hour: the hour field is a wildcard (``*``, ``*/2``): the entry runs at every real
            instant its fields match, also twice in a repeated hour (see the module docstring).
        day_or: a day matches when its day of month *or* its day of week does (Vixie cron, when
            both fields are restricted); ``False``: both must match (Celery's ``crontab``).
    """

    minute: frozenset[int]
    hour: frozenset[int]
    day_of_month: frozenset[int]
    month_of_year: frozenset[int]
    day_of_week: frozenset[int]
    wildcard_hour: bool = True
    day_or: bool = False

    def day_matches(self, day: date) -> bool:
        """Does the (local) date ``day`` match the day and month fields?"""
        if day.month not in self.month_of_year:
            return False
        dom, dow = day.day in self.day_of_month, day.isoweekday() % 7 in self.day_of_week
        return (dom or dow) if self.day_or else (dom and dow)


_NAMES = {
    3: {
        n: i
        for i, n in enumerate(
            ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), start=1
        )
    },
    4: {n: i for i, n in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))},
}
_BOUNDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
_FIELDS = ("minute", "hour", "day of month", "month", "day of week")


def _field(text: str, index: int) -> frozenset[int]:
    lo, hi = _BOUNDS[index]
    names = _NAMES.get(index, {})

    def number(s: str) -> int:
        value = names.get(s.lower()) if not s.isdigit() else int(s)
        if value is None or not lo <= value <= hi:
            raise ValueError(s)
        return value

    out: set[int] = set()
    for part in text.split(","):
        rng, _, step_text = part.partition("/")
        step = int(step_text) if step_text else 1
        if step < 1 or (step_text and not step_text.isdigit()):
            raise ValueError(part)
        if rng == "*":
            first, last = lo, hi
        elif "-" in rng:
            a, b = rng.split("-", 1)
            first, last = number(a), number(b)
            if first > last:
                raise ValueError(part)
        else:
            first = number(rng)
            last = hi if step_text else first
        out.update(range(first, last + 1, step))
    if index == 4 and 7 in out:  # 7 is Sunday too
        out = (out - {7}) | {0}
    return frozenset(out)


def parse_cron(expr: str) -> CronFields:
    """Parse a five-field cron expression (minute hour day-of-month month day-of-week; numbers,
    ``*``, ranges ``a-b``, steps ``/n``, lists ``a,b``, English month and day names, day of week 0
    or 7 = Sunday). As in Vixie cron, when both day fields are restricted a day matching either
    runs. Raises ConfigError naming the field that is wrong."""
    if not isinstance(expr, str):
        raise ConfigError(f"a cron expression must be a str, got {type(expr).__name__}")
    parts = expr.split()
    if len(parts) != 5:
        raise ConfigError(f"a cron expression has 5 fields (minute hour day-of-month month day-of-week), got {expr!r}")
    fields = []
    for i, text in enumerate(parts):
        try:
            fields.append(_field(text, i))
        except ValueError:
            lo, hi = _BOUNDS[i]
            raise ConfigError(
                f"cron expression {expr!r}: bad {_FIELDS[i]} field {text!r} (numbers {lo}-{hi}, "
                "'*', ranges a-b, steps /n, lists a,b)"
            ) from None
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    return CronFields(
        minute,
        hour,
        day_of_month,
        month_of_year,
        day_of_week,
        wildcard_hour=parts[1].startswith("*"),
        day_or=not parts[2].startswith("*") and not parts[4].startswith("*"),
    )


def _offset(tz: tzinfo, ts: float) -> timedelta:
    return datetime.fromtimestamp(ts, tz).utcoffset() or timedelta(0)


def _gap_end(tz: tzinfo, before: float, after: float) -> float:
    """The first second (Unix) of the new offset, for a change between ``before`` (old offset)
    and ``after`` (new offset)."""
    lo, hi = math.floor(before), math.ceil(after)
    new = _offset(tz, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _offset(tz, mid) == new:
            hi = mid
        else:
            lo = mid
    return float(hi)


def _fires(tz: tzinfo, wall: datetime, wild: bool) -> list[float]:
    """The UTC instants (Unix seconds, ascending) at which the local time ``wall`` (naive) of
    ``tz`` is due, by the rules of the module docstring."""
    first = wall.replace(tzinfo=tz, fold=0).timestamp()
    second = wall.replace(tzinfo=tz, fold=1).timestamp()
    if first == second:
        return [first]
    if datetime.fromtimestamp(first, tz).replace(tzinfo=None) == wall:  # repeated: fold 0 is the earlier
        return [first, second] if wild else [first]
    return [] if wild else [_gap_end(tz, second, first)]  # skipped (in a gap fold 1 is the earlier)


def _walls(fields: CronFields, start: datetime, days: int) -> Iterator[datetime]:
    """The local times (naive, ascending, whole minutes) at or after ``start`` that match the
    fields, over at most ``days`` days."""
    hours, minutes = sorted(fields.hour), sorted(fields.minute)
    day = start.date()
    for _ in range(days):
        if fields.day_matches(day):
            for h in hours:
                for m in minutes:
                    wall = datetime(day.year, day.month, day.day, h, m)
                    if wall >= start:
                        yield wall
        day += timedelta(days=1)


def _naive_utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc).replace(tzinfo=None)


def cron_instants(fields: CronFields, tz: tzinfo, after: float, until: float) -> list[float]:
    """The UTC instants (Unix seconds, ascending) in ``(after, until]`` at which the crontab is
    due in the zone ``tz``."""
    if until <= after:
        return []
    offs = (_offset(tz, after), _offset(tz, until))
    lo = _naive_utc(after) + min(offs) - timedelta(minutes=1)
    hi = _naive_utc(until) + max(offs)
    out: set[float] = set()
    for wall in _walls(fields, lo.replace(second=0, microsecond=0), (hi.date() - lo.date()).days + 1):
        if wall > hi:
            break
        out.update(t for t in _fires(tz, wall, fields.wildcard_hour) if after < t <= until)
    return sorted(out)


def cron_next(fields: CronFields, tz: tzinfo, after: float) -> float | None:
    """The first UTC instant (Unix seconds) after ``after`` at which the crontab is due in ``tz``,
    or ``None`` when it is not due within :data:`CRON_SEARCH_DAYS`."""
    lo = _naive_utc(after) + min(_offset(tz, after), _offset(tz, after + 86400.0)) - timedelta(minutes=1)
    best = None
    for wall in _walls(fields, lo.replace(second=0, microsecond=0), CRON_SEARCH_DAYS):
        fires = _fires(tz, wall, fields.wildcard_hour)
        if best is not None and fires and fires[0] > best:
            break  # the first instant of a later local time only grows: nothing earlier follows
        for t in fires:
            if t > after and (best is None or t < best):
                best = t
    return best
