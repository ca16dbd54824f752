"""Publish-time uniqueness (``unique=True``): do not queue a second run of a key while one is
queued or running.

``GuardedTask.apply_async`` asks :meth:`taskguard.Locks.mark_queued` before publishing — one
single-key script on the lease hash: a run of the key that is queued (an unexpired mark) or
running (a live lease) answers with its task id, and the publish returns that run's
``AsyncResult`` and publishes nothing; else the new task id is marked and the message published
with the ``taskguard_unique`` header. The mark is cleared by the worker when the run starts
(atomically with its lease, or when it is skipped), by the worker's main process when the message is
revoked or expires (``task_revoked``), at once when the publish itself fails, and otherwise by
its TTL (``unique_ttl``, default the publish's ``expires`` or 1 hour, plus any countdown): a
message lost after publishing blocks the key no longer than that.

The lease stays the correctness boundary: uniqueness only saves queue space. A copy published
without ``unique=True`` (another client, ``send_task`` by name) is not stopped here; its run is
guarded as always.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery.utils.time import maybe_iso8601
from kombu.utils.uuid import uuid

from taskguard import ConfigError, LeaseBackendError

from .headers import UNIQUE_HEADER, read_header
from .metrics import install_if_wanted

__all__ = ["publish", "clear", "mark_of", "DEFAULT_UNIQUE_TTL"]

log = logging.getLogger("taskguard.celery")

#: How long a queued mark lasts by default when the publish gives no ``expires``, seconds.
DEFAULT_UNIQUE_TTL = 3600.0


def _seconds_until(when: Any) -> float:
    if when is None:
        return 0.0
    if isinstance(when, (int, float)):
        return max(0.0, float(when))
    dt = maybe_iso8601(when) if isinstance(when, str) else when
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return max(0.0, (dt - datetime.now(timezone.utc)).total_seconds())


def mark_ttl(task: Any, options: dict) -> float:
    """Seconds the queued mark lasts: ``unique_ttl`` (else the publish's ``expires``, else
    :data:`DEFAULT_UNIQUE_TTL`) after the run is due (``countdown`` / ``eta``)."""
    opts = task.taskguard_options
    base = opts.unique_ttl
    if base is None:
        expires = options.get("expires", getattr(task, "expires", None))
        base = _seconds_until(expires) if expires is not None else DEFAULT_UNIQUE_TTL
    delay = (
        _seconds_until(options.get("countdown"))
        if options.get("countdown") is not None
        else _seconds_until(options.get("eta"))
    )
    return max(base, 1.0) + delay


def publish(
    task: Any, args: Any, kwargs: Any, task_id: str | None, options: dict, send: Callable[[str, dict], Any]
) -> Any:
    """Publish ``task`` unless a run of its key is queued or running; returns the new or the
    existing run's ``AsyncResult``. ``send(task_id, options)`` publishes. Raises TypeError when
    the arguments do not bind to the task's signature (and what the key fails with on them, with
    its own type: :class:`taskguard.keys.KeyTemplate`), LeaseBackendError when Redis fails (nothing is
    published then), and whatever ``send`` raises (the mark is cleared first)."""
    key = task.taskguard_options.key.render(tuple(args or ()), dict(kwargs or {}))
    task_id = task_id or uuid()
    locks = task.taskguard_locks
    shadow = not task.taskguard_options.enforce
    try:
        marked, existing = locks.mark_queued(key, task_id, ttl=mark_ttl(task, options), task=task.name, shadow=shadow)
    except LeaseBackendError as e:
        if not shadow:
            raise
        log.warning("task %s: shadow mode: uniqueness of %r could not be checked (%s); publishing", task.name, key, e)
        return send(task_id, options)
    if not marked:
        install_if_wanted(task.app)  # app.conf.taskguard_metrics counts suppressions here too
        locks.report_suppressed(key, task.name, existing, shadow=shadow)
        if shadow:  # published anyway, without a mark of its own
            log.info(
                "task %s: shadow mode: would not have been published, a run of %r is queued or running: %s; "
                "publishing it",
                task.name,
                key,
                existing,
            )
            return send(task_id, options)
        log.info("task %s: not published, a run of %r is queued or running: %s", task.name, key, existing)
        return task.AsyncResult(existing)
    options = {**options, "headers": {**(options.get("headers") or {}), UNIQUE_HEADER: key}}
    try:
        return send(task_id, options)
    except BaseException:
        try:
            locks.clear_queued(key, task_id, task.name, shadow)  # never leave a mark for a message that was not sent
        except LeaseBackendError as e:
            log.warning(
                "task %s: could not clear the queued mark of a failed publish (its TTL bounds it): %s", task.name, e
            )
        raise


def mark_of(task: Any, request: Any) -> tuple[str, str, str] | None:
    """``(key, task id, task name)`` of the queued mark ``request`` was published with (the
    arguments of :meth:`taskguard.Locks.clear_queued`), or ``None``."""
    key = read_header(request, UNIQUE_HEADER)
    run_id = getattr(request, "id", None)
    if not isinstance(key, str) or not key or not isinstance(run_id, str) or not run_id:
        return None
    return key, run_id, task.name


def clear(task: Any, request: Any) -> None:
    """The run of ``request`` started (or will never run): clear its key's queued mark if it
    names this task id. Never raises (logged)."""
    mark = mark_of(task, request)
    if mark is None:
        return
    try:
        opts = getattr(task, "taskguard_options", None)
        task.taskguard_locks.clear_queued(*mark, opts is not None and not opts.enforce)
    except (ConfigError, LeaseBackendError) as e:
        log.warning("task %s[%s]: could not clear its queued mark (its TTL bounds it): %s", task.name, request.id, e)
