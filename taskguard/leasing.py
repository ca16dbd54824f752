"""The lease policy over a :class:`~taskguard.backend.Backend`: acquiring (with waiting), claiming,
restoring, renewing, releasing and verifying leases, their handles, events and heartbeat
registration. :class:`~taskguard.Locks` exposes it as its lease methods.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import time
import weakref
from collections.abc import Mapping
from typing import Any

from .backend import AcquireRequest, AcquireStatus, Backend, ClaimRequest, LeaseWrite, RecordCondition, RenewItem
from .clock import LOCAL, Clock
from .errors import ConfigError, LeaseBackendError, LeaseLost
from .events import Emitter, LeaseEvent
from .heartbeat import get_heartbeat
from .lease import Acquisition, HolderInfo, Lease, slot_of, slot_suffix
from .liveness import process_identity
from .validate import (
    check_key,
    check_limit,
    check_name,
    check_queued_mark,
    check_replicas,
    check_run_id,
    check_seconds,
    check_token,
    check_ttl,
    check_value,
    encodable,
    is_instant,
)

__all__ = ["Leases", "LeaseRequest", "new_owner_token", "finished_id", "holder_meta"]

log = logging.getLogger("taskguard")


def new_owner_token() -> str:
    """A fresh owner token: 144 random bits from :mod:`secrets`, URL-safe text."""
    return secrets.token_urlsafe(18)


def finished_id(run_id: str | None, delivery: Any) -> str | None:
    """The identity a finished run is recorded under: ``run_id``, or ``run_id#delivery``.
    Raises ConfigError for a ``delivery`` that is not a non-empty ``str`` or ``None``."""
    if delivery is None or run_id is None:
        return run_id
    if not isinstance(delivery, str) or not delivery:
        raise ConfigError(f"delivery must be a non-empty str or None, got {delivery!r}")
    return run_id + "#" + encodable("delivery", delivery)


_BASE_META: dict[int, tuple[dict[str, Any], str]] = {}  # per pid: default holder metadata and its JSON


def holder_meta(holder: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The holder metadata stored with a lease: this process's ``host`` and ``pid`` plus
    ``holder``, and its JSON. Raises ConfigError for a non-mapping or non-JSON ``holder``."""
    pid = os.getpid()
    base = _BASE_META.get(pid)
    if base is None:
        ident = process_identity()
        base = _BASE_META[pid] = (ident, json.dumps(ident, separators=(",", ":")))
    if holder is None:
        return dict(base[0]), base[1]
    if not isinstance(holder, Mapping) or not all(isinstance(k, str) for k in holder):
        raise ConfigError("holder must be a mapping with str keys")
    meta: dict[str, Any] = dict(base[0])
    meta.update(holder)
    try:
        return meta, json.dumps(meta, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"holder metadata must be JSON-serializable: {e}") from None


def _task_of(meta: Mapping[str, Any]) -> str | None:
    name = meta.get("task") or meta.get("job")
    return name if isinstance(name, str) else None


@dataclasses.dataclass(slots=True)
class LeaseRequest(AcquireRequest):
    """A validated :meth:`~taskguard.Locks.acquire` call: the
    :class:`~taskguard.backend.AcquireRequest` the backend is sent on each try, plus what the
    policy does around it.

    Attributes (beside the backend's):
        wait: seconds to wait for a held lease (0: try once).
        renew: register the lease with the heartbeat.
        max_hold: seconds the heartbeat renews it at most (``None``: no bound).
        holder: the holder metadata (``dict``) the handle carries.
    """

    wait: float = 0.0
    renew: bool = False
    max_hold: float | None = None
    holder: dict[str, Any] | None = None

    @classmethod
    def build(
        cls,
        key: str,
        ttl: float,
        wait: float = 0.0,
        holder: Mapping[str, Any] | None = None,
        renew: bool = False,
        max_hold: float | None = None,
        run_id: str | None = None,
        refuse_finished: bool = False,
        delivery: str | None = None,
        markers: bool = True,
        limit: int = 1,
        replicas: int = 0,
        replica_timeout: float = 0.1,
        queued_mark: tuple[str, str] | None = None,
    ) -> LeaseRequest:
        """Validate the arguments of :meth:`~taskguard.Locks.acquire` (see there; ``max_hold``:
        ``None`` for no bound) and draw a fresh owner token. Raises ConfigError."""
        key = check_key(key)
        ttl = check_ttl(ttl)
        wait = check_seconds("wait", wait, allow_zero=True)
        max_hold = None if max_hold is None else check_seconds("max_hold", max_hold)
        run_id = check_run_id(run_id)
        limit = check_limit(limit)
        replicas, replica_timeout = check_replicas(replicas, replica_timeout)
        fid = finished_id(run_id, delivery)
        meta, meta_json = holder_meta(holder)
        return cls(
            key,
            new_owner_token(),
            ttl,
            meta_json,
            run_id,
            refuse_finished and run_id is not None,
            fid,
            markers,
            limit,
            replicas,
            replica_timeout,
            check_queued_mark(queued_mark),
            wait=wait,
            renew=renew,
            max_hold=max_hold,
            holder=meta,
        )


