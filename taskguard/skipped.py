"""The explicit value of a run that did not happen because its lease could not be had."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Mapping
from typing import Any

from .values import Reason

__all__ = ["Skipped", "is_skipped", "SKIP_REASONS", "TAG"]

#: Reasons the core and the adapters use. Others may be added; consumers must accept any string.
SKIP_REASONS = tuple(r.value for r in Reason)

#: Key and value marking the dict form of a ``Skipped`` (used where a serializer knows no
#: custom types, e.g. msgpack or YAML result backends).
TAG = "__taskguard_skipped__"


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A run that was skipped, returned in place of the body's result.

    Attributes:
        key: the user's lease key (``str``); the total's key for ``"limit_total"``, the rate
            key for ``"rate_limited"`` / ``"backoff"``.
        reason: why (``"held"``: another holder has the lease; ``"limit"``: all ``limit=N``
            slots of the key are held; ``"limit_total"``: every place in the task's
            ``limit_total`` is held (the run gave its key's slot back); ``"rate_limited"``: the run
            would have waited for its turn under the task's ``rate`` past ``rate_max_wait``;
            ``"once"``: the key's work was
            completed by an earlier call (``once=True``; its stored value is returned, not this);
            ``"idempotency_conflict"``: reported by shadow mode only; ``"wait_timeout"``: ``wait``
            seconds passed without getting it; ``"retry_exhausted"``: ``on_skip="retry"`` ran
            out of attempts; ``"duplicate"``: a redelivered copy of a run that already finished;
            ``"running"``: another execution of the same run id still holds the lease;
            ``"coalesced"``: ``overlap="coalesce"``, a later call of the key superseded this one as
            the pending follow-up (``follow_up`` names it);
            ``"stale_leader"``: no longer produced — beat claims its slots against the leader
            lease now — and kept so results stored by earlier releases still read; adapters may
            add others).
        task: the task's name where known, else ``None``.
        holder_ttl: seconds (float) left on the holder's lease when the skip was decided, where
            known, else ``None``.
        at: Unix epoch seconds (float) when the skip was decided.
        follow_up: ``reason="coalesced"``: the run id (Celery task id, RQ job id) of the pending
            follow-up that superseded this call and runs in its place, else ``None``.

    It never carries an owner token. ``bool(Skipped(...))`` is ``False`` so that
    ``if result:`` does not mistake a skip for a truthy result; use :func:`is_skipped` to test.
    """

    key: str
    reason: str
    task: str | None = None
    holder_ttl: float | None = None
    at: float = dataclasses.field(default_factory=time.time)
    follow_up: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.reason, enum.Enum):  # stored and pickled as the plain string: older readers
            object.__setattr__(self, "reason", self.reason.value)

    def __bool__(self) -> bool:
        return False

    def to_dict(self) -> dict[str, Any]:
        """The tagged-dict form: plain JSON/msgpack-safe values plus the ``TAG`` marker."""
        d = dataclasses.asdict(self)
        d[TAG] = 1
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Skipped:
        """Rebuild from :meth:`to_dict` output. Raises ``ValueError`` when ``data`` is not one."""
        if not _is_tagged(data):
            raise ValueError("not a tagged Skipped dict")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def describe(self) -> str:
        """One readable line, e.g. for logs and the ``task-skipped`` event."""
        who = f"{self.task}: " if self.task else ""
        left = f" (holder has {self.holder_ttl:.1f}s left)" if self.holder_ttl is not None else ""
        if self.reason == "limit":
            return f"{who}skipped, every slot of lease {self.key!r} held (limit){left}"
        if self.reason == "limit_total":
            return f"{who}skipped, every place in the total {self.key!r} held (limit_total){left}"
        if self.reason == "coalesced":
            return f"{who}coalesced into the pending follow-up {self.follow_up} of lease {self.key!r}"
        if self.reason == "rate_limited":
            return f"{who}skipped, rate {self.key!r}: its turn is past rate_max_wait"
        return f"{who}skipped, lease {self.key!r} {self.reason}{left}"


def _is_tagged(x: Any) -> bool:
    return isinstance(x, Mapping) and x.get(TAG) == 1 and "key" in x and "reason" in x


def is_skipped(value: Any) -> bool:
    """True for a :class:`Skipped` and for its tagged-dict form (see :meth:`Skipped.to_dict`)."""
    return isinstance(value, Skipped) or _is_tagged(value)


def as_skipped(value: Any) -> Skipped | None:
    """The :class:`Skipped` that ``value`` is or encodes (its tagged-dict form, e.g. a Celery
    JSON result), else ``None``: ``s = as_skipped(result.get())`` then ``s.reason``."""
    if isinstance(value, Skipped):
        return value
    return Skipped.from_dict(value) if _is_tagged(value) else None
