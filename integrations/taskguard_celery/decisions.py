"""Celery's side of the guard pipeline (:mod:`taskguard.pipeline`): the hooks it calls, and what
each of its decisions means for a Celery execution.

* :class:`Run` — the task runs its body (``GuardedTask``);
* :class:`Skip` — per ``on_skip`` (:func:`taskguard_celery.skipping.skip`);
* :class:`Defer` for a rate turn (``"rate_limited"``) or past a back-off pause (``"backoff"``,
  also after the body raised :class:`taskguard.RateLimited`) — the request is re-published for its turn
  (``signature_from_request`` with the request's own ``retries``, as ``on_skip="retry"`` does, so
  ``max_retries`` is not consumed) with the ``taskguard_rate`` header, and the execution ends with
  ``Retry`` (state RETRY). One deferral never lasts longer than half the broker's redelivery
  timeout (Redis ``visibility_timeout``, RabbitMQ ``consumer_timeout``;
  :func:`taskguard_celery.identity.redelivery_timeout`): a worker holds a delayed message unacked
  until its ETA, and the broker would hand a message held longer to another worker as well. A
  longer wait re-checks and defers again. Direct and eager calls wait for their turn in the
  calling thread instead (in the pipeline);
* :class:`Defer` for another execution of the same task id — a deferred copy
  (:func:`taskguard_celery.identity.defer`), ``Ignore``;
* :class:`Stored` — the ``once`` value is the result; :class:`Duplicate` — ``Ignore``;
* :class:`Pend` (``overlap="coalesce"``) — this call's own message is kept in Redis as the key's
  pending follow-up, published again (same task id) by the run that ends; the execution ends with
  ``Ignore`` (no result yet: the follow-up stores it), after sending the key's backstop (a copy of
  this message, delayed past the holder's TTL, header ``taskguard_coalesce``) when it is the one
  to. A call it supersedes gets its result (``Skipped(reason="coalesced")``) and ``task-skipped``
  event here.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from celery.exceptions import Ignore, Reject, Retry

from taskguard.handoff import parse_handle, release_handle
from taskguard.overlap import Pending
from taskguard.pipeline import Decision, Defer, Duplicate, Execution, Pend, Skip, Stored, shadow_line
from taskguard.run import GuardedRun
from taskguard.settlement import Settlement, settle
from taskguard.skipped import Skipped
from taskguard.values import Ending, Reason

from . import identity, skipping, uniqueness
from .headers import COALESCE_HEADER, PUBLISH_HEADER, RATE_HEADER, RUN_HEADERS, UNIQUE_HEADER, read_header, without
from .serialization import decode, encode, stored_form

__all__ = ["CeleryHooks", "execution", "outcome", "max_countdown"]

log = logging.getLogger("taskguard.celery")


def max_countdown(app: Any) -> float:
    """The longest one deferral lasts, seconds: half the broker's redelivery timeout, at least 1 s."""
    return max(1.0, identity.redelivery_timeout(app) / 2)


def execution(task: Any, req: Any, local: bool, redelivered: bool, slot: Any) -> Execution:
    """What Celery knows about this execution of ``task`` (its request ``req``)."""
    stamp = read_header(req, PUBLISH_HEADER)
    try:
        finished_ttl = None if local else identity.finished_ttl(task, req)
    except BaseException:  # (a bad taskguard_redelivery_timeout) it will not run: no longer queued
        uniqueness.clear(task, req)
        raise
    return Execution(
        task=task.name,
        run_id=req.id or None,
        holder={"task": task.name, "task_id": req.id},
        redelivered=redelivered,
        local=local,
        stamp=stamp if isinstance(stamp, str) and stamp and not local else None,
        slot=slot,
        finished_ttl=finished_ttl,
        tag=task,
        backstop=_is_backstop(req),
    )


def _is_backstop(req: Any) -> bool:
    header = read_header(req, COALESCE_HEADER)
    return isinstance(header, dict) and header.get("as") == "backstop"


#: headers of this delivery that a re-published follow-up must not carry: the retry handle (never
#: claimed twice), deferral and rate state, the publish stamp (a new publish), the queued mark.
_OWN_HEADERS = (*RUN_HEADERS, PUBLISH_HEADER, COALESCE_HEADER, UNIQUE_HEADER)


def _fresh_headers(req: Any) -> dict:
    return without(req.headers, _OWN_HEADERS)


