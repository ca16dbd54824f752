"""One guarded run of a body, from begin to end.

:class:`GuardedRun` is the single place that decides how a guarded run starts and ends:
:meth:`Locks.with_lease`, the Celery task class and the RQ job wrapper all drive one, and only
translate their framework's events into its calls:

* :meth:`GuardedRun.begin` — take over a persisted handle (a retry) or acquire; refuse a copy of
  a run that already finished (when the caller says this copy may be one); notice when the holder
  is another execution of this same run id, and either report it (``"running"``) or wait for it;
* :meth:`GuardedRun.finish` / :meth:`GuardedRun.fail` — the run is over: release, recording it as
  finished so that redelivered copies of it are refused;
* :meth:`GuardedRun.hand_back` — this execution ends but the run is not over (its message goes
  back to the queue): release without recording anything;
* :meth:`GuardedRun.keep` — a retry of this run will claim the lease: stretch it and return the
  handle to persist;
* :meth:`GuardedRun.skip` — the lease could not be had: the :class:`~taskguard.Skipped` value, reported.

While the body runs, ``with run:`` makes :func:`taskguard.context.current_lease` return its lease.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from .context import current_runs, running
from .errors import ConfigError, IdempotencyConflict, LeaseBackendError, LeaseLost
from .handoff import ResumeRequest, persist, restore_handle, resume
from .lease import Acquisition, Lease
from .leasing import finished_id
from .liveness import holder_is_dead
from .once import decode_record, encode_record, record_value
from .policy import ON_LOST
from .skipped import Skipped
from .values import OnLost, Reason, RunState

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

__all__ = ["GuardedRun", "RunRequest", "Nested", "nested_in", "SAME_RUN", "SHADOW_ONCE"]

log = logging.getLogger("taskguard")

#: What :meth:`GuardedRun.begin` does when the lease is held by another execution of the same run
#: id: ``"report"`` — return with reason ``"running"`` (the caller defers this copy);
#: ``"wait"`` — wait for that execution to end (bounded), then run.
SAME_RUN = ("report", "wait")
#: Record of a key holding shadow mode's completion (``once``): a digest of the fingerprint of the
#: first shadow run that completed while it held the lease, for ``once_ttl``.
SHADOW_ONCE = "shadow-once"


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """What one guarded run asks for (see :class:`GuardedRun` for each field)."""

    key: str
    ttl: float
    wait: float = 0.0
    renew: bool = True
    holder: Mapping[str, Any] | None = None
    max_hold: float | None = None
    limit: int = 1
    run_id: str | None = None
    task: str | None = None
    on_lost: str = OnLost.RAISE
    finished_ttl: float | None = None
    delivery: str | None = None
    once: Any = None
    enforce: bool = True
    total: tuple[str, int] | None = None
    replicas: int | None = None
    replica_timeout: float | None = None
    queued_mark: tuple[str, str] | None = None


class GuardedRun:
    """The lifecycle of one guarded run of ``key``.

    ``GuardedRun(locks, RunRequest(key, ttl=..., ...), on_lost_report=..., tag=...)``; the
    request's fields may also be given as keywords after the key: ``GuardedRun(locks, key, ttl=...)``.

    Args:
        locks: the :class:`~taskguard.Locks` to use.
        request: a :class:`RunRequest`, or the lease key (``str``) with its fields as keywords:
        key: the lease key (``str``).
        ttl: lease TTL, seconds (float > 0).
        wait: seconds to wait for a lease held by another run before skipping (>= 0).
        renew: keep the lease alive with the heartbeat while the body runs.
        holder: non-secret holder metadata stored with the lease.
        max_hold: stop renewing after this many seconds (``None``: the locks' default).
        limit: how many runs may hold ``key`` at once (``int`` >= 1; see :meth:`Locks.acquire`).
        total: ``(total key, limit_total)``: the run also needs one of ``limit_total`` places in
            the total key, or ``None``. It takes its key's slot first, then the total's; when
            the total has none it gives its key's slot back at once (reason ``"limit_total"``;
            with ``wait``, it waits for the total holding nothing, then asks for its key again
            without waiting). The total's lease is ``lease.total``; both are renewed,
            kept for a retry (:meth:`keep`: one handle with the total's nested) and released
            together, and losing either is losing the run's lease (``on_lost``).
        run_id: the identity of the run (a Celery task id, an RQ job id), or ``None``.
        task: the task name for skips, events and logs, or ``None``.
        on_lost: :class:`~taskguard.values.OnLost`: ``"raise"`` (:meth:`finish` raises
            :class:`~taskguard.LeaseLost` when the lease was lost while the body ran) or ``"warn"`` (log and carry on).
        finished_ttl: seconds a finished run's own marker is kept (see
            :meth:`~taskguard.Lease.release`); ``None``: no marker, only the key's fence record
            remembers its last finished run (the caller has another record of finished runs,
            such as Celery's result backend, or none is needed).
        on_lost_report: called with the run and the reason when :meth:`finish` finds the lease was lost
            (an adapter's event), before ``on_lost`` applies.
        once: a :class:`~taskguard.once.OncePolicy`: the run completes once per key (see
            :mod:`taskguard.once`); :meth:`begin` answers ``reason="once"`` when the key's work
            is done (:meth:`stored_value`), and :meth:`finish` stores the value with the release.
        enforce: ``False`` for shadow mode: :meth:`begin` evaluates the guard (lease, limit,
            once) and reports what it would have done — ``skip`` events with ``shadow=True`` —
            but always lets the body run, with :attr:`lease` ``None`` when the lease could not
            be had; it never waits, and a shadow run stores no completion record: with a once
            policy, a shadow run that would have run and completes records its fingerprint's
            digest in a shadow record of its own (:data:`SHADOW_ONCE`), against which later
            shadow runs report ``"once"`` or ``"idempotency_conflict"`` as enforcement would.
        replicas, replica_timeout: the durability option of the lease's acquisition or claim
            (see :meth:`~taskguard.Locks.acquire`); ``None``: the locks' own.
        queued_mark: ``(task, run id)`` of the publish-time queued mark this run's acquisition
            of ``key`` clears atomically (see :meth:`~taskguard.Locks.acquire`), or ``None``;
            :attr:`unmarked` says whether an acquisition carrying it took the lease.

    Attributes:
        lease: the held :class:`~taskguard.Lease` after a successful :meth:`begin`, else ``None``.
        reason: why :meth:`begin` did not get the lease (a :class:`~taskguard.values.Reason`
            where it is one of them): ``"held"``, ``"limit"``, ``"limit_total"`` (no place left
            in the total), ``"wait_timeout"``,
            ``"duplicate"`` (this copy's run already finished), ``"unreplicated"`` (fewer replicas
            than asked acknowledged the lease in time; it was released), ``"running"`` (another
            execution of this run id holds it) or ``"once"`` (the key's work is done: see
            :meth:`stored_value`). In shadow mode: what the guard would have done (the body
            runs anyway), or ``None``.
        holder_ttl: seconds left on the holder's lease when not acquired, where known.
        state: a :class:`~taskguard.values.RunState`: ``"new"``, ``"running"``, ``"skipped"``,
            ``"finished"``, ``"handed_back"`` or ``"kept"``.
        tag: free for the adapter (e.g. the Celery task object the run belongs to).
        unmarked: ``True`` once the lease was acquired with :attr:`RunRequest.queued_mark`:
            the mark is gone with the acquisition (a lease restored from a handle clears none).
        delivery: which delivery of ``run_id`` this is, when an id can run more than once (a
            Celery publish stamp): finished runs are recorded per (``run_id``, ``delivery``).

    Raises ConfigError for an invalid ``on_lost``; the lease operations raise as documented on
    :class:`~taskguard.Locks`.
    """

    __slots__ = (
        "locks",
        "request",
        "key",
        "ttl",
        "wait",
        "renew",
        "holder",
        "max_hold",
        "run_id",
        "task",
        "on_lost",
        "finished_ttl",
        "on_lost_report",
        "lease",
        "reason",
        "holder_ttl",
        "state",
        "tag",
        "_ctx",
        "delivery",
        "limit",
        "once",
        "enforce",
        "total",
        "_record",
        "on_end",
        "unmarked",
    )

    def __init__(
        self,
        locks: Locks,
        request: RunRequest | str,
        *,
        on_lost_report: Callable[[GuardedRun, str], None] | None = None,
        tag: Any = None,
        **fields: Any,
    ) -> None:
        if not isinstance(request, RunRequest):  # the keyword form: GuardedRun(locks, key, ttl=..., ...)
            request = RunRequest(request, **fields)
        elif fields:
            raise TypeError(f"GuardedRun takes a RunRequest or a key with keywords, not both ({', '.join(fields)})")
        if request.on_lost not in ON_LOST:
            raise ConfigError(f"on_lost must be one of {ON_LOST}, got {request.on_lost!r}")
        r = self.request = request
        self.limit, self.once, self.enforce, self.total = r.limit, r.once, r.enforce, r.total
        self._record: dict[str, Any] | None = None
        self.locks, self.key, self.ttl, self.wait, self.renew = locks, r.key, r.ttl, r.wait, r.renew
        self.holder, self.max_hold, self.run_id, self.task = r.holder, r.max_hold, r.run_id, r.task
        self.on_lost, self.finished_ttl, self.on_lost_report, self.tag = (
            OnLost(r.on_lost),
            r.finished_ttl,
            on_lost_report,
            tag,
        )
        self.delivery = r.delivery
        self.lease: Lease | None = None
        self.reason: str | None = None
        self.holder_ttl: float | None = None
        self.state = RunState.NEW
        self._ctx: running | None = None
        self.unmarked = False
        #: called with the run after it released its lease for good (finish, fail, hand back;
        #: not keep): the pipeline wakes a key's pending follow-up through it. Never raises.
        self.on_end: Callable[[GuardedRun], None] | None = None

    def __repr__(self) -> str:
        return f"<GuardedRun key={self.key!r} run_id={self.run_id!r} state={self.state}>"

    # -- begin -----------------------------------------------------------------------------------
    def begin(
        self,
        *,
        handle: Mapping[str, Any] | None = None,
        refuse_finished: bool = False,
        same_run: str = "report",
        same_run_wait: float = 0.0,
    ) -> bool:
        """Take the lease for this run. Returns ``True`` when the body may run (:attr:`lease` is
        held), else ``False`` with :attr:`reason` and :attr:`holder_ttl` set.

        Args:
            handle: a persisted handle of this run (a retry's): claimed one-shot, with the same
                fencing token; if it expired meanwhile the lease is acquired afresh. A malformed
                handle is logged and ignored (the run acquires normally).
            refuse_finished: this copy may be a redelivery of a run that already finished
                (reason ``"duplicate"`` then).
            same_run: when another execution of this run id holds the lease (see
                :data:`SAME_RUN`). A holder whose process is known dead (same host) is released
                first in either mode.
            same_run_wait: with ``same_run="wait"``, the longest wait in seconds; each step is
                bounded by the holder's TTL, so a dead holder is outlived.

        Raises ConfigError for an unknown ``same_run``, LeaseBackendError when Redis fails.
        """
        if same_run not in SAME_RUN:
            raise ConfigError(f"same_run must be one of {SAME_RUN}, got {same_run!r}")
        if not self.enforce:
            return self._begin_shadow(handle)
        if self.once is not None and self._completed():
            return False
        acq = self._resume(handle, refuse_finished) if handle is not None else None
        if acq is None:
            # with a run id, look first without waiting: never wait inside acquire behind an
            # execution of this very run (that is the same-run path below)
            acq = self._acquire(0.0 if self.run_id is not None else self.wait, refuse_finished)
            if (
                not acq.acquired
                and self.wait > 0
                and self.run_id is not None
                and acq.reason in ("held", "limit", "limit_total")
                and acq.holder_run != self.run_id
            ):
                acq = self._acquire(self.wait, refuse_finished)
        if not acq.acquired and self.run_id is not None and acq.holder_run == self.run_id:
            acq = self._same_run(acq, same_run, same_run_wait, refuse_finished)
        if not acq.acquired:
            self.reason, self.holder_ttl = Reason.of(acq.reason or Reason.HELD), acq.holder_ttl
            return False
        self.lease = acq.lease
        self.state = RunState.RUNNING
        try:
            completed = self.once is not None and self._completed()  # completed between the check and the lease
        except BaseException:  # Redis failed, or another fingerprint completed it: the body will not run
            self.hand_back()
            self.lease, self.state = None, RunState.NEW
            raise
        if completed:
            self.hand_back()
            self.lease, self.state = None, RunState.NEW
            return False
        return True

    def run_unguarded(self) -> None:
        """Let the body run without a lease (a periodic entry's ``overlap="allow"``): nothing is
        acquired, released or recorded; :attr:`lease` stays ``None`` and the end calls do
        nothing."""
        self.state = RunState.RUNNING

    # -- once=True and shadow mode -------------------------------------------------------------------
    def _completed(self) -> bool:
        """Is the key's work done (a completion record with this fingerprint)? Sets
        :attr:`reason` to ``"once"`` when it is; raises IdempotencyConflict for a record with
        another fingerprint."""

        raw = self.locks.completions.get(self.key)
        record = decode_record(raw) if raw is not None else None
        if record is None:
            return False
        if record["fp"] != self.once.fingerprint:
            raise IdempotencyConflict(self.key, self.task)
        self._record, self.reason, self.holder_ttl = record, Reason.ONCE, None
        return True

    def stored_value(self) -> Any:
        """After :meth:`begin` answered ``reason="once"``: the value the completed run stored
        (deserialised by the policy), after emitting the ``skip`` event (reason ``"once"``)."""

        self.state = RunState.SKIPPED
        self.locks.report_skip(Skipped(key=self.key, reason=Reason.ONCE, task=self.task))
        return record_value(self.once, self._record or {})

    def _begin_shadow(self, handle: Mapping[str, Any] | None = None) -> bool:
        """Shadow mode: evaluate, report what would have happened, and let the body run — also
        when Redis cannot be reached (logged; the run has no lease then). A retry's persisted
        handle is claimed as in enforced mode."""

        would = None
        try:
            if self.once is not None:
                try:
                    if self._completed():
                        would = Reason.ONCE
                except IdempotencyConflict:
                    would = Reason.IDEMPOTENCY_CONFLICT
                if would is None:  # what earlier shadow runs of the key would have stored
                    done = self.locks.get_record(self.key, SHADOW_ONCE)
                    if done is not None:
                        would = Reason.ONCE if done == self._shadow_digest() else Reason.IDEMPOTENCY_CONFLICT
            acq = self._resume(handle, False) if handle is not None else None
            if acq is None:
                acq = self._acquire(0.0)
        except LeaseBackendError as e:
            log.warning(
                "%s: shadow mode: the guard could not be evaluated (%s); running without a lease", self._who(), e
            )
            self.reason, self.state = "error", RunState.RUNNING
            return True
        if acq.acquired:
            self.lease = acq.lease
        elif would is None:
            would, self.holder_ttl = Reason.of(acq.reason or Reason.HELD), acq.holder_ttl
        self.reason = would
        self.state = RunState.RUNNING
        if would is not None:
            self.locks.report_skip(
                Skipped(key=self._skip_key(), reason=would, task=self.task, holder_ttl=self.holder_ttl), shadow=True
            )
        return True

    def _shadow_digest(self) -> str:
        import hashlib

        return hashlib.sha256(self.once.fingerprint.encode()).hexdigest()

    def _store_shadow_completion(self) -> None:
        """Shadow mode, once policy: this run would have run (it holds the lease) and completed:
        record it in the key's shadow completion record (the first one stays). Never raises."""
        try:
            self.locks.put_record(self.key, SHADOW_ONCE, self._shadow_digest(), ttl=self.once.ttl, if_absent=True)
        except LeaseBackendError as e:
            log.warning("%s: shadow mode: could not record the completion of %r: %s", self._who(), self.key, e)

    def _resume(self, handle: Mapping[str, Any], refuse_finished: bool) -> Acquisition | None:
        """Take over a persisted handle of this run (:func:`taskguard.handoff.resume`), or ``None``
        when the handle is malformed (logged; the run acquires normally). Raises
        LeaseBackendError."""
        try:
            return resume(
                self.locks,
                handle,
                ResumeRequest(
                    key=self.key,
                    ttl=self.ttl,
                    holder=self.holder,
                    renew=self.renew,
                    max_hold=self.max_hold,
                    run_id=self.run_id,
                    refuse_finished=refuse_finished,
                    delivery=self.delivery,
                    markers=self.finished_ttl is not None,
                    limit=self.limit,
                    total=self.total,
                    replicas=self.request.replicas,
                    replica_timeout=self.request.replica_timeout,
                ),
            )
        except ConfigError as e:
            log.error("%s: ignoring its persisted lease handle: %s", self._who(), e)
            return None

    def _acquire(self, wait: float, refuse_finished: bool = False) -> Acquisition:
        if self.total is not None:
            return self._acquire_both(wait, refuse_finished)
        return self._acquire_key(wait, refuse_finished)

    def _acquire_both(self, wait: float, refuse_finished: bool) -> Acquisition:
        """The key's slot, then a place in the total, never holding one while waiting for the
        other (no hold-and-wait, so two runs can never wait on each other; each is a separate
        single-key script, so the two keys may live in different Redis Cluster slots). The
        key's lease, with the total's as its :attr:`~taskguard.Lease.total`; or not acquired
        with the key's reason, ``"limit_total"``, or ``"wait_timeout"``."""
        total_key, total_limit = cast("tuple[str, int]", self.total)
        deadline = time.monotonic() + wait
        while True:
            # (no queued mark here: the key's slot may be given back to wait for the total, and a
            # run waiting is still queued; it goes with the key's acquisition below, or is
            # cleared the separate way once the run began)
            acq = self._acquire_key(max(0.0, deadline - time.monotonic()), refuse_finished, unmark=False)
            if not acq.acquired:
                return acq
            lease = cast(Lease, acq.lease)
            try:
                tacq = self._acquire_total(total_key, total_limit, 0.0)
            except BaseException:
                self._give_back(lease)
                raise
            if tacq.acquired:
                lease.total = tacq.lease
                return acq
            self._give_back(lease)  # no place in the total: nothing is held while waiting for it
            if tacq.reason == Reason.UNREPLICATED:  # the total's place was not on the replicas in time
                return tacq
            left = deadline - time.monotonic()
            if left <= 0:
                reason = Reason.WAIT_TIMEOUT.value if wait > 0 else Reason.LIMIT_TOTAL.value
                return Acquisition(False, None, reason, tacq.holder_ttl, tacq.holder_run)
            tacq = self._acquire_total(total_key, total_limit, left)  # woken when a place frees
            if tacq.reason == Reason.UNREPLICATED:
                return tacq
            if not tacq.acquired:
                return Acquisition(False, None, Reason.WAIT_TIMEOUT.value, tacq.holder_ttl, tacq.holder_run)
            total = cast(Lease, tacq.lease)
            try:
                acq = self._acquire_key(0.0, refuse_finished)
            except BaseException:
                self._give_back(total)
                raise
            if acq.acquired:
                cast(Lease, acq.lease).total = total
                return acq
            self._give_back(total)
            if acq.reason == Reason.DUPLICATE or (self.run_id is not None and acq.holder_run == self.run_id):
                return acq
            if time.monotonic() >= deadline:
                return Acquisition(False, None, Reason.WAIT_TIMEOUT.value, acq.holder_ttl, acq.holder_run)

    def _acquire_total(self, total_key: str, total_limit: int, wait: float) -> Acquisition:
        return self.locks.acquire(
            total_key,
            ttl=self.ttl,
            wait=wait,
            holder=self.holder,
            renew=self.renew,
            max_hold=self.max_hold,
            run_id=self.run_id,
            markers=False,
            limit=total_limit,
            replicas=self.request.replicas,
            replica_timeout=self.request.replica_timeout,
        )

    def _give_back(self, lease: Lease) -> None:
        """Release a lease taken for a run that will not run now (not finished). Never raises:
        its TTL bounds what a Redis error leaves behind."""
        try:
            lease.release()
        except LeaseBackendError as e:
            log.warning("%s: could not give back lease %r (its TTL bounds it): %s", self._who(), lease.key, e)

    def _acquire_key(self, wait: float, refuse_finished: bool = False, unmark: bool = True) -> Acquisition:
        mark = self.request.queued_mark if unmark else None
        acq = self.locks.acquire(
            self.key,
            ttl=self.ttl,
            wait=wait,
            holder=self.holder,
            renew=self.renew,
            max_hold=self.max_hold,
            run_id=self.run_id,
            refuse_finished=refuse_finished,
            delivery=self.delivery,
            markers=self.finished_ttl is not None,
            limit=self.limit,
            replicas=self.request.replicas,
            replica_timeout=self.request.replica_timeout,
            queued_mark=mark,
        )
        if acq.acquired and mark is not None:
            self.unmarked = True
        return acq

    def _same_run(self, acq: Acquisition, mode: str, bound: float, refuse_finished: bool) -> Acquisition:
        """The lease is held by another execution of this run id (a redelivered copy, a retry
        published while the body still runs, an abandoned RQ job re-queued)."""
        released = self._release_dead(self.key)
        if self.total is not None:  # and its place in the total, which a dead holder keeps too
            released = self._release_dead(self.total[0]) or released
        if released:
            acq = self._acquire(0.0, refuse_finished)
            if acq.acquired or acq.holder_run != self.run_id:
                return acq
        if mode == "wait":
            deadline = time.monotonic() + bound
            while not acq.acquired and acq.holder_run == self.run_id:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                step = left if acq.holder_ttl is None else min(left, acq.holder_ttl + 0.05)
                acq = self._acquire(step, refuse_finished)
            if acq.acquired or acq.holder_run != self.run_id:
                return acq
        return Acquisition(False, None, Reason.RUNNING.value, acq.holder_ttl, acq.holder_run)

    def _release_dead(self, key: str) -> bool:
        """Release ``key``'s lease held by this run id in a process known dead (same host).
        Returns ``True`` when one was released. Raises LeaseBackendError."""
        run_id = cast(str, self.run_id)
        info = next((i for i in self.locks.holders(key) if i.run_id == run_id), None)
        if info is None or not holder_is_dead(info.holder):
            return False
        if not self.locks.release_run(key, run_id, fencing_token=info.fencing_token):  # (that very lease)
            return False
        log.warning(
            "%s: the previous holder of %r (pid %s) is dead; lease released", self._who(), key, info.holder.get("pid")
        )
        return True

    # -- the body -------------------------------------------------------------------------------
    def call(self, fn: Callable[[Any], Any]) -> Any:
        """The whole run around ``fn(lease)`` for callers without a framework (``with_lease``,
        ``once``): begin; the skip (or, with a once policy, the stored value) when the lease could
        not be had; else ``fn``'s value after :meth:`finish`, or ``fn``'s exception after
        :meth:`fail`."""
        if not self.begin():
            return self.stored_value() if self.reason == Reason.ONCE else self.skip()
        with self:
            try:
                value = fn(self.lease)
            except BaseException:
                self.fail()
                raise
        self.finish(value)
        return value

    def __enter__(self) -> GuardedRun:
        self._ctx = running(self)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(*exc)

    # -- end ---------------------------------------------------------------------------------------
    def finish(self, value: Any = None) -> None:
        """The body returned ``value``: release, recording the run as finished (with a once
        policy, storing ``value`` as the key's completion, atomically with the release). If the
        lease was lost while the body ran (the heartbeat found it gone, or the release found
        another owner), report it and, with ``on_lost="raise"``, raise
        :class:`~taskguard.LeaseLost`. A Redis error while releasing is logged (the TTL bounds
        the lease), never raised; a once value that cannot be stored raises ConfigError (the
        lease is released, nothing stored)."""
        if (
            self.once is not None
            and not self.enforce
            and self.state == RunState.RUNNING
            and self.lease is not None
            and self.reason is None
        ):
            self._store_shadow_completion()  # before the release: the next holder sees it
        lease = self._end(RunState.FINISHED)
        if lease is None:
            return
        was_lost = lease.lost
        store = None
        if self.once is not None and self.enforce:
            try:
                store = (encode_record(self.once, value, self.key), self.once.ttl)
            except BaseException as e:  # whatever the serializer raises: release first, store nothing
                self._release_quietly(lease, finished=True)
                if isinstance(e, ConfigError) or not isinstance(e, Exception):
                    raise
                raise ConfigError(
                    f"once=True: the value of {self.key!r} cannot be stored "
                    f"({type(e).__name__}: {e}); nothing was stored"
                ) from None
        total = lease.total
        total_lost = total is not None and total.lost
        try:
            released = self.locks.leasing.release(lease, finished=True, finished_ttl=self.finished_ttl, store=store)
        except LeaseBackendError as e:
            log.warning("%s: could not release lease %r: %s", self._who(), self.key, e)
            released = not lease.lost
        if total is not None:  # its place in the total: a plain release
            try:
                released = total.release() and released
            except LeaseBackendError as e:
                log.warning("%s: could not release lease %r: %s", self._who(), total.key, e)
                released = released and not total.lost
        self._ended()
        if was_lost or total_lost or not released:
            reason = (
                lease.lost_reason
                or (f"its place in the total {total.key!r}: {total.lost_reason}" if total and total.lost else None)
                or "lost while the body ran"
            )
            if self.on_lost_report is not None:
                self.on_lost_report(self, reason)
            if self.on_lost == OnLost.RAISE:
                raise LeaseLost(self.key, reason)
            log.warning("%s: lease %r was lost while the body ran (%s)", self._who(), self.key, reason)

    def fail(self) -> None:
        """The body raised and the run is over (its message is not requeued): release,
        recording it as finished. Never raises (the body's exception must win)."""
        lease = self._end(RunState.FINISHED)
        if lease is not None:
            self._release_quietly(lease, finished=True)
            self._ended()

    def hand_back(self) -> None:
        """This execution ends but the run is not over (its message goes back to the queue, or
        the same id will run again): release without recording it as finished. Never raises."""
        lease = self._end(RunState.HANDED_BACK)
        if lease is not None:
            self._release_quietly(lease, finished=False)
            self._ended()

    def keep(self, seconds: float) -> dict[str, Any] | None:
        """A retry of this run will claim the lease: stretch it to ``seconds`` from now, stop
        renewing it here and return the handle to persist with the retry (``None`` when the
        lease is no longer held; the retry then acquires afresh). Raises LeaseBackendError."""
        lease = self._end(RunState.KEPT)
        return None if lease is None else persist(lease, seconds)

    def release_kept(self, handle: Mapping[str, Any]) -> None:
        """:meth:`keep` handed the lease to a retry that was then never published (max retries
        exceeded, a publish error): the run ends here. Release the kept lease, recording the run as
        finished. Never raises (the caller's own exception must win)."""
        if self.state != RunState.KEPT:
            return
        self.state = RunState.FINISHED
        lease = restore_handle(self.locks, handle, ttl=self.ttl)  # (with its place in the total)
        lease.run_id = self.run_id
        lease.finished_id = finished_id(self.run_id, self.delivery)
        self._release_quietly(lease, finished=True)

    def skip(self, report: bool = True) -> Skipped:
        """The :class:`~taskguard.Skipped` value of a run that did not get its lease, after
        emitting the ``skip`` event (``report=False``: the caller reports it, e.g. after
        deciding on a retry)."""
        self.state = RunState.SKIPPED
        skipped = Skipped(
            key=self._skip_key(), reason=self.reason or Reason.HELD, task=self.task, holder_ttl=self.holder_ttl
        )
        if report:
            self.locks.report_skip(skipped)
        return skipped

    def _skip_key(self) -> str:
        """The key a skip names: the total's when the total had no place (``"limit_total"``)."""
        if self.reason == Reason.LIMIT_TOTAL and self.total is not None:
            return self.total[0]
        return self.key

    def _ended(self) -> None:
        on_end = self.on_end
        if on_end is not None:
            try:
                on_end(self)
            except Exception as e:  # never over the run's own outcome
                log.error("%s: after its end: %s", self._who(), e)

    def _end(self, state: RunState) -> Lease | None:
        if self.state != RunState.RUNNING:
            return None
        self.state = state
        return self.lease

    def _release_quietly(self, lease: Lease, finished: bool) -> None:
        try:
            lease.release(finished=finished, finished_ttl=self.finished_ttl if finished else None)
        except LeaseBackendError as e:
            log.warning(
                "%s: could not release lease %r after the body ended (its TTL bounds it): %s", self._who(), self.key, e
            )
        if lease.total is not None:
            self._give_back(lease.total)

    def _who(self) -> str:
        name = self.task or "run"
        return f"{name}[{self.run_id}]" if self.run_id else name


class Nested:
    """A guarded call made inside a run of the same key in the same thread (recursion; Celery's
    eager ``replace()``, which runs the replacement inside the caller): it runs under that run's
    lease (``lease``), neither acquiring nor releasing — the run already holds the key. ``tag``
    is the adapter's (Celery: the task, for ``self.lease``)."""

    __slots__ = ("tag", "lease")
    state = "nested"

    def __init__(self, tag: Any, lease: Lease | None) -> None:
        self.tag, self.lease = tag, lease


def nested_in(key: str, locks: Locks, tag: Any = None) -> Nested | None:
    """The call of ``key`` on ``locks`` as a :class:`Nested` one when a run of that key is running
    in this thread (or asyncio task) and has not lost its lease, else ``None``: the call then is a
    run of its own (under a lost lease another holder may have the key: the call asks for it and is
    skipped as ``held`` while that one holds it)."""
    outer = next(
        (
            r
            for r in reversed(current_runs())
            if isinstance(r, GuardedRun) and r.key == key and r.locks is locks and r.state == RunState.RUNNING
        ),
        None,
    )
    if outer is None or (outer.lease is not None and outer.lease.lost):
        return None
    return Nested(tag, outer.lease)
