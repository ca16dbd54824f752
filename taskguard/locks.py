"""The lease API shared by :class:`~taskguard.RedisLocks` and :class:`~taskguard.MemoryLocks`.

Backends implement a handful of primitives (``_try_acquire``, ``_renew_one``, ...); everything a
user calls — waiting, handles, claiming, ``with_lease``, events, the heartbeat — lives here once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from .clock import LOCAL, Clock
from .errors import ConfigError, LeaseBackendError, LeaseLost
from .events import Emitter, LeaseEvent, Listener
from .heartbeat import get_heartbeat
from .lease import Acquisition, HolderInfo, Lease, slot_of, slot_suffix
from .liveness import process_identity
from .skipped import Skipped
from .throttle import Throttle
from .validate import (  # noqa: F401
    MAX_SECONDS,
    MIN_TTL,
    check_burst,
    check_fraction,
    check_key,
    check_limit,
    check_name,
    check_prefix,
    check_rate,
    check_run_id,
    check_seconds,
    check_token,
    check_ttl,
    check_value,
    encodable,
)

__all__ = ["Locks", "check_seconds", "check_fraction", "new_owner_token"]

log = logging.getLogger("taskguard")
T = TypeVar("T")

ON_LOST = ("raise", "warn")


def new_owner_token() -> str:
    """A fresh owner token: 144 random bits from :mod:`secrets`, URL-safe text."""
    return secrets.token_urlsafe(18)


_BASE_META: dict[int, tuple[dict[str, Any], str]] = {}  # per pid: default holder metadata and its JSON


def _task_of(meta: Mapping[str, Any]) -> str | None:
    name = meta.get("task") or meta.get("job")
    return name if isinstance(name, str) else None


def _finished_id(run_id: str | None, delivery: Any) -> str | None:
    """The identity a finished run is recorded under: ``run_id``, or ``run_id#delivery``."""
    if delivery is None or run_id is None:
        return run_id
    if not isinstance(delivery, str) or not delivery:
        raise ConfigError(f"delivery must be a non-empty str or None, got {delivery!r}")
    return run_id + "#" + encodable("delivery", delivery)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


#: Record of a key holding shadow mode's queued mark of a task (``shadow-q:<task>``: the run id).
SHADOW_QUEUED = "shadow-q:"

