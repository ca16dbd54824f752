"""Handing a lease from one run of a task to its retry, through a persisted handle.

A run that schedules its own retry keeps its lease: :func:`persist` stretches the TTL to cover
the countdown, stops renewing it in this process and returns a small JSON-safe handle
``{"key", "owner", "fence", "expires"}`` that travels with the retry (Celery: the ``taskguard``
message header; RQ: a Redis record keyed by job id). The retried run calls :func:`resume`, which
claims the handle (one-shot: of two copies of one retry message exactly one wins, with the same
fencing token); if the lease expired meanwhile it acquires afresh (a larger fence); if another
owner holds it, the run is not acquired and must not run.

Under a task's ``limit_total`` the run holds two leases, its key's and its place in the total
(:attr:`taskguard.Lease.total`): the handle then carries the total's as a nested handle,
``{"key", "owner", "fence", "expires", "total": {"key", "owner", "fence", "expires"}}``.
:func:`resume` claims the key's first and then the total's (each one-shot, each keeping its
fencing token; either one expired or taken is acquired afresh); when the total has no place left
the key's lease is given back and the run is not acquired (``reason="limit_total"``).
:func:`release_handle` releases both.

The handle holds the owner token: whoever can read where it is persisted can renew or release
that lease.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from .errors import ConfigError, LeaseBackendError
from .lease import Acquisition, Lease, slot_of
from .validate import is_instant

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

__all__ = [
    "persist",
    "handle_of",
    "parse_handle",
    "ResumeRequest",
    "resume",
    "release_handle",
    "restore_handle",
]

log = logging.getLogger("taskguard")


def persist(lease: Lease, ttl: float) -> dict[str, Any] | None:
    """Stretch ``lease`` to ``ttl`` seconds from now, stop renewing it here, and return its handle.

    Returns ``None`` when the lease is no longer held (the retry will then acquire afresh).
    Raises LeaseBackendError when Redis fails.

    With a :attr:`~taskguard.Lease.total` lease, that one is stretched too and its handle nested
    under ``"total"``; when it is no longer held, the key's lease is released and ``None``
    returned (the retry acquires both afresh)."""
    lease.stop_renewing()  # first: a heartbeat round must not renew it after the stretch
    total = lease.total
    if total is not None:
        total.stop_renewing()
    if not lease.renew(ttl):
        if total is not None:
            total.release()
        return None
    if total is not None and not total.renew(ttl):
        lease.release()
        return None
    return handle_of(lease)


def handle_of(lease: Lease) -> dict[str, Any]:
    """The handle of a held ``lease`` as it stands (nothing renewed): ``{"key", "owner", "fence",
    "expires"}``, plus ``"total"`` (the same four fields) for a lease with a total."""
    h: dict[str, Any] = {
        "key": lease.key,
        "owner": lease.owner_token,
        "fence": lease.fencing_token,
        "expires": lease.expires_at,
    }
    if lease.total is not None:
        h["total"] = handle_of(lease.total)
    return h


def parse_handle(data: Any, _nested: bool = False) -> dict[str, Any]:
    """Validate a persisted handle (with its nested ``"total"`` handle, if any); raise
    ConfigError saying what is wrong (never echoing the token)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"malformed lease handle: expected a mapping, got {type(data).__name__}")
    key, owner, fence, expires = (data.get(f) for f in ("key", "owner", "fence", "expires"))
    if not isinstance(key, str) or not key:
        raise ConfigError("malformed lease handle: 'key' must be a non-empty str")
    if not isinstance(owner, str) or not owner:
        raise ConfigError("malformed lease handle: 'owner' must be a non-empty str")
    if fence is not None and (isinstance(fence, bool) or not isinstance(fence, int)):
        raise ConfigError("malformed lease handle: 'fence' must be an int or null")
    if expires is not None and not is_instant(expires):
        raise ConfigError("malformed lease handle: 'expires' must be a finite number or null")
    try:
        key.encode("utf-8"), owner.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("malformed lease handle: 'key' and 'owner' must be valid Unicode text") from None
    out: dict[str, Any] = {
        "key": key,
        "owner": owner,
        "fence": fence,
        "expires": None if expires is None else float(expires),
    }
    total = data.get("total")
    if total is not None:
        if _nested:
            raise ConfigError("malformed lease handle: a total's handle has no 'total' of its own")
        try:
            out["total"] = parse_handle(total, _nested=True)
        except ConfigError as e:
            raise ConfigError(str(e).replace("lease handle:", "lease handle's total:", 1)) from None
    return out


@dataclasses.dataclass(frozen=True)
class ResumeRequest:
    """What :func:`resume` asks for once the handle is set aside: the lease on ``key`` (see
    :meth:`Locks.acquire` for each field), and with ``total`` ``(total key, limit_total)`` a place
    in the task's total."""

    key: str
    ttl: float
    holder: Mapping[str, Any] | None = None
    renew: bool = True
    max_hold: float | None = None
    run_id: str | None = None
    refuse_finished: bool = False
    delivery: str | None = None
    markers: bool = True
    limit: int = 1
    total: tuple[str, int] | None = None
    replicas: int | None = None
    replica_timeout: float | None = None

    def acquire(self, locks: Locks) -> Acquisition:
        """Acquire ``key`` afresh."""
        return locks.acquire(
            self.key,
            ttl=self.ttl,
            holder=self.holder,
            renew=self.renew,
            max_hold=self.max_hold,
            run_id=self.run_id,
            refuse_finished=self.refuse_finished,
            delivery=self.delivery,
            markers=self.markers,
            limit=self.limit,
            replicas=self.replicas,
            replica_timeout=self.replica_timeout,
        )

    def of_total(self) -> ResumeRequest:
        """The same request for the place in the total (no finished-run checks, no markers)."""
        key, limit = cast("tuple[str, int]", self.total)
        return dataclasses.replace(
            self, key=key, limit=limit, total=None, refuse_finished=False, delivery=None, markers=False
        )


