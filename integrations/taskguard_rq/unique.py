"""Enqueue-time uniqueness for RQ: do not queue a second job of a key while one is queued or
running.

:func:`enqueue_unique` asks :meth:`taskguard.Locks.mark_queued` (one single-key script on the
lease hash) before enqueuing: a job of the key that is queued or running answers with its job
id, and the existing :class:`rq.job.Job` is returned with nothing enqueued; else the new job id
is marked and the job enqueued with ``meta["taskguard_unique"]`` naming the key. The mark is
cleared when the job starts (after it took its lease or was skipped), at once when the enqueue
itself fails, by the next ``enqueue_unique`` of the key when the job it names will never start
(:func:`never_starts`: cancelled, or failed, stopped or finished without clearing it), and
otherwise by its TTL (``unique_ttl``, default the job's queued ``ttl`` or 1 hour, plus the delay
of a scheduled job) — also for a job deleted while queued (``job.delete()``, ``queue.empty()``):
a job missing from Redis cannot be told from one its publisher has marked and not yet written.

Where the job id *is* the key (``job_id=`` given), RQ's own ``unique=True`` (RQ >= 2.8: the id
check and the enqueue in one step, ``DuplicateJobError`` when the id exists) does the work: a job
of that id that is queued, started, scheduled, deferred (or in any other state but over) is
returned; one that is over (finished, failed, stopped or canceled), which RQ keeps for its
``result_ttl`` / ``failure_ttl``, is deleted with its registry entries and its results
(``Job.delete``, atomically with a last look at its status) and the new job is enqueued under
the id: the old job's result is gone.

The lease stays the correctness boundary: uniqueness only saves queue space.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from taskguard import ConfigError, unique
from taskguard.validate import check_seconds

from .config import locks_for

__all__ = ["enqueue_unique", "clear_mark", "mark_of", "UNIQUE_META_KEY"]

log = logging.getLogger("rq.worker.taskguard")

#: ``job.meta`` entry of a job enqueued by :func:`enqueue_unique`: the key it marked queued.
UNIQUE_META_KEY = "taskguard_unique"


def enqueue_unique(
    queue: Any,
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    job_id: str | None = None,
    at: datetime | None = None,
    in_: timedelta | None = None,
    unique_ttl: float | None = None,
    **options: Any,
) -> Any:
    """Enqueue ``fn(*args, **kwargs)`` on ``queue`` unless a job of its key is queued or running.

    Args:
        queue: an ``rq.Queue``.
        fn: a ``@guarded_job`` function (its ``key`` template names the key).
        args, kwargs: the job's arguments.
        job_id: an explicit job id: the id is then the key, and RQ's own ``unique=True`` decides
            while a job of the id is live; a job of the id that is over is deleted (its result
            with it) and the new one enqueued.
        at / in_: schedule the job (``Queue.enqueue_at`` / ``enqueue_in``; a worker with
            ``--with-scheduler`` runs it).
        unique_ttl: seconds the queued mark lasts when the job never starts (lost), plus any
            delay (default: the job's queued ``ttl`` option, else 1 hour).
        options: other ``Queue.enqueue_call`` options (``job_timeout``, ``result_ttl``,
            ``ttl``, ``retry``, ``meta``, ...).

    Returns the new or the existing ``rq.job.Job``. Raises ConfigError for a function that is not
    a guarded job, TypeError for arguments that do not bind to its signature (and what a key
    fails with on them, with its own type: :class:`taskguard.keys.KeyTemplate`), LeaseBackendError when Redis fails
    (nothing enqueued), and what RQ raises (the mark is cleared first)."""
    from rq.job import Job

    opts = getattr(fn, "taskguard_options", None)
    if opts is None:
        raise ConfigError(f"enqueue_unique needs a @guarded_job function, got {fn!r}")
    task_name: str = fn.taskguard_name  # type: ignore[attr-defined]  # (set by @guarded_job with its options)
    if unique_ttl is not None:
        unique_ttl = check_seconds("unique_ttl", unique_ttl)
    kwargs = dict(kwargs or {})
    try:
        from rq.exceptions import DuplicateJobError
    except ImportError:  # RQ < 2.8: no unique= of its own; the keyed mark below, under the given id
        DuplicateJobError = None  # type: ignore[misc,assignment]  # noqa: N806  (the name stays None on RQ < 2.8)
    if job_id is not None and DuplicateJobError is not None:
        for _ in range(_ROUNDS):
            try:
                return _enqueue(queue, fn, args, kwargs, job_id, at, in_, dict(options, unique=True))
            except DuplicateJobError:
                if not _delete_if_over(Job, job_id, queue.connection):
                    break
        log.info("job %s is queued or running: not enqueued again", job_id)
        locks_for(getattr(fn, "taskguard_locks", None)).report_suppressed(job_id, task_name, job_id)
        return _handle(Job, job_id, queue)
    key = opts.key.render(tuple(args), kwargs)
    locks = locks_for(getattr(fn, "taskguard_locks", None))
    new_id = job_id or str(uuid.uuid4())
    base = unique_ttl if unique_ttl is not None else float(options.get("ttl") or unique.DEFAULT_TTL)
    delay = (
        in_.total_seconds()
        if in_ is not None
        else max(0.0, (at.astimezone(timezone.utc) - datetime.now(timezone.utc)).total_seconds())
        if at is not None
        else 0.0
    )

    def send(marked: bool) -> Any:  # marked: the job clears the mark its meta names when it starts
        if not marked:
            return _enqueue(queue, fn, args, kwargs, new_id, at, in_, options)
        meta = {**(options.get("meta") or {}), UNIQUE_META_KEY: key}
        return _enqueue(queue, fn, args, kwargs, new_id, at, in_, dict(options, meta=meta))

    return unique.publish(
        locks,
        key,
        new_id,
        ttl=max(base, 1.0) + delay,
        task=task_name,
        shadow=not opts.enforce,
        send=send,
        existing=lambda found: _handle(Job, found, queue),
        over=lambda found: never_starts(Job, found, queue.connection),
    )


#: The states of a job that is over: its id may be enqueued again (every other state, known or
#: not — queued, started, scheduled, deferred, RQ 3's rate_limited and ready_to_enqueue, a job
#: being created — blocks it).
OVER = frozenset({"finished", "failed", "stopped", "canceled"})
#: How many times an explicit id is tried when the job found under it was over and deleted.
_ROUNDS = 3


def never_starts(job_class: Any, job_id: str, connection: Any) -> bool:
    """Whether the job ``job_id`` a queued mark names will never start: its status is over
    (:data:`OVER`: cancelled, or failed, stopped or finished without having cleared its mark). A
    job with no hash is not: its publisher may have marked it and not written it yet (however
    long it stalls there), so a job deleted while queued is left to the mark's TTL. Raises what
    redis-py raises."""
    status = connection.hget(job_class.key_for(job_id), "status")
    return status is not None and (status.decode() if isinstance(status, bytes) else status) in OVER


def _delete_if_over(job_class: Any, job_id: str, connection: Any) -> bool:
    """Delete the job ``job_id`` if it is over (:data:`OVER`), with its registry entries and
    results, in one transaction watching the job's hash: a job enqueued under the id meanwhile is
    never deleted. Returns ``True`` when the id may be tried again (deleted, gone, or changed
    meanwhile), ``False`` when a job of the id is live."""
    from redis.exceptions import WatchError
    from rq.exceptions import InvalidJobOperation, NoSuchJobError
    from rq.results import Result

    key = job_class.key_for(job_id)
    with connection.pipeline() as pipe:
        try:
            pipe.watch(key)
            status = pipe.hget(key, "status")
            if status is None:
                return True  # gone meanwhile (or never saved): enqueue again
            if (status.decode() if isinstance(status, bytes) else status) not in OVER:
                return False
            job = job_class.fetch(job_id, connection=connection)
            pipe.multi()
            job.delete(pipeline=pipe)
            pipe.delete(Result.get_key(job_id))  # RQ 2's delete leaves the job's results
            pipe.execute()
        except (WatchError, NoSuchJobError, InvalidJobOperation):
            return True  # changed or deleted meanwhile: look again
    log.info(
        "job %s was over (%s): deleted with its result, enqueued again",
        job_id,
        status.decode() if isinstance(status, bytes) else status,
    )
    return True


def _handle(job_class: Any, job_id: str, queue: Any) -> Any:
    """The existing job: fetched, or — while its enqueue is still being written by the caller that
    marked it, or after it was deleted — a handle on its id that reads it when asked."""
    from rq.exceptions import NoSuchJobError

    try:
        return job_class.fetch(job_id, connection=queue.connection)
    except NoSuchJobError:
        return job_class(job_id, connection=queue.connection)


def _enqueue(queue: Any, fn: Any, args: tuple, kwargs: dict, job_id: str, at: Any, in_: Any, options: dict) -> Any:
    # the job's own arguments go as args= / kwargs=, so none of them is taken for an RQ option
    if at is not None:
        return queue.enqueue_at(at, fn, args=tuple(args), kwargs=kwargs, job_id=job_id, **options)
    if in_ is not None:
        return queue.enqueue_in(in_, fn, args=tuple(args), kwargs=kwargs, job_id=job_id, **options)
    return queue.enqueue_call(fn, args=args, kwargs=kwargs, job_id=job_id, **options)


def mark_of(job: Any) -> tuple[str, str, str] | None:
    """``(key, job id, job name)`` of the queued mark ``job`` was enqueued with (the arguments of
    :meth:`taskguard.Locks.clear_queued`), or ``None``."""
    key = (getattr(job, "meta", None) or {}).get(UNIQUE_META_KEY) if job is not None else None
    if not isinstance(key, str) or not key:
        return None
    return key, job.id, getattr(job.func, "taskguard_name", None) or job.func_name


def clear_mark(locks: Any, job: Any) -> None:
    """The job started (or will not run): clear its key's queued mark if it names this job
    (:func:`taskguard.unique.clear`; never raises)."""
    mark = mark_of(job)
    if mark is not None:
        opts = getattr(job.func, "taskguard_options", None)
        unique.clear(locks, mark, opts is not None and not opts.enforce)
