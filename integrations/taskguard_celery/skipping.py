"""What a guarded Celery task does when it does not run its body (skips per ``on_skip``, stored
values, duplicates, as :mod:`taskguard.settlement` decides), and the events that report them."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from celery.exceptions import Ignore, Retry

from taskguard import Skipped
from taskguard.pipeline import Duplicate, Skip, Stored
from taskguard.settlement import settle as settle_decision
from taskguard.values import Ending

from .headers import HEADER, RATE_HEADER, continuing, without
from .serialization import result_value

__all__ = ["settle", "republish", "result_codec", "send_event", "skip_count"]

log = logging.getLogger("taskguard.celery")

NO_RATE = object()  # (republish: no pacing state to carry)


def result_codec(task: Any) -> tuple[Any, Any]:
    """``(dumps, loads)`` storing a ``once`` value as the task's results are serialised: the
    app's ``result_serializer``, read back accepting ``result_accept_content`` (or
    ``accept_content``) — kombu's registry (kombu/serialization.py)."""
    from kombu.serialization import dumps as k_dumps, loads as k_loads, prepare_accept_content

    conf = task.app.conf
    serializer = conf.result_serializer
    accept = prepare_accept_content(conf.result_accept_content or conf.accept_content)  # names -> MIME types

    def dumps(value: Any) -> tuple[str, str, Any]:
        return k_dumps(value, serializer=serializer)

    def loads(data: Any, content_type: str, encoding: str) -> Any:
        return k_loads(data, content_type, encoding, accept=accept)

    return dumps, loads


def settle(task: Any, decision: Skip | Stored | Duplicate, skips: int) -> Any:
    """End an execution that does not run its body as the core settles it
    (:func:`taskguard.settlement.settle`): the ``task-skipped`` event, then a value, a skip
    retry (``Retry``), an ``Ignore`` or a ``TaskSkipped``."""
    req = task.request
    s = settle_decision(
        task.taskguard_options,
        decision,
        task.taskguard_locks,
        task.name,
        skips=skips,
        can_retry=not req.called_directly,
    )
    send_skip_event(task, s.skipped, retrying=s.ending == Ending.RETRY)
    if s.ending == Ending.RETRY:
        retry_after_skip(task, s.countdown, s.attempt, s.skipped.reason)
    if isinstance(decision, Stored):
        # the chain goes on: the value is the work's
        log.info("task %s[%s]: %r already completed; returning the stored value", task.name, req.id, decision.key)
        return s.value
    if isinstance(decision, Duplicate):
        log.info("task %s[%s]: redelivered copy of a finished run ignored", task.name, req.id)
        raise Ignore(f"duplicate of finished {task.name}[{req.id}]")
    if s.ending == Ending.RAISE:
        raise s.error()
    if s.ending == Ending.IGNORE:
        raise Ignore(s.skipped.describe())
    if s.stop_chain:
        # the tracer reads these from this very request after we return
        # (celery/app/trace.py, _dispatch_callbacks_and_chain)
        req.callbacks = None
        req.chain = None
    return result_value(s.skipped, task)


def retry_after_skip(task: Any, countdown: float, skips: int, reason: str = "held") -> NoReturn:
    """``on_skip="retry"``: re-publish this request ``countdown`` seconds later (:func:`republish`)."""
    why = {
        "limit": "every slot of the lease held (limit)",
        "limit_total": "every place in the total held (limit_total)",
    }.get(reason, f"lease {reason}")
    republish(task, countdown, f"{why}; retry {skips} of {task.taskguard_options.skip_max_retries}", skips)


def republish(task: Any, countdown: float, message: str, skips: Any, rate: Any = NO_RATE) -> NoReturn:
    """Re-publish this request ``countdown`` seconds later as the same run without counting a
    retry (``max_retries`` is for the body's failures, not for contention or a rate turn): its
    ``skips`` so far in the ``taskguard`` header, with ``rate`` its pacing state in the
    ``taskguard_rate`` header (else none: its turn was used, the next attempt asks the rate
    again), no deferral header but a publish's that waited (:func:`.headers.continuing`). Raises
    ``Retry``."""
    req = task.request
    headers = {**without(req.headers), **continuing(req)}
    if skips:
        headers[HEADER] = {"skips": skips}
    if rate is not NO_RATE:
        headers[RATE_HEADER] = rate
    sig = task.signature_from_request(req, countdown=countdown, retries=req.retries, headers=headers)
    if req.is_eager:
        raise Retry(message, when=countdown, is_eager=True, sig=sig)
    sig.apply_async()
    raise Retry(message, when=countdown, sig=sig)


def send_skip_event(task: Any, skipped: Skipped, retrying: bool = False, **extra: Any) -> None:
    send_event(
        task,
        "task-skipped",
        key=skipped.key,
        reason=skipped.reason,
        holder_ttl=skipped.holder_ttl,
        result=skipped.describe(),
        retrying=retrying,
        **extra,
    )


def send_event(task: Any, type_: str, **fields: Any) -> None:
    """Send a Celery event from a worker execution (never from direct/eager calls). Sent even
    when the worker runs without ``-E``: ``Task.send_event`` uses its own dispatcher
    (celery/app/task.py). A broker error is logged, never raised over the task's outcome."""
    req = task.request
    if req.called_directly or req.is_eager:
        return
    try:
        task.send_event(type_, name=task.name, **fields)
    except Exception as e:
        log.warning("task %s: could not send %s event: %s", task.name, type_, e)


def skip_count(task: Any, header: Any) -> int:
    skips = header.get("skips", 0) if isinstance(header, dict) else 0
    if isinstance(skips, bool) or not isinstance(skips, int) or skips < 0:
        log.error("task %s[%s]: ignoring a malformed skip count in its %r header", task.name, task.request.id, HEADER)
        return 0
    return skips
