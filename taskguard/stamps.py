"""Publish stamps: which publish of a run id a delivery belongs to.

A stamp, ``"<publish time, ms, hex>.<random>"``, is made for every publish of a run (a call, a
retry, a replacement, a chain step) and kept by every copy of that publish (a broker redelivery,
a deferred copy); the pipeline records finished runs per (run id, stamp)
(:attr:`taskguard.pipeline.Execution.stamp`), so a new publish of an id is never taken for a copy
of an earlier one. An adapter carries it in its messages (Celery: the ``taskguard_publish``
header).

This module imports no task framework.
"""

from __future__ import annotations

import secrets
import time
from datetime import datetime, timezone
from typing import Any

__all__ = ["CLOCK_SKEW", "new_stamp", "stamp_time", "predates"]

#: Clock difference between hosts allowed when a recorded outcome's time is compared with a
#: publish stamp, seconds.
CLOCK_SKEW = 1.0


def new_stamp() -> str:
    """A publish stamp: publish time in ms (hex), a dot, 32 random bits."""
    return f"{int(time.time() * 1000):x}.{secrets.token_hex(4)}"


def stamp_time(stamp: Any) -> float | None:
    """The publish time (Unix epoch seconds) in a stamp, or ``None`` for anything else."""
    if not isinstance(stamp, str) or "." not in stamp:
        return None
    try:
        return int(stamp.split(".", 1)[0], 16) / 1000.0
    except ValueError:
        return None


def predates(done: Any, stamp: Any) -> bool:
    """Was an outcome recorded at ``done`` (a ``datetime`` or an ISO 8601 string; naive: UTC)
    recorded before the publish ``stamp`` (by more than :data:`CLOCK_SKEW`), so that it is the
    outcome of an earlier publish of the run id? ``False`` when either is unknown (an unstamped
    publish, a client without taskguard: the run id decides)."""
    published = stamp_time(stamp)
    if published is None or done is None:
        return False
    try:
        done_dt = done if isinstance(done, datetime) else datetime.fromisoformat(str(done))
    except ValueError:
        return False
    if done_dt.tzinfo is None:
        done_dt = done_dt.replace(tzinfo=timezone.utc)
    return done_dt.timestamp() < published - CLOCK_SKEW
