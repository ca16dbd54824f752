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
  ``taskguard_defer`` header), at most one per delivery pending at any time
  (:mod:`taskguard.deferral`).

Where a run's outcome is recorded:

* When Celery's result backend stores the outcome (a persistent backend, results not ignored,
  kept at least as long as the broker may redeliver), a redelivered copy reads the task's state
  there (``SUCCESS``, ``FAILURE`` or ``REVOKED`` = finished); the lease's fence record remembers the
  key's last finished run for the moment between the release and the result being stored. No
  other record is written — except for a deferred copy of a publish: its delivery waited for
  another delivery of its task id, whose outcome the backend then holds under the same id
  (written after this delivery was published, so its date cannot tell them apart). Such a copy's
  run writes a finished marker, and its copies (the broker's redeliveries of it) read that
  marker, never the backend.
* Otherwise the release writes a finished marker kept for :func:`redelivery_window` seconds: as
  long as the broker can still deliver a copy.
"""

from __future__ import annotations

import logging
import weakref
from datetime import timedelta
from typing import Any

from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend
from celery.exceptions import Ignore, TimeLimitExceeded

from taskguard import deferral, stamps
from taskguard.run import GuardedRun
from taskguard.stamps import predates
from taskguard.validate import check_seconds

from .headers import DEFER_HEADER, PUBLISH_HEADER, continuing, read_header

__all__ = [
    "redelivery_timeout",
    "redelivery_window",
    "finished_ttl",
    "is_redelivery",
    "is_deferred_publish",
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
CLOCK_SKEW = stamps.CLOCK_SKEW  # (a stored result's date_done against a publish stamp)
DEFER_MAX = deferral.DEFER_MAX
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
    when the result backend records finished runs (and this is not a deferred copy of a publish,
    :func:`is_deferred_publish`), else :func:`redelivery_window`."""
    if _stores_outcome(task, request) and not is_deferred_publish(request):
        return None
    return redelivery_window(task.app)


def is_deferred_publish(request: Any) -> bool:
    """Is this delivery a deferred copy of a publish
    (:func:`taskguard.deferral.waits_for_another_delivery`)? It waited for another delivery of its
    task id, whose outcome the result backend then holds under the same id, written after this
    delivery was published: such a copy's run is told finished by its own finished marker, never
    by the backend."""
    return bool(continuing(request))


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
    does not record it or cannot be read, and for a deferred copy of a publish
    (:func:`is_deferred_publish`): the lease then decides, by the key's last finished run and the
    run's finished marker."""
    if not request.id or is_deferred_publish(request) or not _stores_outcome(task, request):
        return False
    try:
        meta = task.backend.get_task_meta(request.id)
    except Exception as e:
        log.warning("task %s[%s]: could not read its state from the result backend: %s", task.name, request.id, e)
        return False
    state = meta.get("status")
    # Celery stores date_done in UTC (celery/backends/base.py, _get_result_meta)
    if state in READY_STATES and predates(meta.get("date_done"), read_header(request, PUBLISH_HEADER)):
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


def end_chain(task: Any, run: GuardedRun) -> None:
    """A deferred copy runs, or is dropped as a duplicate: its chain ends
    (:func:`taskguard.deferral.end`)."""
    req = task.request
    header = deferral.carried(read_header(req, DEFER_HEADER))
    if header is not None:
        deferral.end(run.locks, run.key, req.id, header, f"task {task.name}[{req.id}]")


def defer(task: Any, run: GuardedRun, redelivered: bool) -> None:
    """Another execution of this task id holds the lease: re-publish this copy to look again when
    that lease could have ended, unless another deferred copy of the same delivery is pending
    (:mod:`taskguard.deferral`: the broker's redeliveries of one delivery join that delivery's
    one chain; each publish starts a chain of its own). Always raises
    :class:`celery.exceptions.Ignore` (this copy stores no result and is acked)."""
    req = task.request
    timeout = redelivery_timeout(task.app)
    header = deferral.carried(read_header(req, DEFER_HEADER))
    d = deferral.plan(req.id, header, redelivered, read_header(req, PUBLISH_HEADER), run.holder_ttl, timeout / 2)
    if req.called_directly or req.is_eager:
        raise Ignore(f"{task.name}[{req.id}] runs in another execution")
    who = f"task {task.name}[{req.id}]"
    if deferral.superseded(run.locks, run.key, d, who):
        log.info("%s: another execution runs it and a deferred copy is pending; this copy is dropped", who)
        raise Ignore(f"duplicate of running {task.name}[{req.id}]")
    # publish first, then name the new copy in the record
    headers = {**(req.headers or {}), DEFER_HEADER: d.header()}
    task.signature_from_request(req, countdown=d.countdown, retries=req.retries, headers=headers).apply_async()
    deferral.name(run.locks, run.key, d, d.countdown + timeout + SWEEP_MARGIN, who)
    log.info("%s: another execution runs it; this copy looks again in %.1fs", who, d.countdown)
    raise Ignore(f"{task.name}[{req.id}] runs in another execution; deferred {d.countdown:.1f}s")
