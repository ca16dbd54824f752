"""Run identity of Celery deliveries: which copies of a task id run, wait, or are dropped.

The rules (design §3b):

* A message the broker delivers again carries ``delivery_info["redelivered"]`` (kombu sets it on
  every transport's restore or redelivery; Celery's ``worker_deduplicate_successful_tasks`` relies
  on it, celery/app/trace.py). Such a copy is a **duplicate** when its run already *finished*
  (ended in a way that acked it): it never runs again and never stores a result.
* A message that was not redelivered is a **publish** (a retry, ``replace()``, ``apply_async``
  with an existing id, a chain step): it runs, after the current holder of its task id is done.
* A run that handed its message back (``Reject(requeue=True)``, a time limit with ``acks_late``
  and without ``acks_on_timeout``, ``reject_on_worker_lost``) is not finished: its redelivery runs.
* A copy that finds another execution of its task id holding the lease is re-published to look
  again later (a *deferred copy*, which carries the redelivered status forward in its
  ``taskguard_defer`` header). At most one deferred copy per delivery is pending at any time: a
  record under the lease key names the pending one; the copy that defers next publishes its own
  copy and then swaps the record to it atomically; a copy the record does not name (the broker's
  own redelivery of a superseded copy, the loser of a swap) is dropped. The chain continues until
  the holder ends, so if it dies the work still runs once, and a crash anywhere in a deferral
  loses nothing: the record only ever names a copy that was published.

Where a run's outcome is recorded:

* When Celery's result backend stores the outcome (a persistent backend, results not ignored,
  kept at least as long as the broker may redeliver), a redelivered copy reads the task's state
  there (``SUCCESS``, ``FAILURE`` or ``REVOKED`` = finished); the lease's fence record remembers the
  key's last finished run for the moment between the release and the result being stored. No
  other record is written.
* Otherwise the release writes a finished marker kept for :func:`redelivery_window` seconds: as
  long as the broker can still deliver a copy.
"""

from __future__ import annotations

import logging
import secrets
import weakref
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend
from celery.exceptions import Ignore, TimeLimitExceeded

from taskguard import LeaseBackendError
from taskguard.run import GuardedRun
from taskguard.validate import check_seconds

from .headers import DEFER_HEADER, PUBLISH_HEADER, publish_time, read_header

__all__ = [
    "redelivery_timeout",
    "redelivery_window",
    "finished_ttl",
    "is_redelivery",
    "finished_in_backend",
    "defer",
    "end_chain",
    "DEFER_MAX",
    "READY_STATES",
    "CLOCK_SKEW",
]

log = logging.getLogger("taskguard.celery")

#: Task states that mean the run finished (its message was acked).
READY_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
#: Clock difference between hosts allowed when a stored result's ``date_done`` is compared with a
#: publish stamp, seconds.
CLOCK_SKEW = 1.0
#: Longest a deferred copy waits before looking again, seconds.
DEFER_MAX = 10.0
#: Added to the broker's redelivery timeout for its restore sweep and clock skew, seconds.
SWEEP_MARGIN = 60.0
#: RabbitMQ's default ``consumer_timeout`` (30 minutes): an unacked delivery older than that
#: closes its channel, and the message is delivered again.
RABBITMQ_CONSUMER_TIMEOUT = 1800.0
#: Redis transport default ``visibility_timeout`` (kombu/transport/redis.py).
REDIS_VISIBILITY_TIMEOUT = 3600.0
#: SQS default ``visibility_timeout`` (kombu/transport/SQS.py).
SQS_VISIBILITY_TIMEOUT = 1800.0
#: Other transports.
DEFAULT_REDELIVERY_TIMEOUT = 3600.0

_TRANSPORT_TIMEOUTS = {
    "redis": REDIS_VISIBILITY_TIMEOUT,
    "sqs": SQS_VISIBILITY_TIMEOUT,
    "amqp": RABBITMQ_CONSUMER_TIMEOUT,
}

