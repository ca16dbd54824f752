"""``GuardedTask`` and ``@guarded_task``: Celery tasks whose body runs under a fenced lease.

The guard runs where the body runs (``Task.__call__``): worker executions, direct calls,
``apply()`` and eager mode all get it; enqueuing does nothing special.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime, timezone
from typing import Any, Callable

from celery import Task, shared_task
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.time import maybe_iso8601

from taskguard import Acquisition, ConfigError, Lease, LeaseBackendError, LeaseLost, Locks, Skipped, TaskSkipped
from taskguard.context import current_lease, current_runs, running
from taskguard.handoff import parse_handle, persist, release_handle, resume
from taskguard.liveness import holder_is_dead
from taskguard.keys import KeyTemplate
from taskguard.locks import check_seconds
from taskguard.policy import OPTION_NAMES, GuardOptions

from .config import locks_for
from .serialization import result_value

__all__ = ["GuardedTask", "guarded_task", "current_lease", "HEADER"]  # current_lease: taskguard.context

log = logging.getLogger("taskguard.celery")

#: The one namespaced message header taskguard writes: ``{"key", "owner", "fence", "expires"}``
#: for a retry that keeps its lease, plus ``"skips"`` (``on_skip="retry"`` attempts so far).
HEADER = "taskguard"
#: Header of messages published by the taskguard beat scheduler (see taskguard_celery.beat).
BEAT_HEADER = "taskguard_beat"
#: Longest a deferred duplicate delivery waits before looking again, seconds.
DEFER_MAX = 10.0


@dataclasses.dataclass
class _Run:
    task: "GuardedTask"
    key: str
    lease: Lease
    kept: bool = False  # the lease was handed to a published retry
    retry_published: bool = False  # a retry of this task id is out: this run must not mark it done


def _read_header(request: Any, name: str = HEADER) -> dict | None:
    """The ``taskguard`` header of a request: custom headers are flat message headers under
    protocol 2 (``Context`` exposes them as attributes and, via ``_get_custom_headers``, in
    ``request.headers``); eager mode and protocol 1 only have ``request.headers``
    (celery/app/task.py, ``Context``)."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, name, None)
    return value


