"""``GuardedTask`` and ``@guarded_task``: Celery tasks whose body runs under a fenced lease.

The guard runs where the body runs (``Task.__call__``): worker executions, direct calls,
``apply()`` and eager mode all get it; enqueuing does nothing special.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from celery import Task, shared_task
from celery.app.annotations import resolve_all as resolve_all_annotations
from celery.app.task import Context
from celery.exceptions import Reject, Retry
from celery.utils.time import get_exponential_backoff_interval

from taskguard import ConfigError, LeaseBackendError, Locks, RateLimited
from taskguard.context import current_lease, current_runs, running
from taskguard.debounce import closing
from taskguard.handoff import parse_handle, release_handle
from taskguard.pipeline import Run, decide, perform
from taskguard.policy import OPTION_DEFAULTS, OPTION_NAMES, GuardOptions, check_option_names
from taskguard.run import nested_in
from taskguard.schedule.options import apply_entry_options
from taskguard.schedule.periodic import slot_run as beat_slot
from taskguard.validate import check_seconds

from . import debouncing, identity, setup, skipping, uniqueness
from .config import locks_for
from .decisions import CeleryHooks, execution, max_countdown, outcome
from .headers import (
    BEAT_HEADER,
    DEBOUNCE_HEADER,
    DEFER_HEADER,
    HEADER,
    PUBLISH_HEADER,
    RATE_HEADER,
    continuing,
    new_publish_stamp,
    read_header,
    without,
)

__all__ = ["GuardedTask", "guarded_task", "current_lease", "HEADER"]  # current_lease: taskguard.context

log = logging.getLogger("taskguard.celery")


#: The requests whose run a ``GuardedTask.__call__`` has judged already (the worker's or
#: ``apply()``'s, pushed by Celery's tracer), and the copies ``Task.__call__`` makes of them for
#: calls inside that run (``push_request``). A call that finds one of them on top of its task's
#: request stack is a direct call from inside that run (recursion, its own errback, which Celery
#: calls while the failed run's request is still pushed: celery/backends/base.py), not that run.
_judged: weakref.WeakSet[Any] = weakref.WeakSet()


class _DirectCall(Context):
    """The request a direct call from inside a run of its task is judged by: what a direct call
    from outside any run has (``called_directly``, no id), with the call's arguments."""