class Locks:
    """Base of the lease backends. Not used directly.

    Args:
        prefix: prefix of every Redis key this object touches: 1-64 characters of
            ``A-Z a-z 0-9 _ - . :`` (:func:`~taskguard.validate.check_prefix`; ConfigError otherwise).
        renew_fraction: the heartbeat renews a lease every ``ttl * renew_fraction`` seconds;
            a number in (0, 0.5], default 1/3.
        max_hold: default bound in seconds on how long the heartbeat keeps renewing one lease
            (``None``: no bound).
        shutdown_timeout: seconds :meth:`close` spends releasing live leases (default 5).
        listeners: callables receiving each :class:`~taskguard.events.LeaseEvent`.

    Attribute ``clock`` (a :class:`taskguard.clock.Clock`, default the local clocks): its
    ``monotonic()`` measures how long a handle presumes its lease held; its ``time()`` gives the
    informational ``expires_at`` of handles.
    """

    clock: Clock = LOCAL

    def __init__(
        self,
        *,
        prefix: str = "taskguard",
        renew_fraction: float = 1 / 3,
        max_hold: float | None = None,
        shutdown_timeout: float = 5.0,
        listeners: Iterable[Listener] = (),
    ) -> None:
        self.prefix = check_prefix(prefix)
        self.renew_fraction = check_fraction(renew_fraction)
        self.max_hold = None if max_hold is None else check_seconds("max_hold", max_hold)
        self.shutdown_timeout = check_seconds("shutdown_timeout", shutdown_timeout)
        self._emitter = Emitter(listeners)
        self._live: weakref.WeakSet[Lease] = weakref.WeakSet()

    # -- backend primitives ------------------------------------------------------------------
    def _now(self) -> float:
        return self.clock.time()

    def server_time(self) -> float:
        """The backend's clock: Unix epoch seconds (float) — for Redis, the server's ``TIME``.
        Raises LeaseBackendError when Redis fails."""
        return self.clock.time()

    def server_clock(self) -> Clock:
        """A :class:`~taskguard.clock.Clock` whose ``time()`` follows the backend's clock (for
        Redis: a :class:`~taskguard.clock.ServerClock`, one per locks object, reading ``TIME`` at
        most once a minute unless refreshed) and whose ``monotonic()`` is :attr:`clock`'s. For
        instants compared across hosts (beat's slots, a deferred run's turn)."""
        return self.clock

    def _try_acquire(self, key: str, owner: str, ttl: float, holder_json: str, run_id: str | None,
                     wait: float = 0.0, refuse_finished: bool = False, finished_id: str | None = None,
                     markers: bool = True, limit: int = 1) -> tuple[int, int | None, float | None, str | None, int]:
        """-> (1 acquired | 0 held | 2 run already finished, fencing token, holder's TTL seconds or
        None, holder's run id or None, the slot taken). ``wait``: seconds the caller will wait if
        the lease is held (0: it will not). ``limit``: holders admitted at once; when held, the
        holder reported is another execution of ``run_id`` if one holds a slot, else the holder
        whose lease ends first. Slot ``i``'s owner token is ``owner + slot_suffix(i)``."""
        raise NotImplementedError

    def _wait_signal(self, key: str, timeout: float) -> None:
        """Block up to ``timeout`` seconds or until a release of ``key`` is signalled."""
        raise NotImplementedError

    def _renew_one(self, key: str, owner: str, ttl: float) -> bool:
        raise NotImplementedError

    def _renew_many(self, items: Sequence[tuple[str, str, float]]) -> list[Any]:
        """Renew several leases; one outcome each: ``True``, ``False`` or an exception."""
        out: list[Any] = []
        for key, owner, ttl in items:
            try:
                out.append(self._renew_one(key, owner, ttl))
            except LeaseBackendError as e:
                out.append(e)
        return out

    def _release_one(self, key: str, owner: str, finished_run: str | None = None,
                     finished_ttl: float | None = None) -> bool:
        raise NotImplementedError

    def _release_storing_one(self, key: str, owner: str, finished_run: str, finished_ttl: float | None,
                             record: str, record_ttl: float) -> bool:
        """Release and write the key's completion record in one atomic step (see
        :data:`taskguard.scripts.RELEASE_STORING`)."""
        raise NotImplementedError

    def _get_completion(self, key: str) -> str | None:
        """The key's completion record (``once=True``), or ``None``."""
        raise NotImplementedError

    def _claim_one(self, key: str, owner: str, new_owner: str, ttl: float, holder_json: str,
                   run_id: str | None = None) -> tuple[bool, int | None, float | None]:
        """-> (claimed, fencing token, PTTL seconds of the key when not claimed; -2.0 if absent)."""
        raise NotImplementedError

    def _holders_one(self, key: str) -> list[HolderInfo]:
        raise NotImplementedError

    def _owns_one(self, key: str, owner: str) -> bool:
        raise NotImplementedError

    # -- listeners ---------------------------------------------------------------------------
    def add_listener(self, fn: Listener) -> Callable[[], None]:
        """Register ``fn`` for this object's :class:`~taskguard.events.LeaseEvent` s."""
        return self._emitter.add_listener(fn)

    def _emit(self, kind: str, key: str, status: str, **fields: Any) -> None:
        # hot paths test self._emitter.active first, so that no event (nor its fields) is built
        # when nobody listens
        if self._emitter.active:
            self._emitter.emit(LeaseEvent(kind, key, status, **fields))

    # -- public API ----------------------------------------------------------------------------
    def acquire(
        self,
        key: str,
        *,
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
    ) -> Acquisition:
        """Try to take the lease on ``key`` for ``ttl`` seconds, waiting up to ``wait`` seconds.

        The lease and its next fencing token are set in one atomic step. While waiting, the
        caller wakes when the holder releases (a release signal) or when the holder's lease
        expires, not by tight polling.

        With ``limit=N`` up to N holders hold ``key`` at once (a fenced semaphore): each is a
        full lease in one of N slots (:attr:`Lease.slot`), with its own owner token, expiry and
        fencing token, which grows per (key, slot) — so storage fences per slot, e.g. a row per
        slot, where one per-key token would reject the older of two legitimate holders. A
        crashed holder's slot comes back when its TTL runs out; renew, release, claim and the
        heartbeat work per holder as for a plain lease. Another execution of the same
        ``run_id`` never takes a second slot (reported as holding). Lowering N later never
        admits more than N new holders beside those still in higher slots.

        Args:
            key: the user's lease key (non-empty ``str``).
            ttl: lease time-to-live in seconds (float > 0).
            wait: how long to wait for a held lease, seconds (float >= 0; 0 = try once).
            holder: non-secret JSON-serializable metadata stored with the lease (e.g. task name,
                task id); ``host`` and ``pid`` are added unless given.
            renew: keep the lease alive with the process heartbeat until released.
            max_hold: stop renewing after this many seconds (default: the object's ``max_hold``).
            run_id: the identity of the run asking (e.g. a task id), recorded with the lease (see
                :meth:`release_run`) and reported to other callers as ``holder_run``.
            refuse_finished: refuse the lease (reason ``"duplicate"``) when the run ``run_id``
                already finished under ``key`` (``lease.release(finished=True)``: it is the last
                run recorded as finished on ``key``, or its finished marker still exists). For a
                redelivered copy of a run. Without it, an acquisition by ``run_id`` starts a new
                run of that id and clears its finished marker.
            delivery: which delivery of ``run_id`` this is (e.g. a publish stamp), when one id
                can be run more than once: finished runs are then recorded and refused per
                (``run_id``, ``delivery``), so a new delivery of the same id is never taken for a
                copy of an earlier one.
            markers: with ``refuse_finished``, also look for the run's own finished marker (one
                more key in the script; see :mod:`taskguard.scripts`). ``False`` when the caller
                never writes markers (``release(finished_ttl=None)``): the key's last finished
                run is still checked.
            limit: how many holders may hold ``key`` at once (``int``, 1 to
                :data:`~taskguard.validate.MAX_LIMIT`; default 1, a plain lease). Every caller
                of one key should pass the same limit.

        Returns:
            :class:`~taskguard.Acquisition`; when not acquired, ``reason`` is ``"held"``
            (``wait == 0``, limit 1), ``"limit"`` (``wait == 0``, limit > 1: N holders are in),
            ``"wait_timeout"`` or ``"duplicate"``, ``holder_ttl`` the time left on the holder
            whose lease ends first and ``holder_run`` the holder's run id (when one holder is
            in; under a limit, another execution of ``run_id`` if one holds a slot, else
            ``None``).

        Raises:
            ConfigError: invalid ``key``, ``ttl``, ``wait``, ``max_hold``, ``limit`` or ``holder``.
            LeaseBackendError: Redis unreachable or failing. Never reported as "held".
        """
        key = check_key(key)
        ttl = check_ttl(ttl)
        wait = check_seconds("wait", wait, allow_zero=True)
        max_hold = self.max_hold if max_hold is None else check_seconds("max_hold", max_hold)
        run_id = check_run_id(run_id)
        limit = check_limit(limit)
        finished_id = _finished_id(run_id, delivery)
        meta, meta_json = self._holder_meta(holder)
        owner = new_owner_token()
        started = time.monotonic()
        deadline = started + wait
        while True:
            sent_mono, sent_at = self.clock.monotonic(), self.clock.time()
            try:
                remaining = max(0.0, deadline - time.monotonic())
                code, fence, holder_ttl, holder_run, slot = self._try_acquire(
                    key, owner, ttl, meta_json, run_id, remaining, refuse_finished and run_id is not None,
                    finished_id, markers, limit)
            except LeaseBackendError as e:
                self._emit("acquire", key, "error", duration=time.monotonic() - started, ttl=ttl, error=str(e),
                           task=_task_of(meta))
                raise
            if code == 2:
                self._emit("acquire", key, "duplicate", duration=time.monotonic() - started, ttl=ttl,
                           task=_task_of(meta))
                return Acquisition(False, None, "duplicate")
            if code == 1:
                lease = Lease(self, key, owner + slot_suffix(slot), ttl=ttl, fencing_token=fence,
                              expires_at=sent_at + ttl, holder=meta, run_id=run_id, deadline=sent_mono + ttl)
                lease.finished_id = finished_id
                self._track(lease, renew, max_hold)
                if self._emitter.active:
                    self._emit("acquire", key, "acquired", duration=time.monotonic() - started,
                               fencing_token=fence, ttl=ttl, holder=meta, task=_task_of(meta))
                return Acquisition(True, lease)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = "wait_timeout" if wait > 0 else ("limit" if limit > 1 else "held")
                self._emit("acquire", key, reason, duration=time.monotonic() - started, ttl=ttl, task=_task_of(meta))
                return Acquisition(False, None, reason, holder_ttl, holder_run)
            pause = remaining if holder_ttl is None or holder_ttl < 0 else min(remaining, holder_ttl + 0.001)
            try:
                self._wait_signal(key, pause)
            except LeaseBackendError as e:
                self._emit("acquire", key, "error", duration=time.monotonic() - started, ttl=ttl, error=str(e),
                           task=_task_of(meta))
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
        """Rebuild a handle from persisted values, without a round trip.

        Nothing is invented: ``expires_at`` and ``fencing_token`` stay ``None`` unless given. A
        given ``expires_at`` (epoch seconds) is turned once, against this host's wall clock, into
        the monotonic deadline by which the handle presumes the lease gone (without it, only a
        renew or release tells).
        Redis checks ``owner_token`` atomically on every renew and release, so a forged or stale
        token can neither extend nor release anyone's lease. ``ttl`` (seconds) is what renewals
        use; ``renew=True`` registers the handle with the heartbeat.

        Raises ConfigError for an empty key or token, or a bad ``ttl``.
        """
        key = check_key(key)
        ttl = check_ttl(ttl)
        check_token(owner_token)
        if fencing_token is not None and (isinstance(fencing_token, bool) or not isinstance(fencing_token, int)):
            raise ConfigError("fencing_token must be an int or None")
        lease = Lease(self, key, owner_token, ttl=ttl, fencing_token=fencing_token, expires_at=expires_at)
        self._track(lease, renew, self.max_hold)
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
    ) -> Acquisition:
        """One-shot takeover of a persisted handle (e.g. by a retry of the task that held it).

        Atomically: if ``owner_token`` still owns ``key``, swap in a fresh owner token, keep the
        fencing token, record ``holder`` and set the TTL to ``ttl`` seconds. The persisted token
        stops working at once, so of two claims with the same persisted token exactly one
        succeeds.

        Returns an :class:`~taskguard.Acquisition` holding the new handle, or, when not claimed,
        ``reason="not_owner"`` (another owner holds the key; ``holder_ttl`` its time left) or
        ``reason="expired"`` (no lease exists: acquire afresh, which gives a larger fence).
        ``run_id`` and ``delivery`` are recorded on the new handle (see :meth:`acquire`).

        Raises ConfigError for bad arguments, LeaseBackendError when Redis fails.
        """
        key = check_key(key)
        ttl = check_ttl(ttl)
        check_token(owner_token)
        max_hold = self.max_hold if max_hold is None else check_seconds("max_hold", max_hold)
        run_id = check_run_id(run_id)
        meta, meta_json = self._holder_meta(holder)
        new_owner = new_owner_token() + slot_suffix(slot_of(owner_token))  # the claim keeps the slot
        started = time.monotonic()
        sent_mono, sent_at = self.clock.monotonic(), self.clock.time()
        try:
            ok, fence, pttl = self._claim_one(key, owner_token, new_owner, ttl, meta_json, run_id)
        except LeaseBackendError as e:
            self._emit("claim", key, "error", duration=time.monotonic() - started, ttl=ttl, error=str(e))
            raise
        took = time.monotonic() - started
        if not ok:
            reason = "expired" if pttl is not None and pttl == -2 else "not_owner"
            self._emit("claim", key, reason, duration=took, ttl=ttl)
            return Acquisition(False, None, reason, None if reason == "expired" else pttl)
        lease = Lease(self, key, new_owner, ttl=ttl, fencing_token=fence, expires_at=sent_at + ttl, holder=meta,
                      run_id=run_id, deadline=sent_mono + ttl)
        lease.finished_id = _finished_id(run_id, delivery)
        self._track(lease, renew, max_hold)
        self._emit("claim", key, "claimed", duration=took, fencing_token=fence, ttl=ttl, holder=meta,
                   task=_task_of(meta))
        return Acquisition(True, lease)

    def release_run(self, key: str, run_id: str) -> bool:
        """Release ``key`` on behalf of the run ``run_id`` (given at acquire/claim), without its
        owner token: for a supervisor that knows the run is over but never had its handle (e.g.
        a Celery worker's main process after a hard time limit killed the child). Returns
        ``True`` when the lease was that run's and is now released. Raises LeaseBackendError."""
        checked = check_run_id(run_id)
        if checked is None:
            raise ConfigError("run_id is required")
        run_id = checked
        started = time.monotonic()
        ok = self._release_run(check_key(key), run_id)
        self._emit("release", key, "released_for_run" if ok else "not_owner", duration=time.monotonic() - started)
        return ok

    def _release_run(self, key: str, run_id: str) -> bool:
        raise NotImplementedError

    def force_release(self, key: str) -> bool:
        """Delete the lease on ``key`` whoever holds it (an operator's tool, e.g. ``taskguard
        release KEY --force``): the holder finds it lost at its next renewal or release, and its
        fenced writes still carry the old, now lower, fencing token. Returns ``True`` when a lease
        was there. Raises ConfigError for a bad key, LeaseBackendError when Redis fails."""
        key = check_key(key)
        ok = self._force_release_one(key)
        self._emit("release", key, "forced" if ok else "no_lease")
        return ok

    def _force_release_one(self, key: str) -> bool:
        raise NotImplementedError

    def holder(self, key: str) -> HolderInfo | None:
        """Who holds ``key``: holder metadata, fencing token and remaining TTL (seconds), or
        ``None`` when no lease is held (under a limit: the holder in the lowest slot; see
        :meth:`holders`). Never returns the owner token.
        Raises LeaseBackendError when Redis fails."""
        held = self._holders_one(check_key(key))
        return held[0] if held else None

    def holders(self, key: str) -> list[HolderInfo]:
        """Every holder of ``key`` (one for a plain lease, up to N under ``limit=N``), by slot:
        a list of :class:`~taskguard.lease.HolderInfo` (never an owner token); empty when none.
        Raises ConfigError for a bad key, LeaseBackendError when Redis fails."""
        return self._holders_one(check_key(key))

    def with_lease(
        self,
        key: str,
        fn: Callable[[Lease], T],
        *,
        ttl: float,
        wait: float = 0.0,
        renew: bool = True,
        holder: Mapping[str, Any] | None = None,
        max_hold: float | None = None,
        on_lost: str = "raise",
        task: str | None = None,
        limit: int = 1,
    ) -> T | Skipped:
        """Run ``fn(lease)`` under the lease on ``key`` and return its value.

        Returns a :class:`~taskguard.Skipped` (reason ``"held"``, ``"limit"`` or
        ``"wait_timeout"``) when the lease could not be had (``limit``: as for :meth:`acquire`),
        and emits a ``skip`` event. With ``renew=True`` the heartbeat keeps the lease alive while
        ``fn`` runs. After ``fn`` returns, the release itself checks
        that this owner still held the lease; if it did not (or the heartbeat found it lost),
        ``on_lost="raise"`` raises :class:`~taskguard.LeaseLost` and ``on_lost="warn"`` logs,
        reports and returns the value. An exception from ``fn`` propagates unchanged; a Redis
        error while releasing after it is logged, never raised in its place.

        Raises ConfigError for bad arguments, LeaseBackendError when Redis fails at acquire.
        """
        from .run import GuardedRun

        run = GuardedRun(self, key, ttl=ttl, wait=wait, renew=renew, holder=holder, max_hold=max_hold,
                         on_lost=on_lost, task=task, limit=limit)
        result: T | Skipped = run.call(fn)  # (GuardedRun.call is untyped in fn's value)
        return result

    def once(
        self,
        key: str,
        fn: Callable[[Lease], T],
        *,
        ttl: float,
        once_ttl: float = 86400.0,
        fingerprint: Any = None,
        wait: float = 0.0,
        renew: bool = True,
        holder: Mapping[str, Any] | None = None,
        task: str | None = None,
    ) -> T | Skipped:
        """Run ``fn(lease)`` once per ``key``: the first call that *completes* stores its value
        (JSON, kept ``once_ttl`` seconds, written atomically with the lease's release); later
        calls with the same ``key`` and ``fingerprint`` do not run ``fn`` and return the stored
        value. A call that raises stores nothing, so the next call runs. While a call runs,
        others get a :class:`~taskguard.Skipped` (reason ``"held"``/``"wait_timeout"``) as from
        :meth:`with_lease`. "Completed once", not exactly-once: see :mod:`taskguard.once`.

        Args:
            key: the business key (``str``).
            fn: the work, called with the held :class:`~taskguard.Lease`; its value must be
                JSON-serialisable (at most 1 MiB).
            ttl, wait, renew, holder, task: as for :meth:`with_lease`.
            once_ttl: seconds the completion record is kept (default 1 day).
            fingerprint: what work the call asks for: any JSON-serialisable value (hashed), or
                ``None`` (every call of ``key`` is the same work).

        Raises:
            IdempotencyConflict: ``key`` was completed by a call with another fingerprint.
            ConfigError: bad arguments, a fingerprint or value with no JSON form, a value over
                1 MiB (raised after ``fn`` ran; nothing stored).
            LeaseBackendError: Redis unreachable or failing.
        """
        from .once import OncePolicy, fingerprint_of
        from .run import GuardedRun

        policy = OncePolicy(fingerprint_of(fingerprint), ttl=check_seconds("once_ttl", once_ttl))
        run = GuardedRun(self, key, ttl=ttl, wait=wait, renew=renew, holder=holder, task=task, once=policy)
        result: T | Skipped = run.call(fn)  # (GuardedRun.call is untyped in fn's value)
        return result

    # -- publish-time uniqueness -------------------------------------------------------------------
    def mark_queued(self, key: str, run_id: str, *, ttl: float, task: str, shadow: bool = False) -> tuple[bool, str]:
        """Before publishing run ``run_id`` of task ``task`` on ``key`` (``unique=True``):
        atomically, if a run of that task on ``key`` is queued (marked and unexpired) or running
        (a live holder whose metadata names the task, with its task / job id), answer ``(False,
        that run's id)``; else mark ``run_id`` as queued for ``ttl`` seconds and answer ``(True,
        run_id)``. Other tasks sharing the key neither suppress nor are suppressed. The mark is
        cleared by :meth:`clear_queued` (the run took its lease, was skipped, revoked, or its
        publish failed) and otherwise expires. One single-key script.

        ``shadow=True`` (shadow mode: the caller publishes whatever the answer, and reports a
        ``False``): the same decision against a *shadow* mark of its own (the record
        ``shadow-q:<task>`` of ``key``), never the enforced mark, so that each publish is told
        what enforcement would first have answered; a live holder of the task counts as running,
        as above. Checked and set in two steps (a report only, never a guard).

        Raises ConfigError for bad arguments, LeaseBackendError when Redis fails: the call may
        have marked ``run_id`` before its answer was lost (a timeout), so the mark is cleared
        first (one try; when that fails too, the mark's ``ttl`` bounds it), and the caller
        publishes nothing."""
        checked = check_run_id(run_id)
        if checked is None:
            raise ConfigError("run_id is required")
        run_id = checked
        if not isinstance(task, str) or not task:
            raise ConfigError(f"task must be a non-empty str, got {task!r}")
        key, task = check_key(key), encodable("task", task)
        ttl = check_seconds("ttl", ttl)
        if shadow:
            return self._mark_queued_shadow(key, run_id, ttl, task)
        try:
            return self._mark_queued_one(key, run_id, ttl, task)
        except LeaseBackendError:
            try:
                self._clear_queued_one(key, run_id, task)
            except LeaseBackendError as e:
                log.warning("could not clear the queued mark of %r after a failed mark (its TTL bounds it): %s",
                            key, e)
            raise

    def clear_queued(self, key: str, run_id: str, task: str, shadow: bool = False) -> bool:
        """Clear the queued mark of ``task`` on ``key`` if it names ``run_id`` (``shadow=True``:
        the shadow mark, see :meth:`mark_queued`). Returns ``True`` when it did. Raises
        LeaseBackendError when Redis fails."""
        if shadow:
            return self.delete_record(key, SHADOW_QUEUED + task, if_value=run_id)
        return self._clear_queued_one(check_key(key), run_id, task)

    def _mark_queued_shadow(self, key: str, run_id: str, ttl: float, task: str) -> tuple[bool, str]:
        for info in self.holders(key):
            meta = info.holder if isinstance(info.holder, dict) else {}
            if task in (meta.get("task"), meta.get("job")):
                found = meta.get("task_id") or meta.get("job_id")
                if isinstance(found, str) and found:
                    return False, found
        if self.put_record(key, SHADOW_QUEUED + task, run_id, ttl=ttl, if_absent=True):
            return True, run_id
        return False, self.get_record(key, SHADOW_QUEUED + task) or run_id

    def _mark_queued_one(self, key: str, run_id: str, ttl: float, task: str) -> tuple[bool, str]:
        raise NotImplementedError

    def _clear_queued_one(self, key: str, run_id: str, task: str) -> bool:
        raise NotImplementedError

    def report_suppressed(self, key: str, task: str | None, existing: str, shadow: bool = False) -> None:
        """Emit the ``publish`` event (status ``"suppressed"``) of a publish that found ``existing``
        queued or running (adapters; the metric ``taskguard_publishes_suppressed_total``).
        ``shadow=True``: shadow mode would have suppressed it (it was published; the metric
        ``taskguard_skips_total{reason="unique",shadow="true"}``)."""
        self._emit("publish", key, "suppressed", task=task, shadow=shadow)

    # -- records (small values kept for callers under a lease key's hash tag) ---------------------
    def put_record(self, key: str, name: str, value: str, *, ttl: float, if_absent: bool = False,
                   if_value: str | None = None) -> bool:
        """Keep ``value`` (``str``) as the record ``name`` of lease key ``key`` for ``ttl`` seconds.

        Records live beside the lease (one Redis Cluster slot with it) and are what the adapters
        keep per run: a beat slot's marker, an RQ job's persisted handle, a deferred copy's nonce.
        Conditions, checked atomically with the write: ``if_absent`` (only when no record
        exists), ``if_value`` (only when the record holds exactly this value), both (either).
        Returns ``True`` when written. Raises ConfigError for bad arguments, LeaseBackendError
        when Redis fails."""
        if if_value is not None and not isinstance(if_value, str):
            raise ConfigError("if_value must be a str or None")
        cond = ("absent_or_eq" if if_absent else "eq") if if_value is not None else ("absent" if if_absent else "any")
        return self._put_record(check_key(key), check_name(name), check_value(value),
                                check_seconds("ttl", ttl), cond, if_value or "")

    def get_record(self, key: str, name: str) -> str | None:
        """The record ``name`` of ``key``, or ``None``. Raises LeaseBackendError."""
        return self._get_record(check_key(key), check_name(name))

    def delete_record(self, key: str, name: str, *, if_value: str | None = None) -> bool:
        """Delete the record ``name`` of ``key`` (only if it holds ``if_value``, when given).
        Returns ``True`` when deleted. Raises LeaseBackendError."""
        return self._delete_record(check_key(key), check_name(name), if_value or "")

    def count_record(self, key: str, name: str, *, by: int = 1, ttl: float | None = None) -> int:
        """Add ``by`` (``int``, may be negative) to the integer record ``name`` of ``key`` (a
        missing record counts as 0) and return the sum (``int``); ``ttl`` (seconds, float) sets
        the record's expiry, ``None`` keeps the one it has. One ``INCRBY`` (with ``PEXPIRE`` in one
        transaction when ``ttl`` is given). A call re-sent by the Redis client after it ran (a timeout
        under a retry policy) adds ``by`` twice.

        Raises ConfigError for a ``by`` that is not an ``int``, a bad key, name or ``ttl``, and
        when the record holds something other than an integer (written by :meth:`put_record`) or
        the sum would leave the signed 64-bit range; LeaseBackendError when Redis fails."""
        if isinstance(by, bool) or not isinstance(by, int):
            raise ConfigError("by must be an int")
        return self._count_record(check_key(key), check_name(name), by,
                                  None if ttl is None else check_seconds("ttl", ttl))

    @staticmethod
    def _not_a_counter(key: str, name: str) -> ConfigError:
        return ConfigError(f"record {name!r} of key {key!r} does not hold an integer (or the sum leaves the "
                           "signed 64-bit range): count_record counts only records it made")

    def get_lease_record(self, key: str, name: str) -> str | None:
        """The lease record ``name`` of ``key`` (written by a holder with
        :meth:`Lease.put_record`), or ``None``. Anyone may read it. Raises LeaseBackendError."""
        return self._get_lease_record(check_key(key), check_name(name))

    # -- rates ----------------------------------------------------------------------------------
    def throttle(self, key: str, *, rate: Any, burst: int | None = None, book_within: float = 0.0,
                 consume: bool = True, shadow: bool = False) -> Throttle:
        """One call under a cluster-wide rate for ``key``: ``rate`` is ``"N/s"``, ``"N/m"``,
        ``"N/h"``, ``"N/d"`` or ``(count, seconds)``; ``burst`` (default 1: evenly spaced) calls
        may pass at once. Over any window of ``t`` seconds at most ``burst + t x count / period``
        calls pass, across every process (GCRA, :mod:`taskguard.throttle`; one key, O(1)
        memory, one round trip, the Redis server's clock).

        A denied call gets ``retry_after`` seconds. With ``book_within`` (seconds, default 0: never)
        a denied call whose turn is at most that far away *books* it (``booked=True``): that
        turn is reserved for it, so come back at ``retry_after`` and go ahead without asking
        again; denied callers then get distinct turns instead of stampeding at the same instant.
        ``consume=False`` only checks: the answer a call would get now, with nothing counted or
        booked. ``shadow=True`` counts (and books) in the *shadow* state of ``key``, a rate state
        of its own that enforced calls never see and that never consumes theirs: shadow mode's
        calls, so that each gets the answer enforcement would have given it (see
        :func:`taskguard.pacing.shadow_check`).

        Returns a :class:`~taskguard.throttle.Throttle`. Raises ConfigError for a bad rate,
        burst or key, LeaseBackendError when Redis fails."""
        count, period = check_rate(rate)
        burst = 1 if burst is None else check_burst(burst)
        book = check_seconds("book_within", book_within, allow_zero=True)
        interval_us = max(int(round(period / count * 1e6)), 1)
        code, wait_us, remaining = self._throttle_one(check_key(key), interval_us, (burst - 1) * interval_us,
                                                      int(book * 1e6) if consume else 0, consume, bool(shadow))
        return Throttle(allowed=code == 1, retry_after=wait_us / 1e6, remaining=remaining, booked=code == 2)

    def _throttle_one(self, key: str, interval_us: int, tau_us: int, book_us: int,
                      consume: bool = True, shadow: bool = False) -> tuple[int, int, int]:
        raise NotImplementedError

    def _put_lease_record(self, lease: Lease, name: str, value: str, if_absent: bool, if_value: str | None) -> bool:
        if if_value is not None and not isinstance(if_value, str):
            raise ConfigError("if_value must be a str or None")
        cond = ("absent_or_eq" if if_absent else "eq") if if_value is not None else ("absent" if if_absent else "any")
        name, value = check_name(name), check_value(value)
        if lease.inherited:
            raise LeaseLost(lease.key, "inherited from the parent process")
        lease.ensure_held()
        code = self._put_lease_record_one(lease.key, lease.owner_token, name, value, cond, if_value or "")
        if code < 0:
            lease._mark_lost("not held in Redis")
            raise LeaseLost(lease.key, lease.lost_reason or "not held in Redis")
        return code == 1

    def _put_lease_record_one(self, key: str, owner: str, name: str, value: str, cond: str, expect: str) -> int:
        raise NotImplementedError

    def _get_lease_record(self, key: str, name: str) -> str | None:
        raise NotImplementedError

    def _put_record(self, key: str, name: str, value: str, ttl: float, cond: str, expect: str) -> bool:
        raise NotImplementedError

    def _get_record(self, key: str, name: str) -> str | None:
        raise NotImplementedError

    def _delete_record(self, key: str, name: str, expect: str) -> bool:
        raise NotImplementedError

    def _count_record(self, key: str, name: str, by: int, ttl: float | None) -> int:
        raise NotImplementedError

    def report_skip(self, skipped: Skipped, shadow: bool = False) -> None:
        """Emit the ``skip`` event for a run skipped outside :meth:`with_lease` (adapters);
        ``shadow=True`` for a skip a guard in shadow mode would have made (the run went ahead)."""
        self._emit("skip", skipped.key, skipped.reason, task=skipped.task, shadow=shadow)

    def check_health(self) -> Health:
        raise NotImplementedError

    def close(self, timeout: float | None = None) -> None:
        """Release every lease this object still holds in this process (best effort), spending
        at most ``timeout`` seconds (default :attr:`shutdown_timeout`); leases left unreleased
        then expire by their TTL."""
        deadline = time.monotonic() + (self.shutdown_timeout if timeout is None else timeout)
        live = [lease for lease in list(self._live) if not lease.released and not lease.inherited]
        for lease in live:  # none of them is renewed any more, released below or not
            if lease._renewing:
                get_heartbeat().discard(lease)
        for lease in live:
            if time.monotonic() >= deadline:
                log.warning("close() ran out of time; remaining leases expire by their TTL")
                break
            if not lease.released:
                try:
                    lease.release()
                except LeaseBackendError as e:
                    log.warning("could not release lease %r at close: %s", lease.key, e)

    # -- handle operations (called by Lease) ------------------------------------------------
    def _track(self, lease: Lease, renew: bool, max_hold: float | None) -> None:
        self._live.add(lease)
        if renew:
            lease._renewing = True
            get_heartbeat().add(lease, self.renew_fraction, max_hold)

    def _renew_lease(self, lease: Lease, ttl: float | None) -> bool:
        ttl = lease.ttl if ttl is None else check_ttl(ttl)
        if lease.inherited or lease.released or lease._lost_reason is not None:
            return False
        started, sent_mono, sent_at = time.monotonic(), self.clock.monotonic(), self.clock.time()
        try:
            ok = self._renew_one(lease.key, lease.owner_token, ttl)
        except LeaseBackendError as e:
            self._emit("renew", lease.key, "error", duration=time.monotonic() - started, ttl=ttl, error=str(e),
                       task=lease.task)
            raise
        self._emit("renew", lease.key, "renewed" if ok else "not_owner", duration=time.monotonic() - started,
                   fencing_token=lease.fencing_token, ttl=ttl, task=lease.task)
        if ok:
            lease._extended(sent_mono, sent_at, ttl)
        else:
            get_heartbeat().discard(lease)
            lease._mark_lost("renew found another owner or no lease")
        return ok

    def _release_lease(self, lease: Lease, finished: bool = False, finished_ttl: float | None = None,
                       store: tuple[str, float] | None = None) -> bool:
        """Release ``lease``; with ``store`` (record, TTL seconds), also write the key's completion
        record atomically with the release (the run finished)."""
        if lease.inherited or lease.released:
            return False
        if lease._renewing:
            get_heartbeat().discard(lease)
        started = time.monotonic()
        try:
            if finished_ttl is not None:
                finished_ttl = check_seconds("finished_ttl", finished_ttl)
            if store is not None:
                ok = self._release_storing_one(lease.key, lease.owner_token, lease.finished_id or "", finished_ttl,
                                               store[0], store[1])
            else:
                ok = self._release_one(lease.key, lease.owner_token, lease.finished_id if finished else None,
                                       finished_ttl if finished else None)
        except LeaseBackendError as e:
            self._emit("release", lease.key, "error", duration=time.monotonic() - started, error=str(e),
                       task=lease.task)
            raise
        if self._emitter.active:
            self._emit("release", lease.key, "released" if ok else "not_owner", duration=time.monotonic() - started,
                       fencing_token=lease.fencing_token, task=lease.task)
        if ok:
            lease._mark_released()
        else:
            lease._mark_lost("release found another owner or no lease")
            lease._mark_released()
        self._live.discard(lease)
        return ok

    def _verify_lease(self, lease: Lease) -> bool:
        if lease.inherited:
            return False
        ok = self._owns_one(lease.key, lease.owner_token)
        if not ok:
            lease._mark_lost("not held in Redis")
        return ok

    def _holder_meta(self, holder: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
        pid = os.getpid()
        base = _BASE_META.get(pid)
        if base is None:
            ident = process_identity()
            base = _BASE_META[pid] = (ident, json.dumps(ident, separators=(",", ":")))
        if holder is None:
            return dict(base[0]), base[1]
        meta: dict[str, Any] = dict(base[0])
        if holder is not None:
            if not isinstance(holder, Mapping) or not all(isinstance(k, str) for k in holder):
                raise ConfigError("holder must be a mapping with str keys")
            meta.update(holder)
        try:
            return meta, json.dumps(meta, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"holder metadata must be JSON-serializable: {e}") from None


class Health:
    """Outcome of :meth:`check_health`: ``ok`` (bool; also the truthiness), ``latency`` (seconds,
    float, of the probe round trip, or ``None``), ``detail`` (readable, never a password)."""

    __slots__ = ("ok", "latency", "detail")

    def __init__(self, ok: bool, latency: float | None, detail: str) -> None:
        self.ok, self.latency, self.detail = ok, latency, detail

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Health(ok={self.ok}, latency={self.latency}, detail={self.detail!r})"
