"""The guard pipeline: one decision per guarded execution, made in the core.

Both task adapters (Celery's ``GuardedTask``, RQ's ``@guarded_job``) hand :func:`decide` the
guard's options (:class:`~taskguard.policy.GuardOptions`), the call's lease key and arguments,
what the framework knows about this execution (an :class:`Execution`) and a small set of hooks
(:class:`Hooks`), and get back one typed decision:

==========================================================  ===================================
inputs                                                      decision
==========================================================  ===================================
redelivered, and the framework's own record says the run    :class:`Duplicate` (no run)
finished (``Hooks.finished``)
``rate``: over it, turn past ``rate_max_wait``              :class:`Skip` (``"rate_limited"``,
                                                            or ``"backoff"`` while a pause is on;
                                                            the rate key; a kept handle released)
``rate``: over it, a worker execution                       :class:`Defer` (``"rate_limited"`` /
                                                            ``"backoff"``, countdown, pacing
                                                            state; a kept handle released; skip
                                                            reported)
``rate``: over it, a local call (direct, eager)             waits for its turn here, then on
``rate``: room (or shadow mode: checked and reported)       goes on to the lease; the
                                                            :class:`Run` carries the rate charge
                                                            (the call's ``cost``)
``limit``: an int, or its callable's value for this call    the lease's slots
``limit_total``: the key's slot, then a place in the total  both held, or :class:`Skip`
                                                            (``"limit_total"``; the key's slot
                                                            given back at once)
``once``: the key's work done (same fingerprint)            :class:`Stored` (the stored value)
lease refused: this copy's run already finished             :class:`Duplicate` (with the run)
lease held by another execution of the same run id          :class:`Defer` (``"running"``;
                                                            countdown: holder's TTL, >= 0.5 s)
lease refused otherwise (held, limit, limit_total,           :class:`Skip` (not yet reported)
wait_timeout)
lease taken after waiting, redelivered, and finished        :class:`Duplicate` (lease handed back)
meanwhile (``wait > 0``)
lease taken (or shadow mode: whatever the guard said)       :class:`Run` (shadow: reported first)
``overlap="coalesce"``: lease refused (held, limit,         :class:`Pend` (the key's pending
wait_timeout), a worker execution with a run id             follow-up; the one it supersedes
                                                            ends via :meth:`Hooks.supersede`)
``overlap="coalesce"``: superseded (``coalesced_into``)     :class:`Skip` (``"coalesced"``)
``overlap="coalesce"``: a backstop execution                :class:`Pend` (wakes the follow-up
                                                            once the lease is free, else looks
                                                            again later)
``overlap="replace"``: this run id was replaced (a retry    :class:`Skip` (``"replaced"``)
or redelivery of a replaced run)
``overlap="replace"``: lease refused (held, limit)          :class:`Run` after taking the lease
                                                            over from the oldest named holder
                                                            (:meth:`Hooks.replaced` is told)
``overlap="allow"`` (a periodic entry's): a copy of a slot  :class:`Duplicate` (no run)
that started already
``overlap="allow"``: otherwise                              :class:`Run` without a lease (the
                                                            body runs beside any other run)
==========================================================  ===================================

A run decided :class:`Run` under ``overlap="coalesce"`` wakes the key's pending follow-up when it
ends (:func:`taskguard.overlap.wake_pending`, through :meth:`Hooks.wake`).

The body of a :class:`Run` runs in :func:`perform`, which ends the run by how the body ended,
in one place for both adapters:

==========================================================  ===================================
the body                                                    the run, and what the adapter gets
==========================================================  ===================================
returned                                                    finished (``once``: the value stored);
                                                            :class:`Performed` with the value
returned the framework's own "run me again" (RQ's           settled by the adapter
``Retry``: :meth:`Hooks.returned`)                          (:meth:`Hooks.returned`); the value
returned, but the lease was taken over meanwhile            :class:`Skip` (``"replaced"``)
(``overlap="replace"``)
raised :class:`~taskguard.RateLimited` (an upstream's       handed back; :func:`backed_off`: the
429), enforced                                              rate key paused cluster-wide, then a
                                                            :class:`Defer` (``"backoff"``) past
                                                            the pause, a :class:`Skip` past
                                                            ``rate_max_wait``, or (a local call)
                                                            the exception
raised a failure (:meth:`Hooks.failed`) after another       failed; :class:`Skip` (``"replaced"``)
run took its lease over (``overlap="replace"``)
raised anything else (shadow mode's ``RateLimited`` too)    as the framework treats the exception
                                                            (:meth:`Hooks.settle`); re-raised
==========================================================  ===================================

The publish-time queued mark (``unique``) is cleared as soon as the execution started or will
never run: on every decision but a rate :class:`Defer` (still queued), and before any exception
raised while deciding. A run that takes its lease clears it in the same atomic step as the
acquisition (:meth:`Hooks.queued_mark`, ``queued_mark`` of :meth:`taskguard.Locks.acquire`), so a
worker that dies right after its lease was taken leaves no mark behind; every other decision
clears it through :meth:`Hooks.clear_mark`. What a decision means for the
framework (a stored result, a re-published message, an ``Ignore``, ``TaskSkipped``, RQ's
``Retry``) is the adapter's: it only translates.

This module imports no task framework.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from .errors import ConfigError, LeaseBackendError, LeaseLost, RateLimited
from .keys import KeyTemplate
from .overlap import (
    Pending,
    claim_backstop,
    offer,
    pending,
    record_ttl,
    refresh,
    replace_holder,
    replaced_by,
    take,
    wake_pending,
)
from .pacing import back_off, charging, pace, parse_state, shadow_reason
from .policy import GuardOptions
from .run import GuardedRun, RunRequest
from .skipped import Skipped
from .validate import check_seconds
from .values import Overlap, Reason, plain

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

log = logging.getLogger("taskguard")

__all__ = [
    "Execution",
    "Hooks",
    "Decision",
    "Run",
    "Skip",
    "Defer",
    "Stored",
    "Duplicate",
    "Pend",
    "decide",
    "shadow_line",
    "replaced_skip",
    "backed_off",
    "Performed",
    "perform",
]


@dataclasses.dataclass(frozen=True)
class Execution:
    """What the framework knows about one execution of a guarded task.

    Attributes:
        task: the task's name (holders, skips, events, logs).
        run_id: the run's identity (Celery task id, RQ job id), or ``None``.
        holder: non-secret holder metadata stored with the lease.
        redelivered: this copy may be a redelivery of a run that already finished.
        local: a direct or eager call (no broker: a rate wait happens in the calling thread,
            no finished-run bookkeeping by slot).
        stamp: the publish stamp (a delivery of ``run_id``), or ``None``.
        slot: a beat slot's ``(run id, finished ttl seconds)``: the slot's messages share one
            run identity, or ``None``.
        finished_ttl: seconds a finished run's own marker is kept (``None``: none).
        same_run: ``"report"`` (Celery: defer this copy) or ``"wait"`` (RQ: wait for the other
            execution of this run id), see :data:`taskguard.run.SAME_RUN`.
        same_run_wait: the longest such wait, seconds.
        stoppable: its framework can stop this execution from outside (``replace_terminate``:
            Celery's revoke with terminate, RQ's stop-job command). A local execution never is,
            nor one running in its worker's own process (RQ's ``SimpleWorker``). A run that
            replaces one that is not stoppable leaves it running, and reporting itself replaced
            when it ends (reported by the replacing run too, it was counted twice).
        tag: free for the adapter (stored on the :class:`~taskguard.run.GuardedRun`).
        backstop: ``overlap="coalesce"``: this execution is the key's backstop (Celery's delayed
            copy), which wakes the pending follow-up once the holder's lease has expired.
    """

    task: str
    run_id: str | None = None
    holder: Mapping[str, Any] | None = None
    redelivered: bool = False
    local: bool = True
    stamp: str | None = None
    slot: tuple[str, float] | None = None
    finished_ttl: float | None = None
    same_run: str = "report"
    same_run_wait: float = 0.0
    tag: Any = None
    backstop: bool = False
    stoppable: bool = True


def shadow_line(key: str, reason: str, rate: bool) -> str:
    """The log line (after the task's name) of a run shadow mode lets go although its guard would
    have held it back (:meth:`Hooks.shadow`): the same words from every adapter."""
    if rate:
        what = "rate-limited" if reason == Reason.RATE_LIMITED else "backing off"
        return f"shadow mode: would have been {what} (rate key {key!r}); running it"
    return f"shadow mode: would have been skipped ({reason}, lease {key!r}); running it"


class Hooks(Protocol):
    """What an adapter tells the pipeline, and does for it."""

    def persisted_handle(self) -> Mapping[str, Any] | None:
        """The lease handle persisted for this run (a retry's), or ``None``. May raise
        LeaseBackendError."""

    def release_handle(self, handle: Mapping[str, Any]) -> None:
        """Release a persisted handle's lease and forget the handle (a lease not held through a
        rate wait; a replaced run's retry, whose lease another run took over). Never raises."""

    def finished(self) -> bool:
        """Has this run finished per the framework's own record (Celery's result backend)?"""

    def clear_mark(self) -> None:
        """Clear the publish-time queued mark naming this execution. Never raises."""

    def queued_mark(self) -> tuple[str, str, str] | None:
        """``(key, run id, task)`` of the queued mark this execution was published with
        (``unique=True``, enforced), or ``None``. Never raises."""

    def result_codec(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``(dumps, loads)`` for a ``once`` value, as the framework stores results."""

    def rate_state(self) -> Any:
        """The pacing state this execution carried back from a rate deferral, as it came (a
        header's or a record's value; ``None`` when none): the pipeline checks it."""

    def rate_bound(self) -> float:
        """The longest one rate deferral may last, seconds."""

    def rate_go(self) -> None:
        """The rate let this execution go (forget a carried pacing state)."""

    def shadow(self, key: str, reason: str, holder_ttl: float | None, leased: bool, rate: bool) -> None:
        """Shadow mode: the guard (``rate`` or the lease) would have held this run back
        (``reason`` a plain ``str``, for events and records): log :func:`shadow_line` and record
        it where the framework shows a run's state, whichever guard it was."""

    def lost(self, run: GuardedRun, reason: str) -> None:
        """The lease was lost while the body ran (before ``on_lost`` applies)."""

    # -- overlap="coalesce" (called only for a guard with it) ------------------------------------
    def pending_message(self) -> Any:
        """What :meth:`wake` needs to run this call later as the key's follow-up (a JSON value;
        Celery: the call's own message, serialised; RQ: ``None``, the job id suffices)."""

    def supersede(self, prev: Pending, skipped: Skipped) -> None:
        """``prev`` is no longer the key's follow-up: end it as ``skipped`` (reason
        ``"coalesced"``, naming this call) — Celery stores and reports its result, RQ marks the
        job (:meth:`coalesced_into`) and runs it now. Never raises."""

    def wake(self, p: Pending) -> None:
        """Run the follow-up ``p`` now (Celery: publish its message; RQ: move its scheduled job to
        now). May raise (logged; the backstop still wakes it)."""

    def coalesced_into(self) -> str | None:
        """The follow-up's run id when this execution's call was superseded (RQ: its job is run
        once more to end), else ``None``."""

    # -- overlap="replace" -------------------------------------------------------------------------
    def replaced(self, holder: Any) -> None:
        """This run took the lease over from ``holder`` (a :class:`~taskguard.lease.HolderInfo`):
        with ``replace_terminate``, stop that run's execution. Never raises."""

    # -- how the body ended (:func:`perform`) ------------------------------------------------------
    def failed(self, exc: BaseException) -> bool:
        """Is ``exc``, raised by the body, its failure (``True``), or the framework's own control
        flow (``False``: Celery's ``Retry`` and ``Reject``, a worker shutting down)?"""

    def settle(self, run: GuardedRun, exc: BaseException) -> None:
        """The body raised ``exc``: end ``run`` as the framework will treat it — hand it back
        (the message comes back, the same id runs again), keep it for a retry, or fail it.
        Never raises."""

    def returned(self, run: GuardedRun, value: Any) -> bool:
        """The body returned ``value``: ``True`` when that is not the run's end and the adapter
        settled the run itself (RQ's returned ``Retry``), ``False`` to finish it."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Run the body under ``run`` (begun; in shadow mode its lease may be ``None``), inside
    :meth:`charging` (so that the body may :func:`taskguard.settle_cost`)."""

    run: GuardedRun
    charge: charging | None = None  # a guard with a rate: the rate key and the cost it was admitted at

    def charging(self) -> contextlib.AbstractContextManager[Any]:
        """The context the body runs in: its rate charge, or nothing."""
        return self.charge if self.charge is not None else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class Skip:
    """Not run: ``skipped`` (not yet reported; ``on_skip`` applies). ``run`` when a lease was asked."""

    skipped: Skipped
    run: GuardedRun | None = None


@dataclasses.dataclass(frozen=True)
class Defer:
    """Not now: come back in ``countdown`` seconds. ``why`` (a :class:`~taskguard.values.Reason`):
    ``"rate_limited"`` or ``"backoff"`` (its turn under the rate, or past a back-off pause:
    ``key`` the rate key, ``state`` the pacing state to carry back, the skip already reported) or
    ``"running"`` (another execution of this run id holds the lease: ``run``). ``skipped``: the
    rate skip as reported."""

    countdown: float
    why: Reason
    key: str
    state: dict[str, Any] | None = None
    run: GuardedRun | None = None
    skipped: Skipped | None = None

    @property
    def what(self) -> str:
        """A rate deferral's cause for people: ``"rate-limited"`` or ``"backing off (upstream
        rate limit)"``."""
        return "backing off (upstream rate limit)" if self.why == Reason.BACKOFF else "rate-limited"

    def describe(self) -> str:
        """A rate deferral as a log line says it, e.g. ``"rate-limited; its turn is booked in 2.00s"``."""
        booked = self.state is not None and self.state.get("turn") is not None
        return f"{self.what}; {'its turn is booked' if booked else 'it asks again'} in {self.countdown:.2f}s"


@dataclasses.dataclass(frozen=True)
class Stored:
    """``once``: the key's work was completed earlier; ``value`` is its stored value (the
    ``skip`` event, reason ``"once"``, was emitted)."""

    value: Any
    key: str


@dataclasses.dataclass(frozen=True)
class Duplicate:
    """A copy of a run that already finished: nothing runs, nothing is stored. ``run`` when
    the lease was asked (its deferral chain, if any, ends)."""

    key: str
    run: GuardedRun | None = None


@dataclasses.dataclass(frozen=True)
class Pend:
    """``overlap="coalesce"``: the key's lease is held and this call is its pending follow-up
    (recorded in Redis; the run that holds the lease wakes it when it ends), or has nothing left
    to do here (``woken``).

    Attributes:
        key: the lease key.
        countdown: seconds until the backstop looks again (past the holder's TTL, >= 1 s).
        backstop: this execution sends the key's backstop (Celery: a delayed copy of its message
            marked as the backstop; RQ schedules every pending job at ``countdown`` anyway).
        woken: the follow-up was woken already (a run that just ended took it, or a backstop
            found nothing left to wait for): Celery ends this execution quietly, RQ runs the job
            again at once.
    """

    key: str
    countdown: float
    backstop: bool = False
    woken: bool = False


Decision = Run | Skip | Defer | Stored | Duplicate | Pend


def _mark_of(hooks: Hooks, key: str) -> tuple[str, str] | None:
    """``(task, run id)`` of this execution's queued mark when it lives on the lease's own key
    (the acquisition then clears it atomically), else ``None``."""
    mark = hooks.queued_mark()
    return (mark[2], mark[1]) if mark is not None and mark[0] == key else None


def decide(
    opts: GuardOptions,
    key: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ex: Execution,
    hooks: Hooks,
    locks: Locks,
) -> Decision:
    """Decide one execution (see the module's table). Raises what the call's arguments cause
    (``TypeError``...), LeaseBackendError when Redis fails before the body could run,
    :class:`~taskguard.IdempotencyConflict`; the queued mark is cleared first."""
    if ex.redelivered and hooks.finished():
        hooks.clear_mark()
        return Duplicate(key)
    coalesce = opts.overlap == Overlap.COALESCE and not ex.local and ex.run_id is not None
    if coalesce:
        into = hooks.coalesced_into()
        if into is not None:
            hooks.clear_mark()
            return Skip(Skipped(key=key, reason=Reason.COALESCED, task=ex.task, follow_up=into))
        if ex.backstop:
            hooks.clear_mark()
            return _backstop(opts, key, hooks, locks)
    # the run's identity as its lease names it: a beat slot's messages share the slot's
    slot_id = ex.slot[0] if ex.slot is not None and not ex.local else None
    replace = opts.overlap == Overlap.REPLACE and opts.enforce
    if replace and not ex.local:
        try:
            by = replaced_by(locks, key, slot_id or ex.run_id)
        except BaseException:
            hooks.clear_mark()
            raise
        if by is not None:  # a retry or redelivery of a replaced run never takes the lease back
            hooks.clear_mark()
            kept = hooks.persisted_handle()
            if kept is not None:  # the lease it kept is the replacing run's now: its record goes
                hooks.release_handle(kept)
            return Skip(Skipped(key=key, reason=Reason.REPLACED, task=ex.task, follow_up=by or None))
    try:
        handle = hooks.persisted_handle()
        charge = None
        if opts.rate is not None:
            # the rate first: a run deferred to its turn must not sit on a lease meanwhile
            paced = _pace(opts, args, kwargs, ex, hooks, locks, handle)
            if not isinstance(paced, charging):
                if isinstance(paced, Skip):
                    hooks.clear_mark()  # it will not run: no longer queued
                return paced  # (a Defer: still queued)
            charge = paced
        once = opts.once_policy(args, kwargs, *hooks.result_codec()) if opts.once else None
        run_id, stamp, finished_ttl = ex.run_id, ex.stamp, ex.finished_ttl
        if ex.slot is not None and not ex.local:
            # a beat slot's messages share one run identity (the slot), whichever task id each
            # has: a slot published again after a hand-over runs once
            run_id, stamp = ex.slot[0], None
            finished_ttl = max(finished_ttl or 0.0, ex.slot[1])
        holder = ex.holder
        if opts.replace_terminate and (ex.local or not ex.stoppable):
            holder = {**(holder or {}), "stoppable": False}  # (read by the run that replaces it)
        run = GuardedRun(
            locks,
            RunRequest(
                key,
                opts.ttl,
                opts.wait,
                opts.renew,
                holder,
                opts.max_hold,
                opts.limit_of(args, kwargs),
                run_id,
                ex.task,
                opts.on_lost,
                finished_ttl,
                stamp,
                once,
                opts.enforce,
                opts.total_of(args, kwargs),
                opts.replicas,
                opts.replica_timeout,
                _mark_of(hooks, key) if opts.enforce else None,
            ),
            on_lost_report=hooks.lost,
            tag=ex.tag,
        )
        # with a publish stamp, finished runs are known per delivery: no copy of a delivery whose
        # run finished runs again, whichever copy the broker hands out first (an ETA message held
        # past the visibility timeout runs on two workers at once); unstamped (a client without
        # taskguard), only a redelivered copy is checked
        refuse = ex.redelivered or stamp is not None or ex.slot is not None
        if opts.overlap == Overlap.ALLOW:
            hooks.clear_mark()
            return _allow(key, ex, locks, run)
        began = run.begin(handle=handle, refuse_finished=refuse, same_run=ex.same_run, same_run_wait=ex.same_run_wait)
        if coalesce:
            run.on_end = lambda r: wake_pending(locks, key, hooks.wake, ex.task)
            if not began and run.reason in (Reason.HELD, Reason.LIMIT, Reason.WAIT_TIMEOUT):
                hooks.clear_mark()  # it will run as the follow-up, or not at all: no longer queued
                return _pend(
                    opts,
                    key,
                    ex,
                    hooks,
                    locks,
                    run,
                    lambda: run.begin(refuse_finished=refuse, same_run=ex.same_run, same_run_wait=ex.same_run_wait),
                )
            if began:
                _quietly_take(locks, key, cast(str, ex.run_id))  # it runs: no longer pending
        if replace and not began and run.reason in (Reason.HELD, Reason.LIMIT):
            began = _replace(opts, key, ex, hooks, locks, run, refuse)
    except BaseException:
        hooks.clear_mark()  # it will not run: no longer queued
        raise
    if not (began and run.unmarked):  # (a run that took its lease cleared its mark with it)
        hooks.clear_mark()  # it started, or will not run: no longer queued
    if not began:
        if run.reason == Reason.ONCE:
            return Stored(run.stored_value(), key)
        if run.reason == Reason.DUPLICATE:
            return Duplicate(key, run)
        if run.reason == Reason.RUNNING:
            return Defer(max(run.holder_ttl or 1.0, 0.5), Reason.RUNNING, key, run=run)
        return Skip(run.skip(report=False), run)
    if ex.redelivered and opts.wait > 0 and hooks.finished():
        # it waited behind other runs of the key: its own run may have finished meanwhile
        run.hand_back()
        return Duplicate(key, run)
    if not opts.enforce and run.reason is not None:
        hooks.shadow(key, plain(run.reason), run.holder_ttl, run.lease is not None, False)
    return Run(run, charge)


def _pend(
    opts: GuardOptions,
    key: str,
    ex: Execution,
    hooks: Hooks,
    locks: Locks,
    run: GuardedRun,
    begin_again: Callable[[], bool],
) -> Run | Pend:
    """``overlap="coalesce"``, the lease refused: make this call the key's pending follow-up."""
    run_id = cast(str, ex.run_id)
    countdown = max(run.holder_ttl or opts.ttl, 1.0) + 1.0
    prev = offer(locks, key, run_id, hooks.pending_message(), ttl=record_ttl(countdown, opts.ttl))
    if prev is not None:
        hooks.supersede(prev, Skipped(key=key, reason=Reason.COALESCED, task=ex.task, follow_up=run_id))
    # a run that ended between this call's acquire and its record found nothing to wake: look again
    if begin_again():
        if take(locks, key, run_id) is not None:
            return Run(run)
        run.hand_back()  # (wakes what is pending now) a run that ended took this call: a copy of it runs
        return Pend(key, 0.0, woken=True)
    backstop = claim_backstop(locks, key, ttl=countdown + 5.0)
    return Pend(key, countdown, backstop=backstop)


def _replace(
    opts: GuardOptions, key: str, ex: Execution, hooks: Hooks, locks: Locks, run: GuardedRun, refuse: bool
) -> bool:
    """``overlap="replace"``, the lease refused: take it over from the oldest holder and begin.
    A few rounds, for calls replacing each other at once; ``False`` (a skip) when the holders
    cannot be replaced (none named by a run id)."""
    for _ in range(5):
        victim = replace_holder(locks, key, run.run_id, opts.limit)
        if run.begin(refuse_finished=refuse, same_run=ex.same_run, same_run_wait=ex.same_run_wait):
            if victim is not None and (victim.holder or {}).get("stoppable") is False:
                log.warning(
                    "%s[%s]: lease %r taken over from %s, which cannot be stopped from here (a local "
                    "call, or a worker's own process); it goes on without its lease",
                    ex.task,
                    ex.run_id,
                    key,
                    victim.run_id,
                )
            elif victim is not None:
                log.info("%s[%s]: lease %r taken over from %s", ex.task, ex.run_id, key, victim.run_id)
                hooks.replaced(victim)
            return True
        if victim is None and run.reason not in (Reason.HELD, Reason.LIMIT):
            return False
        if victim is None and not [h for h in locks.holders(key) if h.run_id is not None]:
            return False
    return False


#: ``overlap="allow"``: the lease record ``slot-started:<slot run id>`` says a periodic slot's run
#: started (kept as long as the slot's finished marker), so a copy of the slot (published again by
#: a new leader) does not run it twice.
SLOT_STARTED_RECORD = "slot-started:"


def _allow(key: str, ex: Execution, locks: Locks, run: GuardedRun) -> Run | Duplicate:
    """``overlap="allow"`` (a periodic entry's): the body runs without a lease, beside any other
    run of the key. A periodic slot still runs once: its first execution records that it started
    (one ``SET NX``); a copy of it is a :class:`Duplicate`."""
    if ex.slot is not None and not ex.local:
        started = locks.put_record(key, SLOT_STARTED_RECORD + ex.slot[0], "1", ttl=ex.slot[1], if_absent=True)
        if not started:
            return Duplicate(key)
    run.run_unguarded()
    return Run(run)


def replaced_skip(opts: GuardOptions, run: GuardedRun) -> Skipped | None:
    """``overlap="replace"``: after ``run``'s body ended with its lease lost (an exception, or
    ``LeaseLost`` from the end), the ``Skipped(reason="replaced")`` it ends with when another run
    took its lease over, else ``None``. Never raises (a Redis error: ``None``)."""
    if opts.overlap != Overlap.REPLACE or run.run_id is None:
        return None
    try:
        by = replaced_by(run.locks, run.key, run.run_id)
    except LeaseBackendError:
        return None
    if by is None:
        return None
    return Skipped(key=run.key, reason=Reason.REPLACED, task=run.task, follow_up=by or None)


def _backstop(opts: GuardOptions, key: str, hooks: Hooks, locks: Locks) -> Pend:
    """The key's backstop: wake its pending follow-up once a slot of the lease is free (its
    holder ended without waking it: killed), else look again after the holders' TTL."""
    if pending(locks, key) is None:
        return Pend(key, 0.0, woken=True)
    holders = locks.holders(key)
    if len(holders) < opts.limit:
        wake_pending(locks, key, hooks.wake, "backstop")
        return Pend(key, 0.0, woken=True)
    countdown = max(min((h.ttl if h.ttl is not None else opts.ttl) for h in holders), 1.0) + 1.0
    refresh(locks, key, ttl=record_ttl(countdown, opts.ttl))
    claim_backstop(locks, key, ttl=countdown + 5.0, renew=True)
    return Pend(key, countdown, backstop=True)


def _quietly_take(locks: Locks, key: str, run_id: str) -> None:
    try:
        take(locks, key, run_id)
    except LeaseBackendError as e:  # its record expires; at worst the follow-up runs once more
        log.warning("could not clear the pending record of %r: %s", key, e)


def _carried_state(hooks: Hooks, ex: Execution) -> dict[str, Any] | None:
    """The pacing state the execution carried back, checked (:func:`taskguard.pacing.parse_state`):
    a malformed one is logged and the run paced afresh."""
    try:
        return parse_state(hooks.rate_state())
    except ValueError as e:
        log.error("%s[%s]: ignoring a malformed carried pacing state (%s); pacing it afresh", ex.task, ex.run_id, e)
        return None


def _pace(
    opts: GuardOptions,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ex: Execution,
    hooks: Hooks,
    locks: Locks,
    handle: Mapping[str, Any] | None,
) -> Skip | Defer | charging:
    """The rate (:func:`taskguard.pacing.pace`), the run costing ``opts.cost_of`` the call: its
    :class:`~taskguard.pacing.charging` when the run goes on now (a local call waits for its
    turn here; a run back a moment before its booked turn waits for it, then re-checks it
    against a back-off pause), else the :class:`Skip` or :class:`Defer` (reason
    ``"rate_limited"``, or ``"backoff"`` while a pause is on). Raises ConfigError for a cost
    that could never pass."""
    state = _carried_state(hooks, ex)
    rate_key = cast(KeyTemplate, opts.rate_key).render(args, kwargs)  # (a guard with a rate has its key)
    rate = cast("tuple[int, float]", opts.rate)
    cost = opts.cost_of(args, kwargs)
    if opts.rate_burst is not None and cost > opts.rate_burst:
        raise ConfigError(
            f"task {ex.task!r}: a call of cost {cost} can never pass its rate, whose rate_burst is "
            f"{opts.rate_burst} (cost units): raise rate_burst to at least {cost} or split the call"
        )
    bound = hooks.rate_bound()
    if not opts.enforce:  # shadow mode: checked, not consumed; reported; the run goes ahead
        reason = shadow_reason(
            locks,
            rate_key,
            rate=rate,
            burst=opts.rate_burst,
            max_wait=opts.rate_max_wait,
            max_countdown=bound,
            task=ex.task,
            cost=cost,
        )
        if reason is not None:
            hooks.shadow(rate_key, reason, None, False, True)
        return charging(locks, rate_key, rate, cost, shadow=True)
    while True:
        p = pace(
            locks,
            rate_key,
            rate=rate,
            burst=opts.rate_burst,
            max_wait=opts.rate_max_wait,
            max_countdown=bound,
            state=state,
            cost=cost,
        )
        if p.go:
            if p.countdown > 0:
                time.sleep(p.countdown)  # back a moment before its booked turn: re-checked at it
                continue
            hooks.rate_go()
            return charging(locks, rate_key, rate, cost)
        why = Reason(p.reason)
        if p.skip:
            if handle is not None:
                hooks.release_handle(handle)
            return Skip(Skipped(key=rate_key, reason=why, task=ex.task))
        if not ex.local:
            if handle is not None:  # a retry's kept lease is not held through a rate wait
                hooks.release_handle(handle)
            skipped = Skipped(key=rate_key, reason=why, task=ex.task, holder_ttl=None)
            locks.report_skip(skipped)
            return Defer(p.countdown, why, rate_key, state=p.state, skipped=skipped)
        time.sleep(p.countdown)  # a direct or eager call waits for its turn here
        state = p.state


def backed_off(
    opts: GuardOptions,
    key: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ex: Execution,
    hooks: Hooks,
    locks: Locks,
    exc: RateLimited,
) -> Skip | Defer | None:
    """The body of a :class:`Run` raised :class:`~taskguard.RateLimited` (an upstream's 429;
    the adapter handed the run back, or in shadow mode failed it). Pauses the rate key
    cluster-wide for ``exc.retry_after`` seconds (:func:`taskguard.pacing.back_off`; ``exc.key``,
    else the task's rate key, else its lease key) and decides what becomes of the run:

    * a :class:`Defer` (reason ``"backoff"``, the skip reported) past the pause — the adapter
      re-publishes it as for a rate turn, consuming none of the task's retries;
    * a :class:`Skip` (reason ``"backoff"``) when the pause outlasts ``rate_max_wait``;
    * ``None`` for a local call (direct, eager: the caller gets the ``RateLimited``) and in
      shadow mode (the shadow state is paused and the would-be back-off reported; the
      exception is the body's own).

    Raises ConfigError for a ``retry_after`` that is not a positive number of seconds,
    LeaseBackendError when Redis fails."""
    rate_key = (
        exc.key
        if exc.key is not None
        else (cast(KeyTemplate, opts.rate_key).render(args, kwargs) if opts.rate is not None else key)
    )
    p = back_off(
        locks,
        rate_key,
        exc.retry_after,
        max_wait=opts.rate_max_wait,
        max_countdown=hooks.rate_bound(),
        state=_carried_state(hooks, ex),
        shadow=not opts.enforce,
    )
    skipped = Skipped(key=rate_key, reason=Reason.BACKOFF, task=ex.task, holder_ttl=None)
    if not opts.enforce:
        locks.report_skip(skipped, shadow=True)
        hooks.shadow(rate_key, Reason.BACKOFF.value, None, True, True)
        return None
    if ex.local:
        return None
    if p.skip:
        return Skip(skipped)
    locks.report_skip(skipped)
    return Defer(p.countdown, Reason.BACKOFF, rate_key, state=p.state, skipped=skipped)


@dataclasses.dataclass(frozen=True)
class Performed:
    """How the body of a :class:`Run` ended (:func:`perform`): ``value``, what it returned; or
    ``instead``, the decision the execution ends with in place of a value (a :class:`Skip`:
    replaced by another run, or a back-off past ``rate_max_wait``; a :class:`Defer` past a
    back-off pause), which the adapter translates like any other."""

    value: Any = None
    instead: Skip | Defer | None = None


def perform(
    decision: Run,
    body: Callable[[], Any],
    opts: GuardOptions,
    key: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ex: Execution,
    hooks: Hooks,
    locks: Locks,
) -> Performed:
    """Run ``body()`` under the decision's run (and its rate charge) and end the run by how it
    ended (the table in this module's docstring): both adapters end a run the same way, and
    tell only what their framework means by a value or an exception (:meth:`Hooks.failed`,
    :meth:`Hooks.settle`, :meth:`Hooks.returned`).

    Raises what the body raised (after the run is settled), :class:`~taskguard.LeaseLost` from
    the end of a run whose lease was lost with ``on_lost="raise"`` (unless another run took it
    over: then :class:`Skip`), ConfigError for a ``once`` value that cannot be stored."""
    run = decision.run
    with run, decision.charging():
        try:
            value = body()
        except RateLimited as exc:
            if not opts.enforce:  # shadow mode: the guard does not act on it; it is the body's failure
                hooks.settle(run, exc)
                try:
                    backed_off(opts, key, args, kwargs, ex, hooks, locks, exc)  # (reported only)
                except (ConfigError, LeaseBackendError) as e:  # the body's own exception stays the answer
                    log.warning("%s: shadow mode: could not report the back-off (%s)", ex.task or "run", e)
                raise
            if not _pause_given(exc):  # a bad retry_after: the run fails with ConfigError, as documented
                hooks.settle(run, exc)
                raise ConfigError(f"{exc!r}: retry_after must be a number of seconds > 0") from exc
            run.hand_back()  # it runs again after the pause
            after = backed_off(opts, key, args, kwargs, ex, hooks, locks, exc)
            if after is None:
                raise
            return Performed(instead=after)
        except BaseException as exc:
            replaced = replaced_skip(opts, run) if hooks.failed(exc) else None
            if replaced is None:
                hooks.settle(run, exc)
                raise
            run.fail()
            return Performed(instead=Skip(replaced))
    if hooks.returned(run, value):
        return Performed(value)
    try:
        run.finish(value)
    except LeaseLost:
        replaced = replaced_skip(opts, run)
        if replaced is None:
            raise
        return Performed(instead=Skip(replaced))
    return Performed(value)


def _pause_given(exc: RateLimited) -> bool:
    """Does ``exc`` name a pause :func:`backed_off` can set (``retry_after`` seconds > 0, a rate
    key that is ``None`` or a non-empty ``str``)?"""
    try:
        check_seconds("retry_after", exc.retry_after)
    except ConfigError:
        return False
    return exc.key is None or (isinstance(exc.key, str) and exc.key != "")