_timeouts: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def redelivery_timeout(app: Any) -> float:
    """Seconds a delivered but unacknowledged message can stay with a consumer before the broker
    delivers it again, from the app's settings:

    * ``app.conf.taskguard_redelivery_timeout`` when set (seconds > 0; say so for a RabbitMQ whose
      ``consumer_timeout`` is not the default);
    * Redis / Sentinel transport: ``broker_transport_options["visibility_timeout"]`` (kombu's
      default 3600);
    * SQS: ``visibility_timeout`` (default 1800);
    * AMQP (RabbitMQ): its default ``consumer_timeout``, 1800;
    * anything else: 3600.

    Raises ConfigError naming the setting when it is invalid."""
    cached = _timeouts.get(app)
    if cached is not None:
        return cached
    conf = app.conf
    explicit = conf.get("taskguard_redelivery_timeout")
    if explicit is not None:
        value = check_seconds("app.conf.taskguard_redelivery_timeout", explicit)
    else:
        try:
            driver = app.connection_for_write().transport.driver_type  # builds no connection
        except Exception:  # an unknown transport: the generic bound
            driver = ""
        default = _TRANSPORT_TIMEOUTS.get(driver, DEFAULT_REDELIVERY_TIMEOUT)
        options = conf.broker_transport_options or {}
        raw = options.get("visibility_timeout", default) if driver in ("redis", "sqs") else default
        value = check_seconds("broker_transport_options['visibility_timeout']", raw)
    _timeouts[app] = value
    return value


def redelivery_window(app: Any) -> float:
    """Seconds after a run ends during which the broker may still deliver a copy of its message:
    :func:`redelivery_timeout` plus :data:`SWEEP_MARGIN`."""
    return redelivery_timeout(app) + SWEEP_MARGIN


def _stores_outcome(task: Any, request: Any) -> bool:
    """Does Celery's result backend keep this run's outcome long enough to tell a finished run?"""
    backend = task.backend
    if isinstance(backend, (DisabledBackend, RPCBackend)):  # rpc: results live on the caller's queue
        return False
    ignore = getattr(request, "ignore_result", None)
    if ignore is None:
        ignore = task.ignore_result
    if ignore:
        return False
    expires = task.app.conf.result_expires
    if isinstance(expires, timedelta):
        expires = expires.total_seconds()
    return not expires or float(expires) >= redelivery_window(task.app)


def finished_ttl(task: Any, request: Any) -> float | None:
    """The ``finished_ttl`` of a run of ``task`` (see :class:`taskguard.run.GuardedRun`): ``None``
    when the result backend records finished runs, else :func:`redelivery_window`."""
    return None if _stores_outcome(task, request) else redelivery_window(task.app)


def is_redelivery(request: Any) -> bool:
    """Is this delivery a copy of a message delivered before (by the broker, or a deferred copy
    of such a copy)?"""
    info = getattr(request, "delivery_info", None) or {}
    if info.get("redelivered"):
        return True
    defer_header = read_header(request, DEFER_HEADER)
    return isinstance(defer_header, dict) and defer_header.get("redelivered") is True


def finished_in_backend(task: Any, request: Any) -> bool:
    """Has the run of ``request.id`` finished, per the result backend? ``False`` when the backend
    does not record it or cannot be read (the lease then decides)."""
    if not request.id or not _stores_outcome(task, request):
        return False
    try:
        meta = task.backend.get_task_meta(request.id)
    except Exception as e:
        log.warning("task %s[%s]: could not read its state from the result backend: %s", task.name, request.id, e)
        return False
    state = meta.get("status")
    if state in READY_STATES and _stored_before_this_publish(meta, read_header(request, PUBLISH_HEADER)):
        return False  # the outcome of an earlier publish of this id, not of this delivery's run
    if (
        state == "FAILURE"
        and task.acks_late
        and not task.acks_on_timeout
        and isinstance(meta.get("result"), TimeLimitExceeded)
    ):
        # a hard time limit stores FAILURE, then hands an acks_late message back when
        # acks_on_timeout is off (celery/worker/request.py: on_timeout, then on_failure): not finished
        return False
    return state in READY_STATES


