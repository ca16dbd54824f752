"""Release leases from the worker's main process when a child cannot.

A prefork child killed by a hard time limit, ``revoke(terminate=True)`` or a crash
(``WorkerLostError``) runs no ``finally``. Celery reports these from the main process
(celery/worker/request.py: ``Request.on_timeout`` and ``Request.on_failure`` send
``task_failure``; ``Request._announce_revoked`` sends ``task_revoked``), which knows the task id
and arguments but not the lease's owner token. The lease records the task id as its run id, so
the main process releases it with :meth:`taskguard.Locks.release_run` — once the child is dead:
a child that survives the signal (Celery's soft cancel with ``SIGUSR1``, ``SIGINT``) keeps its
lease to the end of its body.

Where this cannot happen — the whole worker killed, or a lost child whose message is requeued
(``task_reject_on_worker_lost``; Celery sends no signal then) — the lease lives until its TTL,
and a redelivered copy of the task finds its own task id holding it: if that holder process is
known dead (same host) the copy releases and runs, else it is deferred until the lease ends (see
:mod:`taskguard_celery.identity`).

A retry message that is revoked or expires before it runs releases the lease it kept (its
``taskguard`` header holds the handle).

A message that will never run clears the queued mark it was published with (``unique=True``),
and a debounce window's message the window's record (so that the next call opens a new window
instead of joining one that never runs): revoked or expired (``task_revoked``), or received by a
worker that does not know its task name (``task_unknown``: celery/worker/consumer/consumer.py
``on_unknown_task`` rejects the message and stores ``NotRegistered`` — a worker of an older
deploy, a renamed task). That worker knows no options of the task, so it clears them in the
app's default lease store (a task declared with ``locks=`` of its own leaves them to their TTL).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from billiard.exceptions import WorkerLostError
from celery.exceptions import TimeLimitExceeded
from celery.signals import task_failure, task_revoked, task_unknown

from taskguard import ConfigError, LeaseBackendError, debounce, unique
from taskguard.handle_records import release_when_dead
from taskguard.liveness import process_identity

from . import uniqueness
from .config import locks_for
from .headers import DEBOUNCE_HEADER, HEADER, UNIQUE_HEADER, read_header
from .setup import receiver
from .task import GuardedTask, release_retry_handle, run_options

__all__ = ["release_for_run"]

log = logging.getLogger("taskguard.celery")


def release_for_run(task: GuardedTask, task_id: str | None, args: Any, kwargs: Any, request: Any = None) -> bool:
    """Release the lease the execution ``task_id`` of ``task`` holds for this call (and its place
    in the total) once its process is dead (:func:`taskguard.handle_records.release_when_dead`):
    Celery announces a terminated task revoked right after sending the signal, and a hard time
    limit before killing the child (celery/worker/request.py ``Request.terminate``; billiard/pool.py
    ``on_hard_timeout``), so the child may still be running the body — and one that survives the
    signal (``signal="SIGUSR1"``, Celery's soft cancel; ``SIGINT``, which pool children ignore)
    goes on under its lease and releases it itself. ``True`` when released at once. The lease is
    found by the execution's task id in its holder metadata, so a beat slot's run (named by its
    slot) is found too; with the execution's ``request`` (its headers), a beat entry's own options
    (``key``...) apply, as in the child."""
    opts = task.taskguard_options
    if opts is None or not task_id:
        return False

    def announce(key: str) -> None:
        log.warning("task %s[%s]: lease %r released by the worker's main process", task.name, task_id, key)

    if request is not None:
        opts = run_options(task, request, opts)[0]
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    try:
        key, total = opts.key.render(args, kwargs), opts.total_of(args, kwargs)
        keys = [key, *(() if total is None else (total[0],))]
        released = release_when_dead(
            task.taskguard_locks, task_id, keys, execution=_execution(task_id, request), on_release=announce
        )
    except (ConfigError, LeaseBackendError) as e:
        log.warning(
            "task %s[%s]: could not release its lease from the main process (its TTL bounds it): %s",
            task.name,
            task_id,
            e,
        )
        return False
    if released:
        announce(key)
    return released


def _execution(task_id: str, request: Any) -> dict[str, Any]:
    """The holder metadata naming this worker's execution of ``task_id``: its task id, on this host
    and PID namespace (the pool child is this main process's), and its pool child's pid when the
    request tells it (``Request.worker_pid``) — never another worker's copy of the same message."""
    ident = process_identity()
    execution: dict[str, Any] = {"task_id": task_id, **{k: ident[k] for k in ("host", "pidns") if k in ident}}
    pid = getattr(request, "worker_pid", None)
    if isinstance(pid, int) and not isinstance(pid, bool):
        execution["pid"] = pid
    return execution


@receiver(task_failure)
def _on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    if isinstance(sender, GuardedTask) and isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
        # Celery pushes the lost execution's request for this signal (celery/worker/request.py
        # Request.on_failure), not for a hard time limit's (on_timeout): then the task's own options
        req = sender.request
        release_for_run(sender, task_id, args, kwargs, req if getattr(req, "id", None) == task_id else None)


@receiver(task_revoked)
def _on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    if not isinstance(sender, GuardedTask) or request is None:
        return
    uniqueness.clear(sender, request)  # revoked or expired: it will not run, so it is no longer queued
    _drop_window(lambda: sender.taskguard_locks, read_header(request, DEBOUNCE_HEADER), request.id, sender.name)
    if terminated:
        release_for_run(sender, request.id, request.args, request.kwargs, request)
        return
    headers = dict(getattr(request, "headers", None) or {})
    if HEADER not in headers and getattr(request, HEADER, None) is not None:
        headers[HEADER] = getattr(request, HEADER)
    try:
        if release_retry_handle(sender, headers):
            log.warning("task %s[%s]: revoked retry released its kept lease", sender.name, request.id)
    except (ConfigError, LeaseBackendError) as e:
        log.warning("task %s[%s]: could not release the revoked retry's lease: %s", sender.name, request.id, e)


@receiver(task_unknown)
def _on_unknown(sender: Any = None, message: Any = None, name: Any = None, id: Any = None, **_: Any) -> None:  # noqa: A002
    headers = getattr(message, "headers", None) or {}
    key = headers.get(UNIQUE_HEADER)
    app = getattr(sender, "app", None)
    if not (isinstance(name, str) and isinstance(id, str) and app is not None):
        return
    if not (isinstance(key, str) and key) and DEBOUNCE_HEADER not in headers:
        return
    if isinstance(key, str) and key:
        try:
            unique.clear(locks_for(app), (key, id, name), False)  # (never raises: a failure is logged)
        except ConfigError as e:
            log.warning("task %s[%s]: could not clear its queued mark (its TTL bounds it): %s", name, id, e)
    _drop_window(lambda: locks_for(app), headers.get(DEBOUNCE_HEADER), id, name)


def _drop_window(locks: Callable[[], Any], header: Any, run_id: Any, name: str) -> None:
    """A debounce window's message (its header ``{"key": ...}``) will never run: drop the window
    from ``locks()`` (never raises: a failure is logged)."""
    key = header.get("key") if isinstance(header, dict) else None
    if not (isinstance(key, str) and key and isinstance(run_id, str)):
        return
    try:
        if debounce.drop(locks(), key, run_id):
            log.info("task %s[%s]: its debounce window of %r will never run: dropped", name, run_id, key)
    except (ConfigError, LeaseBackendError) as e:
        log.warning("task %s[%s]: could not drop its debounce window (its TTL bounds it): %s", name, run_id, e)
