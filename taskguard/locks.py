"""The public lease API, :class:`Locks`: a facade composing the policies over one backend.

A :class:`~taskguard.backend.Backend` (Redis: :class:`~taskguard.redis_backend.RedisBackend`;
in-process: :class:`~taskguard.memory_backend.MemoryBackend`) does the atomic steps; the policies
decide what to ask it — leases (:class:`~taskguard.leasing.Leases`), records
(:class:`~taskguard.records.Records`), rates (:class:`~taskguard.throttle.Rates`), completions
of ``once`` (:class:`~taskguard.completions.Completions`) and queue marks
(:class:`~taskguard.queue_marks.QueueMarks`). :class:`~taskguard.RedisLocks` and
:class:`~taskguard.MemoryLocks` pick the backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .backend import Backend, Health
from .clock import Clock
from .completions import Completions
from .events import Emitter, LeaseEvent, Listener
from .lease import Acquisition, HolderInfo, Lease
from .leasing import LeaseRequest, Leases, new_owner_token
from .once import OncePolicy, fingerprint_of
from .queue_marks import SHADOW_QUEUED, QueueMarks
from .records import Records
from .run import GuardedRun
from .skipped import Skipped
from .throttle import Rates, Throttle
from .validate import check_fraction, check_prefix, check_seconds

__all__ = ["Locks", "Health", "check_seconds", "check_fraction", "new_owner_token", "SHADOW_QUEUED"]

log = logging.getLogger("taskguard")
T = TypeVar("T")


class Locks:
    """The lease API over a backend. Not built directly: use :class:`~taskguard.RedisLocks` or
    :class:`~taskguard.MemoryLocks`.

    Args:
        backend: the :class:`~taskguard.backend.Backend` doing the atomic steps.
        prefix: prefix of every Redis key this object touches: 1-64 characters of
            ``A-Z a-z 0-9 _ - . :`` (:func:`~taskguard.validate.check_prefix`; ConfigError otherwise).
        renew_fraction: the heartbeat renews a lease every ``ttl * renew_fraction`` seconds;
            a number in (0, 0.5], default 1/3.
        max_hold: default bound in seconds on how long the heartbeat keeps renewing one lease
            (``None``: no bound).
        shutdown_timeout: seconds :meth:`close` spends releasing live leases (default 5).
        listeners: callables receiving each :class:`~taskguard.events.LeaseEvent`.

    Attributes: ``backend``; the policies ``leasing``, ``records``, ``rates``, ``completions`` and
    ``queue_marks``; ``clock`` (a :class:`taskguard.clock.Clock`, default the local clocks): its
    ``monotonic()`` measures how long a handle presumes its lease held; its ``time()`` gives the
    informational ``expires_at`` of handles.
    """

    #: Replicas that must acknowledge each acquisition and claim before it counts (``int``; 0:
    #: none waited for) and the longest wait for them (seconds): the defaults of
    #: :meth:`acquire` and :meth:`claim` (see :class:`~taskguard.RedisLocks`).
    replicas: int = 0
    replica_timeout: float = 0.1

    def __init__(
        self,
        backend: Backend,
        *,
        prefix: str = "taskguard",
        renew_fraction: float = 1 / 3,
        max_hold: float | None = None,
        shutdown_timeout: float = 5.0,
        listeners: Iterable[Listener] = (),
    ) -> None:
        self.prefix = check_prefix(prefix)
        renew_fraction = check_fraction(renew_fraction)
        max_hold = None if max_hold is None else check_seconds("max_hold", max_hold)
        self.shutdown_timeout = check_seconds("shutdown_timeout", shutdown_timeout)
        self._emitter = Emitter(listeners)
        self.backend = backend
        self.leasing = Leases(backend, self._emitter, renew_fraction, max_hold)
        self.records = Records(backend)
        self.rates = Rates(backend)
        self.completions = Completions(backend, self.leasing)
        self.queue_marks = QueueMarks(backend, self.records, self._emitter)

    @property
    def clock(self) -> Clock:
        return self.leasing.clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self.leasing.clock = clock

    @property
    def renew_fraction(self) -> float:
        return self.leasing.renew_fraction

    @property
    def max_hold(self) -> float | None:
        return self.leasing.max_hold

    @property
    def emitter(self) -> Emitter:
        """The :class:`~taskguard.events.Emitter` of this object's events."""
        return self._emitter

    def server_time(self) -> float:
        """The backend's clock: Unix epoch seconds (float) — for Redis, the server's ``TIME``.
        Raises LeaseBackendError when Redis fails."""
        return self.backend.server_time()

    def server_clock(self) -> Clock:
        """A :class:`~taskguard.clock.Clock` whose ``time()`` follows the backend's clock (for
        Redis: a :class:`~taskguard.clock.ServerClock`, one per locks object, reading ``TIME`` at
        most once a minute unless refreshed) and whose ``monotonic()`` is :attr:`clock`'s. For
        instants compared across hosts (beat's slots, a deferred run's turn)."""
        return self.clock

    # -- listeners ---------------------------------------------------------------------------
    def add_listener(self, fn: Listener) -> Callable[[], None]:
        """Register ``fn`` for this object's :class:`~taskguard.events.LeaseEvent` s."""
        return self._emitter.add_listener(fn)

    # -- leases ------------------------------------------------------------------------------
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
        replicas: int | None = None,
        replica_timeout: float | None = None,
        queued_mark: tuple[str, str] | None = None,
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
            replicas: how many replicas must acknowledge the acquisition (Redis ``WAIT``, on
                the connection that took it) before it is returned as acquired (``int`` 0 to
                16; default: the object's :attr:`replicas`). When fewer do within
                ``replica_timeout`` seconds (default: the object's), the lease is released
                again and the reason is ``"unreplicated"``.
            replica_timeout: seconds (float > 0, at most 60) to wait for those replicas.
            queued_mark: ``(task, run id)``: when the lease is acquired, the queued mark of
                ``task`` on ``key`` (:meth:`mark_queued`) is cleared in the same atomic step if
                it names that run id — the run has started, so it no longer counts as queued,
                and no crash between the two can leave the mark to its TTL. ``None`` (default):
                no mark is touched. A refused acquisition leaves the mark as it is; one given
                back as ``"unreplicated"`` had taken the lease, so the mark is gone with it.

        Returns:
            :class:`~taskguard.Acquisition`; when not acquired, ``reason`` is ``"held"``
            (``wait == 0``, limit 1), ``"limit"`` (``wait == 0``, limit > 1: N holders are in),
            ``"wait_timeout"``, ``"duplicate"`` or ``"unreplicated"``, ``holder_ttl`` the time left on the holder
            whose lease ends first and ``holder_run`` the holder's run id (when one holder is
            in; under a limit, another execution of ``run_id`` if one holds a slot, else
            ``None``).

        Raises:
            ConfigError: invalid ``key``, ``ttl``, ``wait``, ``max_hold``, ``limit``,
                ``replicas``, ``replica_timeout``, ``queued_mark`` or ``holder``; ``replicas`` > 0 on a Redis
                Cluster client.
            LeaseBackendError: Redis unreachable or failing. Never reported as "held".
        """
        leasing = self.leasing
        return leasing.acquire(
            LeaseRequest.build(
                key,
                ttl,
                wait,
                holder,
                renew,
                leasing.max_hold if max_hold is None else max_hold,
                run_id,
                refuse_finished,
                delivery,
                markers,
                limit,
                self.replicas if replicas is None else replicas,
                self.replica_timeout if replica_timeout is None else replica_timeout,
                queued_mark,
            )
        )

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
        return self.leasing.restore(
            key, owner_token, ttl=ttl, expires_at=expires_at, fencing_token=fencing_token, renew=renew
        )

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
        replicas: int | None = None,
        replica_timeout: float | None = None,
    ) -> Acquisition:
        """One-shot takeover of a persisted handle (e.g. by a retry of the task that held it).

        Atomically: if ``owner_token`` still owns ``key``, swap in a fresh owner token, keep the
        fencing token, record ``holder`` and set the TTL to ``ttl`` seconds. The persisted token
        stops working at once, so of two claims with the same persisted token exactly one
        succeeds.

        Returns an :class:`~taskguard.Acquisition` holding the new handle, or, when not claimed,
        ``reason="not_owner"`` (another owner holds the key; ``holder_ttl`` its time left) or
        ``reason="expired"`` (no lease exists: acquire afresh, which gives a larger fence).
        ``run_id`` and ``delivery`` are recorded on the new handle (see :meth:`acquire`), and
        ``replicas`` / ``replica_timeout`` apply as there: a claim fewer replicas acknowledged in
        time is released (the persisted token is spent) with ``reason="unreplicated"``.

        Raises ConfigError for bad arguments, LeaseBackendError when Redis fails.
        """
        return self.leasing.claim(
            key,
            owner_token,
            ttl=ttl,
            holder=holder,
            renew=renew,
            max_hold=max_hold,
            run_id=run_id,
            delivery=delivery,
            replicas=self.replicas if replicas is None else replicas,
            replica_timeout=self.replica_timeout if replica_timeout is None else replica_timeout,
        )

    def release_run(self, key: str, run_id: str, fencing_token: int | None = None) -> bool:
        """Release ``key`` on behalf of the run ``run_id`` (given at acquire/claim), without its
        owner token: for a supervisor that knows the run is over but never had its handle (e.g.
        a Celery worker's main process after a hard time limit killed the child). With
        ``fencing_token`` (int), only a lease of that run carrying that token is released: a
        supervisor that looked at the holder first (:meth:`holders`, e.g. to see that its process
        is dead) passes the token it saw, so a later lease of the same run id (a retry, a
        redelivered copy) taken in between is never released. Returns ``True`` when the lease was
        that run's and is now released. Raises ConfigError for a bad key, run id or token,
        LeaseBackendError when Redis fails."""
        return self.leasing.release_run(key, run_id, fencing_token)

    def force_release(self, key: str) -> bool:
        """Delete the lease on ``key`` whoever holds it (an operator's tool, e.g. ``taskguard
        release KEY --force``): the holder finds it lost at its next renewal or release, and its
        fenced writes still carry the old, now lower, fencing token. Returns ``True`` when a lease
        was there. Raises ConfigError for a bad key, LeaseBackendError when Redis fails."""
        return self.leasing.force_release(key)

    def holder(self, key: str) -> HolderInfo | None:
        """Who holds ``key``: holder metadata, fencing token and remaining TTL (seconds), or
        ``None`` when no lease is held (under a limit: the holder in the lowest slot; see
        :meth:`holders`). Never returns the owner token.
        Raises LeaseBackendError when Redis fails."""
        held = self.leasing.holders(key)
        return held[0] if held else None

    def holders(self, key: str) -> list[HolderInfo]:
        """Every holder of ``key`` (one for a plain lease, up to N under ``limit=N``), by slot:
        a list of :class:`~taskguard.lease.HolderInfo` (never an owner token); empty when none.
        Raises ConfigError for a bad key, LeaseBackendError when Redis fails."""
        return self.leasing.holders(key)

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
        run = GuardedRun(
            self,
            key,
            ttl=ttl,
            wait=wait,
            renew=renew,
            holder=holder,
            max_hold=max_hold,
            on_lost=on_lost,
            task=task,
            limit=limit,
        )
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
        policy = OncePolicy(fingerprint_of(fingerprint), ttl=check_seconds("once_ttl", once_ttl))
        run = GuardedRun(self, key, ttl=ttl, wait=wait, renew=renew, holder=holder, task=task, once=policy)
        result: T | Skipped = run.call(fn)  # (GuardedRun.call is untyped in fn's value)
        return result

    # -- publish-time uniqueness -------------------------------------------------------------
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
        return self.queue_marks.mark(key, run_id, ttl=ttl, task=task, shadow=shadow)

    def clear_queued(self, key: str, run_id: str, task: str, shadow: bool = False) -> bool:
        """Clear the queued mark of ``task`` on ``key`` if it names ``run_id`` (``shadow=True``:
        the shadow mark, see :meth:`mark_queued`). Returns ``True`` when it did. Raises
        LeaseBackendError when Redis fails."""
        return self.queue_marks.clear(key, run_id, task, shadow)

    def report_suppressed(self, key: str, task: str | None, existing: str, shadow: bool = False) -> None:
        """Emit the ``publish`` event (status ``"suppressed"``) of a publish that found ``existing``
        queued or running (adapters; the metric ``taskguard_publishes_suppressed_total``).
        ``shadow=True``: shadow mode would have suppressed it (it was published; the metric
        ``taskguard_skips_total{reason="unique",shadow="true"}``)."""
        self.queue_marks.report_suppressed(key, task, existing, shadow)

    # -- records (small values kept for callers under a lease key's hash tag) -----------------
    def put_record(
        self, key: str, name: str, value: str, *, ttl: float, if_absent: bool = False, if_value: str | None = None
    ) -> bool:
        """Keep ``value`` (``str``) as the record ``name`` of lease key ``key`` for ``ttl`` seconds.

        Records live beside the lease (one Redis Cluster slot with it) and are what the adapters
        keep per run: a beat slot's marker, an RQ job's persisted handle, a deferred copy's nonce.
        Conditions, checked atomically with the write: ``if_absent`` (only when no record
        exists), ``if_value`` (only when the record holds exactly this value), both (either).
        Returns ``True`` when written. Raises ConfigError for bad arguments, LeaseBackendError
        when Redis fails."""
        return self.records.put(key, name, value, ttl=ttl, if_absent=if_absent, if_value=if_value)

    def get_record(self, key: str, name: str) -> str | None:
        """The record ``name`` of ``key``, or ``None``. Raises LeaseBackendError."""
        return self.records.get(key, name)

    def delete_record(self, key: str, name: str, *, if_value: str | None = None) -> bool:
        """Delete the record ``name`` of ``key`` (only if it holds ``if_value``, when given).
        Returns ``True`` when deleted. Raises LeaseBackendError."""
        return self.records.delete(key, name, if_value=if_value)

    def count_record(self, key: str, name: str, *, by: int = 1, ttl: float | None = None) -> int:
        """Add ``by`` (``int``, may be negative) to the integer record ``name`` of ``key`` (a
        missing record counts as 0) and return the sum (``int``); ``ttl`` (seconds, float) sets
        the record's expiry, ``None`` keeps the one it has. One ``INCRBY`` (with ``PEXPIRE`` in one
        transaction when ``ttl`` is given). A call re-sent by the Redis client after it ran (a timeout
        under a retry policy) adds ``by`` twice.

        Raises ConfigError for a ``by`` that is not an ``int``, a bad key, name or ``ttl``, and
        when the record holds something other than an integer (written by :meth:`put_record`) or
        the sum would leave the signed 64-bit range; LeaseBackendError when Redis fails."""
        return self.records.count(key, name, by=by, ttl=ttl)

    def get_lease_record(self, key: str, name: str) -> str | None:
        """The lease record ``name`` of ``key`` (written by a holder with
        :meth:`Lease.put_record`), or ``None``. Anyone may read it. Raises LeaseBackendError."""
        return self.records.get_lease_record(key, name)

    # -- rates -------------------------------------------------------------------------------
    def throttle(
        self,
        key: str,
        *,
        rate: Any,
        burst: int | None = None,
        cost: int = 1,
        book_within: float = 0.0,
        consume: bool = True,
        shadow: bool = False,
    ) -> Throttle:
        """One call under a cluster-wide rate for ``key``: ``rate`` is ``"N/s"``, ``"N/m"``,
        ``"N/h"``, ``"N/d"`` or ``(count, seconds)`` — N *cost units* per period; the call costs
        ``cost`` units (``int`` >= 1, default 1: every call counts 1; e.g. an LLM request's
        tokens); ``burst`` cost units may pass at once (default: ``cost``, so with ``cost=1``
        calls are evenly spaced). Over any window of ``t`` seconds at most ``burst + t x count /
        period`` cost units pass, across every process (weighted GCRA, :mod:`taskguard.throttle`;
        one key, O(1) memory, one round trip, the Redis server's clock).

        A denied call gets ``retry_after`` seconds. With ``book_within`` (seconds, default 0: never)
        a denied call whose turn is at most that far away *books* it (``booked=True``): that
        turn is reserved for it, so come back at ``retry_after`` and go ahead without asking
        again (a back-off pause set meanwhile still applies: :mod:`taskguard.pacing` re-checks it);
        denied callers then get distinct turns instead of stampeding at the same instant.
        While a back-off pause is on (:meth:`back_off`) every call is denied (``paused=True``).
        ``consume=False`` only checks: the answer a call would get now, with nothing counted or
        booked. ``shadow=True`` counts (and books) in the *shadow* state of ``key``, a rate state
        of its own that enforced calls never see and that never consumes theirs: shadow mode's
        calls, so that each gets the answer enforcement would have given it (see
        :func:`taskguard.pacing.shadow_reason`).

        Returns a :class:`~taskguard.throttle.Throttle`. Raises ConfigError for a bad rate,
        burst, cost or key, and for a ``cost`` above ``burst`` (such a call could never pass);
        LeaseBackendError when Redis fails."""
        return self.rates.throttle(
            key, rate=rate, burst=burst, cost=cost, book_within=book_within, consume=consume, shadow=shadow
        )

    def settle_cost(self, key: str, *, rate: Any, by: int, shadow: bool = False) -> None:
        """Correct the rate state of ``key`` after a call whose actual cost differed from the cost
        it was admitted with: ``by`` cost units (``int``, actual minus estimate; negative gives
        units back) are added without a check — an overrun delays later calls, a refund lets them
        sooner, never beyond ``burst``. ``rate`` as given to :meth:`throttle`. One round trip; a
        call re-sent by the client after it ran counts twice. Raises ConfigError for a bad key,
        rate or ``by`` (beyond +-10**9); LeaseBackendError when Redis fails."""
        self.rates.settle(key, rate=rate, by=by, shadow=shadow)

    def back_off(self, key: str, retry_after: float, *, shadow: bool = False) -> float:
        """Pause the rate ``key`` cluster-wide for ``retry_after`` seconds (float > 0) on the
        backend's clock: until the pause ends no :meth:`throttle` call on ``key`` passes, whatever
        its rate, and booked turns falling inside it are re-checked and booked again after it
        (:mod:`taskguard.pacing`). For an upstream's ``429 Too Many Requests`` with
        ``Retry-After``. A longer pause already on is kept. Returns the seconds (float) until the
        pause ends. Raises ConfigError for a bad key or duration; LeaseBackendError when Redis
        fails."""
        return self.rates.back_off(key, retry_after, shadow=shadow)

    # -- reports, health, shutdown ------------------------------------------------------------
    def report_skip(self, skipped: Skipped, shadow: bool = False) -> None:
        """Emit the ``skip`` event for a run skipped outside :meth:`with_lease` (adapters);
        ``shadow=True`` for a skip a guard in shadow mode would have made (the run went ahead)."""
        if self._emitter.active:
            self._emitter.emit(LeaseEvent("skip", skipped.key, skipped.reason, task=skipped.task, shadow=shadow))

    def check_health(self) -> Health:
        """Probe the backend once (Redis: one PING). Returns :class:`Health`; never raises.

        Starts no background work and touches no lease, so it suits readiness endpoints."""
        return self.backend.check_health()

    def check_durability(self, replicas: int | None, replica_timeout: float | None) -> None:
        """Raise ConfigError when the durability option (``replicas``, ``replica_timeout``) cannot
        be honoured by these locks (see :meth:`taskguard.RedisLocks.check_durability`); locks
        without replicas (:class:`~taskguard.MemoryLocks`) ignore the option."""

    def close(self, timeout: float | None = None) -> None:
        """Release every lease this object still holds in this process (best effort), spending
        at most ``timeout`` seconds (default :attr:`shutdown_timeout`); leases left unreleased
        then expire by their TTL."""
        self.leasing.close(self.shutdown_timeout if timeout is None else timeout)
