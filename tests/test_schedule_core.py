"""The periodic-schedule core (taskguard.schedule) on its own: slot arithmetic, settings, entry
options, and the leader lease / fenced slot claims against real Redis, with a plain adapter (no
Celery, no RQ)."""

from __future__ import annotations

import itertools
import math
import re
import sys
import time
from datetime import datetime, timezone
from zoneinfo import ZoneInfo

import pytest
import redis

from taskguard import ConfigError, LeaseLost, RedisLocks
from taskguard.clock import FixedClock
from taskguard.heartbeat import get_heartbeat
from taskguard.keys import KeyTemplate
from taskguard.policy import GuardOptions
from taskguard.schedule import (
    Cron,
    Interval,
    PeriodicEntry,
    PeriodicScheduler,
    Search,
    SettingNames,
    apply_entry_options,
    check_entry_options,
    parse_cron,
    schedule_settings,
    slot_run,
)
from taskguard.schedule.claims import read_record
from taskguard.schedule.cron import cron_instants, cron_next

UTC = timezone.utc
NAMES = SettingNames(leader_ttl="leader_ttl", catch_up="catch_up", name="name", loop="loop", role="sched")


def ts(*args):
    return datetime(*args, tzinfo=UTC).timestamp()


def hm(instants):
    return [datetime.fromtimestamp(t, UTC).strftime("%H:%M") for t in instants]


# -- slot arithmetic ------------------------------------------------------------------------------------
def test_interval_slots_are_epoch_aligned_windows():
    every = Interval(10)
    assert every.latest(1003.5, 5.0) == (1000.0, 6.5)  # 3.5 s late, next window in 6.5 s
    assert every.latest(1007.5, 5.0) == (None, 2.5)  # beyond the lookback: none
    assert every.slot_id(1000.0) == "every10s:100" and every.slot_id(999.9999) == "every10s:100"
    assert every.count_between(1000.0, 1050.0) == 4  # 1010 .. 1040
    assert every.count_between(1050.0, 1000.0) == 0
    assert every.keep == 300.0 and Interval(3600).keep == 7200.0 and every.slack == 0.0
    assert Interval(0).seconds == 0.001  # below a millisecond counts as one


def test_cron_expressions_parse_like_vixie_cron():
    f = parse_cron("*/15 9-17 * jan,JUL mon-fri")
    assert f.minute == {0, 15, 30, 45} and f.hour == set(range(9, 18)) and f.month_of_year == {1, 7}
    assert f.day_of_week == {1, 2, 3, 4, 5} and not f.wildcard_hour and not f.day_or
    assert parse_cron("0 * * * 7").day_of_week == {0} and parse_cron("0 */2 * * *").wildcard_hour
    assert parse_cron("5/20 0 1 * *").minute == {5, 25, 45}
    both = parse_cron("0 0 13 * 5")  # the 13th or a Friday (both day fields restricted)
    assert both.day_or
    fri = datetime(2026, 3, 6).date()
    assert both.day_matches(fri) and both.day_matches(datetime(2026, 3, 13).date())
    assert not both.day_matches(datetime(2026, 3, 7).date())
    for bad, field in (
        ("60 * * * *", "minute"),
        ("* 24 * * *", "hour"),
        ("* * 0 * *", "day of month"),
        ("* * * 13 *", "month"),
        ("* * * * 8", "day of week"),
        ("*/0 * * * *", "minute"),
        ("5-1 * * * *", "minute"),
    ):
        with pytest.raises(ConfigError, match=f"bad {field} field"):
            parse_cron(bad)
    with pytest.raises(ConfigError, match="5 fields"):
        parse_cron("* * * *")


def test_cron_instants_follow_vixie_rules_across_daylight_saving_changes():
    paris = ZoneInfo("Europe/Paris")
    spring = (ts(2026, 3, 28, 23, 50), ts(2026, 3, 29, 3, 10))  # 02:00 CET -> 03:00 CEST
    fall = (ts(2026, 10, 24, 23, 50), ts(2026, 10, 25, 3, 10))  # 03:00 CEST -> 02:00 CET
    # a fixed-hour job skipped by the gap runs right after it (03:00 CEST = 01:00 UTC)
    assert hm(cron_instants(parse_cron("30 2 * * *"), paris, *spring)) == ["01:00"]
    # a wildcard-hour job: its local time inside the gap does not exist
    assert hm(cron_instants(parse_cron("30 * * * *"), paris, *spring)) == ["00:30", "01:30", "02:30"]
    # the repeated hour: a fixed-hour job once, a wildcard-hour job at every real instant
    assert hm(cron_instants(parse_cron("30 2 * * *"), paris, *fall)) == ["00:30"]
    assert hm(cron_instants(parse_cron("0 * * * *"), paris, *fall)) == ["00:00", "01:00", "02:00", "03:00"]
    every = cron_instants(parse_cron("* * * * *"), paris, *fall)
    assert len(every) == 200 and all(b - a == 60 for a, b in itertools.pairwise(every))
    # the next instant, and None for a crontab that never fires
    assert cron_next(parse_cron("30 2 * * *"), paris, spring[0]) == ts(2026, 3, 29, 1, 0)
    assert cron_next(parse_cron("0 0 31 2 *"), paris, spring[0]) is None


