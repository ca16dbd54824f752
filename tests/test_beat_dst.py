"""Beat across daylight-saving changes: the real ``-S taskguard`` scheduler's tick loop on a
simulated clock (``app.now``, the clock Celery's scheduler and schedules read), real Redis.

Expected instants are derived here, independently of the scheduler: a minute-by-minute
simulation of Vixie cron over ``zoneinfo`` local times (:func:`vixie`), and ``ephem`` for solar
events. Vixie cron's rules for a change of less than 3 hours: a wildcard job runs on the new local
time at once (every real instant whose local time matches, also through a repeated hour); a
fixed-time job does not run again in a repeated local time, and a job whose local time was
skipped by a spring-forward gap runs right after the gap. Here an entry is a wildcard one when its
hour field is (``"*"``, ``"*/2"``): an entry for fixed hours runs once per local time.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import Celery, signals
from celery._state import get_current_app
from celery.schedules import crontab, solar

from taskguard import RedisLocks
from taskguard.clock import FixedClock
from taskguard_celery.beat import TaskguardScheduler

UTC = timezone.utc
MINUTE = timedelta(minutes=1)


def say(*parts):
    print("   ", *parts, flush=True)


def utc(*args):
    return datetime(*args, tzinfo=UTC)


def vixie(minutes, hours, zone, start, end):
    """UTC instants in ``(start, end]`` at which Vixie cron (stepping every real minute) runs a job
    ``minutes`` / ``hours`` (sets; ``hours=None``: the wildcard ``*``) in ``zone``."""
    tz = ZoneInfo(zone)

    def wall(t):
        return t.astimezone(tz).replace(tzinfo=None)

    out, high = [], None
    t, prev = start + MINUTE, wall(start)
    while t <= end:
        w = wall(t)
        if hours is None:
            candidates = [w]
        elif high is not None and w <= high:
            candidates = []  # the clock went back: fixed-time jobs wait until it catches up
        elif w - prev > MINUTE:  # the clock jumped forward: fixed-time jobs of the skipped minutes run now
            candidates = [prev + MINUTE * k for k in range(1, (w - prev) // MINUTE + 1)]
        else:
            candidates = [w]
        if any(c.minute in minutes and (hours is None or c.hour in hours) for c in candidates):
            out.append(t)
        prev, high = w, w if high is None else max(high, w)
        t += MINUTE
    return out


def fmt(instants):
    return [f"{t:%H:%M}" for t in instants]


# The transitions of 2026: (zone, label, start, end) with the change inside the window.
TRANSITIONS = [
    ("Europe/Paris", "fall", utc(2026, 10, 24, 23, 50), utc(2026, 10, 25, 3, 10)),  # 03:00 CEST -> 02:00 CET
    ("Europe/Paris", "spring", utc(2026, 3, 28, 23, 50), utc(2026, 3, 29, 3, 10)),  # 02:00 CET -> 03:00 CEST
    ("America/New_York", "fall", utc(2026, 11, 1, 4, 50), utc(2026, 11, 1, 8, 10)),  # 02:00 EDT -> 01:00 EST
    ("America/New_York", "spring", utc(2026, 3, 8, 5, 50), utc(2026, 3, 8, 9, 10)),  # 02:00 EST -> 03:00 EDT
    ("Australia/Lord_Howe", "fall", utc(2026, 4, 4, 13, 20), utc(2026, 4, 4, 16, 40)),  # 02:00 +11 -> 01:30 +10:30
    ("Australia/Lord_Howe", "spring", utc(2026, 10, 3, 13, 50), utc(2026, 10, 3, 17, 10)),  # 02:00 +10:30 -> 02:30 +11
]

# (name, crontab fields, minutes, hours) — hours None: a wildcard hour field
ENTRIES = [
    ("every-minute", {"minute": "*"}, set(range(60)), None),
    ("quarter", {"minute": "*/15"}, {0, 15, 30, 45}, None),
    ("hourly-45", {"minute": "45"}, {45}, None),
    ("at-1-45", {"minute": "45", "hour": "1"}, {45}, {1}),
    ("at-2-15", {"minute": "15", "hour": "2"}, {15}, {2}),
    ("at-2-30", {"minute": "30", "hour": "2"}, {30}, {2}),
    ("hour-2-every-10", {"minute": "*/10", "hour": "2"}, {0, 10, 20, 30, 40, 50}, {2}),
]


class SimClock:
    """The simulated clock: ``app.now`` returns it (aware, in the app's zone), and so does the
    scheduler's ``taskguard_clock`` (a :class:`taskguard.clock.FixedClock` over it)."""

    def __init__(self, app, start):
        self.app, self.t = app, start

    def now(self):
        return self.t.astimezone(self.app.timezone)


def run_beat(tmp_path, redis_url, prefix, zone, entries, start, end, loop=5.0):
    """Drive the real TaskguardScheduler's ``tick()`` from ``start`` to ``end`` on a simulated
    clock, advancing it by the delay each tick asks for. Returns ``{entry name: [slot instants]}``
    of every message published (read from the published messages' ``taskguard_beat`` header)."""
    app = Celery("dst", set_as_current=False, broker="memory://")
    app.conf.timezone = zone
    app.conf.beat_max_loop_interval = loop
    app.conf.taskguard_beat_leader_ttl = 60
    client = redis.Redis.from_url(redis_url)
    app.conf.taskguard_locks = RedisLocks(client, prefix=prefix)
    app.conf.beat_schedule = {name: {"task": "t", "schedule": sched} for name, sched in entries.items()}
    clock = SimClock(app, start + timedelta(seconds=1))
    app.now = clock.now
    # current too: the persistent schedule's entries are unpickled without their app, and their
    # schedules then read the current app's clock (as in a real ``celery beat``)
    previous = get_current_app()
    app.set_current()
    published: dict = {name: [] for name in entries}

    def on_publish(sender=None, headers=None, **kw):
        beat = (headers or {}).get("taskguard_beat")
        if beat and beat["entry"] in published:
            instant = datetime.fromtimestamp(int(beat["slot"].split(":")[1]), UTC)
            if instant <= end:
                published[beat["entry"]].append(instant)

    signals.after_task_publish.connect(on_publish, weak=False)
    # the scheduler's own clock (slot instants, lateness; by default the Redis server's) runs on
    # the same simulated time
    s = TaskguardScheduler(
        app,
        schedule_filename=str(tmp_path / f"beat-{zone.replace('/', '_')}"),
        taskguard_clock=FixedClock(lambda: clock.t.timestamp()),
    )
    ticks = 0
    try:
        while clock.t < end + timedelta(seconds=loop + 1):
            delay = s.tick()
            ticks += 1
            clock.t += timedelta(seconds=max(delay, 0.05))  # a tick takes some time, as in a real loop
    finally:
        signals.after_task_publish.disconnect(on_publish)
        s.close()
        previous.set_current()
        client.close()
    say(f"{zone} {start:%Y-%m-%d %H:%M} .. {end:%H:%M} UTC: {ticks} ticks, stats {dict(s.taskguard_stats)}")
    return published


def test_the_oracle_matches_hand_made_tables():
    """The expected instants (derived from zoneinfo and Vixie's rules) against a few hand-made ones."""
    start, end = utc(2026, 10, 24, 23, 50), utc(2026, 10, 25, 3, 10)
    every = vixie(set(range(60)), None, "Europe/Paris", start, end)
    assert len(every) == 200 and all(b - a == MINUTE for a, b in itertools.pairwise(every))  # every real minute
    assert fmt(vixie({30}, {2}, "Europe/Paris", start, end)) == ["00:30"]  # 02:30 CEST only
    assert fmt(vixie({0}, None, "Europe/Paris", start, end)) == ["00:00", "01:00", "02:00", "03:00"]
    spring = (utc(2026, 3, 28, 23, 50), utc(2026, 3, 29, 3, 10))
    assert fmt(vixie({30}, {2}, "Europe/Paris", *spring)) == ["01:00"]  # 02:30 skipped: right after the gap
    assert fmt(vixie({30}, None, "Europe/Paris", *spring)) == ["00:30", "01:30", "02:30"]
    # Lord Howe, 30-minute changes: 01:30-01:59 repeated in April, 02:00-02:29 skipped in October
    lh_fall = (utc(2026, 4, 4, 13, 20), utc(2026, 4, 4, 16, 40))
    assert fmt(vixie({45}, None, "Australia/Lord_Howe", *lh_fall)) == ["13:45", "14:45", "15:15", "16:15"]
    assert fmt(vixie({45}, {1}, "Australia/Lord_Howe", *lh_fall)) == ["14:45"]
    lh_spring = (utc(2026, 10, 3, 13, 50), utc(2026, 10, 3, 17, 10))
    assert fmt(vixie({15}, {2}, "Australia/Lord_Howe", *lh_spring)) == ["15:30"]
    assert fmt(vixie({15}, None, "Australia/Lord_Howe", *lh_spring)) == ["14:45", "16:15"]


def test_an_every_minute_crontab_runs_every_real_minute_through_the_paris_fall_back(tmp_path, redis_url, prefix):
    """Issue input: ``crontab(minute="*")``, Europe/Paris, across the 2026-10-25 fall-back, on the
    scheduler's tick loop. Before, nothing was published from 01:00 to 02:59 UTC (the next-due
    estimate parked the entry in Celery's heap until 03:00 UTC, and the repeated hour's instants
    were not found)."""
    start, end = utc(2026, 10, 24, 23, 50), utc(2026, 10, 25, 3, 10)
    got = run_beat(tmp_path, redis_url, prefix, "Europe/Paris", {"m": crontab(minute="*")}, start, end)["m"]
    expected = vixie(set(range(60)), None, "Europe/Paris", start, end)
    missing = sorted(set(expected) - set(got))
    say(f"published {len(got)}, expected {len(expected)}; missing {fmt(missing)[:5]}...{fmt(missing)[-3:]}")
    assert got == expected


@pytest.mark.parametrize("zone,label,start,end", TRANSITIONS, ids=[f"{z}-{lb}" for z, lb, _, _ in TRANSITIONS])
def test_crontab_entries_across_dst_changes_run_at_vixie_crons_instants(
    tmp_path, redis_url, prefix, zone, label, start, end
):
    """Wildcard-hour and fixed-hour entries across both 2026 changes of zones with 1 h and 30 min
    shifts, each published exactly at the instants of the independently derived table, once each."""
    entries = {name: crontab(**fields) for name, fields, _, _ in ENTRIES}
    got = run_beat(tmp_path, redis_url, prefix, zone, entries, start, end)
    bad = {}
    for name, _, minutes, hours in ENTRIES:
        expected = vixie(minutes, hours, zone, start, end)
        if got[name] != expected:
            bad[name] = (fmt(got[name])[:12], fmt(expected)[:12])
        elif name != "every-minute":
            say(f"{name}: {fmt(got[name])}")
    assert not bad, bad


def solar_events(event, lat, lon, start, end):
    """UTC instants of ``event`` (sunrise or sunset) in ``(start, end]``, from ephem directly
    (the horizon and pressure Celery documents for these events: upper limb at -0:34, no refraction)."""
    import ephem

    obs = ephem.Observer()
    obs.lat, obs.lon, obs.elevation, obs.pressure, obs.horizon = str(lat), str(lon), 0, 0, "-0:34"
    method = {"sunrise": obs.next_rising, "sunset": obs.next_setting}[event]
    out, t = [], start
    while True:
        nxt = method(ephem.Sun(), start=ephem.Date(t.replace(tzinfo=None))).datetime().replace(tzinfo=UTC)
        if nxt > end:
            return out
        out.append(nxt.replace(microsecond=0) + (timedelta(seconds=1) if nxt.microsecond >= 500000 else timedelta()))
        t = nxt + timedelta(seconds=1)


@pytest.mark.parametrize(
    "zone,lat,lon,start",
    [
        ("Europe/Paris", 48.85, 2.35, utc(2026, 10, 23, 12)),
        ("Europe/Paris", 48.85, 2.35, utc(2026, 3, 27, 12)),
        ("America/New_York", 40.71, -74.0, utc(2026, 10, 30, 12)),
        ("America/New_York", 40.71, -74.0, utc(2026, 3, 6, 12)),
        ("Australia/Lord_Howe", -31.55, 159.08, utc(2026, 4, 2, 12)),
        ("Australia/Lord_Howe", -31.55, 159.08, utc(2026, 10, 1, 12)),
    ],
    ids=["paris-fall", "paris-spring", "ny-fall", "ny-spring", "lord-howe-fall", "lord-howe-spring"],
)
def test_solar_entries_across_dst_changes_run_at_each_event_once(tmp_path, redis_url, prefix, zone, lat, lon, start):
    """Sunrise and sunset entries over four days around each change: each event published once,
    at its UTC instant (solar events do not move with the local clock)."""
    end = start + timedelta(days=4)
    entries = {ev: solar(ev, lat, lon) for ev in ("sunrise", "sunset")}
    got = run_beat(tmp_path, redis_url, prefix, zone, entries, start, end, loop=30.0)
    for ev in entries:
        expected = solar_events(ev, lat, lon, start, end)
        say(f"{ev}: {[f'{t:%m-%d %H:%M:%S}' for t in got[ev]]}")
        assert len(got[ev]) == len(expected) == 4
        assert all(abs((g - e).total_seconds()) <= 1 for g, e in zip(got[ev], expected, strict=True)), (
            got[ev],
            expected,
        )


# Public reports turned into tests: (zone, crontab fields, minutes, hours, start, end)
REPORTS = {
    # celery#10107: an hourly crontab skips the second 1 AM of the US/Pacific fall-back
    "celery-10107-hourly-fall-back": (
        "US/Pacific",
        {"minute": "0"},
        {0},
        None,
        utc(2026, 11, 1, 6, 30),
        utc(2026, 11, 1, 11, 30),
    ),
    # django-celery-beat#134, celery#9653: a daily 16:04 New York entry ran an hour late on the DST day
    "celery-9653-daily-after-spring-forward": (
        "America/New_York",
        {"minute": "4", "hour": "16"},
        {4},
        {16},
        utc(2026, 3, 7, 20, 30),
        utc(2026, 3, 8, 20, 30),
    ),
    # celery PR #10608 review: a 2-hour change (Antarctica/Troll) and a 45-minute zone (Pacific/Chatham)
    "celery-10608-troll-2h-fall-back": (
        "Antarctica/Troll",
        {"minute": "0", "hour": "23"},
        {0},
        {23},
        utc(2026, 10, 24, 20, 0),
        utc(2026, 10, 25, 23, 30),
    ),
    "celery-10608-chatham-spring-forward": (
        "Pacific/Chatham",
        {"minute": "50", "hour": "3"},
        {50},
        {3},
        utc(2026, 9, 26, 12, 0),
        utc(2026, 9, 27, 16, 0),
    ),
    # a gap at midnight (America/Santiago, first Sunday of September): 00:30 does not exist
    "santiago-midnight-gap": (
        "America/Santiago",
        {"minute": "30", "hour": "0"},
        {30},
        {0},
        utc(2026, 9, 5, 20, 0),
        utc(2026, 9, 6, 8, 0),
    ),
}


@pytest.mark.parametrize("case", list(REPORTS))
def test_reported_dst_cases_run_at_vixie_crons_instants(tmp_path, redis_url, prefix, case):
    zone, fields, minutes, hours, start, end = REPORTS[case]
    got = run_beat(tmp_path, redis_url, prefix, zone, {"e": crontab(**fields)}, start, end, loop=30.0)["e"]
    expected = vixie(minutes, hours, zone, start, end)
    say(f"{case}: published {[f'{t:%m-%d %H:%M}' for t in got]}, expected {[f'{t:%m-%d %H:%M}' for t in expected]}")
    assert expected and got == expected