class Leases:
    """Leases over ``backend``; events go to ``emitter``.

    Attributes:
        backend: the :class:`~taskguard.backend.Backend`.
        emitter: the :class:`~taskguard.events.Emitter` of lease events.
        clock: a :class:`~taskguard.clock.Clock`: its ``monotonic()`` measures how long a handle
            presumes its lease held, its ``time()`` gives handles' informational ``expires_at``.
        renew_fraction: the heartbeat renews every ``ttl * renew_fraction`` seconds.
        max_hold: default bound in seconds on heartbeat renewal per lease (``None``: none).
    """

    def __init__(self, backend: Backend, emitter: Emitter, renew_fraction: float, max_hold: float | None) -> None:
        self.backend = backend
        self.emitter = emitter
        self.clock: Clock = LOCAL
        self.renew_fraction = renew_fraction
        self.max_hold = max_hold
        self._live: weakref.WeakSet[Lease] = weakref.WeakSet()

    def _emit(self, kind: str, key: str, status: str, **fields: Any) -> None:
        # hot paths test self.emitter.active first, so that no event (nor its fields) is built
        # when nobody listens
        if self.emitter.active:
            self.emitter.emit(LeaseEvent(kind, key, status, **fields))

    # -- taking leases ------------------------------------------------------------------------
    def acquire(self, request: LeaseRequest) -> Acquisition:
        """Try, and wait up to ``request.wait`` seconds, for the lease (see :meth:`Locks.acquire`)."""
        req = request
        meta = req.holder or {}
        key, ttl, wait = req.key, req.ttl, req.wait
        backend, clock = self.backend, self.clock
        started = time.monotonic()
        deadline = started + wait
        while True:
            sent_mono, sent_at = clock.monotonic(), clock.time()
            try:
                reply = backend.acquire(req, max(0.0, deadline - time.monotonic()))
            except LeaseBackendError as e:
                self._emit(
                    "acquire",
                    key,
                    "error",
                    duration=time.monotonic() - started,
                    ttl=ttl,
                    error=str(e),
                    task=_task_of(meta),
                )
                raise
            status = reply.status
            if status is AcquireStatus.ACQUIRED:
                lease = Lease(
                    self,
                    key,
                    req.owner + slot_suffix(reply.slot),
                    ttl=ttl,
                    fencing_token=reply.fencing_token,
                    expires_at=sent_at + ttl,
                    holder=meta,
                    run_id=req.run_id,
                    deadline=sent_mono + ttl,
                )
                lease.finished_id = req.finished_id
                self.track(lease, request.renew, request.max_hold)
                if self.emitter.active:
                    self._emit(
                        "acquire",
                        key,
                        "acquired",
                        duration=time.monotonic() - started,
                        fencing_token=reply.fencing_token,
                        ttl=ttl,
                        holder=meta,
                        task=_task_of(meta),
                    )
                return Acquisition(True, lease)
            if status is AcquireStatus.UNREPLICATED:
                self._emit(
                    "acquire", key, "unreplicated", duration=time.monotonic() - started, ttl=ttl, task=_task_of(meta)
                )
                return Acquisition(False, None, "unreplicated")
            if status is AcquireStatus.FINISHED:
                self._emit(
                    "acquire", key, "duplicate", duration=time.monotonic() - started, ttl=ttl, task=_task_of(meta)
                )
                return Acquisition(False, None, "duplicate")
            holder_ttl = reply.holder_ttl
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = "wait_timeout" if wait > 0 else ("limit" if req.limit > 1 else "held")
                self._emit("acquire", key, reason, duration=time.monotonic() - started, ttl=ttl, task=_task_of(meta))
                return Acquisition(False, None, reason, holder_ttl, reply.holder_run)
            pause = remaining if holder_ttl is None or holder_ttl < 0 else min(remaining, holder_ttl + 0.001)
            try:
                backend.wait_signal(key, pause)
            except LeaseBackendError as e:
                self._emit(
                    "acquire",
                    key,
                    "error",
                    duration=time.monotonic() - started,
                    ttl=ttl,
                    error=str(e),
                    task=_task_of(meta),
                )
                raise

    def restore(
        self,
        key: str,
        owner_token: str,
        *,
        ttl: float,
        expires_at: float | None = None,
        fencing_token: int | None = None,
        renew: bool = False,
    ) -> Lease:
        """See :meth:`Locks.restore`."""
        key = check_key(key)
        ttl = check_ttl(ttl)
        check_token(owner_token)
        if fencing_token is not None and (isinstance(fencing_token, bool) or not isinstance(fencing_token, int)):
            raise ConfigError("fencing_token must be an int or None")
        if expires_at is not None and not is_instant(expires_at):
            raise ConfigError(f"expires_at must be a finite number of epoch seconds or None, got {expires_at!r}")
        lease = Lease(self, key, owner_token, ttl=ttl, fencing_token=fencing_token, expires_at=expires_at)
        self.track(lease, renew, self.max_hold)
        return lease

    def claim(
        self,
        key: str,
        owner_token: str,
        *,
        ttl: float,
        holder: Mapping[str, Any] | None = None,
        renew: bool = False,
        max_hold: float | None = None,
        run_id: str | None = None,
        delivery: str | None = None,
        replicas: int = 0,
        replica_timeout: float = 0.1,
    ) -> Acquisition:
        """See :meth:`Locks.claim`."""
        key = check_key(key)
        ttl = check_ttl(ttl)
        check_token(owner_token)
        max_hold = self.max_hold if max_hold is None else check_seconds("max_hold", max_hold)
        run_id = check_run_id(run_id)
        replicas, replica_timeout = check_replicas(replicas, replica_timeout)
        meta, meta_json = holder_meta(holder)
        new_owner = new_owner_token() + slot_suffix(slot_of(owner_token))  # the claim keeps the slot
        started = time.monotonic()
        sent_mono, sent_at = self.clock.monotonic(), self.clock.time()
        try:
            reply = self.backend.claim(
                ClaimRequest(key, owner_token, new_owner, ttl, meta_json, run_id, replicas, replica_timeout)
            )
        except LeaseBackendError as e:
            self._emit("claim", key, "error", duration=time.monotonic() - started, ttl=ttl, error=str(e))
            raise
        took = time.monotonic() - started
        if not reply.claimed:
            reason = "unreplicated" if reply.unreplicated else "expired" if reply.expired else "not_owner"
            self._emit("claim", key, reason, duration=took, ttl=ttl)
            return Acquisition(False, None, reason, None if reply.expired else reply.holder_ttl)
        fence = reply.fencing_token
        lease = Lease(
            self,
            key,
            new_owner,
            ttl=ttl,
            fencing_token=fence,
            expires_at=sent_at + ttl,
            holder=meta,
            run_id=run_id,
            deadline=sent_mono + ttl,
        )
        lease.finished_id = finished_id(run_id, delivery)
        self.track(lease, renew, max_hold)
        self._emit(
            "claim", key, "claimed", duration=took, fencing_token=fence, ttl=ttl, holder=meta, task=_task_of(meta)
        )
        return Acquisition(True, lease)

    # -- without a handle ---------------------------------------------------------------------
    def release_run(self, key: str, run_id: str, fencing_token: int | None = None) -> bool:
        """See :meth:`Locks.release_run`."""
        run = check_run_id(run_id)
        if run is None:
            raise ConfigError("run_id is required")
        if fencing_token is not None and (isinstance(fencing_token, bool) or not isinstance(fencing_token, int)):
            raise ConfigError(f"fencing_token must be an int, not {type(fencing_token).__name__}")
        started = time.monotonic()
        ok = self.backend.release_run(check_key(key), run, fencing_token)
        self._emit("release", key, "released_for_run" if ok else "not_owner", duration=time.monotonic() - started)
        return ok

    def force_release(self, key: str) -> bool:
        """See :meth:`Locks.force_release`."""
        key = check_key(key)
        ok = self.backend.force_release(key)
        self._emit("release", key, "forced" if ok else "no_lease")
        return ok

    def holders(self, key: str) -> list[HolderInfo]:
        """See :meth:`Locks.holders`."""
        return self.backend.holders(check_key(key))

    # -- handle operations (called by Lease and the heartbeat) ----------------------------------
    def track(self, lease: Lease, renew: bool, max_hold: float | None) -> None:
        """Count ``lease`` among this process's live leases (released by :meth:`close`); with
        ``renew``, register it with the heartbeat."""
        self._live.add(lease)
        if renew:
            lease.renewing = True
            get_heartbeat().add(lease, self.renew_fraction, max_hold)

    def renew_many(self, items: list[RenewItem]) -> list[Any]:
        """One heartbeat round: see :meth:`taskguard.backend.Backend.renew_many`."""
        return self.backend.renew_many(items)

    def renew(self, lease: Lease, ttl: float | None) -> bool:
        """See :meth:`Lease.renew`."""
        ttl = lease.ttl if ttl is None else check_ttl(ttl)
        if lease.inherited or lease.released or lease.marked_lost:
            return False
        started, sent_mono, sent_at = time.monotonic(), self.clock.monotonic(), self.clock.time()
        try:
            ok = self.backend.renew(lease.key, lease.owner_token, ttl)
        except LeaseBackendError as e:
            self._emit(
                "renew", lease.key, "error", duration=time.monotonic() - started, ttl=ttl, error=str(e), task=lease.task
            )
            raise
        self._emit(
            "renew",
            lease.key,
            "renewed" if ok else "not_owner",
            duration=time.monotonic() - started,
            fencing_token=lease.fencing_token,
            ttl=ttl,
            task=lease.task,
        )
        if ok:
            lease.note_renewed(sent_mono, sent_at, ttl)
        else:
            get_heartbeat().discard(lease)
            lease.mark_lost("renew found another owner or no lease")
        return ok

    def release(
        self,
        lease: Lease,
        *,
        finished: bool = False,
        finished_ttl: float | None = None,
        store: tuple[str, float] | None = None,
    ) -> bool:
        """Release ``lease`` (see :meth:`Lease.release`); with ``store`` (record, TTL seconds),
        also write the key's completion record atomically with the release (the run finished)."""
        if lease.inherited or lease.released:
            return False
        if lease.renewing:
            lease.stop_renewing()
        started = time.monotonic()
        try:
            if finished_ttl is not None:
                finished_ttl = check_seconds("finished_ttl", finished_ttl)
            if store is not None:
                ok = self.backend.release_storing(
                    lease.key, lease.owner_token, lease.finished_id or "", finished_ttl, store[0], store[1]
                )
            else:
                ok = self.backend.release(
                    lease.key,
                    lease.owner_token,
                    lease.finished_id if finished else None,
                    finished_ttl if finished else None,
                )
        except LeaseBackendError as e:
            self._emit(
                "release", lease.key, "error", duration=time.monotonic() - started, error=str(e), task=lease.task
            )
            raise
        if self.emitter.active:
            self._emit(
                "release",
                lease.key,
                "released" if ok else "not_owner",
                duration=time.monotonic() - started,
                fencing_token=lease.fencing_token,
                task=lease.task,
            )
        if not ok:
            lease.mark_lost("release found another owner or no lease")
        lease.mark_released()
        self._live.discard(lease)
        return ok

    def verify(self, lease: Lease) -> bool:
        """Whether ``lease``'s owner token still owns its key (one round trip)."""
        if lease.inherited:
            return False
        ok = self.backend.owns(lease.key, lease.owner_token)
        if not ok:
            lease.mark_lost("not held in Redis")
        return ok

    def put_record(self, lease: Lease, name: str, value: str, if_absent: bool, if_value: str | None) -> bool:
        """See :meth:`Lease.put_record`."""
        if if_value is not None and not isinstance(if_value, str):
            raise ConfigError("if_value must be a str or None")
        cond = RecordCondition.of(if_absent, if_value)
        name, value = check_name(name), check_value(value)
        if lease.inherited:
            raise LeaseLost(lease.key, "inherited from the parent process")
        lease.ensure_held()
        outcome = self.backend.put_lease_record(lease.key, lease.owner_token, name, value, cond, if_value or "")
        if outcome is LeaseWrite.NOT_HELD:
            lease.mark_lost("not held in Redis")
            raise LeaseLost(lease.key, lease.lost_reason or "not held in Redis")
        return outcome is LeaseWrite.WRITTEN

    def close(self, timeout: float) -> None:
        """Release every lease still held by this process (best effort) within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        live = [lease for lease in list(self._live) if not lease.released and not lease.inherited]
        for lease in live:  # none of them is renewed any more, released below or not
            lease.stop_renewing()
        for lease in live:
            if time.monotonic() >= deadline:
                log.warning("close() ran out of time; remaining leases expire by their TTL")
                break
            if not lease.released:
                try:
                    lease.release()
                except LeaseBackendError as e:
                    log.warning("could not release lease %r at close: %s", lease.key, e)