class CeleryHooks:
    """:class:`taskguard.pipeline.Hooks` for one execution of a ``GuardedTask``."""

    __slots__ = ("task", "req", "handle")

    def __init__(self, task: Any, req: Any, handle: dict | None) -> None:
        self.task, self.req, self.handle = task, req, handle

    def persisted_handle(self) -> dict | None:
        return self.handle  # a retry's, from its ``taskguard`` header

    def release_handle(self, handle: Any) -> None:
        try:
            release_handle(self.task.taskguard_locks, parse_handle(handle))
        except Exception as e:  # (a Redis error, a malformed handle) the kept lease's TTL bounds it
            log.warning("task %s: could not release its kept lease before a rate wait: %s", self.task.name, e)

    def finished(self) -> bool:
        return identity.finished_in_backend(self.task, self.req)

    def clear_mark(self) -> None:
        uniqueness.clear(self.task, self.req)

    def queued_mark(self) -> tuple[str, str, str] | None:
        return uniqueness.mark_of(self.task, self.req)

    def result_codec(self) -> Any:
        return skipping.result_codec(self.task)

    def rate_state(self) -> Any:
        return read_header(self.req, RATE_HEADER)

    def rate_bound(self) -> float:
        return max_countdown(self.task.app)

    def rate_go(self) -> None:
        pass

    def shadow(self, key: str, reason: str, holder_ttl: float | None, leased: bool, rate: bool) -> None:
        # a task-guard-shadow event, never task-skipped (which Flower would show as the task's
        # state); the core's skip event (shadow=True) was emitted already
        skipping.send_event(
            self.task, "task-guard-shadow", key=key, reason=reason, holder_ttl=holder_ttl, leased=leased
        )
        log.info("task %s[%s]: %s", self.task.name, self.req.id, shadow_line(key, reason, rate))

    # -- how the body ended -----------------------------------------------------------------------
    def failed(self, exc: BaseException) -> bool:
        return isinstance(exc, Exception) and not isinstance(exc, (Retry, Reject))

    def settle(self, run: GuardedRun, exc: BaseException) -> None:
        """The body raised ``exc``: a ``Retry`` (``self.retry()`` kept the lease for it already;
        one of another kind, e.g. a nested call's ``on_skip``, hands it back), a ``Reject``
        (requeued: handed back; else failed), a failure (acked, ``acks_on_failure`` or not: the
        message is not requeued, so failed), or the worker going down (an ``acks_late`` message
        comes back: handed back)."""
        if isinstance(exc, Reject) and not exc.requeue or self.failed(exc):
            run.fail()
        else:
            run.hand_back()

    def returned(self, run: GuardedRun, value: Any) -> bool:
        return False

    def lost(self, run: Any, reason: str) -> None:
        skipping.send_event(
            self.task, "task-lease-lost", key=run.key, reason=reason, fencing_token=run.lease.fencing_token
        )

    # -- overlap="coalesce" ------------------------------------------------------------------------
    def pending_message(self) -> dict:
        """This call's own message (task id, arguments, options), in the task's serializer."""
        req = self.req
        sig = self.task.signature_from_request(req, retries=req.retries, headers=_fresh_headers(req))
        return encode(self.task, dict(sig))

    def wake(self, p: Pending) -> None:
        """Publish the follow-up's own message (same task id, a new publish)."""
        self.task.app.signature(decode(p.message)).apply_async()
        log.info("task %s: woke the pending follow-up %s", self.task.name, p.run_id)

    def supersede(self, prev: Pending, skipped: Skipped) -> None:
        """``prev`` (an earlier pending call, whose execution ended) ends here: its result is
        ``skipped`` (reason ``"coalesced"``), reported like any skip (core event, Prometheus,
        ``task-skipped`` with its task id)."""
        self._end_other(prev.run_id, skipped)
        log.info("task %s[%s]: coalesced into the pending follow-up %s", self.task.name, prev.run_id, skipped.follow_up)

    def _end_other(self, task_id: str, skipped: Skipped) -> None:
        """Another execution of this task (``task_id``) ends as ``skipped``, decided here as the
        core settles any skip (:func:`taskguard.settlement.settle`, per ``on_skip``; a superseded
        call is never retried): its result stored — SUCCESS with the ``Skipped``, or with
        ``on_skip="raise"`` FAILURE with ``TaskSkipped``; nothing with ``"ignore"`` — and the skip
        reported (core event, Prometheus, ``task-skipped`` with its task id). Never raises."""
        task = self.task
        s = Settlement(Ending.RESULT, skipped)
        try:
            s = settle(task.taskguard_options, Skip(skipped), task.taskguard_locks, task.name)
        except Exception as e:
            log.warning("task %s[%s]: could not report its skip: %s", task.name, task_id, e)
        try:
            if task.ignore_result or s.ending == Ending.IGNORE:
                pass
            elif s.ending == Ending.RAISE:
                task.backend.mark_as_failure(task_id, s.error(), call_errbacks=False)
            else:
                task.backend.store_result(task_id, stored_form(skipped, task), "SUCCESS")
        except Exception as e:
            log.warning("task %s[%s]: could not store its %s result: %s", task.name, task_id, skipped.reason, e)
        try:
            with task.app.events.default_dispatcher(hostname=self.req.hostname) as d:
                d.send(
                    "task-skipped",
                    uuid=task_id,
                    name=task.name,
                    key=skipped.key,
                    reason=skipped.reason,
                    holder_ttl=None,
                    result=skipped.describe(),
                    retrying=False,
                    follow_up=skipped.follow_up,
                )
        except Exception as e:
            log.warning("task %s: could not send task-skipped event: %s", task.name, e)

    def coalesced_into(self) -> str | None:
        return None  # a superseded call's execution has ended already (its result stored by supersede)

    def replaced(self, holder: Any) -> None:
        """``replace_terminate=True``: end the replaced run ``Skipped(reason="replaced")`` — its
        result stored (SUCCESS) and its skip reported here — then revoke it with terminate (its
        worker's pool kills the execution; the lease it held is this run's already).

        The order matters: Celery's worker writes REVOKED for a terminated task from its main
        process, at once, without the child's say (celery/worker/request.py
        ``Request.terminate`` -> ``_announce_revoked`` -> ``backend.mark_as_revoked``), and a
        key-value result backend (Redis, Memcached, ...) never overwrites a SUCCESS
        (celery/backends/base.py ``BaseKeyValueStoreBackend._store_result``), so the stored
        ``Skipped`` stays its result. Celery still sends ``task-revoked`` (and the
        ``task_revoked`` signal) after the ``task-skipped`` event: event consumers (Flower) show
        the task REVOKED. Another result backend may overwrite the result with REVOKED."""
        task = self.task
        # the holder's task id (a beat slot's run is named by its slot, its execution by its task id)
        task_id = (holder.holder or {}).get("task_id") or holder.run_id
        if not task.taskguard_options.replace_terminate or not isinstance(task_id, str):
            return
        self._end_other(
            task_id, Skipped(key=holder.key, reason=Reason.REPLACED, task=task.name, follow_up=self.req.id or None)
        )
        try:
            task.app.control.revoke(task_id, terminate=True)
            log.info("task %s[%s]: revoked the replaced run %s (terminate)", task.name, self.req.id, task_id)
        except Exception as e:
            log.warning("task %s: could not revoke the replaced run %s: %s", task.name, task_id, e)