def _stored_before_this_publish(meta: dict, stamp: Any) -> bool:
    published = publish_time(stamp)
    done = meta.get("date_done")
    if published is None or done is None:
        return False  # an unstamped publish (a client without taskguard): the task id decides
    try:
        done_dt = done if isinstance(done, datetime) else datetime.fromisoformat(str(done))
    except ValueError:
        return False
    if done_dt.tzinfo is None:  # Celery stores UTC (celery/backends/base.py, _get_result_meta)
        done_dt = done_dt.replace(tzinfo=timezone.utc)
    return done_dt.timestamp() < published - CLOCK_SKEW


def _chain_record(req: Any, redelivered: bool, header: dict | None) -> tuple[str, str]:
    """(chain, record name) of this copy's deferral chain: its own header's, else one chain for
    the broker's redeliveries of this delivery (task id and publish stamp), else a new one."""
    if header:
        chain = header["chain"]
    elif redelivered:
        stamp = read_header(req, PUBLISH_HEADER)
        chain = "r:" + (stamp if isinstance(stamp, str) else "")
    else:
        chain = secrets.token_hex(8)
    return chain, f"defer:{req.id}:{chain}"


def _defer_header(req: Any) -> dict | None:
    header = read_header(req, DEFER_HEADER)
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("chain"), str)
        or not isinstance(header.get("nonce"), str)
    ):
        return None
    return header


def end_chain(task: Any, run: GuardedRun) -> None:
    """A deferred copy runs, or is dropped as a duplicate: its chain ends, so its record goes
    (only while it still names this copy)."""
    req = task.request
    header = _defer_header(req)
    if header is None:
        return
    _chain, record = _chain_record(req, False, header)
    try:
        run.locks.delete_record(run.key, record, if_value=header["nonce"])
    except LeaseBackendError as e:  # it expires by itself
        log.warning("task %s[%s]: could not end its deferral record: %s", task.name, req.id, e)


def defer(task: Any, run: GuardedRun, redelivered: bool) -> None:
    """Another execution of this task id holds the lease: re-publish this copy to look again when
    that lease could have ended, unless another deferred copy of the same delivery is pending.
    Always raises :class:`celery.exceptions.Ignore` (this copy stores no result and is acked)."""
    req = task.request
    header = _defer_header(req)
    # the broker's redeliveries of one delivery join that delivery's one chain; each publish
    # starts a chain of its own
    chain, record = _chain_record(req, redelivered, header)
    timeout = redelivery_timeout(task.app)
    countdown = min(max(run.holder_ttl or 1.0, 0.5), DEFER_MAX, max(0.5, timeout / 2))
    nonce = secrets.token_hex(8)
    if req.called_directly or req.is_eager:
        raise Ignore(f"{task.name}[{req.id}] runs in another execution")
    expected = header["nonce"] if header else None
    locks = run.locks
    try:
        current = locks.get_record(run.key, record)
    except LeaseBackendError as e:
        log.warning(
            "task %s[%s]: could not read its deferred copy's record (%s); deferring anyway", task.name, req.id, e
        )
        current = None
    if current is not None and current != expected:
        log.info(
            "task %s[%s]: another execution runs it and a deferred copy is pending; this copy is dropped",
            task.name,
            req.id,
        )
        raise Ignore(f"duplicate of running {task.name}[{req.id}]")
    # publish first, then name the new copy in the record: the record only ever names a copy that
    # exists, so a crash between the two loses nothing (this copy, unacked, comes back and still
    # matches the record); a copy published by a loser of the swap finds itself unnamed and goes
    headers = {**(req.headers or {}), DEFER_HEADER: {"chain": chain, "nonce": nonce, "redelivered": redelivered}}
    task.signature_from_request(req, countdown=countdown, retries=req.retries, headers=headers).apply_async()
    try:
        if not locks.put_record(
            run.key, record, nonce, ttl=countdown + timeout + SWEEP_MARGIN, if_absent=True, if_value=expected
        ):
            log.info("task %s[%s]: another copy deferred first; this one's copy will be dropped", task.name, req.id)
    except LeaseBackendError as e:
        log.warning("task %s[%s]: could not record its deferred copy: %s", task.name, req.id, e)
    log.info("task %s[%s]: another execution runs it; this copy looks again in %.1fs", task.name, req.id, countdown)
    raise Ignore(f"{task.name}[{req.id}] runs in another execution; deferred {countdown:.1f}s")