class GuardedTask(Task):
    """A Celery task class whose body runs under a fenced lease.

    Guard options are task options (``@app.task(base=GuardedTask, ttl=30, key=...)`` or
    ``@guarded_task(...)``): ``key``, ``ttl``, ``wait``, ``blocking_wait``, ``renew``,
    ``on_skip``, ``on_lost``, ``skip_retry_delay``, ``skip_max_retries``, ``max_hold``,
    ``continue_on_skip`` (see :meth:`taskguard.policy.GuardOptions.build`) and ``locks`` (a
    :class:`taskguard.Locks`; see :mod:`taskguard_celery.config` for the default). They are
    validated when the task class is made; a bad one raises :class:`taskguard.ConfigError`.

    The body reaches its lease as ``self.lease`` (``bind=True``) or :func:`current_lease`; both
    are local to the running request, so the threads pool stays correct.
    """

    key: Any = None
    ttl: float = 60.0
    wait: float = 0.0
    blocking_wait: bool = False
    renew: bool = True
    on_skip: str = "result"
    on_lost: str = "raise"
    skip_retry_delay: float | None = None
    skip_max_retries: int = 3
    max_hold: float | None = None
    continue_on_skip: bool = False
    locks: Locks | None = None

    _taskguard: GuardOptions | None = None
    _plain_call: bool = False
    _locks_cache: Locks | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if run is None:  # an intermediate base class, not a task
            return
        bound = not isinstance(run, staticmethod)
        fn = run.__func__ if isinstance(run, staticmethod) else run
        name = cls.__dict__.get("name") or f"{fn.__module__}.{fn.__qualname__}"
        cls._taskguard = GuardOptions.build(fn, name=name, skip_self=bound,
                                            **{opt: getattr(cls, opt) for opt in OPTION_NAMES})
        # does any class between GuardedTask and Task define its own __call__ (a user's base)?
        mro = cls.__mro__
        after = mro[mro.index(GuardedTask) + 1:]
        cls._plain_call = next((k for k in after if "__call__" in k.__dict__), Task) is Task

    # -- the body's view ----------------------------------------------------------------------
    @property
    def lease(self) -> Lease | None:
        """The running request's lease (``None`` outside a guarded run)."""
        run = self._current_run()
        return run.lease if run else None

    def _current_run(self) -> _Run | None:
        return next((r for r in reversed(current_runs()) if getattr(r, "task", None) is self), None)

    @property
    def taskguard_locks(self) -> Locks:
        locks = self._locks_cache
        if locks is None:
            locks = self._locks_cache = locks_for(self._get_app(), self.locks)
        return locks

    # -- the guard ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        opts = self._taskguard
        if opts is None:
            return super().__call__(*args, **kwargs)
        req = self.request
        if opts.on_skip == "ignore" and getattr(req, "chord", None):
            raise ConfigError(f"task {self.name!r}: on_skip='ignore' is refused inside a chord "
                              "(the chord would never complete); use on_skip='result'")
        locks = self.taskguard_locks
        beat = _read_header(req, BEAT_HEADER)
        if isinstance(beat, dict):
            opts = self._beat_options(opts, beat)
        key = opts.key.render(args, kwargs)
        if isinstance(beat, dict) and self._stale_leader(locks, beat):
            return self._skip(locks, key, "stale_leader", None, 0)
        holder = {"task": self.name, "task_id": req.id}
        header = _read_header(req) or {}
        skips = header.get("skips", 0) if isinstance(header, dict) else 0
        if isinstance(skips, bool) or not isinstance(skips, int) or skips < 0:
            log.error("task %s[%s]: ignoring a malformed skip count in its %r header", self.name, req.id, HEADER)
            skips = 0
        run_id = req.id or None
        acq = None
        if isinstance(header, dict) and "owner" in header:
            try:
                acq = resume(locks, header, key=key, ttl=opts.ttl, holder=holder, renew=opts.renew,
                             max_hold=opts.max_hold, run_id=run_id)
            except ConfigError as e:  # a malformed header: say so, and acquire normally
                log.error("task %s[%s]: ignoring its %r header: %s", self.name, req.id, HEADER, e)
        if acq is None:
            acq = locks.acquire(key, ttl=opts.ttl, wait=opts.wait, holder=holder, renew=opts.renew,
                                max_hold=opts.max_hold, run_id=run_id)
        if not acq.acquired and run_id and acq.reason != "done":
            acq = self._same_task_holds(locks, key, run_id, acq, holder)
        if not acq.acquired:
            if acq.reason == "done":
                # another copy of this very task id already finished: ack quietly, store nothing
                log.info("task %s[%s]: duplicate delivery of a finished task ignored", self.name, req.id)
                raise Ignore(f"duplicate of finished {self.name}[{req.id}]")
            if acq.reason == "running":
                self._defer_duplicate(acq.holder_ttl)
            return self._skip(locks, key, acq.reason or "held", acq.holder_ttl, skips)
        run = _Run(self, key, acq.lease)
        try:
            with running(run):
                if self._plain_call and not req.called_directly:
                    # the tracer already pushed this request (celery/app/trace.py): run the body
                    # as it would for a task without its own __call__
                    result = self.run(*args, **kwargs)
                else:
                    result = super().__call__(*args, **kwargs)
        except BaseException as exc:
            if not run.kept:
                final = not (isinstance(exc, (Retry, Reject)) and (not isinstance(exc, Reject) or exc.requeue))
                self._release_quietly(run.lease, done=final and not run.retry_published)
            raise
        if run.kept:
            return result
        self._finish(run)
        return result

    def _beat_options(self, opts: GuardOptions, beat: dict) -> GuardOptions:
        """A beat entry's own key / TTL (``options["taskguard"]`` in the schedule)."""
        changes: dict[str, Any] = {}
        spec, ttl = beat.get("key"), beat.get("ttl")
        try:
            if isinstance(spec, str) and spec:
                cache = self.__class__.__dict__.get("_tg_entry_keys")
                if cache is None:
                    cache = {}
                    type(self)._tg_entry_keys = cache
                if spec not in cache:
                    cache[spec] = KeyTemplate(spec, self.run)
                changes["key"] = cache[spec]
            if ttl is not None:
                changes["ttl"] = check_seconds("ttl", ttl)
        except ConfigError as e:
            log.error("task %s: ignoring the beat entry's guard options: %s", self.name, e)
            return opts
        return dataclasses.replace(opts, **changes) if changes else opts

    @staticmethod
    def _stale_leader(locks: Locks, beat: dict) -> bool:
        """Was this message published by a beat that is no longer the leader?"""
        fence, leader_key = beat.get("leader_fence"), beat.get("leader_key")
        if not isinstance(fence, int) or isinstance(fence, bool) or not isinstance(leader_key, str) or not leader_key:
            return False
        current = locks.holder(leader_key)
        return current is not None and current.fencing_token is not None and fence < current.fencing_token

    def _same_task_holds(self, locks: Locks, key: str, run_id: str, acq: Acquisition, holder: dict) -> Acquisition:
        """The lease is held: by another delivery of this same task id? A redelivered message
        (acks_late after a crash, a visibility timeout, a duplicated ETA message) carries the
        same id as the run holding the lease. If that holder's process is known dead (this host),
        release it and acquire; if it is alive or unknown, report ``"running"``."""
        info = locks.holder(key)
        if info is None or info.holder.get("task_id") != run_id:
            return acq
        opts = self._taskguard
        if holder_is_dead(info.holder) and locks.release_run(key, run_id):
            log.warning("task %s[%s]: the previous holder of %r (pid %s) is dead; lease released",
                        self.name, run_id, key, info.holder.get("pid"))
            return locks.acquire(key, ttl=opts.ttl, holder=holder, renew=opts.renew, max_hold=opts.max_hold,
                                 run_id=run_id)
        return Acquisition(False, None, "running", info.ttl)

    def _defer_duplicate(self, holder_ttl: float | None) -> None:
        """Another delivery of this task id runs now: this copy neither runs nor stores a result
        (that would overwrite the real run's). It is re-published to look again when the holder's
        lease could have ended; then it is dropped quietly (done) or runs (the holder died)."""
        req = self.request
        countdown = min(max(holder_ttl or 1.0, 0.5), DEFER_MAX)
        log.info("task %s[%s]: another delivery is running it; this copy looks again in %.1fs",
                 self.name, req.id, countdown)
        if not (req.called_directly or req.is_eager):
            sig = self.signature_from_request(req, countdown=countdown, retries=req.retries, headers=req.headers)
            sig.apply_async()
        raise Ignore(f"duplicate of running {self.name}[{req.id}], deferred {countdown:.1f}s")

    def _finish(self, run: _Run) -> None:
        lease = run.lease
        was_lost = lease.lost
        try:
            released = lease.release(mark_done=not run.retry_published)
        except LeaseBackendError as e:
            log.warning("task %s: could not release lease %r: %s", self.name, run.key, e)
            released = not lease.lost
        if was_lost or not released:
            reason = lease.lost_reason or "lost while the body ran"
            self._send_event("task-lease-lost", key=run.key, reason=reason, fencing_token=lease.fencing_token)
            if self._taskguard.on_lost == "raise":
                raise LeaseLost(run.key, reason)
            log.warning("task %s[%s]: lease %r was lost while the body ran (%s)", self.name, self.request.id,
                        run.key, reason)

    @staticmethod
    def _release_quietly(lease: Lease, done: bool = True) -> None:
        try:
            lease.release(mark_done=done)
        except LeaseBackendError as e:  # the body's own exception must win
            log.warning("could not release lease %r after the body ended: %s", lease.key, e)

    # -- skipping ---------------------------------------------------------------------------------
    def _skip(self, locks: Locks, key: str, reason: str, holder_ttl: float | None, skips: int) -> Any:
        opts = self._taskguard
        req = self.request
        skipped = Skipped(key=key, reason=reason, task=self.name, holder_ttl=holder_ttl)
        if opts.on_skip == "retry" and not req.called_directly:
            if skips < opts.skip_max_retries:
                locks.report_skip(skipped)
                self._send_skip_event(skipped, retrying=True)
                self._retry_after_skip(opts.retry_delay(holder_ttl), skips + 1)
            skipped = dataclasses.replace(skipped, reason="retry_exhausted")
        locks.report_skip(skipped)
        self._send_skip_event(skipped)
        if opts.on_skip == "raise":
            raise TaskSkipped(key, skipped.reason, self.name, holder_ttl)
        if opts.on_skip == "ignore":
            raise Ignore(skipped.describe())
        if not opts.continue_on_skip:
            # the tracer reads these from this very request after we return
            # (celery/app/trace.py, _dispatch_callbacks_and_chain)
            req.callbacks = None
            req.chain = None
        return result_value(skipped, self)

    def _retry_after_skip(self, countdown: float, skips: int) -> None:
        """Re-publish this request ``countdown`` seconds later without counting a retry
        (``max_retries`` is for the body's failures, not for contention)."""
        req = self.request
        headers = {**(req.headers or {}), HEADER: {"skips": skips}}
        sig = self.signature_from_request(req, countdown=countdown, retries=req.retries, headers=headers)
        if req.is_eager:
            raise Retry(f"lease held; retry {skips} of {self._taskguard.skip_max_retries}",
                        when=countdown, is_eager=True, sig=sig)
        sig.apply_async()
        raise Retry(f"lease held; retry {skips} of {self._taskguard.skip_max_retries}", when=countdown, sig=sig)

    def _send_skip_event(self, skipped: Skipped, retrying: bool = False) -> None:
        self._send_event("task-skipped", key=skipped.key, reason=skipped.reason, holder_ttl=skipped.holder_ttl,
                         result=skipped.describe(), retrying=retrying)

    def _send_event(self, type_: str, **fields: Any) -> None:
        """Send a Celery event from a worker execution (never from direct/eager calls). Sent even
        when the worker runs without ``-E``: ``Task.send_event`` uses its own dispatcher
        (celery/app/task.py). A broker error is logged, never raised over the task's outcome."""
        req = self.request
        if req.called_directly or req.is_eager:
            return
        try:
            self.send_event(type_, name=self.name, **fields)
        except Exception as e:
            log.warning("task %s: could not send %s event: %s", self.name, type_, e)

    # -- retries keep the lease -------------------------------------------------------------------
    def retry(self, args=None, kwargs=None, exc=None, throw=True, eta=None, countdown=None, max_retries=None,
              **options):
        """Celery's ``Task.retry``, keeping this run's lease for the retried run.

        The lease TTL is stretched to cover the countdown plus ``ttl``, renewal stops here, and
        the handle travels in the ``taskguard`` header, merged with the request's other custom
        headers and any ``headers=`` given here (Celery's own retry would replace them). If the
        retry is not published (max retries exceeded, a publish error) the lease is released."""
        run = self._current_run()
        req = self.request
        if run is None or req.called_directly or run.kept:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        headers = {**(req.headers or {}), **(options.pop("headers", None) or {})}
        headers.pop(HEADER, None)
        if not throw:
            # the body goes on running after this call: the retry must not claim the lease
            # beside it. It goes out without the handle, finds this task id still holding the
            # lease, waits (deferred) until this run releases, then acquires afresh.
            out = super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, headers=headers, **options)
            run.retry_published = True
            return out
        handle = persist(run.lease, _retry_delay(eta, countdown, self.default_retry_delay) + self._taskguard.ttl)
        if handle is not None:
            headers[HEADER] = handle
            run.kept = True
        # else: lost meanwhile; the retry acquires afresh
        try:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, headers=headers, **options)
        except Retry:
            run.retry_published = True
            raise
        except BaseException:
            run.kept = False  # not published: the lease is released on the way out
            raise