def test_cron_schedule_names_utc_instants_of_its_zone():
    cron = Cron(parse_cron("0 9 * * *"), ZoneInfo("America/New_York"))
    now = ts(2026, 7, 1, 13, 0, 30)  # 09:00:30 EDT
    assert cron.latest(now, 60.0) == (ts(2026, 7, 1, 13, 0), 86400.0 - 30.0)
    assert cron.latest(now, 10.0)[0] is None
    assert cron.slot_id(ts(2026, 7, 1, 13, 0)) == f"at:{int(ts(2026, 7, 1, 13, 0))}"
    assert cron.count_between(ts(2026, 7, 1, 12), ts(2026, 7, 4, 13)) == 3  # the 1st, 2nd and 3rd, not the 4th
    assert cron.keep == 90000.0


def test_searched_schedule_walks_its_next_instants():
    def next_after(t):  # every 7 s, from the epoch
        return float((math.floor(t / 7) + 1) * 7)

    s = Search(next_after, slack=60.0)
    assert s.latest(100.0, 20.0) == (98.0, 5.0)
    assert s.latest(100.0, 1.0) == (None, 5.0)
    assert s.count_between(0.0, 71.0) == 10 and s.slot_id(98.0) == "at:98" and s.slack == 60.0

    def unknown(t):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        Search(unknown).latest(100.0, 20.0)


# -- settings and entry options -------------------------------------------------------------------------
def test_settings_defaults_and_refusals_name_the_setting():
    s = schedule_settings(NAMES, default_name="app", loop_interval=1.0)
    assert (s.leader_ttl, s.catch_up, s.name, s.allowed_lateness) == (30.0, 33.0, "app", 33.0)
    assert schedule_settings(NAMES, catch_up=0, default_name="app", loop_interval=1.0).allowed_lateness == 3.0
    for kwargs, says in (
        ({"leader_ttl": -1}, "leader_ttl: "),
        ({"leader_ttl": 4000}, "leader_ttl must be at most"),
        ({"leader_ttl": 1.5}, "at least twice the sched loop interval (1 s, loop)"),
        ({"catch_up": float("nan")}, "catch_up: "),
        ({"name": " "}, "name must be a non-empty str"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)):
            schedule_settings(NAMES, default_name="app", loop_interval=1.0, **kwargs)


def _body(tenant, day=None):
    return tenant


def test_entry_options_are_checked_once_at_start_and_laid_over_the_tasks_at_run():
    out = check_entry_options(
        "entry 'e'", {"key": "r:{tenant}", "ttl": 5, "rate": (2, 60), "rate_key": "t:{tenant}"}, _body
    )
    assert out["rate"] == [2, 60]  # JSON-safe for the message
    for bad, says in (
        ({"ttl": 0.001}, "ttl"),
        ({"limit": 0}, "limit"),
        ({"rate": "x"}, "rate"),
        ({"rate_key": "k"}, "rate_key needs rate"),
        ({"key": ""}, "key must be"),
        ({"key": "r:{nope}"}, "key: "),
        ({"tll": 5}, "must be a dict with keys"),
    ):
        with pytest.raises(ConfigError, match=f"entry 'e': .*{says}"):
            check_entry_options("entry 'e'", bad, _body)
    task = GuardOptions.build(_body, name="report")
    guard = apply_entry_options(
        task,
        {"entry": "e", "slot": "at:1", "ttl": 7, "limit": 2, "rate": [1, 60], "key": "r:{tenant}"},
        _body,
        "report",
    )
    assert (guard.ttl, guard.limit, guard.rate) == (7.0, 2, (1, 60.0))
    assert guard.key.render(("t1",), {}) == "r:t1" and guard.rate_key.render(("t1",), {}) == "report"
    kept = apply_entry_options(task, {"ttl": -1, "limit": 3, "rate_key": "x"}, _body, "report")
    assert kept.ttl == task.ttl and kept.limit == 3 and kept.rate_key is None  # bad fields dropped, alone
    assert apply_entry_options(task, {"entry": "e"}, _body, "report") is task
    assert isinstance(guard.key, KeyTemplate)


# -- the protocol against real Redis --------------------------------------------------------------------------
class ListAdapter:
    """Publishes into a list; ``fail`` raises that many times, ``crash`` raises a BaseException
    (a process dying between claim and confirm) once."""

    def __init__(self, entries):
        self._entries, self.published, self.fail, self.crash = entries, [], 0, False

    def entries(self):
        return list(self._entries)

    def publish(self, entry, slot):
        if self.crash:
            self.crash = False
            self.published.append(slot.header())
            raise KeyboardInterrupt("dies after publishing, before confirming")
        if self.fail:
            self.fail -= 1
            raise ConnectionError("broker unreachable (injected)")
        self.published.append(slot.header())
        return slot.id


