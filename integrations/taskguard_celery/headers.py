"""The message headers taskguard writes, and how a request exposes them."""

from __future__ import annotations

import secrets
import time
from typing import Any

__all__ = [
    "HEADER",
    "BEAT_HEADER",
    "DEFER_HEADER",
    "PUBLISH_HEADER",
    "RATE_HEADER",
    "UNIQUE_HEADER",
    "new_publish_stamp",
    "publish_time",
    "read_header",
]

#: The handle of a lease kept for a retry, ``{"key", "owner", "fence", "expires"}``, plus ``"skips"``
#: (``on_skip="retry"`` attempts so far).
HEADER = "taskguard"
#: Header of messages published by the taskguard beat scheduler (see :mod:`taskguard_celery.beat`).
BEAT_HEADER = "taskguard_beat"
#: Header of a copy taskguard re-published to look again later while another execution of its task
#: id runs: ``{"chain", "nonce", "redelivered"}`` (see :mod:`taskguard_celery.identity`).
DEFER_HEADER = "taskguard_defer"
#: Stamp of one publish of a guarded task: ``"<publish time, ms, hex>.<random>"``. Every publish
#: through ``GuardedTask.apply_async`` (a call, a retry, a replacement, a chain step) gets a new one;
#: a broker redelivery and taskguard's deferred copies keep it. Finished runs are recorded per
#: (task id, stamp), so a new publish of an id is never taken for a copy of an earlier one.
PUBLISH_HEADER = "taskguard_publish"
#: Header of a message published with ``unique=True``: the key it marked queued (the worker clears
#: the mark when the run starts, is skipped or revoked).
UNIQUE_HEADER = "taskguard_unique"
#: Header of a run deferred by its task's ``rate``: ``{"since", "turn"}`` (see :mod:`taskguard.pacing`).
RATE_HEADER = "taskguard_rate"


def new_publish_stamp() -> str:
    """A publish stamp (see :data:`PUBLISH_HEADER`): publish time in ms (hex), a dot, 32 random bits."""
    return f"{int(time.time() * 1000):x}.{secrets.token_hex(4)}"


def publish_time(stamp: Any) -> float | None:
    """The publish time (Unix epoch seconds) in a stamp, or ``None`` for anything else."""
    if not isinstance(stamp, str) or "." not in stamp:
        return None
    try:
        return int(stamp.split(".", 1)[0], 16) / 1000.0
    except ValueError:
        return None


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
