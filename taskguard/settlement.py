"""How an execution that does not run its body ends, decided once for both adapters.

:func:`settle` takes a decision of :mod:`taskguard.pipeline` that is not a run — a
:class:`~taskguard.pipeline.Skip`, a :class:`~taskguard.pipeline.Stored` or a
:class:`~taskguard.pipeline.Duplicate` — with the guard's options, reports it, and returns a
:class:`Settlement`, which the adapter only translates (Celery: return, ``TaskSkipped``,
``Ignore``, ``self.retry``-like re-publish; RQ: return or ``TaskSkipped``):

===================================================  =========================================
decision, ``on_skip``                                settlement (reported as a ``skip`` event)
===================================================  =========================================
``Stored`` (``once``)                                ``result``: the stored value (the core
                                                     reported the skip when it read the record)
``Duplicate``                                        ``ignore`` (reason ``"duplicate"``)
``Skip``, ``on_skip="retry"``, the adapter can        ``retry`` in ``opts.retry_delay(holder_ttl)``
retry it (not a direct call), the reason is not       seconds, attempt ``skips + 1``, while
one of :data:`NOT_RETRIED` (``"rate_limited"``,       ``skips < skip_max_retries``
a superseded call's), ``skips < skip_max_retries``
``Skip``, ``on_skip="retry"``, retries used up       as ``on_skip="result"``, reason
                                                     ``"retry_exhausted"``
``Skip``, ``on_skip="raise"``                        ``raise`` (:meth:`Settlement.error`)
``Skip``, ``on_skip="ignore"``                       ``ignore``
``Skip``, ``on_skip="result"`` (or ``"retry"`` that  ``result``: the ``Skipped``; ``stop_chain``
cannot retry, or a reason of :data:`NOT_RETRIED`)     unless ``continue_on_skip``
===================================================  =========================================

Shadow mode (``enforce=False``) holds no run back: the pipeline runs the body of a call the
guard would have held back and reports that (a ``skip`` event with ``shadow=True``, and
:meth:`taskguard.pipeline.Hooks.shadow`). The decisions it still makes — a duplicate of a run
that finished, a copy of a debounce window that ran already — are settled here as in enforced
mode.

This module imports no task framework.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .errors import TaskSkipped
from .pipeline import Duplicate, Skip, Stored
from .policy import GuardOptions
from .skipped import Skipped
from .values import Ending, OnSkip, Reason

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

__all__ = ["Settlement", "settle"]


@dataclasses.dataclass(frozen=True)
class Settlement:
    """How an execution without a run ends.

    Attributes:
        ending: :class:`~taskguard.values.Ending`.
        skipped: the skip as reported (``"once"`` for a stored value, ``"duplicate"``...).
        value: ``result``: what the execution returns (the ``Skipped``, or the stored value).
        countdown: ``retry``: seconds until it runs again.
        attempt: ``retry``: which skip retry the next execution is (1-based).
        stop_chain: ``result`` of a skip: what was linked to the task (callbacks, a chain's next
            steps) does not run (``continue_on_skip`` off).
    """

    ending: Ending
    skipped: Skipped
    value: Any = None
    countdown: float = 0.0
    attempt: int = 0
    stop_chain: bool = False

    def error(self) -> TaskSkipped:
        """The :class:`~taskguard.TaskSkipped` an ``ending="raise"`` raises."""
        s = self.skipped
        return TaskSkipped(s.key, s.reason, s.task, s.holder_ttl, s.follow_up)


#: Skip reasons ``on_skip="retry"`` never retries: the rate has its own deferral (its skip came
#: past ``rate_max_wait``), and a call another call superseded — replaced, coalesced into a
#: follow-up, debounced into a newer window — has its work done by that call; run again, it would
#: undo what superseding it meant. They end as ``on_skip="result"`` would.
NOT_RETRIED = frozenset({Reason.RATE_LIMITED, Reason.REPLACED, Reason.COALESCED, Reason.DEBOUNCED})


def settle(
    opts: GuardOptions,
    decision: Skip | Stored | Duplicate,
    locks: Locks,
    task: str | None,
    *,
    skips: int = 0,
    can_retry: bool = False,
) -> Settlement:
    """Report ``decision`` (the core's ``skip`` event) and decide how the execution ends (the
    table in the module docstring). ``skips``: skip retries made so far; ``can_retry``: the
    adapter can run this call again later (Celery, but not a direct call); ``task`` names the
    task in the skip of a ``Stored`` or ``Duplicate``."""
    if isinstance(decision, Stored):
        return Settlement(Ending.RESULT, Skipped(key=decision.key, reason=Reason.ONCE, task=task), decision.value)
    if isinstance(decision, Duplicate):
        skipped = Skipped(key=decision.key, reason=Reason.DUPLICATE, task=task)
        locks.report_skip(skipped)
        return Settlement(Ending.IGNORE, skipped)
    skipped = decision.skipped
    if opts.on_skip == OnSkip.RETRY and can_retry and skipped.reason not in NOT_RETRIED:
        if skips < opts.skip_max_retries:
            locks.report_skip(skipped)
            return Settlement(Ending.RETRY, skipped, countdown=opts.retry_delay(skipped.holder_ttl), attempt=skips + 1)
        skipped = dataclasses.replace(skipped, reason=Reason.RETRY_EXHAUSTED)
    locks.report_skip(skipped)
    if opts.on_skip == OnSkip.RAISE:
        return Settlement(Ending.RAISE, skipped)
    if opts.on_skip == OnSkip.IGNORE:
        return Settlement(Ending.IGNORE, skipped)
    return Settlement(Ending.RESULT, skipped, skipped, stop_chain=not opts.continue_on_skip)
