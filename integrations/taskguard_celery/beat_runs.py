"""The worker's side of a beat message (the ``taskguard_beat`` header): its slot and its entry's
guard options. Imports no scheduler (the slot protocol is :mod:`taskguard.schedule`)."""

from __future__ import annotations

from typing import Any

from taskguard.policy import GuardOptions
from taskguard.schedule.options import apply_entry_options
from taskguard.schedule.periodic import slot_run

__all__ = ["entry_guard", "beat_run"]


def entry_guard(task: Any, opts: GuardOptions, header: dict) -> GuardOptions:
    """The guard options of a run published for a beat entry: the task's own, with the entry's
    ``key`` / ``ttl`` / ``limit`` / ``rate`` / ``rate_key`` / ``overlap`` (``options["taskguard"]`` in the
    schedule) when it gives them. A bad entry option is logged and the task's own value is used
    (:func:`taskguard.schedule.options.apply_entry_options`)."""
    return apply_entry_options(opts, header, task.run, task.name, cache=type(task))


def beat_run(header: dict) -> tuple[str, float] | None:
    """``(run id, seconds to remember it finished)`` of a beat message's slot, or ``None`` when
    the header does not name one: every message published for one slot has the same run id
    (``beat:<entry>:<slot>``), so a slot published twice runs once."""
    return slot_run(header)
