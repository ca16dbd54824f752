"""``overlap="coalesce"``: at most one pending follow-up per key, the latest call's own.

A run of a key whose lease is held (every slot, under ``limit``) does not skip: it becomes the
key's **pending follow-up**. One record per key (``coalesce``, kept beside the lease like every
lease record) names it — its run id and what the adapter needs to publish it again (Celery: the
call's own message, serialised; RQ: nothing, the job id is enough) — so a burst of any number of
calls leaves one record. A later call takes the record over (compare-and-swap): the call it
supersedes ends ``Skipped(reason="coalesced", follow_up=<the new call's run id>)``.

When a run of the key ends (finish, fail, hand back), it takes the record and asks its adapter to
wake the follow-up (:func:`wake_pending`): Celery publishes the stored message, RQ moves the
scheduled job to now; the follow-up then takes the lease like any call (and, should a newer run
have taken it first, becomes the pending follow-up again). Nothing waits in a worker slot.

If the holder dies without ending (its worker SIGKILLed), nobody wakes the follow-up: a backstop
does, when the holder's lease has expired. Celery publishes one backstop message per key at a time
(a delayed copy of the pending call, marked in its ``coalesce`` header; the ``coalesce-backstop``
record says one is out); RQ schedules the pending job itself at that time. A backstop finding the
lease still held (a long body, renewed) looks again after the holder's TTL.

This module imports no task framework.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from .errors import LeaseBackendError

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

__all__ = [
    "Pending",
    "PENDING_RECORD",
    "BACKSTOP_RECORD",
    "offer",
    "pending",
    "take",
    "refresh",
    "wake_pending",
    "claim_backstop",
    "record_ttl",
]

log = logging.getLogger("taskguard")

#: The lease record naming a key's pending follow-up (JSON: ``{"id": run id, "msg": adapter data}``).
PENDING_RECORD = "coalesce"
#: The lease record saying a backstop (Celery: a delayed message) is out for the key.
BACKSTOP_RECORD = "coalesce-backstop"
#: ``overlap="replace"``: the lease record ``replaced:<run id>`` names the run that took the lease
#: over from the run ``run id`` (kept ``REPLACED_TTL`` seconds), so that run, and any retry or
#: redelivery of it, ends ``Skipped(reason="replaced")``.
REPLACED_RECORD = "replaced:"
#: Seconds a ``replaced:`` record is kept: a replaced run learns it at its end, a retry of it at
#: its start (a day covers retries and redeliveries).
REPLACED_TTL = 86400.0
#: How many compare-and-swap rounds a write may take before giving up (each round loses only to
#: another writer that succeeded).
_ROUNDS = 100


@dataclasses.dataclass(frozen=True)
class Pending:
    """A key's pending follow-up: ``run_id`` (``str``) and ``message`` (the adapter's JSON value)."""

    run_id: str
    message: Any = None


def _parse(raw: str | None) -> Pending | None:
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        return Pending(str(data["id"]), data.get("msg"))
    except (ValueError, KeyError, TypeError):
        log.error("ignoring a malformed %r record", PENDING_RECORD)
        return None


def record_ttl(countdown: float, ttl: float) -> float:
    """Seconds the pending record is kept: past the backstop (``countdown``) by the lease ``ttl``
    and a minute's margin (the backstop refreshes it while the holder lives)."""
    return countdown + ttl + 60.0


def pending(locks: Locks, key: str) -> Pending | None:
    """The key's pending follow-up, or ``None``. Raises LeaseBackendError."""
    return _parse(locks.get_record(key, PENDING_RECORD))


def offer(locks: Locks, key: str, run_id: str, message: Any, *, ttl: float) -> Pending | None:
    """Make ``run_id`` the key's pending follow-up (kept ``ttl`` seconds). Returns the follow-up
    it supersedes (``None`` when there was none, or it was ``run_id`` itself). One record per key
    whatever the number of calls. Raises LeaseBackendError."""
    value = json.dumps({"id": run_id, "msg": message}, separators=(",", ":"))
    for _ in range(_ROUNDS):
        old = locks.get_record(key, PENDING_RECORD)
        if locks.put_record(key, PENDING_RECORD, value, ttl=ttl, if_absent=old is None, if_value=old):
            prev = _parse(old)
            return prev if prev is not None and prev.run_id != run_id else None
    raise LeaseBackendError("coalesce", key, "could not record the pending follow-up: too much contention")