def outcome(task: Any, decision: Decision, skips: int, redelivered: bool) -> Any:
    """What a decision other than ``Run`` means for this execution: the result, or the
    exception Celery turns into its state (``Retry``, ``Ignore``, ``TaskSkipped``)."""
    if isinstance(decision, Duplicate) and decision.run is not None:
        identity.end_chain(task, decision.run)
    if isinstance(decision, (Skip, Stored, Duplicate)):
        return skipping.settle(task, decision, skips)
    if isinstance(decision, Pend):
        _pend(task, decision)
    assert isinstance(decision, Defer)
    if decision.why == Reason.RUNNING:
        identity.defer(task, cast(GuardedRun, decision.run), redelivered)  # raises Ignore
    _defer_rate(task, decision)


def _pend(task: Any, d: Pend) -> None:
    """This call is the key's pending follow-up (or was woken already): send the backstop when it
    is this execution's to send, then end quietly (``Ignore``: no result yet)."""
    req = task.request
    if d.woken:
        raise Ignore(f"{task.name}[{req.id}]: its follow-up runs")
    if d.backstop:
        headers = {**_fresh_headers(req), COALESCE_HEADER: {"as": "backstop"}}
        task.signature_from_request(req, countdown=d.countdown, retries=req.retries, headers=headers).apply_async()
    log.info("task %s[%s]: lease %r held; pending follow-up (runs when the holder ends)", task.name, req.id, d.key)
    raise Ignore(f"{task.name}[{req.id}]: pending follow-up of {d.key!r}")


def _defer_rate(task: Any, d: Defer) -> None:
    """Re-publish this request for its turn under the rate; raises ``Retry``."""
    req = task.request
    header = read_header(req)
    skipping.send_skip_event(
        task,
        cast(Skipped, d.skipped),
        retrying=True,
        retry_after=round(d.countdown, 3),
        turn=None if d.state is None else d.state.get("turn"),
    )
    log.info("task %s[%s]: %s", task.name, req.id, d.describe())
    skips = header.get("skips") if isinstance(header, dict) else None
    skipping.republish(task, d.countdown, f"{d.what}; deferred {d.countdown:.2f}s", skips, rate=d.state)
