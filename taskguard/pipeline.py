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
``once``: the key's work done (same fingerprint)            :class:`Stored` (the stored value)
lease refused: this copy's run already finished             :class:`Duplicate` (with the run)
lease held by another execution of the same run id          :class:`Defer` (``"running"``;
                                                            countdown: holder's TTL, >= 0.5 s)
lease refused otherwise (held, limit, wait_timeout)         :class:`Skip` (not yet reported)
lease taken after waiting, redelivered, and finished        :class:`Duplicate` (lease handed back)
meanwhile (``wait > 0``)
lease taken (or shadow mode: whatever the guard said)       :class:`Run` (shadow: reported first)
==========================================================  ===================================

After the body: a body that raised :class:`~taskguard.RateLimited` (an upstream's 429) is
decided by :func:`backed_off`: the rate key paused cluster-wide, the run a :class:`Defer`
(``"backoff"``) past the pause, or a :class:`Skip` past ``rate_max_wait``.

The publish-time queued mark (``unique``) is cleared through :meth:`Hooks.clear_mark` as soon as
the execution started or will never run: on every decision but a rate :class:`Defer` (still
queued), and before any exception raised while deciding. What a decision means for the
framework (a stored result, a re-published message, an ``Ignore``, ``TaskSkipped``, RQ's
``Retry``) is the adapter's: it only translates.

This module imports no task framework.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from .errors import RateLimited
from .keys import KeyTemplate
from .pacing import back_off, charging, pace, shadow_reason
from .policy import GuardOptions
from .run import GuardedRun, RunRequest
from .skipped import Skipped
from .values import Reason, plain

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

__all__ = ["Execution", "Hooks", "Decision", "Run", "Skip", "Defer", "Stored", "Duplicate", "decide", "backed_off"]


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
        tag: free for the adapter (stored on the :class:`~taskguard.run.GuardedRun`).
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


class Hooks(Protocol):
    """What an adapter tells the pipeline, and does for it."""

    def persisted_handle(self) -> Mapping[str, Any] | None:
        """The lease handle persisted for this run (a retry's), or ``None``. May raise
        LeaseBackendError."""

    def release_handle(self, handle: Mapping[str, Any]) -> None:
        """Release a persisted handle's lease (not held through a rate wait). Never raises."""

    def finished(self) -> bool:
        """Has this run finished per the framework's own record (Celery's result backend)?"""

    def clear_mark(self) -> None:
        """Clear the publish-time queued mark naming this execution. Never raises."""

    def result_codec(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``(dumps, loads)`` for a ``once`` value, as the framework stores results."""

    def rate_state(self) -> dict[str, Any] | None:
        """The pacing state this execution carried back from a rate deferral, or ``None``."""

    def rate_bound(self) -> float:
        """The longest one rate deferral may last, seconds."""

    def rate_go(self) -> None:
        """The rate let this execution go (forget a carried pacing state)."""

    def shadow(self, key: str, reason: str, holder_ttl: float | None, leased: bool, rate: bool) -> None:
        """Shadow mode: the guard (``rate`` or the lease) would have held this run back
        (``reason`` a plain ``str``, for events and records)."""

    def lost(self, run: GuardedRun, reason: str) -> None:
        """The lease was lost while the body ran (before ``on_lost`` applies)."""


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


Decision = Run | Skip | Defer | Stored | Duplicate


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
        run = GuardedRun(
            locks,
            RunRequest(
                key,
                opts.ttl,
                opts.wait,
                opts.renew,
                ex.holder,
                opts.max_hold,
                opts.limit_of(args, kwargs),
                run_id,
                ex.task,
                opts.on_lost,
                finished_ttl,
                stamp,
                once,
                opts.enforce,
            ),
            on_lost_report=hooks.lost,
            tag=ex.tag,
        )
        # with a publish stamp, finished runs are known per delivery: no copy of a delivery whose
        # run finished runs again, whichever copy the broker hands out first (an ETA message held
        # past the visibility timeout runs on two workers at once); unstamped (a client without
        # taskguard), only a redelivered copy is checked
        began = run.begin(
            handle=handle,
            refuse_finished=ex.redelivered or stamp is not None or ex.slot is not None,
            same_run=ex.same_run,
            same_run_wait=ex.same_run_wait,
        )
    except BaseException:
        hooks.clear_mark()  # it will not run: no longer queued
        raise
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
    state = hooks.rate_state()
    rate_key = cast(KeyTemplate, opts.rate_key).render(args, kwargs)  # (a guard with a rate has its key)
    rate = cast("tuple[int, float]", opts.rate)
    cost = opts.cost_of(args, kwargs)
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
        state=hooks.rate_state(),
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
