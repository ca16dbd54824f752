"""Deferred copies: one pending copy per delivery of a run whose id another execution runs.

A copy of a run that finds another execution of its run id holding the lease (a
:class:`~taskguard.pipeline.Defer`, reason ``"running"``) is published again to look later — a
*deferred copy*, carrying ``{"chain", "nonce", "redelivered"}`` (Celery: the ``taskguard_defer``
header). At most one deferred copy per delivery is pending at any time: the lease record
``defer:<run id>:<chain>`` under the lease key names the pending one (its nonce). The copy that
defers next publishes its own copy first and then swaps the record to it atomically
(:func:`name`); a copy the record does not name (the broker's own redelivery of a superseded copy,
the loser of a swap) is dropped (:func:`superseded`). The chain goes on until the holder ends, so
if it dies the work still runs once, and a crash anywhere in a deferral loses nothing: the record
only ever names a copy that was published. A copy that runs (or is dropped as a duplicate) ends
its chain (:func:`end`). A publish's chain waits for another delivery of its run id, so a record
of the run id's outcome (Celery's result backend) may be that delivery's: such a copy is told
finished only by its own finished marker (:func:`waits_for_another_delivery`).

This module imports no task framework.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .errors import LeaseBackendError

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

__all__ = ["Deferral", "DEFER_MAX", "carried", "plan", "superseded", "name", "end", "waits_for_another_delivery"]

log = logging.getLogger("taskguard")

#: Longest a deferred copy waits before looking again, seconds.
DEFER_MAX = 10.0
#: How the chain of the broker's redeliveries of one delivery begins (then its publish stamp).
_REDELIVERY_CHAIN = "r:"


@dataclasses.dataclass(frozen=True)
class Deferral:
    """One deferral of a copy: its ``chain`` and the ``record`` naming the chain's pending copy,
    the ``nonce`` of the copy it publishes, the nonce the record should name now
    (``expected``: this copy's, ``None`` for a chain's first deferral), and the ``countdown``."""

    chain: str
    record: str
    nonce: str
    expected: str | None
    countdown: float
    redelivered: bool

    def header(self) -> dict[str, Any]:
        """What the published copy carries (:func:`carried` reads it back)."""
        return {"chain": self.chain, "nonce": self.nonce, "redelivered": self.redelivered}


def carried(value: Any) -> Mapping[str, Any] | None:
    """A deferred copy's carried ``{"chain", "nonce", ...}``, or ``None`` (not one, or malformed)."""
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("chain"), str)
        or not isinstance(value.get("nonce"), str)
    ):
        return None
    return value


def waits_for_another_delivery(header: Mapping[str, Any] | None) -> bool:
    """Is ``header`` (what a copy carries, :func:`carried`) a deferred copy of a *publish*? A
    publish's chain starts when the publish finds another execution of its run id holding the
    lease: one that is necessarily another delivery's (the publish's own run never started), so
    the framework's record of the run id's outcome may be that delivery's, not this one's. (A
    chain started by the broker's redelivery may be waiting for its own delivery's run.)"""
    return header is not None and not str(header.get("chain", "")).startswith(_REDELIVERY_CHAIN)


def _record(run_id: str, chain: str) -> str:
    return f"defer:{run_id}:{chain}"


def plan(
    run_id: str,
    header: Mapping[str, Any] | None,
    redelivered: bool,
    stamp: Any,
    holder_ttl: float | None,
    bound: float,
) -> Deferral:
    """The deferral of this copy (``header``: what it carries, if it is a deferred copy): its own
    chain, else one chain for the broker's redeliveries of one delivery (run id and publish
    ``stamp``), else (a publish) a new one; a countdown of the holder's TTL, at least 0.5 s, at
    most :data:`DEFER_MAX` and ``bound`` seconds."""
    if header:
        chain = header["chain"]
    elif redelivered:
        chain = _REDELIVERY_CHAIN + (stamp if isinstance(stamp, str) else "")
    else:
        chain = secrets.token_hex(8)
    countdown = min(max(holder_ttl or 1.0, 0.5), DEFER_MAX, max(0.5, bound))
    expected = header["nonce"] if header else None
    return Deferral(chain, _record(run_id, chain), secrets.token_hex(8), expected, countdown, redelivered)


def superseded(locks: Locks, key: str, d: Deferral, who: str) -> bool:
    """Is another deferred copy of this delivery pending (the record names another copy)? Then
    this copy is dropped. A Redis error: ``False`` (logged; it defers anyway)."""
    try:
        current = locks.get_record(key, d.record)
    except LeaseBackendError as e:
        log.warning("%s: could not read its deferred copy's record (%s); deferring anyway", who, e)
        return False
    return current is not None and current != d.expected


def name(locks: Locks, key: str, d: Deferral, ttl: float, who: str) -> None:
    """After publishing its copy: name it in the record, unless another copy deferred first
    (then the published copy finds itself unnamed and goes). Never raises."""
    try:
        if not locks.put_record(key, d.record, d.nonce, ttl=ttl, if_absent=True, if_value=d.expected):
            log.info("%s: another copy deferred first; this one's copy will be dropped", who)
    except LeaseBackendError as e:
        log.warning("%s: could not record its deferred copy: %s", who, e)


def end(locks: Locks, key: str, run_id: str, header: Mapping[str, Any], who: str) -> None:
    """A deferred copy runs, or is dropped as a duplicate: its chain ends, so its record goes
    (only while it still names this copy). Never raises."""
    try:
        locks.delete_record(key, _record(run_id, header["chain"]), if_value=header["nonce"])
    except LeaseBackendError as e:  # it expires by itself
        log.warning("%s: could not end its deferral record: %s", who, e)
