"""What a guarded Celery task does when it does not run its body: skips (per ``on_skip``),
duplicates, and the events that report them."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from celery.exceptions import Ignore, Retry

from taskguard import Locks, Skipped, TaskSkipped

from .headers import DEFER_HEADER, HEADER, RATE_HEADER
from .serialization import result_value

__all__ = ["skip", "duplicate", "completed", "result_codec", "send_event", "skip_count"]

log = logging.getLogger("taskguard.celery")


def duplicate(task: Any, key: str, locks: Locks) -> Any:
    """A redelivered copy of a run that already finished: store nothing, ack it."""
    req = task.request
    skipped = Skipped(key=key, reason="duplicate", task=task.name)
    locks.report_skip(skipped)
    send_skip_event(task, skipped)
    log.info("task %s[%s]: redelivered copy of a finished run ignored", task.name, req.id)
    raise Ignore(f"duplicate of finished {task.name}[{req.id}]")


def completed(task: Any, key: str, value: Any) -> Any:
    """``once=True``: the key's work was completed by an earlier call; its stored ``value`` is this
    run's result (reason ``"once"``, reported; the chain goes on: the value is the work's)."""
    skipped = Skipped(key=key, reason="once", task=task.name)
    send_event(task, "task-skipped", key=key, reason="once", holder_ttl=None, result=skipped.describe(), retrying=False)
    log.info("task %s[%s]: %r already completed; returning the stored value", task.name, task.request.id, key)
    return value


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


def skip(task: Any, skipped: Skipped, skips: int, locks: Locks) -> Any:
    """A run that did not get its lease, per ``on_skip``: reported, then a value, a retry,
    an ``Ignore`` or a ``TaskSkipped``."""
    opts = task.taskguard_options
    req = task.request
    if opts.on_skip == "retry" and not req.called_directly and skipped.reason != "rate_limited":
        if skips < opts.skip_max_retries:
            locks.report_skip(skipped)
            send_skip_event(task, skipped, retrying=True)
            retry_after_skip(task, opts.retry_delay(skipped.holder_ttl), skips + 1, skipped.reason)
        skipped = dataclasses.replace(skipped, reason="retry_exhausted")
    locks.report_skip(skipped)
    send_skip_event(task, skipped)
    if opts.on_skip == "raise":
        raise TaskSkipped(skipped.key, skipped.reason, task.name, skipped.holder_ttl, skipped.follow_up)
    if opts.on_skip == "ignore":
        raise Ignore(skipped.describe())
    if not opts.continue_on_skip:
        # the tracer reads these from this very request after we return
        # (celery/app/trace.py, _dispatch_callbacks_and_chain)
        req.callbacks = None
        req.chain = None
    return result_value(skipped, task)


def retry_after_skip(task: Any, countdown: float, skips: int, reason: str = "held") -> None:
    """Re-publish this request ``countdown`` seconds later without counting a retry
    (``max_retries`` is for the body's failures, not for contention)."""
    req = task.request
    headers = {**(req.headers or {}), HEADER: {"skips": skips}}
    headers.pop(DEFER_HEADER, None)
    headers.pop(RATE_HEADER, None)  # its turn was used: the next attempt asks the rate again
    sig = task.signature_from_request(req, countdown=countdown, retries=req.retries, headers=headers)
    why = {
        "limit": "every slot of the lease held (limit)",
        "limit_total": "every place in the total held (limit_total)",
    }.get(reason, f"lease {reason}")
    message = f"{why}; retry {skips} of {task.taskguard_options.skip_max_retries}"
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
