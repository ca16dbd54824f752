"""Lease handles and the values lease operations return."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .errors import LeaseLost
from .events import LeaseEvent
from .heartbeat import get_heartbeat
from .validate import check_callback

if TYPE_CHECKING:  # pragma: no cover
    from .leasing import Leases

__all__ = ["Lease", "Acquisition", "HolderInfo", "slot_of", "slot_suffix"]

_STATE_LOCK = threading.Lock()  # guards lost/released transitions of every handle (rare, brief)


def slot_of(owner_token: str) -> int:
    """The holder slot an owner token belongs to: ``i`` for a token ending in ``#i``, else 0
    (see :mod:`taskguard.scripts`)."""
    head, sep, tail = owner_token.rpartition("#")
    return int(tail) if sep and tail.isascii() and tail.isdigit() else 0  # as Lua's %d: ASCII digits


def slot_suffix(slot: int) -> str:
    """What a slot's owner tokens end with: ``""`` for slot 0, ``"#i"`` for slot ``i``."""
    return f"#{slot}" if slot else ""


class Lease:
    """A handle on a lease this process holds (or restored from persisted values).

    Attributes:
        key: the user's lease key (``str``).
        owner_token: the secret that proves ownership (``str``). It never appears in ``repr``,
            events, logs or errors; persist it only where only trusted parties can read.
        fencing_token: ``int`` that only grows per key, or ``None`` when restored without one.
            Hand it to the protected storage, which must reject writes carrying a lower token.
        expires_at: Unix epoch seconds (float) by which the lease expires unless renewed
            (computed conservatively from the moment the request was sent), or ``None`` when
            restored without it. Informational: whether the lease is still presumed held
            (:attr:`lost`) is measured on the monotonic clock (a step of the wall clock changes
            nothing), and only the Redis server's clock decides when it expires.
        ttl: the TTL in seconds (float) renewals use by default.
        run_id: the run identity given at acquire/claim (e.g. a task id), or ``None``.
        slot: which of the key's holder slots this lease is (``int``, 0 for a plain lease; 0..N-1
            under ``acquire(limit=N)``). Fencing tokens grow per (key, slot).
        total: under a task's ``limit_total``, the run's second lease — its place in the total
            (a :class:`Lease` on the total's key, with its own slot and fencing token) — else
            ``None``. This handle's own fencing token is the key's; hand storage the one whose
            writes it guards. :meth:`ensure_held` checks both; the task's run renews and
            releases both (:meth:`renew` and :meth:`release` act on this lease only).

    A handle belongs to the process that made it: in a process forked from it, ``renew`` and
    ``release`` do nothing and return ``False`` (the parent still owns the lease).
    Using it as a context manager releases it on exit.
    """

    def __init__(
        self,
        manager: Leases,
        key: str,
        owner_token: str,
        *,
        ttl: float,
        fencing_token: int | None,
        expires_at: float | None,
        holder: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        deadline: float | None = None,
    ) -> None:
        """Made by the lease policy (``manager``, a :class:`taskguard.leasing.Leases`), never by
        users: :meth:`Locks.acquire`, :meth:`Locks.claim` and :meth:`Locks.restore` give handles.
        ``deadline``: when the lease is presumed expired, on ``manager.clock.monotonic()``; when
        not given it is derived once from ``expires_at`` (a persisted handle's epoch expiry)."""
        self._manager = manager
        self.run_id = run_id
        self.finished_id = run_id  # what a finished release records (run_id, or run_id#delivery)
        self.key = key
        self._owner_token = owner_token
        self.ttl = ttl
        self.fencing_token = fencing_token
        self.expires_at = expires_at
        clock = manager.clock
        if deadline is None and expires_at is not None:
            deadline = clock.monotonic() + (expires_at - clock.time())
        self._deadline = deadline  # monotonic: the lease is presumed gone from then on
        self.holder = dict(holder) if holder else {}
        self.acquired_at = clock.time()
        self._pid = os.getpid()
        self._lost_reason: str | None = None
        self._released = False
        #: ``True`` while registered with the heartbeat (see :meth:`stop_renewing`).
        self.renewing = False
        self._lost_callbacks: list[Callable[[Lease, str], None]] = []
        self.total: Lease | None = None

    # -- read-only state -------------------------------------------------------------------
    @property
    def owner_token(self) -> str:
        return self._owner_token

    @property
    def manager(self) -> Leases:
        """The lease policy (:class:`taskguard.leasing.Leases`) this handle belongs to."""
        return self._manager

    @property
    def slot(self) -> int:
        return slot_of(self._owner_token)

    @property
    def task(self) -> str | None:
        """The task / job name from the holder metadata, where given."""
        name = self.holder.get("task") or self.holder.get("job")
        return name if isinstance(name, str) else None

    @property
    def lost(self) -> bool:
        """``True`` once the lease is known or presumed gone: a renew/release found another owner
        (or no lease), or its TTL passed without a renewal — measured on the monotonic clock from
        when the acquire or last successful renewal was sent, so a step of the local wall clock
        neither ends a held lease nor keeps a lost one. ``False`` after a successful release."""
        if self._lost_reason is not None:
            return True
        if self._released:
            return False
        return self.presumed_expired()

    @property
    def marked_lost(self) -> bool:
        """``True`` once a renew, release or check found the lease gone (not merely presumed
        expired, see :attr:`lost`)."""
        return self._lost_reason is not None

    def presumed_expired(self) -> bool:
        """The TTL ran out (on the monotonic clock) since the last successful acquire/renew."""
        return self._deadline is not None and self._manager.clock.monotonic() >= self._deadline

    def note_renewed(self, sent_mono: float, sent_wall: float, ttl: float) -> None:
        """A renewal sent at ``sent_mono`` (monotonic) / ``sent_wall`` (epoch) succeeded: the
        lease runs ``ttl`` seconds from then (counted from the send: conservative)."""
        self._deadline = sent_mono + ttl
        self.expires_at = sent_wall + ttl

    @property
    def lost_reason(self) -> str | None:
        if self._lost_reason is None and self.lost:
            return "expired without renewal"
        return self._lost_reason

    @property
    def released(self) -> bool:
        return self._released

    @property
    def inherited(self) -> bool:
        """``True`` in a process forked after the handle was made (the handle is inert there)."""
        return self._pid != os.getpid()

    def __repr__(self) -> str:
        state = "released" if self._released else ("lost" if self.lost else "held")
        return f"<Lease key={self.key!r} fencing_token={self.fencing_token} expires_at={self.expires_at} state={state}>"

    # -- operations ------------------------------------------------------------------------
    def renew(self, ttl: float | None = None) -> bool:
        """Extend the lease to ``ttl`` seconds from now (default: :attr:`ttl`).

        Returns ``True`` when renewed; ``False`` when this owner no longer holds it (the handle
        is then marked lost), when it was released, or in a forked child. Never recreates an
        expired lease. Raises :class:`~taskguard.LeaseBackendError` when Redis fails and
        ``ValueError`` for a non-positive ``ttl``.
        """
        return self._manager.renew(self, ttl)

    def release(self, *, finished: bool = False, finished_ttl: float | None = None) -> bool:
        """Release the lease if this owner still holds it.

        With ``finished=True`` and a ``run_id`` (given at acquire/claim), also record, atomically
        with the release, that this run finished: an acquire with ``refuse_finished=True`` by the
        same ``run_id`` is then refused with reason ``"duplicate"`` while this is the last run
        recorded on the key (no extra key) and, with ``finished_ttl`` (seconds), for that long in
        any case (one small key per finished run).

        Returns ``True`` when this call released it; ``False`` when it was already released,
        when another owner holds it or it expired (the handle is then marked lost), or in a
        forked child. Raises :class:`~taskguard.LeaseBackendError` when Redis fails.
        """
        return self._manager.release(self, finished=finished, finished_ttl=finished_ttl)

    def put_record(self, name: str, value: str, *, if_absent: bool = False, if_value: str | None = None) -> bool:
        """Write the lease record ``name`` (``str``) of this key, fenced by this lease: the write
        happens only while this owner holds the lease, checked atomically with it (one
        single-key script on Redis), so a holder that lost its lease (expired while paused, taken
        over) can never overwrite what the current holder wrote. Lease records live with the
        key's fence (``fence_idle_ttl`` after its last acquisition) and survive releases; read
        them with :meth:`Locks.get_lease_record`.

        Conditions, checked atomically with the write: ``if_absent`` (only when the record does
        not exist), ``if_value`` (only when it holds exactly this value), both (either). Returns
        ``True`` when written or when it already holds ``value`` (a retried call); ``False``
        when the condition did not hold. Raises :class:`~taskguard.LeaseLost` when this owner
        does not hold the lease (the handle is then marked lost; nothing is written),
        ``ConfigError`` for bad arguments, :class:`~taskguard.LeaseBackendError` when Redis fails.
        """
        return self._manager.put_record(self, name, value, if_absent, if_value)

    def ensure_held(self, verify: bool = False) -> None:
        """Raise :class:`~taskguard.LeaseLost` unless the lease is still held.

        With ``verify=False`` (default) this checks local knowledge only (no round trip): lost
        marks from the heartbeat and ``expires_at``. With ``verify=True`` it also asks Redis
        whether this owner token still owns the key (one round trip). With a :attr:`total`
        lease, that one is checked as well (it raises ``LeaseLost`` naming the total's key).
        """
        if self.lost:
            raise LeaseLost(self.key, self.lost_reason or "lost")
        if self._released:
            raise LeaseLost(self.key, "released")
        if verify and not self._manager.verify(self):
            raise LeaseLost(self.key, self.lost_reason or "not held in Redis")
        if self.total is not None:
            self.total.ensure_held(verify)

    def on_lost(self, callback: Callable[[Lease, str], None]) -> None:
        """Call ``callback(lease, reason)`` once — this :class:`Lease` and the reason (``str``,
        e.g. ``"not the owner"``) — on the thread that finds the lease lost (often the heartbeat's:
        keep it short; what it raises is logged, never propagated).

        Raises ConfigError at once when ``callback`` is not callable or cannot be called with
        those two positional arguments (checked with :func:`inspect.signature`), rather than
        failing unseen in the heartbeat when the lease is lost."""
        check_callback("on_lost callback", callback, self, "reason")
        self._lost_callbacks.append(callback)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._released:
            self.release()

    # -- state transitions (made by the lease policy and the heartbeat, not by users) ---------
    def stop_renewing(self) -> None:
        """Take the handle off the heartbeat (it is no longer renewed in this process)."""
        if self.renewing:
            get_heartbeat().discard(self)
            self.renewing = False

    def mark_lost(self, reason: str) -> bool:
        """Record that the lease is gone (``reason``): emit the ``lost`` event and call the
        :meth:`on_lost` callbacks, once. Returns ``False`` when it was already lost or released."""
        with _STATE_LOCK:
            if self._released or self._lost_reason is not None:
                return False
            self._lost_reason = reason
        self._manager.emitter.emit(
            LeaseEvent(
                "lost",
                self.key,
                reason,
                fencing_token=self.fencing_token,
                ttl=self.ttl,
                holder=self.holder,
                task=self.task,
            )
        )
        for cb in self._lost_callbacks:
            try:
                cb(self, reason)
            except Exception:  # pragma: no cover - defensive, like listeners
                logging.getLogger("taskguard").exception("on_lost callback failed")
        return True

    def mark_released(self) -> None:
        """Record that the lease was released (by this handle, or found gone at release)."""
        with _STATE_LOCK:
            self._released = True


