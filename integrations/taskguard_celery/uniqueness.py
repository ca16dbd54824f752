"""Publish-time uniqueness (``unique=True``): do not queue a second run of a key while one is
queued or running.

``GuardedTask.apply_async`` asks :meth:`taskguard.Locks.mark_queued` before publishing — one
single-key script on the lease hash: a run of the key that is queued (an unexpired mark) or
running (a live lease) answers with its task id, and the publish returns that run's
``AsyncResult`` and publishes nothing; else the new task id is marked and the message published
with the ``taskguard_unique`` header. The mark is cleared by the worker when the run starts
(atomically with its lease, or when it is skipped), by the worker's main process when the message is
revoked or expires (``task_revoked``) or names a task that worker does not know
(``task_unknown``, :mod:`taskguard_celery.supervision`), at once when the publish itself fails, and otherwise by
its TTL (``unique_ttl``, default the publish's ``expires`` or 1 hour, plus any countdown): a
message lost after publishing blocks the key no longer than that.

The lease stays the correctness boundary: uniqueness only saves queue space. A copy published
without ``unique=True`` (another client, ``send_task`` by name) is not stopped here; its run is
guarded as always.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery.utils.time import maybe_iso8601
from kombu.utils.uuid import uuid

from taskguard import unique

from .headers import UNIQUE_HEADER, read_header
from .metrics import install_if_wanted

__all__ = ["publish", "clear", "mark_of", "seconds_until"]


def seconds_until(when: Any) -> float:
    """Seconds from now until ``when`` as Celery takes an ``eta`` / ``expires`` / ``countdown``:
    seconds, a datetime (naive: UTC) or an ISO 8601 string; never negative, ``0.0`` for ``None``.
    Raises ValueError / TypeError for anything else."""
    if when is None:
        return 0.0
    if isinstance(when, (int, float)):
        return max(0.0, float(when))
    dt = maybe_iso8601(when) if isinstance(when, str) else when
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return max(0.0, (dt - datetime.now(timezone.utc)).total_seconds())


def mark_ttl(task: Any, options: dict, unique_ttl: float | None = None) -> float:
    """Seconds the queued mark lasts: ``unique_ttl`` (the publish's, else the task's; else the
    publish's ``expires``, else :data:`taskguard.unique.DEFAULT_TTL`) after the run is due
    (``countdown`` / ``eta``)."""
    base = task.taskguard_options.unique_ttl if unique_ttl is None else unique_ttl
    if base is None:
        expires = options.get("expires", getattr(task, "expires", None))
        base = seconds_until(expires) if expires is not None else unique.DEFAULT_TTL
    delay = (
        seconds_until(options.get("countdown"))
        if options.get("countdown") is not None
        else seconds_until(options.get("eta"))
    )
    return max(base, 1.0) + delay


def publish(
    task: Any,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict,
    send: Callable[[str, dict], Any],
    unique_ttl: float | None = None,
) -> Any:
    """Publish ``task`` unless a run of its key is queued or running (:func:`taskguard.unique.publish`);
    returns the new or the existing run's ``AsyncResult``. ``send(task_id, options)`` publishes;
    ``unique_ttl`` (seconds) is this publish's own (:func:`mark_ttl`). Raises
    TypeError when the arguments do not bind to the task's signature (and what the key fails with
    on them, with its own type: :class:`taskguard.keys.KeyTemplate`), LeaseBackendError when Redis
    fails (nothing is published then), and whatever ``send`` raises (the mark is cleared first)."""
    key = task.taskguard_options.key.render(tuple(args or ()), dict(kwargs or {}))
    task_id = task_id or uuid()
    install_if_wanted(task.app)  # app.conf.taskguard_metrics counts suppressions here too

    def send_marked(marked: bool) -> Any:  # marked: the run clears the mark named in its header
        if not marked:
            return send(task_id, options)
        return send(task_id, {**options, "headers": {**(options.get("headers") or {}), UNIQUE_HEADER: key}})

    return unique.publish(
        task.taskguard_locks,
        key,
        task_id,
        ttl=mark_ttl(task, options, unique_ttl),
        task=task.name,
        shadow=not task.taskguard_options.enforce,
        send=send_marked,
        existing=task.AsyncResult,
        over=lambda run_id: _revoked(task, run_id),
    )


def _revoked(task: Any, run_id: str) -> bool:
    """Is the run ``run_id``, found marked queued, revoked (so it will never start)? Workers write
    REVOKED to the result backend when they get the revoke of a task they do not run
    (celery/worker/control.py ``_revoke``), also one that waits for its countdown — whose mark
    would otherwise stay until it is due, every publish meanwhile handed the revoked run. One
    backend read, only for a publish that finds a mark; ``False`` when the backend cannot tell."""
    try:
        return bool(task.AsyncResult(run_id).state == "REVOKED")
    except Exception:  # (no result backend, or it failed: the mark stands)
        return False


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
    names this task id (:func:`taskguard.unique.clear`; never raises)."""
    opts = getattr(task, "taskguard_options", None)
    unique.clear(task.taskguard_locks, mark_of(task, request), opts is not None and not opts.enforce)
