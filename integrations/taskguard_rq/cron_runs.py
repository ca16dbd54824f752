"""The worker's side of a job enqueued by ``taskguard rq-cron``: its slot and its entry's guard
options, read from ``job.meta``. Imports no scheduler (the slot protocol is :mod:`taskguard.schedule`).

The scheduler (:mod:`taskguard_rq.cron`) enqueues each slot's job with
``job.meta["taskguard_cron"]`` = the slot's header (:meth:`taskguard.schedule.Slot.header`:
``entry``, ``slot``, ``leader_key``, ``leader_fence``, ``keep`` and the entry's guard options).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from taskguard.policy import GuardOptions
from taskguard.schedule.options import apply_entry_options

__all__ = ["CRON_META_KEY", "cron_header", "entry_guard"]

#: ``job.meta`` entry of a job enqueued for a slot: the slot's header (a JSON-safe dict).
CRON_META_KEY = "taskguard_cron"


def cron_header(job: Any) -> Mapping[str, Any] | None:
    """The slot header a cron job carries in ``job.meta["taskguard_cron"]``, or ``None`` (not a
    job of ``taskguard rq-cron``, or no job)."""
    meta = getattr(job, "meta", None) if job is not None else None
    header = meta.get(CRON_META_KEY) if isinstance(meta, dict) else None
    return header if isinstance(header, Mapping) else None


def entry_guard(job: Any, fn: Callable[..., Any], name: str, opts: GuardOptions) -> GuardOptions:
    """The guard options of ``job``'s execution: the job function's own (``opts``), with its cron
    entry's ``key`` / ``ttl`` / ``limit`` / ``rate`` / ``rate_key`` / ``overlap`` laid over them when the job
    was enqueued for a slot that gives them (:func:`taskguard.schedule.options.apply_entry_options`:
    a bad option is logged and the function's own value kept). ``fn``: the job's body, whose
    signature the key templates bind to; ``name``: the job's label, for the log."""
    header = cron_header(job)
    if header is None:
        return opts
    return apply_entry_options(opts, header, fn, name, cache=fn)