def take(locks: Locks, key: str, run_id: str | None = None) -> Pending | None:
    """Remove and return the key's pending follow-up (only when it names ``run_id``, if given),
    atomically: of several takers one gets it. ``None`` when there is none to take. Raises
    LeaseBackendError."""
    for _ in range(_ROUNDS):
        raw = locks.get_record(key, PENDING_RECORD)
        p = _parse(raw)
        if raw is None or (run_id is not None and (p is None or p.run_id != run_id)):
            return None
        if locks.delete_record(key, PENDING_RECORD, if_value=raw):
            return p
    return None


def refresh(locks: Locks, key: str, *, ttl: float) -> None:
    """Keep the pending record (unchanged) ``ttl`` more seconds: a backstop found the holder alive."""
    raw = locks.get_record(key, PENDING_RECORD)
    if raw is not None:
        locks.put_record(key, PENDING_RECORD, raw, ttl=ttl, if_value=raw)


def claim_backstop(locks: Locks, key: str, *, ttl: float, renew: bool = False) -> bool:
    """Should this execution send the key's backstop (``True`` when none is out, or ``renew``: a
    backstop sending the next)? The mark lasts ``ttl`` seconds. Raises LeaseBackendError."""
    return locks.put_record(key, BACKSTOP_RECORD, "1", ttl=ttl, if_absent=not renew)


def wake_pending(locks: Locks, key: str, wake: Callable[[Pending], None], who: str = "run") -> None:
    """A run of ``key`` ended: take the pending follow-up, if any, and ``wake`` it (the adapter
    publishes it). Never raises: a failure is logged (the backstop still wakes it)."""
    try:
        p = take(locks, key)
    except LeaseBackendError as e:
        log.warning("%s: could not read the pending follow-up of %r (the backstop will run it): %s", who, key, e)
        return
    if p is None:
        return
    try:
        wake(p)
    except Exception as e:
        log.error("%s: could not wake the pending follow-up %s of %r: %s", who, p.run_id, key, e)
        try:  # put it back for the backstop, unless a newer call is pending already
            value = json.dumps({"id": p.run_id, "msg": p.message}, separators=(",", ":"))
            locks.put_record(key, PENDING_RECORD, value, ttl=record_ttl(60.0, 60.0), if_absent=True)
        except LeaseBackendError:
            pass


# -- overlap="replace" ------------------------------------------------------------------------------
def replace_holder(locks: Locks, key: str, by: str | None, limit: int) -> Any:
    """Take the lease of ``key`` away from its oldest holder (every slot held, under ``limit``)
    for the run ``by``: record that it was replaced (:data:`REPLACED_RECORD`), then release its
    lease on its behalf (:meth:`taskguard.Locks.release_run`). Its heartbeat then finds the lease
    gone (``lease.lost``, ``ensure_held()`` raises within one renewal interval) and its fenced
    writes carry a lower fencing token than the new holder's. Returns the replaced holder's
    :class:`~taskguard.lease.HolderInfo`, or ``None`` when a slot is free already or the holder
    has no run id (a direct call: it cannot be named, so it is not replaced). Raises
    LeaseBackendError."""
    holders = locks.holders(key)
    if len(holders) < limit:
        return None
    named = [h for h in holders if h.run_id is not None and h.run_id != by]
    if not named:
        return None
    victim = min(named, key=lambda h: (h.since or 0.0, h.fencing_token or 0))
    run_id = cast(str, victim.run_id)  # (named holders only)
    locks.put_record(key, REPLACED_RECORD + run_id, by or "", ttl=REPLACED_TTL)
    if not locks.release_run(key, run_id, fencing_token=victim.fencing_token):  # (not a later lease of the run)
        locks.delete_record(key, REPLACED_RECORD + run_id, if_value=by or "")
        return None
    return victim


def replaced_by(locks: Locks, key: str, run_id: str | None) -> str | None:
    """The run id that replaced the run ``run_id`` of ``key`` (``""`` when that run had none),
    or ``None`` when it was not replaced. Raises LeaseBackendError."""
    if run_id is None:
        return None
    return locks.get_record(key, REPLACED_RECORD + run_id)
