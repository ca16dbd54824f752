"""The message headers taskguard writes, and how a request exposes them."""

from __future__ import annotations

from typing import Any

from taskguard import deferral
from taskguard.stamps import new_stamp, stamp_time

__all__ = [
    "HEADER",
    "BEAT_HEADER",
    "DEFER_HEADER",
    "PUBLISH_HEADER",
    "RATE_HEADER",
    "UNIQUE_HEADER",
    "COALESCE_HEADER",
    "DEBOUNCE_HEADER",
    "new_publish_stamp",
    "publish_time",
    "read_header",
    "RUN_HEADERS",
    "without",
    "continuing",
]

#: The handle of a lease kept for a retry, ``{"key", "owner", "fence", "expires"}``, plus ``"skips"``
#: (``on_skip="retry"`` attempts so far).
HEADER = "taskguard"
#: Header of messages published by the taskguard beat scheduler (see :mod:`taskguard_celery.beat`).
BEAT_HEADER = "taskguard_beat"
#: Header of a copy taskguard re-published to look again later while another execution of its task
#: id runs: ``{"chain", "nonce", "redelivered"}`` (see :mod:`taskguard_celery.identity`).
DEFER_HEADER = "taskguard_defer"
#: Stamp of one publish of a guarded task (:mod:`taskguard.stamps`). Every publish through
#: ``GuardedTask.apply_async`` (a call, a retry, a replacement, a chain step) gets a new one; a
#: broker redelivery and taskguard's deferred copies keep it.
PUBLISH_HEADER = "taskguard_publish"
#: Header of a message published with ``unique=True``: the key it marked queued (the worker clears
#: the mark when the run starts, is skipped or revoked).
UNIQUE_HEADER = "taskguard_unique"
#: Header of a run deferred by its task's ``rate``: ``{"since", "turn"}`` (see :mod:`taskguard.pacing`).
RATE_HEADER = "taskguard_rate"
#: Header of the delayed copy a pending follow-up (``overlap="coalesce"``) sends as its key's
#: backstop: ``{"as": "backstop"}`` (see :mod:`taskguard.overlap`).
COALESCE_HEADER = "taskguard_coalesce"
#: Header of the one message of a ``debounce`` window: ``{"key": lease key}`` (see
#: :mod:`taskguard_celery.debouncing`).
DEBOUNCE_HEADER = "taskguard_debounce"


#: A new publish stamp, and a stamp's publish time (:mod:`taskguard.stamps`).
new_publish_stamp, publish_time = new_stamp, stamp_time


def read_header(request: Any, name: str = HEADER) -> Any:
    """The header ``name`` of a request, or ``None``. Custom headers are flat message headers under
    protocol 2 (``Context`` exposes them as attributes and, via ``_get_custom_headers``, in
    ``request.headers``); eager mode and protocol 1 only have ``request.headers``
    (celery/app/task.py, ``Context``)."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, name, None)
    return value


#: The headers that carry this run's state from one execution to the next (a retry's handle and
#: skip count, a deferred copy's chain, a pacing state): a new attempt is published without them,
#: then given its own.
RUN_HEADERS = (HEADER, DEFER_HEADER, RATE_HEADER)


def without(headers: Any, names: tuple[str, ...] = RUN_HEADERS) -> dict:
    """A copy of a request's ``headers`` (or ``None``) without ``names``."""
    return {k: v for k, v in (headers or {}).items() if k not in names}


def continuing(request: Any) -> dict:
    """The headers of a message that takes over this delivery's run — its retry (``self.retry()``,
    ``autoretry_for``), a skip retry or a rate turn — to keep it the same delivery: a deferred copy
    of a publish (:func:`taskguard.deferral.waits_for_another_delivery`) passes its
    ``taskguard_defer`` header on, so that the message keeps the delivery's publish stamp
    (``GuardedTask.apply_async``) and its run is still told finished by its own finished marker,
    never by the result backend's record of the task id (the other delivery's outcome). Else
    ``{}``."""
    header = read_header(request, DEFER_HEADER)
    return {DEFER_HEADER: header} if deferral.waits_for_another_delivery(deferral.carried(header)) else {}