class GuardedTask(Task):
    """A Celery task class whose body runs under a fenced lease.

    Guard options are task options (``@app.task(base=GuardedTask, ttl=30, key=...)`` or
    ``@guarded_task(...)``): every name of :data:`taskguard.policy.OPTION_NAMES` (see
    :meth:`taskguard.policy.GuardOptions.build`) and ``locks`` (a :class:`taskguard.Locks`; see
    :mod:`taskguard_celery.config` for the default). They are validated when the task class is
    made; a bad one raises :class:`taskguard.ConfigError`.

    The body reaches its lease as ``self.lease`` (``bind=True``) or :func:`current_lease`; both
    are local to the running request, so the threads pool stays correct. Under ``limit_total``
    that is the run's lease on its key (its fencing token is the key's); its place in the
    total is ``self.lease.total`` (a lease with its own fencing token). A retry keeps both: the
    ``taskguard`` header carries the key's handle with the total's nested under ``"total"``.
    """

    # each guard option is a class attribute, its default taskguard.policy.OPTION_DEFAULTS' (the
    # one place they live): set below the class
    locks: Locks | None = None

    #: The guard's options, validated when the class is made (``None``: a class without a guard).
    taskguard_options: GuardOptions | None = None
    _plain_call: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = _body(cls)
        # @app.task(base=GuardedTask, ttll=5): Celery makes every keyword a class attribute, so a
        # misspelt guard option would silently leave the default in force; the same in a base
        # class of tasks (class Reports(GuardedTask): tll = 300), checked here when it is made:
        # its tasks take what their bases define as known
        bases = cls.__mro__[1:]
        check_option_names(
            _task_name(cls, run),
            [n for n in cls.__dict__ if not n.startswith("_")],
            known=lambda n: any(n in k.__dict__ for k in bases),
            noun="task" if run is not None else "task base class",
        )
        if run is None:  # an intermediate base class, not a task
            return
        # (a subclass of a task class, its body inherited, gets its own options too: its ttl, key...)
        cls._build_guard(run)
        # does any class between GuardedTask and Task define its own __call__ (a user's base)?
        mro = cls.__mro__
        after = mro[mro.index(GuardedTask) + 1 :]
        cls._plain_call = next((k for k in after if "__call__" in k.__dict__), Task) is Task

    @classmethod
    def _build_guard(cls, run: Any) -> None:
        """Validate the class's guard options (its attributes) into :attr:`taskguard_options`."""
        fn = run.__func__ if isinstance(run, staticmethod) else run
        cls.taskguard_options = GuardOptions.build(
            fn,
            name=_task_name(cls, run),
            skip_self=not isinstance(run, staticmethod),
            locks=cls.locks,
            **{opt: getattr(cls, opt) for opt in OPTION_NAMES},
        )

    @classmethod
    def annotate(cls) -> None:
        """Celery's ``Task.annotate`` (``task_annotations``, applied when the task is bound to an
        app: celery/app/task.py ``bind``) sets task attributes; guard options among them are
        checked by name as at declaration and applied (the guard was built from the class before).
        Raises ConfigError."""
        super().annotate()
        body = _body(cls)
        if body is None or cls.taskguard_options is None:
            return
        given = [k for d in resolve_all_annotations(cls.app.annotations, cls) for k in d if not k.startswith("@")]
        if not given:
            return
        bases = cls.__mro__[1:]
        check_option_names(_task_name(cls, body), given, known=lambda n: any(n in k.__dict__ for k in bases))
        if any(n in OPTION_NAMES or n == "locks" for n in given):
            cls._build_guard(body)

    @classmethod
    def bind(cls, app: Any) -> Any:
        """Celery's ``Task.bind`` (every task class bound to an app passes here: ``app.task``,
        ``shared_task`` when an app finalizes, ``app.register_task``, first use of an unbound
        task), which first connects the adapter's signal receivers (:func:`.setup.install`)."""
        setup.install(app)
        return super().bind(app)

    # -- the body's view ----------------------------------------------------------------------
    @property
    def lease(self) -> Any:
        """The running request's lease (``None`` outside a guarded run)."""
        run = self._current_run()
        return run.lease if run else None

    def _current_run(self) -> Any:
        return next((r for r in reversed(current_runs()) if getattr(r, "tag", None) is self), None)

    @property
    def taskguard_locks(self) -> Locks:
        return locks_for(self._get_app(), self.locks)

    # -- the guard: Celery's events translated into the run's lifecycle ----------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        opts = self.taskguard_options
        if opts is None:
            return super().__call__(*args, **kwargs)
        entered: list[bool] = []  # set when the body is called: errors from there on are the body's
        try:
            return self._guarded_call(opts, args, kwargs, entered)
        except LeaseBackendError as exc:
            if entered:
                raise
            return self._retry_before_body(exc)

    def _retry_before_body(self, exc: LeaseBackendError) -> Any:
        """Redis failed before the body ran (acquire, claim, the rate, the once record...): the
        body never ran. Celery's ``autoretry_for`` wraps ``run``, which this task never reached,
        so do what it would have done: when ``autoretry_for`` covers :class:`LeaseBackendError`
        (and ``dont_autoretry_for`` does not), retry with the task's ``retry_kwargs``,
        ``retry_backoff``, ``retry_backoff_max``, ``retry_jitter`` and ``max_retries``, computed as
        celery/app/autoretry.py does (``get_exponential_backoff_interval``); past ``max_retries``
        the ``LeaseBackendError`` itself is raised. Else it is raised at once.

        If the retry cannot be published (the broker is the Redis that is down), Celery's
        ``Reject(requeue=False)`` would drop the message: an ``acks_late`` task rejects it with
        ``requeue=True`` instead (the broker delivers it again; if the broker cannot even take
        the reject, the unacknowledged message comes back by itself); any other task fails
        with the ``LeaseBackendError``."""
        autoretry_for = tuple(getattr(self, "autoretry_for", None) or ())
        dont = tuple(getattr(self, "dont_autoretry_for", None) or ())
        if not autoretry_for or not isinstance(exc, autoretry_for) or (dont and isinstance(exc, dont)):
            raise exc
        retry_kwargs = dict(getattr(self, "retry_kwargs", None) or {})
        backoff = float(getattr(self, "retry_backoff", False) or 0)
        if backoff:
            retry_kwargs["countdown"] = get_exponential_backoff_interval(
                factor=int(max(1.0, backoff)),
                retries=self.request.retries,
                maximum=int(getattr(self, "retry_backoff_max", 600)),
                full_jitter=getattr(self, "retry_jitter", True),
            )
        try:
            raise self.retry(exc=exc, **retry_kwargs)
        except Reject as rej:  # the retry was not published
            if getattr(self, "acks_late", False):
                raise Reject(exc, requeue=True) from rej
            raise exc from rej
        finally:
            if "max_retries" in retry_kwargs and hasattr(self, "override_max_retries"):
                del self.override_max_retries  # (Celery's retry sets it; autoretry removes it too)

    def _guarded_call(self, opts: GuardOptions, args: tuple, kwargs: dict, entered: list[bool]) -> Any:
        req = self.request
        if not req.called_directly:
            if req in _judged:  # the enclosing run's request: a direct call made inside that run
                return self._direct_call_inside_run(args, kwargs)
            _judged.add(req)
        if opts.on_skip == "ignore" and getattr(req, "chord", None):
            raise ConfigError(
                f"task {self.name!r}: on_skip='ignore' is refused inside a chord "
                "(the chord would never complete); use on_skip='result'"
            )
        opts, slot_run = run_options(self, req, opts)
        key = opts.key.render(args, kwargs)  # first: wrong arguments are a TypeError, whatever the Redis set-up
        locks = self.taskguard_locks
        header = read_header(req)
        skips = skipping.skip_count(self, header)
        local = req.called_directly or req.is_eager
        args, kwargs, window = self._window_call(opts, req, key, local, args, kwargs)
        nested = nested_in(key, locks, self) if local else None  # (eager replace() runs inside the caller)
        if nested is not None:
            entered.append(True)
            with running(nested):
                return self._body(req, args, kwargs)
        handle = header if isinstance(header, dict) and "owner" in header else None
        # a retry's message carries its one-shot handle: a second copy of it is a copy, not a publish
        redelivered = not local and (identity.is_redelivery(req) or handle is not None)
        ex, hooks = execution(self, req, local, redelivered, slot_run), CeleryHooks(self, req, handle)
        with closing(locks, key, req.id, window is not None):  # (its window's kept call goes when it ends)
            decision = decide(opts, key, args, kwargs, ex, hooks, locks)
            if window is not None:  # refused because the key is busy: the window is put back (Ignore)
                decision = debouncing.busy(self, req, key, window, decision, max_countdown(self.app))
            if not isinstance(decision, Run):
                return outcome(self, decision, skips, redelivered)
            identity.end_chain(self, decision.run)
            entered.append(True)
            done = perform(decision, lambda: self._body(req, args, kwargs), opts, key, args, kwargs, ex, hooks, locks)
            return done.value if done.instead is None else outcome(self, done.instead, skips, redelivered)

    def _direct_call_inside_run(self, args: tuple, kwargs: dict) -> Any:
        """A direct call made inside a run of this task, judged by its own call as one from outside
        any run would be (its own request pushed over the enclosing run's)."""
        own = _DirectCall(args=args, kwargs=kwargs)
        self.request_stack.push(own)
        try:
            return GuardedTask.__call__(self, *args, **kwargs)  # (a subclass's own __call__ ran already)
        finally:
            self.request_stack.pop()

    def _window_call(self, opts: GuardOptions, req: Any, key: str, local: bool, args: tuple, kwargs: dict) -> Any:
        """``(args, kwargs, window)``: a debounce window's message that closes its window runs the
        window's latest call (``window``: its stored call; :func:`.debouncing.arrived`, which raises
        ``Ignore`` for a message early or late); any other message (a closed window's run too: a
        plain run) its own arguments, ``window`` ``None``."""
        header = read_header(req, DEBOUNCE_HEADER)
        if opts.debounce is None or local or not isinstance(header, dict) or debouncing.is_closed(header):
            return args, kwargs, None
        return debouncing.arrived(self, req, key)

    def _body(self, req: Any, args: tuple, kwargs: dict) -> Any:
        if self._plain_call and not req.called_directly:
            # the tracer already pushed this request (celery/app/trace.py): run the body as it
            # would for a task without its own __call__
            return self.run(*args, **kwargs)
        if isinstance(req, _DirectCall) and self.request_stack.top is req:
            # a direct call inside a run: the body gets the request Task.__call__ gives it there
            # (pushed from the enclosing run's), as without taskguard
            self.request_stack.pop()
            try:
                return super().__call__(*args, **kwargs)
            finally:
                self.request_stack.push(req)
        return super().__call__(*args, **kwargs)

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Celery's ``Task.push_request``; a request pushed over one whose run was judged (a
        direct call's, which Celery builds from it) is not a run of its own either."""
        judged = self.request in _judged
        super().push_request(*args, **kwargs)
        if judged:
            _judged.add(self.request)

    # -- publishing ------------------------------------------------------------------------------
    def apply_async(
        self, args=None, kwargs=None, task_id=None, producer=None, link=None, link_error=None, shadow=None, **options
    ):
        """Celery's ``Task.apply_async``, stamping the message with a new publish stamp (the
        ``taskguard_publish`` header) unless it is taskguard's own deferred copy of a delivery
        (a copy looking again while its run id runs elsewhere, or a run deferred to its turn under
        ``rate``), which keeps its delivery's stamp: it is the same delivery, so a copy of one
        that finished is still refused. Every publish of a guarded task passes here: calls,
        retries, replacements, chain and chord steps (celery/app/task.py, celery/canvas.py).

        Guard options per call: ``unique=True/False`` (publish-time uniqueness for this call) and
        ``unique_ttl=`` (seconds its queued mark lasts, instead of the task's). Raises
        :class:`taskguard.ConfigError` for a task option given here (``ttl=``...), a name close to
        one of these two (``uniqe=True``: Celery would have published the message with it as a
        property, silently; celery/celery#9305) and ``unique_ttl=`` without uniqueness."""
        headers = options.get("headers")
        # Celery passes each stamp of a stamped signature as an option of its own name, listed in
        # stamped_headers (celery/canvas.py, celery/app/amqp.py as_task_v2): a stamp is never a
        # guard option, whatever its name
        stamps = frozenset(options.get("stamped_headers") or ())
        unique = None if "unique" in stamps else options.pop("unique", None)
        unique_ttl = None if "unique_ttl" in stamps else options.pop("unique_ttl", None)
        if options.keys() - _PUBLISH_OPTIONS - stamps:  # a name Celery's own calls never pass: a misspelt one?
            check_option_names(
                self.name,
                [n for n in options if n not in stamps],
                supported=PER_CALL_OPTIONS,
                elsewhere=_PER_CALL_ELSEWHERE,
                known=lambda n: False,
            )
        if not (isinstance(headers, dict) and (DEFER_HEADER in headers or RATE_HEADER in headers)):
            options["headers"] = {**(headers or {}), PUBLISH_HEADER: new_publish_stamp()}
        opts = self.taskguard_options
        # taskguard's own copies of a run (retries, skip retries, deferrals) are that run, never a duplicate
        own_copy = (
            isinstance(headers, dict)
            and any(h in headers for h in (HEADER, DEFER_HEADER, RATE_HEADER))
            or bool(options.get("retries"))
        )
        # a step of a chain, group or chord is published as usual: suppressing it would leave the
        # canvas waiting for a result that never comes (celery/canvas.py passes these options)
        in_canvas = (
            link is not None or link_error is not None or any(options.get(k) for k in ("chain", "group_id", "chord"))
        )

        def send(tid: str | None, o: dict[str, Any]) -> Any:  # the publish itself, as Celery makes it
            return super(GuardedTask, self).apply_async(args, kwargs, tid, producer, link, link_error, shadow, **o)

        if (
            opts is not None
            and opts.debounce is not None
            and not own_copy
            and not in_canvas
            and not debouncing.is_window_message(headers)
            and not self.app.conf.task_always_eager
        ):
            return debouncing.publish(self, args, kwargs, task_id, options, send)
        wanted = opts is not None and (opts.unique if unique is None else unique)
        if unique_ttl is not None:
            unique_ttl = check_seconds("unique_ttl", unique_ttl)
            if not wanted:
                raise ConfigError(f"task {self.name!r}: unique_ttl= given to apply_async needs unique=True")
        if wanted and not own_copy and not in_canvas:
            return uniqueness.publish(self, args, kwargs, task_id, options, send, unique_ttl)
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)

    # -- retries keep the lease -------------------------------------------------------------------
    def retry(
        self, args=None, kwargs=None, exc=None, throw=True, eta=None, countdown=None, max_retries=None, **options
    ):
        """Celery's ``Task.retry``, keeping this run's lease for the retried run.

        The lease TTL is stretched to cover the countdown plus ``ttl``, renewal stops here, and
        the handle travels in the ``taskguard`` header, merged with the request's other custom
        headers and any ``headers=`` given here (Celery's own retry would replace them). If the
        retry is not published (max retries exceeded, a publish error) the lease is released.
        With ``throw=False`` the body goes on running: the retry goes out without the handle and
        runs once this run has released the lease (see :mod:`taskguard_celery.identity`)."""
        run = self._current_run()
        req = self.request
        if isinstance(exc, RateLimited) and run is not None and run.enforce and run.state == "running":
            # an upstream 429 (autoretry_for=(Exception,) catches it in ``run`` first): not a
            # retry; the guard defers the run past the pause without consuming max_retries
            raise exc
        if run is None or req.called_directly or run.state != "running":
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        # a retry is a new call: it asks the rate again
        headers = without({**(req.headers or {}), **(options.pop("headers", None) or {})})
        headers.pop(DEBOUNCE_HEADER, None)  # (a debounce window's run: its retry is a plain run of its arguments)
        if not throw:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, headers=headers, **options)
        headers.update(continuing(req))  # (this run ends here: the retry takes over its delivery)
        handle = run.keep(_retry_delay(eta, countdown, self.default_retry_delay) + self.taskguard_options.ttl)
        if handle is not None:
            headers[HEADER] = handle
        # else: lost meanwhile; the retry acquires afresh
        try:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, headers=headers, **options)
        except Retry:
            raise
        except BaseException:  # not published: this run ends here, release what it kept
            if handle is not None:
                run.release_kept(handle)
            raise