@pytest.fixture
def core_env(redis_url, prefix):
    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix)
    now = [1_000_000.5]
    made = []

    def make(entries, loop=1.0, leader_ttl=30, catch_up=None):
        settings = schedule_settings(
            NAMES, leader_ttl=leader_ttl, catch_up=catch_up, default_name="core", loop_interval=loop
        )
        adapter = ListAdapter(entries)
        s = PeriodicScheduler(locks, settings, adapter=adapter, clock=FixedClock(lambda: now[0]), role="sched")
        made.append(s)
        return s, adapter

    yield locks, now, make
    for s in made:
        if s.lease is not None:
            get_heartbeat().discard(s.lease)
        s.close()
    locks.close(timeout=2)


def test_two_schedulers_publish_each_slot_once_and_the_first_after_start(core_env):
    locks, now, make = core_env
    entry = PeriodicEntry("e", Interval(10), {"ttl": 5})
    a, pa = make([entry])
    b, pb = make([entry])
    for _ in range(60):  # 30 s, both ticking every 0.5 s
        a.tick(), b.tick()
        now[0] += 0.5
    slots = [h["slot"] for h in pa.published + pb.published]
    assert slots == ["every10s:100001", "every10s:100002", "every10s:100003"]  # not 100000, the start's window
    assert (a.lease is None) != (b.lease is None) and not (pa.published and pb.published)
    header = (pa.published or pb.published)[0]
    leader = a if a.lease is not None else b
    assert header["leader_key"] == "sched-leader:core" and header["leader_fence"] == leader.lease.fencing_token
    assert header["ttl"] == 5 and header["keep"] == 300.0
    assert slot_run(header) == ("beat:e:every10s:100001", 300.0)
    assert slot_run({"entry": "e"}) is None and slot_run({"entry": "e", "slot": "s", "keep": -1})[1] == 300.0
    record = read_record(locks, "sched-leader:core", "e")
    assert (record.instant, record.state) == (1_000_030.0, "published")


def test_a_failed_publish_is_tried_again_and_a_crash_after_claim_is_published_again_by_the_next_leader(core_env):
    locks, now, make = core_env
    entry = PeriodicEntry("e", Interval(10))
    a, pa = make([entry])
    a.tick()
    now[0] = 1_000_010.2
    pa.fail = 1
    a.tick()  # claimed, the publish failed: looked at again within a second, not at the next slot
    assert pa.published == [] and a.stats["unpublished_slots"] == 1
    assert a.due(entry) == (False, pytest.approx(1.0, abs=0.1))
    now[0] += 1.0
    time.sleep(1.0)  # the retry delay runs on the monotonic clock
    a.tick()
    assert [h["slot"] for h in pa.published] == ["every10s:100001"] and a.stats["republished_slots"] == 1
    # the leader dies after publishing the next slot, before confirming it
    now[0] = 1_000_020.3
    pa.crash = True
    with pytest.raises(KeyboardInterrupt):
        a.tick()
    assert read_record(locks, "sched-leader:core", "e").state == "claimed"
    get_heartbeat().discard(a.lease)
    a.lease.release()  # as if its TTL ran out
    b, pb = make([entry])
    now[0] += 1.0
    b.tick()
    assert [h["slot"] for h in pb.published] == ["every10s:100002"] and b.stats["republished_slots"] == 1
    assert slot_run(pa.published[-1])[0] == slot_run(pb.published[-1])[0]  # one run identity: the slot runs once
    assert pb.published[-1]["leader_fence"] > pa.published[-1]["leader_fence"]
    assert read_record(locks, "sched-leader:core", "e").state == "published"


def test_a_scheduler_that_lost_its_lease_cannot_claim_and_a_new_leader_catches_up(core_env):
    locks, now, make = core_env
    entry = PeriodicEntry("e", Interval(10))
    a, pa = make([entry], leader_ttl=6)
    b, pb = make([entry], leader_ttl=6)
    a.tick(), b.tick()
    old = a.lease or b.lease
    first, second = (a, b) if a.lease is not None else (b, a)
    locks.force_release(old.key)  # taken away behind its back (an expiry, an operator)
    with pytest.raises(LeaseLost):
        old.put_record("slot:e", "1.0 claimed 1 x")
    get_heartbeat().discard(old)
    second.tick()  # the other one leads now
    assert second.lease is not None and second.lease.fencing_token > old.fencing_token
    now[0] = 1_000_010.0 + 8.0  # the slot fell due 8 s ago: within the catch-up window (6 + 1 + 2 = 9 s)
    first.tick(), second.tick()
    published = pa.published + pb.published
    assert [h["slot"] for h in published] == ["every10s:100001"]
    assert published[0]["leader_fence"] == second.lease.fencing_token
    # a gap longer than the window: only the latest slot (if within it) goes, the others are counted
    now[0] = 1_000_060.5
    second.tick()
    assert [h["slot"] for h in pa.published + pb.published][-1] == "every10s:100006"
    assert second.stats["missed_slots"] == 4  # 100002 .. 100005


def test_the_core_imports_no_task_framework():
    import subprocess

    code = (
        "import sys, taskguard.schedule, taskguard.schedule.periodic, taskguard.schedule.options; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu', 'rq')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
