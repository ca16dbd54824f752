"""Publish-time uniqueness (``unique=True``) over a :class:`~taskguard.backend.Backend`: the
queued mark of a task on a key, set and checked in one script, and shadow mode's mark of its own."""

from __future__ import annotations

import logging

from .backend import Backend, QueueReply, new_nonce
from .errors import ConfigError
from .events import Emitter, LeaseEvent
from .records import Records
from .validate import check_key, check_run_id, check_seconds, encodable

__all__ = ["QueueMarks", "SHADOW_QUEUED"]

log = logging.getLogger("taskguard")

#: Record of a key holding shadow mode's queued mark of a task (``shadow-q:<task>``: the run id).
SHADOW_QUEUED = "shadow-q:"


class QueueMarks:
    """:meth:`taskguard.Locks.mark_queued`, :meth:`~taskguard.Locks.clear_queued` and
    :meth:`~taskguard.Locks.report_suppressed` (see there)."""

    def __init__(self, backend: Backend, records: Records, emitter: Emitter) -> None:
        self.backend = backend
        self.records = records
        self.emitter = emitter

    def mark(self, key: str, run_id: str, *, ttl: float, task: str, shadow: bool = False) -> QueueReply:
        run = check_run_id(run_id)
        if run is None:
            raise ConfigError("run_id is required")
        run_id = run
        if not isinstance(task, str) or not task:
            raise ConfigError(f"task must be a non-empty str, got {task!r}")
        key, task = check_key(key), encodable("task", task)
        ttl = check_seconds("ttl", ttl)
        nonce = new_nonce()
        if shadow:  # (reads first: a failure there wrote nothing)
            found = self._shadow_queued(key, task)
            if found is not None:
                return QueueReply(False, found)
        try:
            if shadow:
                if self.records.put(key, SHADOW_QUEUED + task, run_id, ttl=ttl, if_absent=True):
                    return QueueReply(True, run_id)
                return QueueReply(False, self.records.get(key, SHADOW_QUEUED + task) or run_id)
            return self.backend.mark_queued(key, run_id, ttl, task, nonce)
        except BaseException:
            # the write may have run although its answer never came back: a Redis error, or an
            # exception raised while the client waited (KeyboardInterrupt, SystemExit, a gevent or
            # eventlet Timeout). The caller publishes nothing, so the mark this call wrote may not
            # stay behind, blocking the key for the mark's TTL: only that one (the enforced mark:
            # its nonce; shadow mode's record: found absent just before), never an earlier
            # publish's mark of the same run id (a task id given again)
            self._clear_after_failure(key, run_id, task, shadow, nonce)
            raise

    def _clear_after_failure(self, key: str, run_id: str, task: str, shadow: bool, nonce: str) -> None:
        try:
            if shadow:
                self.clear(key, run_id, task, shadow)
            else:
                self.backend.clear_queued(key, run_id, task, written_by=nonce)  # (key checked by mark)
        except Exception as e:
            log.warning("could not clear the queued mark of %r after a failed mark (its TTL bounds it): %s", key, e)

    def clear(self, key: str, run_id: str, task: str, shadow: bool = False) -> bool:
        if shadow:
            return self.records.delete(key, SHADOW_QUEUED + task, if_value=run_id)
        return self.backend.clear_queued(check_key(key), run_id, task)

    def _shadow_queued(self, key: str, task: str) -> str | None:
        """The run of ``task`` on ``key`` that shadow mode finds running (a live holder naming the
        task) or queued (its shadow record), or ``None``. Only reads."""
        for info in self.backend.holders(key):
            meta = info.holder if isinstance(info.holder, dict) else {}
            if task in (meta.get("task"), meta.get("job")):
                found = meta.get("task_id") or meta.get("job_id")
                if isinstance(found, str) and found:
                    return found
        return self.records.get(key, SHADOW_QUEUED + task)

    def report_suppressed(self, key: str, task: str | None, existing: str, shadow: bool = False) -> None:
        if self.emitter.active:
            self.emitter.emit(LeaseEvent("publish", key, "suppressed", task=task, shadow=shadow))