#: The guard options a publish takes (``apply_async(..., unique=True, unique_ttl=30)``).
PER_CALL_OPTIONS = ("unique", "unique_ttl")
_PER_CALL_ELSEWHERE = dict.fromkeys(
    OPTION_NAMES, "it is an option of the task (@guarded_task(...)); a publish takes unique= and unique_ttl="
)
#: Publish options Celery itself passes or documents (celery/app/task.py ``apply_async``,
#: celery/app/amqp.py ``as_task_v2``, kombu's ``Producer.publish``): never checked as misspellings.
_PUBLISH_OPTIONS = frozenset(
    {
        *("countdown", "eta", "expires", "retry", "retry_policy", "queue", "exchange", "routing_key", "priority"),
        *("serializer", "compression", "headers", "time_limit", "soft_time_limit", "ignore_result"),
        *("add_to_parent", "publisher", "connection", "chain", "group_id", "group_index", "chord", "root_id"),
        *("parent_id", "retries", "reply_to", "stamped_headers", "replaced_task_nesting", "argsrepr"),
        *("kwargsrepr", "result_cls", "router", "periodic_task_name", "task_type", "delivery_mode"),
        *("mandatory", "immediate", "content_type", "content_encoding", "declare", "correlation_id"),
        *("exchange_type", "expiration", "timeout", "confirm_timeout", "link", "link_error"),
    }
)

