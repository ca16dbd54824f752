"""The closed vocabularies of a guarded run, as ``str`` enums.

Each member *is* its string (``Reason.HELD == "held"``, ``str(Reason.HELD) == "held"``), so code
and users comparing with plain strings keep working. What leaves the process — a stored result
(a pickled :class:`~taskguard.Skipped`), an event, a message header, RQ's job meta — carries the
plain value (:func:`plain`): a reader running an older release could not unpickle an enum it
does not have (a rolling deploy).
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["Reason", "RunState", "OnSkip", "OnLost", "Overlap", "Ending", "plain"]


class _Value(str, enum.Enum):
    def __str__(self) -> str:  # "held", not "Reason.HELD", in messages and logs
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    @classmethod
    def of(cls, value: Any) -> Any:
        """The member whose value is ``value``, else ``value`` itself (a string this release
        does not know: consumers accept any)."""
        try:
            return cls(value)
        except ValueError:
            return value


class Reason(_Value):
    """Why a run did not run (or, in shadow mode, would not have): see :class:`~taskguard.Skipped`."""

    HELD = "held"
    LIMIT = "limit"
    LIMIT_TOTAL = "limit_total"
    WAIT_TIMEOUT = "wait_timeout"
    RATE_LIMITED = "rate_limited"
    BACKOFF = "backoff"
    ONCE = "once"
    RETRY_EXHAUSTED = "retry_exhausted"
    DUPLICATE = "duplicate"
    RUNNING = "running"
    STALE_LEADER = "stale_leader"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    COALESCED = "coalesced"
    REPLACED = "replaced"
    DEBOUNCED = "debounced"
    UNREPLICATED = "unreplicated"  # the lease was not on enough replicas in time (``replicas=``)


class Ending(_Value):
    """How an execution that does not run its body ends (:class:`taskguard.settlement.Settlement`)."""

    RESULT = "result"  # it returns a value: the Skipped, or a once value stored earlier
    RAISE = "raise"  # it fails with TaskSkipped
    IGNORE = "ignore"  # it ends without a result (Celery's Ignore)
    RETRY = "retry"  # it runs again later, without consuming the task's own retries


class RunState(_Value):
    """Where a :class:`~taskguard.run.GuardedRun` is in its lifecycle."""

    NEW = "new"
    RUNNING = "running"
    SKIPPED = "skipped"
    FINISHED = "finished"
    HANDED_BACK = "handed_back"
    KEPT = "kept"


class OnSkip(_Value):
    """What a run that cannot get its lease does (:data:`taskguard.policy.ON_SKIP`)."""

    RESULT = "result"
    IGNORE = "ignore"
    RETRY = "retry"
    RAISE = "raise"


class OnLost(_Value):
    """What a run whose lease was lost while its body ran does (:data:`taskguard.policy.ON_LOST`)."""

    RAISE = "raise"
    WARN = "warn"


class Overlap(_Value):
    """What a run does when its key's lease is held (:data:`taskguard.policy.OVERLAP`)."""

    SKIP = "skip"
    COALESCE = "coalesce"
    REPLACE = "replace"
    ALLOW = "allow"


def plain(value: Any) -> Any:
    """``value`` as a plain ``str`` when it is one of these enums (for what is stored, sent or
    pickled), else unchanged."""
    return value.value if isinstance(value, enum.Enum) else value
