"""The publish-time uniqueness protocol (``unique=True``) every adapter's publish goes through:
mark the key queued, publish, and never leave a mark behind for a call that was not published.

:func:`publish` asks :meth:`taskguard.Locks.mark_queued` (one single-key script on the lease
hash). A run of the key that is queued (an unexpired mark) or running (a live lease) answers with
its run id: the call publishes nothing and gets that run's handle. Otherwise the new run id is
marked and the call published carrying its key (a Celery header, an RQ job's meta), so that the
run clears the mark when it starts (atomically with its lease: :meth:`taskguard.Locks.acquire`'s
``queued_mark``) or is skipped (:func:`clear`); the mark is cleared at once when the publish
itself fails, and otherwise lasts its TTL — unless the framework can tell that the run a mark
names will never start (an RQ job cancelled or failed while queued: ``over``), which
clears that mark at the next publish of the key. In shadow mode (``enforce=False``) the call is always
published; what uniqueness would have done is reported and logged (shadow mode's mark of its
own, :mod:`taskguard.queue_marks`).

The lease stays the correctness boundary: uniqueness only saves queue space. This module imports
no task framework.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from .errors import ConfigError, LeaseBackendError

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

__all__ = ["publish", "clear", "DEFAULT_TTL"]

log = logging.getLogger("taskguard")

T = TypeVar("T")

#: How long a queued mark lasts when neither the guard (``unique_ttl``) nor the publish (Celery's
#: ``expires``, RQ's queued ``ttl``) says, seconds; the run's delay (countdown, ETA) is added.
DEFAULT_TTL = 3600.0


def publish(
    locks: Locks,
    key: str,
    run_id: str,
    *,
    ttl: float,
    task: str,
    shadow: bool,
    send: Callable[[bool], T],
    existing: Callable[[str], T],
    over: Callable[[str], bool] | None = None,
) -> T:
    """Publish a call of ``task`` on ``key`` (run id ``run_id``) unless a run of the key is queued
    or running.

    Args:
        ttl: seconds the queued mark lasts should the run never start (from when the run is due).
        shadow: shadow mode: publish anyway, report what uniqueness would have done.
        send: ``send(marked)`` publishes the call; with ``marked`` it carries the key so that its
            run clears the mark. Its value is returned.
        existing: ``existing(run_id)`` is the handle returned for the run already queued or
            running (nothing is published then).
        over: ``over(run_id)``, asked of a run found queued or running: ``True`` when the
            framework knows it will never start (it is over while its mark lasts). Its
            mark is then cleared (only if it still names that run: a live lease of the run is
            never touched) and the publish asks once more.

    Raises LeaseBackendError when Redis fails (nothing published; in shadow mode the call is
    published and the failure logged), and whatever ``send`` raises (the mark cleared first)."""
    try:
        marked, found = locks.mark_queued(key, run_id, ttl=ttl, task=task, shadow=shadow)
        if not marked and not shadow and over is not None and found != run_id and over(found):
            # a mark outliving its run: cleared (by this call, or by another one that found it
            # first and may have marked its own run since), then asked again
            if locks.clear_queued(key, found, task):
                log.info("%s: the run %s marked queued on %r will never start: mark cleared", task, found, key)
            marked, found = locks.mark_queued(key, run_id, ttl=ttl, task=task, shadow=shadow)
    except LeaseBackendError as e:
        if not shadow:
            raise
        log.warning("%s: shadow mode: uniqueness of %r could not be checked (%s); publishing", task, key, e)
        return send(False)
    if not marked:
        locks.report_suppressed(key, task, found, shadow=shadow)
        if shadow:  # published anyway, without a mark of its own
            log.info("%s: shadow mode: would not have been published, %r has %s queued or running", task, key, found)
            return send(False)
        log.info("%s: not published, a run of %r is queued or running: %s", task, key, found)
        return existing(found)
    try:
        return send(True)
    except BaseException:
        try:
            locks.clear_queued(key, run_id, task, shadow)  # never leave a mark for a call that was not sent
        except LeaseBackendError as e:
            log.warning("%s: could not clear the queued mark of a failed publish (its TTL bounds it): %s", task, e)
        raise


def clear(locks: Locks, mark: tuple[str, str, str] | None, shadow: bool) -> None:
    """The run named by ``mark`` (``(key, run id, task)``, as the call was published with) started
    or will never run: clear its key's queued mark if it still names this run. Never raises (a
    failure is logged: the mark's TTL bounds it)."""
    if mark is None:
        return
    try:
        locks.clear_queued(*mark, shadow)
    except (ConfigError, LeaseBackendError) as e:
        log.warning("%s[%s]: could not clear its queued mark (its TTL bounds it): %s", mark[2], mark[1], e)