for _name, _default in OPTION_DEFAULTS.items():
    setattr(GuardedTask, _name, _default)


def _body(cls: type) -> Any:
    """The task body ``cls`` runs: its own ``run`` or one a task class it derives from defines (as
    found in its class ``__dict__``: a staticmethod stays one), ``None`` for Celery's abstract
    ``Task.run`` (an intermediate base class of tasks)."""
    run = next((k.__dict__["run"] for k in cls.__mro__ if "run" in k.__dict__), None)
    return None if run is None or run is Task.__dict__["run"] else run


def _task_name(cls: type, run: Any) -> str:
    """The task's name for messages: its ``name``, else the name Celery gives a task of its body."""
    fn = run.__func__ if isinstance(run, staticmethod) else run
    own = "run" in cls.__dict__
    return cls.__dict__.get("name") or (
        f"{fn.__module__}.{fn.__qualname__}" if own and fn is not None else f"{cls.__module__}.{cls.__qualname__}"
    )


def _retry_delay(eta: Any, countdown: Any, default: Any) -> float:
    """Seconds until a retry runs, from ``retry()``'s ``eta`` / ``countdown`` (else the task's
    ``default_retry_delay``) as Celery accepts them; a value Celery would refuse counts as now."""
    try:
        return uniqueness.seconds_until(eta if eta is not None else default if countdown is None else countdown)
    except (TypeError, ValueError):
        return 0.0