def resume(locks: Locks, handle: Mapping[str, Any], request: ResumeRequest) -> Acquisition:
    """Take over the persisted ``handle`` for ``request.key``, else acquire the key afresh when
    free (``key`` and the other names below are ``request``'s fields).

    Returns the :class:`~taskguard.Acquisition`: claimed (same fencing token), acquired anew
    (larger fencing token, the old lease having expired), or not acquired (``reason="held"``:
    another owner holds ``key``, ``holder_run`` says which run; the caller must not run). A handle
    for a different key (the retry's arguments changed the key) is released and ``key`` acquired.

    ``refuse_finished``, ``delivery``, ``markers``, ``limit``, ``replicas`` and
    ``replica_timeout`` are passed on (see :meth:`Locks.acquire`; a claim the replicas did not
    acknowledge in time answers ``reason="unreplicated"``). Under ``limit > 1``, a handle whose
    slot another holder took meanwhile falls back to acquiring any free slot (a larger fence), as
    an expired one does.

    ``total``: ``(total key, limit_total)`` of a task with a total: once ``key`` is held, the
    handle's nested total handle is taken over the same way (or a place in the total acquired
    afresh); with no place left, ``key``'s lease is released again and the answer is not acquired
    with ``reason="limit_total"``. The returned lease's :attr:`~taskguard.Lease.total` is the
    total's lease. A nested total handle that is not wanted (``total`` ``None``, or the key is
    refused) is released.

    Raises ConfigError for a malformed handle, LeaseBackendError when Redis fails (a lease taken
    by this call is given back first)."""
    h = parse_handle(handle)
    th = h.pop("total", None)
    acq = _resume_one(locks, h, request)
    if request.total is None or not acq.acquired:
        if th is not None:
            _release_quietly(locks, th)
        return acq
    lease = cast(Lease, acq.lease)
    total = request.of_total()
    try:
        tacq = _resume_one(locks, th, total) if th is not None else total.acquire(locks)
    except BaseException:
        _release_quietly(locks, lease)
        raise
    if not tacq.acquired:
        _release_quietly(locks, lease)
        why = "unreplicated" if tacq.reason == "unreplicated" else "limit_total"
        return Acquisition(False, None, why, tacq.holder_ttl, tacq.holder_run)
    lease.total = tacq.lease
    return acq


def _resume_one(locks: Locks, h: Mapping[str, Any], r: ResumeRequest) -> Acquisition:
    """:func:`resume` for one parsed handle ``h`` (without a nested total)."""
    if h["key"] != r.key:
        release_handle(locks, h, ttl=r.ttl)
        return r.acquire(locks)
    acq = locks.claim(
        r.key,
        h["owner"],
        ttl=r.ttl,
        holder=r.holder,
        renew=r.renew,
        max_hold=r.max_hold,
        run_id=r.run_id,
        delivery=r.delivery,
        replicas=r.replicas,
        replica_timeout=r.replica_timeout,
    )
    if acq.acquired or acq.reason == "unreplicated":
        return acq
    if acq.reason == "expired" or r.limit > 1:  # (or already claimed and released by another copy of the handle)
        return r.acquire(locks)
    slot = slot_of(h["owner"])  # who took it: another execution of this run, or another run?
    info = next((i for i in locks.holders(r.key) if i.slot == slot), None)
    return Acquisition(False, None, "held", acq.holder_ttl, info.run_id if info is not None else None)


def restore_handle(locks: Locks, handle: Mapping[str, Any], *, ttl: float = 1.0) -> Lease:
    """A :class:`~taskguard.Lease` rebuilt from a persisted handle (see :meth:`Locks.restore`),
    with its :attr:`~taskguard.Lease.total` rebuilt from the nested total handle, if any.
    Raises ConfigError for a malformed handle."""
    h = parse_handle(handle)
    lease = locks.restore(h["key"], h["owner"], ttl=ttl, fencing_token=h["fence"], expires_at=h["expires"])
    th = h.get("total")
    if th is not None:
        lease.total = locks.restore(
            th["key"], th["owner"], ttl=ttl, fencing_token=th["fence"], expires_at=th["expires"]
        )
    return lease


def release_handle(locks: Locks, handle: Mapping[str, Any], *, ttl: float = 1.0) -> bool:
    """Release the lease a persisted handle stands for (e.g. its retry was revoked or never
    published), and its place in the total when the handle has one. Returns ``True`` when the
    key's lease was still held by that handle and is now released."""
    lease = restore_handle(locks, handle, ttl=ttl)
    released = lease.release()
    if lease.total is not None:
        lease.total.release()
    return released


def _release_quietly(locks: Locks, what: Lease | Mapping[str, Any]) -> None:
    """Give back a lease (or a parsed handle's) taken or kept for a run that will not run now.
    Never raises: its TTL bounds what a Redis error leaves behind."""
    try:
        if isinstance(what, Lease):
            what.release()
        else:
            release_handle(locks, what)
    except LeaseBackendError as e:
        key = what.key if isinstance(what, Lease) else what.get("key")
        log.warning("could not give back lease %r (its TTL bounds it): %s", key, e)
