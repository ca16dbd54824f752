"""Handing a lease from one run of a task to its retry, through a persisted handle.

A run that schedules its own retry keeps its lease: :func:`persist` stretches the TTL to cover
the countdown, stops renewing it in this process and returns a small JSON-safe handle
``{"key", "owner", "fence", "expires"}`` that travels with the retry (Celery: the ``taskguard``
message header; RQ: a Redis record keyed by job id). The retried run calls :func:`resume`, which
claims the handle (one-shot: of two copies of one retry message exactly one wins, with the same
fencing token); if the lease expired meanwhile it acquires afresh (a larger fence); if another
owner holds it, the run is not acquired and must not run.

The handle holds the owner token: whoever can read where it is persisted can renew or release
that lease.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .lease import Acquisition, Lease, slot_of

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

__all__ = ["persist", "parse_handle", "resume", "release_handle"]

log = logging.getLogger("taskguard")


def persist(lease: Lease, ttl: float) -> dict[str, Any] | None:
    """Stretch ``lease`` to ``ttl`` seconds from now, stop renewing it here, and return its handle.

    Returns ``None`` when the lease is no longer held (the retry will then acquire afresh).
    Raises LeaseBackendError when Redis fails."""
    lease.stop_renewing()  # first: a heartbeat round must not renew it after the stretch
    if not lease.renew(ttl):
        return None
    return {"key": lease.key, "owner": lease.owner_token, "fence": lease.fencing_token, "expires": lease.expires_at}


def parse_handle(data: Any) -> dict[str, Any]:
    """Validate a persisted handle; raise ConfigError saying what is wrong (never echoing the token)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"malformed lease handle: expected a mapping, got {type(data).__name__}")
    key, owner, fence, expires = (data.get(f) for f in ("key", "owner", "fence", "expires"))
    if not isinstance(key, str) or not key:
        raise ConfigError("malformed lease handle: 'key' must be a non-empty str")
    if not isinstance(owner, str) or not owner:
        raise ConfigError("malformed lease handle: 'owner' must be a non-empty str")
    if fence is not None and (isinstance(fence, bool) or not isinstance(fence, int)):
        raise ConfigError("malformed lease handle: 'fence' must be an int or null")
    if expires is not None:
        try:
            ok = not isinstance(expires, bool) and isinstance(expires, (int, float)) and math.isfinite(float(expires))
        except OverflowError:
            ok = False
        if not ok:
            raise ConfigError("malformed lease handle: 'expires' must be a finite number or null")
    try:
        key.encode("utf-8"), owner.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("malformed lease handle: 'key' and 'owner' must be valid Unicode text") from None
    return {"key": key, "owner": owner, "fence": fence, "expires": None if expires is None else float(expires)}


def resume(
    locks: Locks,
    handle: Mapping[str, Any],
    *,
    key: str,
    ttl: float,
    holder: Mapping[str, Any] | None = None,
    renew: bool = True,
    max_hold: float | None = None,
    run_id: str | None = None,
    refuse_finished: bool = False,
    delivery: str | None = None,
    markers: bool = True,
    limit: int = 1,
    replicas: int | None = None,
    replica_timeout: float | None = None,
) -> Acquisition:
    """Take over the persisted ``handle`` for ``key``, else acquire ``key`` afresh when free.

    Returns the :class:`~taskguard.Acquisition`: claimed (same fencing token), acquired anew
    (larger fencing token, the old lease having expired), or not acquired (``reason="held"``:
    another owner holds ``key``, ``holder_run`` says which run; the caller must not run). A handle
    for a different key (the retry's arguments changed the key) is released and ``key`` acquired.

    ``refuse_finished``, ``delivery``, ``markers``, ``limit``, ``replicas`` and
    ``replica_timeout`` are passed on (see :meth:`Locks.acquire`; a claim the replicas did not
    acknowledge in time answers ``reason="unreplicated"``). Under ``limit > 1``, a handle whose
    slot another holder took meanwhile falls back to acquiring any free slot (a larger fence), as
    an expired one does.

    Raises ConfigError for a malformed handle, LeaseBackendError when Redis fails."""
    h = parse_handle(handle)
    if h["key"] != key:
        release_handle(locks, h, ttl=ttl)
        return locks.acquire(
            key,
            ttl=ttl,
            holder=holder,
            renew=renew,
            max_hold=max_hold,
            run_id=run_id,
            refuse_finished=refuse_finished,
            delivery=delivery,
            markers=markers,
            limit=limit,
            replicas=replicas,
            replica_timeout=replica_timeout,
        )
    acq = locks.claim(
        key,
        h["owner"],
        ttl=ttl,
        holder=holder,
        renew=renew,
        max_hold=max_hold,
        run_id=run_id,
        delivery=delivery,
        replicas=replicas,
        replica_timeout=replica_timeout,
    )
    if acq.acquired or acq.reason == "unreplicated":
        return acq
    if acq.reason == "expired" or limit > 1:  # (or already claimed and released by another copy of the handle)
        return locks.acquire(
            key,
            ttl=ttl,
            holder=holder,
            renew=renew,
            max_hold=max_hold,
            run_id=run_id,
            refuse_finished=refuse_finished,
            delivery=delivery,
            markers=markers,
            limit=limit,
            replicas=replicas,
            replica_timeout=replica_timeout,
        )
    slot = slot_of(h["owner"])  # who took it: another execution of this run, or another run?
    info = next((i for i in locks.holders(key) if i.slot == slot), None)
    return Acquisition(False, None, "held", acq.holder_ttl, info.run_id if info is not None else None)


def release_handle(locks: Locks, handle: Mapping[str, Any], *, ttl: float = 1.0) -> bool:
    """Release the lease a persisted handle stands for (e.g. its retry was revoked or never
    published). Returns ``True`` when it was still held by that handle and is now released."""
    h = parse_handle(handle)
    return locks.restore(h["key"], h["owner"], ttl=ttl, fencing_token=h["fence"]).release()