def _retry_delay(eta: Any, countdown: Any, default: Any) -> float:
    """Seconds until a retry runs, from ``retry()``'s ``eta``/``countdown`` as Celery accepts
    them (``eta`` a datetime or ISO 8601 string; a negative countdown means now)."""
    if eta is not None:
        eta_dt = maybe_iso8601(eta) if isinstance(eta, str) else eta
        if eta_dt.tzinfo is None:
            eta_dt = eta_dt.replace(tzinfo=timezone.utc)
        return max(0.0, (eta_dt - datetime.now(timezone.utc)).total_seconds())
    value = default if countdown is None else countdown
    try:
        return max(0.0, float(value or 0))
    except (TypeError, ValueError):
        return 0.0


def guarded_task(*args: Any, **opts: Any) -> Any:
    """Like Celery's ``shared_task``, for a task whose body runs under a fenced lease.

    ``@guarded_task`` or ``@guarded_task(ttl=60, key="report:{customer_id}", ...)``: every
    Celery task option (``bind``, ``max_retries``, ``autoretry_for``, ``acks_late``, ``base``...)
    plus the guard options of :class:`GuardedTask`. A ``base`` that is not a ``GuardedTask``
    is combined with it. Options are validated here, at declaration; a bad option or a key
    template that does not bind to the function's signature raises :class:`taskguard.ConfigError`.
    """

    def decorate(fn: Callable[..., Any]) -> Any:
        base = opts.pop("base", None) or GuardedTask
        if not issubclass(base, GuardedTask):
            base = type(f"Guarded{base.__name__}", (GuardedTask, base), {"__module__": base.__module__})
        name = opts.get("name") or f"{fn.__module__}.{fn.__qualname__}"
        GuardOptions.build(fn, name=name, skip_self=bool(opts.get("bind")),
                           **{k: opts[k] for k in OPTION_NAMES if k in opts})
        return shared_task(base=base, **opts)(fn)

    if len(args) == 1 and callable(args[0]) and not opts:
        return decorate(args[0])
    if args:
        raise TypeError("guarded_task takes keyword options only: @guarded_task(ttl=60, ...)")
    return decorate


def release_retry_handle(task: GuardedTask, headers: dict) -> bool:
    """Release the lease a retry message's ``taskguard`` header stands for (for a retry that is
    revoked or expires before it runs). Returns ``True`` when released."""
    value = headers.get(HEADER) if isinstance(headers, dict) else None
    if not isinstance(value, dict) or "owner" not in value:
        return False
    handle = parse_handle(value)
    return release_handle(task.taskguard_locks, handle)