#: Keywords Celery's task decorators take that are not task attributes (celery/app/base.py:
#: ``Celery.task`` and ``_task_from_fun``).
_DECORATOR_OPTIONS = frozenset({"bind", "shared", "lazy", "filter", "name", "base"})


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
        check_option_names(name, opts, known=lambda n: hasattr(base, n) or n in _DECORATOR_OPTIONS)
        GuardOptions.build(
            fn,
            name=name,
            skip_self=bool(opts.get("bind")),
            locks=opts.get("locks"),
            **{k: opts[k] for k in OPTION_NAMES if k in opts},
        )
        return shared_task(base=base, **opts)(fn)

    if len(args) == 1 and callable(args[0]) and not opts:
        return decorate(args[0])
    if args:
        raise TypeError("guarded_task takes keyword options only: @guarded_task(ttl=60, ...)")
    return decorate


def run_options(task: GuardedTask, req: Any, opts: GuardOptions) -> tuple[GuardOptions, Any]:
    """The guard options of ``task``'s execution of ``req`` and its slot's ``(run id, keep)``: a
    beat message's (read without importing the scheduler) are the entry's guard options applied
    to ``opts`` (a bad one is logged, the task's own used) and its slot (one run per slot);
    any other message's, ``opts`` and ``None``."""
    beat = read_header(req, BEAT_HEADER)
    if not isinstance(beat, dict):
        return opts, None
    return apply_entry_options(opts, beat, task.run, task.name, cache=type(task)), beat_slot(beat)


def release_retry_handle(task: GuardedTask, headers: dict) -> bool:
    """Release the lease a retry message's ``taskguard`` header stands for (for a retry that is
    revoked or expires before it runs). Returns ``True`` when released."""
    value = headers.get(HEADER) if isinstance(headers, dict) else None
    if not isinstance(value, dict) or "owner" not in value:
        return False
    handle = parse_handle(value)
    return release_handle(task.taskguard_locks, handle)
