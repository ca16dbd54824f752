"""The framework-free periodic-schedule core: several scheduler processes, each due slot published once.

* :mod:`~taskguard.schedule.slots` and :mod:`~taskguard.schedule.cron`: which instant is due and
  its slot name (epoch-aligned intervals; crontabs in a time zone, Vixie cron's DST rules).
* :mod:`~taskguard.schedule.claims`: slot claims fenced by the leader lease.
* :mod:`~taskguard.schedule.periodic`: the leader lease, claim/publish/confirm, catch-up, and the
  interface an adapter implements (:class:`ScheduleAdapter`).
* :mod:`~taskguard.schedule.settings`: the settings, checked at start.
* :mod:`~taskguard.schedule.options`: an entry's guard options (the task option model).

Celery beat (``taskguard_celery.beat``) adapts to it; nothing here imports a task framework.
"""

from .cron import CronFields, parse_cron
from .options import ENTRY_OPTIONS, apply_entry_options, check_entry_options
from .periodic import PeriodicEntry, PeriodicScheduler, ScheduleAdapter, Slot, slot_run
from .settings import ScheduleSettings, SettingNames, schedule_settings
from .slots import Cron, Interval, Schedule, Search

__all__ = [
    "Cron",
    "CronFields",
    "ENTRY_OPTIONS",
    "Interval",
    "PeriodicEntry",
    "PeriodicScheduler",
    "Schedule",
    "ScheduleAdapter",
    "ScheduleSettings",
    "Search",
    "SettingNames",
    "Slot",
    "apply_entry_options",
    "check_entry_options",
    "parse_cron",
    "schedule_settings",
    "slot_run",
]
