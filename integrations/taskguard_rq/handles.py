"""The lease handle of an RQ job, kept in a record under ``rq-job:<job id>``.

A running job's handle lets :class:`~taskguard_rq.GuardedWorker` settle the lease of a killed
work-horse; a retrying job's handle lets the retry claim the same lease. It holds the owner token:
whoever can read this Redis can renew or release that lease.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from taskguard import ConfigError, LeaseBackendError, Locks
from taskguard.handoff import handle_of, parse_handle
from taskguard.run import GuardedRun
from taskguard.values import RunState

__all__ = ["load_handle", "save_handle", "drop_handle", "running_handle"]

# a child of RQ's worker logger: `rq worker`'s own logging (INFO by default) shows these lines
log = logging.getLogger("rq.worker.taskguard")

_HANDLE = "handle"


def _job_key(job_id: str) -> str:
    return "rq-job:" + job_id


def load_handle(locks: Locks, job_id: str) -> dict | None:
    """The lease handle kept for ``job_id`` (a running job's or a retry's), or ``None``.
    A malformed record is logged and ignored. Raises LeaseBackendError."""
    raw = locks.get_record(_job_key(job_id), _HANDLE)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        return {**parse_handle(data), "running": data.get("running") is True}
    except (ValueError, ConfigError, AttributeError) as e:
        log.error("job %s: ignoring its stored lease handle: %s", job_id, e)
        return None


def save_handle(locks: Locks, job_id: str, handle: dict, ttl: float) -> str:
    """Keep ``handle`` for ``job_id`` for ``ttl`` seconds; returns the record as stored (for
    :func:`drop_handle`). Raises LeaseBackendError."""
    raw = json.dumps(handle)
    locks.put_record(_job_key(job_id), _HANDLE, raw, ttl=ttl)
    return raw


def drop_handle(locks: Locks, job_id: str, saved: str | None = None) -> None:
    """Forget the handle kept for ``job_id`` (only the one this execution ``saved``, when given:
    a later execution of the same job id may have stored its own). Raises LeaseBackendError."""
    locks.delete_record(_job_key(job_id), _HANDLE, if_value=saved)


@contextmanager
def running_handle(locks: Locks, job_id: str | None, run: GuardedRun, *, ttl: float) -> Iterator[None]:
    """While the body of ``run`` (an execution of job ``job_id``) runs, keep its lease handle
    marked running (``ttl`` seconds), for :class:`~taskguard_rq.GuardedWorker` should the
    work-horse be killed; afterwards drop it, unless the run was kept for a retry (whose handle
    replaced it). Nothing is kept for a direct call or a run without a lease. A failed save hands
    the lease back before the body ran (nothing left locked) and raises; a failed drop is logged
    (the record's TTL bounds it)."""
    lease = run.lease
    if lease is None or job_id is None:
        yield
        return
    try:
        saved = save_handle(locks, job_id, {**handle_of(lease), "running": True}, ttl=ttl)  # (and its total's)
    except BaseException:
        run.hand_back()
        raise
    try:
        yield
    finally:
        if run.state != RunState.KEPT:
            try:
                drop_handle(locks, job_id, saved)
            except LeaseBackendError as e:
                log.warning("job %s: could not drop its stored lease handle: %s", job_id, e)