@dataclasses.dataclass(frozen=True)
class Acquisition:
    """The outcome of :meth:`Locks.acquire` or :meth:`Locks.claim`.

    Attributes:
        acquired: ``True`` when ``lease`` is held.
        lease: the :class:`Lease`, or ``None``.
        reason: ``None`` when acquired; else ``"held"`` (another owner holds it), ``"limit"``
            (``limit=N`` > 1 and N holders are in),
            ``"wait_timeout"`` (``wait`` seconds passed), ``"duplicate"`` (the ``run_id`` already
            finished under this key, with ``refuse_finished``) or, for a claim, ``"not_owner"``
            (another owner holds it) / ``"expired"`` (no lease exists any more).
        holder_ttl: seconds (float) left on the other holder's lease, where known.
        holder_run: the other holder's run id (e.g. its task id), where known; ``None`` when it
            gave none.

    Truthiness is :attr:`acquired`.
    """

    acquired: bool
    lease: Lease | None = None
    reason: str | None = None
    holder_ttl: float | None = None
    holder_run: str | None = None

    def __bool__(self) -> bool:
        return self.acquired


@dataclasses.dataclass(frozen=True)
class HolderInfo:
    """What :meth:`Locks.holder` tells about a held lease. Never the owner token.

    Attributes:
        key: the user's lease key.
        holder: the holder metadata stored at acquire/claim (``dict``; by default ``host`` and
            ``pid`` plus what the caller passed, e.g. task name and id).
        fencing_token: the lease's fencing token (``int``) or ``None``.
        ttl: seconds (float) left before the lease expires; ``None`` when it has no expiry.
        since: Unix epoch seconds (float) when the lease was acquired, per the server clock.
        run_id: the holder's run id (given at acquire/claim), or ``None``.
        slot: the holder's slot (``int``; 0 for a plain lease, 0..N-1 under a limit).
    """

    key: str
    holder: dict[str, Any]
    fencing_token: int | None
    ttl: float | None
    since: float | None
    run_id: str | None = None
    slot: int = 0
