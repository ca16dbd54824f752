"""Guard options shared by the task adapters, validated when a task is declared."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, cast

from .errors import ConfigError
from .keys import KeyTemplate
from .once import Fingerprint, OncePolicy
from .validate import (
    check_burst,
    check_cost,
    check_limit,
    check_rate,
    check_replicas,
    check_seconds,
    check_ttl,
    closest,
)
from .values import OnLost, OnSkip, Overlap

__all__ = [
    "GuardOptions",
    "PerCall",
    "ON_SKIP",
    "ON_LOST",
    "OVERLAP",
    "DEFAULT_TTL",
    "OPTION_NAMES",
    "OPTION_DEFAULTS",
    "check_option_names",
    "check_overlap",
    "check_overlap_conflicts",
    "ENTRY_OVERLAP",
]

#: What a run that cannot get its lease does.
#: ``result``: finish successfully with a ``Skipped`` value; ``ignore``: record nothing (Celery:
#: ``Ignore``, state SKIPPED for event consumers); ``retry``: try again later, bounded by
#: ``skip_max_retries`` and ending in ``Skipped(reason="retry_exhausted")``; ``raise``: fail with
#: ``TaskSkipped``.
ON_SKIP = tuple(m.value for m in OnSkip)
#: What a run whose lease was lost while its body ran does: ``raise`` fails it with
#: ``LeaseLost``; ``warn`` logs, reports and keeps its result.
ON_LOST = tuple(m.value for m in OnLost)
#: What a run does when its key's lease is held: ``skip`` (``on_skip`` applies), ``coalesce``
#: (become the key's one pending follow-up), ``replace`` (take the lease over from the oldest
#: holder, which ends ``Skipped(reason="replaced")``; see :mod:`taskguard.overlap`) and, for a
#: periodic entry only, ``allow`` (no lease: the entry's runs may overlap).
OVERLAP = tuple(m.value for m in Overlap)
#: The :data:`OVERLAP` values a task takes (``allow`` is refused on a task: see :func:`check_overlap`).
OVERLAP_BUILT = (Overlap.SKIP.value, Overlap.COALESCE.value, Overlap.REPLACE.value)
#: The :data:`OVERLAP` values a periodic entry takes (:mod:`taskguard.schedule.options`).
ENTRY_OVERLAP = OVERLAP
DEFAULT_TTL = 60.0
#: ``debounce_max`` when only ``debounce`` is given: a window stays open at most this many seconds.
DEBOUNCE_MAX_DEFAULT = 3600.0


@dataclasses.dataclass(frozen=True)
class GuardOptions:
    """Validated guard options of one task (see :meth:`build`)."""

    key: KeyTemplate
    ttl: float
    wait: float
    renew: bool
    on_skip: OnSkip
    on_lost: OnLost
    skip_retry_delay: float | None
    skip_max_retries: int
    max_hold: float | None
    continue_on_skip: bool
    limit: int = 1
    rate: tuple[int, float] | None = None
    rate_key: KeyTemplate | None = None
    rate_burst: int | None = None
    rate_max_wait: float | None = None
    once: bool = False
    once_ttl: float = 86400.0
    fingerprint: Any = None
    once_max_bytes: int = 1 << 20
    enforce: bool = True
    unique: bool = False
    unique_ttl: float | None = None
    overlap: Overlap = Overlap.SKIP
    replace_terminate: bool = False
    debounce: float | None = None
    debounce_max: float | None = None
    cost: Any = 1  # an int, or a PerCall of the call's arguments
    limit_fn: PerCall | None = None  # limit= given as a callable of the call's arguments
    limit_total: int | None = None
    limit_total_key: KeyTemplate | None = None
    replicas: int | None = None  # None: the locks' own
    replica_timeout: float | None = None

    @classmethod
    def build(
        cls,
        fn: Callable[..., Any],
        *,
        name: str,
        skip_self: bool = False,
        key: str | Callable[..., str] | None = None,
        ttl: float = DEFAULT_TTL,
        wait: float = 0.0,
        blocking_wait: bool = False,
        renew: bool = True,
        on_skip: str = "result",
        on_lost: str = "raise",
        skip_retry_delay: float | None = None,
        skip_max_retries: int = 3,
        max_hold: float | None = None,
        continue_on_skip: bool = False,
        limit: int | Callable[..., int] = 1,
        rate: Any = None,
        rate_key: str | Callable[..., str] | None = None,
        rate_burst: int | None = None,
        rate_max_wait: float | None = None,
        once: bool = False,
        once_ttl: float = 86400.0,
        fingerprint: Any = None,
        once_max_bytes: int = 1 << 20,
        enforce: bool = True,
        unique: bool = False,
        unique_ttl: float | None = None,
        overlap: str = "skip",
        replace_terminate: bool = False,
        debounce: float | None = None,
        debounce_max: float | None = None,
        cost: int | Callable[..., int] = 1,
        limit_total: int | None = None,
        limit_total_key: str | Callable[..., str] | None = None,
        replicas: int | None = None,
        replica_timeout: float | None = None,
        allowed_on_skip: tuple[str, ...] = ON_SKIP,
        noun: str = "task",
        locks: Any = None,
    ) -> GuardOptions:
        """Validate options for the task ``name`` whose body is ``fn``.

        Args:
            key: lease key template or callable (see :class:`~taskguard.keys.KeyTemplate`);
                default: the task name (one run of the task at a time).
            ttl: lease TTL in seconds (> 0). With ``renew`` the heartbeat keeps it alive, so it
                only bounds how long a crashed worker's lease outlives it.
            wait: seconds a run waits for a held lease before skipping (>= 0). Waiting blocks a
                worker pool slot, so ``wait > 0`` also needs ``blocking_wait=True``.
            renew: renew the lease while the body runs.
            on_skip: one of :data:`ON_SKIP` (restricted to ``allowed_on_skip``).
            on_lost: one of :data:`ON_LOST`.
            skip_retry_delay: ``on_skip="retry"``: seconds before retrying (default: the
                holder's remaining TTL, at least 1 s and at most ``ttl``).
            skip_max_retries: ``on_skip="retry"``: how many skip retries before
                ``Skipped(reason="retry_exhausted")``; independent of the task's ``max_retries``.
            max_hold: stop renewing after this many seconds (a hung body's lease then expires).
            continue_on_skip: run a chain's next step / link callbacks after a skipped run
                (default ``False``: the chain stops at the skip).
            limit: how many runs of one key may run at once (``int`` 1..100; default 1, one at
                a time): each holds a lease in one of ``limit`` slots
                (:meth:`taskguard.Locks.acquire`); a run finding them all taken is skipped with
                reason ``"limit"`` (``on_skip`` applies as to a held lease). Or a callable
                receiving the call's bound arguments as keyword arguments and returning that
                ``int`` (``lambda tenant, **_: 10 if is_premium(tenant) else 2``), evaluated per
                run (:meth:`limit_of`): a value out of range fails that run with ConfigError;
                lowering a key's limit admits nobody new until fewer than the new value hold it.
            limit_total: a second cap over every key of the task (``int`` 1..100; default
                ``None``: none): ``limit=2, limit_total=10`` admits at most 2 runs per key *and*
                10 in all. A run needs a place in both: it takes its key's slot first, then one
                of the total's; when the total has none it gives its key's slot back at once
                (never holding one while waiting for the other) and is skipped with reason
                ``"limit_total"`` (``on_skip`` applies; with ``wait``, it waits holding
                nothing). Both leases are renewed by the heartbeat and released together;
                ``self.lease`` is the key's lease and ``self.lease.total`` the total's
                (each with its own fencing token). Needs ``key=``; must be at least an int
                ``limit``; refused with ``overlap="coalesce"`` / ``"replace"``.
            limit_total_key: the total's key, a template or callable like ``key`` (default:
                the task name, one total for all its runs); must differ from the lease key.
            rate: a cluster-wide rate for the runs (``"N/s"``, ``"N/m"``, ``"N/h"``, ``"N/d"``
                or ``(count, seconds)``; default ``None``: none), checked before the lease: a
                run over it is deferred to its booked turn without consuming the task's retries
                (:mod:`taskguard.pacing`).
            rate_key: the rate's key, a template or callable like ``key`` (default: the task
                name, one rate for all its runs).
            rate_burst: cost units that may pass at once (default: ``cost`` when it is an int,
                so with the default ``cost=1`` runs are evenly spaced; the rate's count, one
                period's worth, when ``cost`` is a callable). A run costing more is refused
                (ConfigError: at declaration for an int ``cost``, for that run for a callable).
            rate_max_wait: longest a run may wait for its turn, seconds from its first
                deferral (default ``None``: no bound); past it the run is skipped with reason
                ``"rate_limited"``.
            once: complete once per ``key`` (which must be given): the first run that succeeds
                stores its value, atomically with its release; later calls with the same key and
                fingerprint return it without running the body (reason ``"once"``); the same key
                with another fingerprint raises :class:`~taskguard.IdempotencyConflict`
                (:mod:`taskguard.once`).
            once_ttl: seconds the stored value is kept (default 1 day).
            fingerprint: which arguments say what work a call asks for: ``None`` (all bound
                arguments, JSON-normalised), argument names, or a callable of the bound
                arguments returning a ``str``.
            once_max_bytes: the largest stored value, bytes after serialisation (default 1 MiB).
            enforce: ``False`` for shadow mode: the guard (lease, limit, rate, once) is evaluated
                and what it would have done reported, but the body always runs (with no lease
                when it could not be had) and no capacity is taken from enforced callers beyond
                a free lease (a rate is checked, not consumed; no value is stored).
            unique: publish-time uniqueness: publishing while a run of the same key is queued or
                running publishes nothing and returns that run's handle (Celery; RQ:
                ``enqueue_unique``). The lease stays the correctness boundary; this saves queue
                space.
            cost: what one run costs under ``rate``, in the rate's units (tokens, query points):
                an ``int`` >= 1 (default 1: every run counts 1) or a callable receiving the
                call's bound arguments as keyword arguments and returning an ``int`` >= 1 (e.g.
                ``lambda prompt, **_: estimate_tokens(prompt)``), evaluated per run. The body may
                correct it with :func:`taskguard.settle_cost`. Needs ``rate``.
            unique_ttl: seconds a queued mark lasts when its run never starts (its message lost),
                plus any countdown (default: the publish's ``expires``, else 1 hour).
            overlap: what a run does when the key's lease is held (every slot, under ``limit``), one of
                :data:`OVERLAP_BUILT` (default ``"skip"``; ``"allow"``, no lease, is for periodic
                entries only and refused here: a task that may overlap needs no guard). ``"coalesce"``:
                it becomes the key's one pending follow-up, superseding
                (``Skipped(reason="coalesced")``) the one before it, and runs once the holder ends
                (:mod:`taskguard.overlap`); ``wait`` still applies first. Refused with ``once`` (a
                follow-up would only read the stored value), ``unique`` (a publish while a run is queued
                or running returns that run's handle: nothing would coalesce), ``on_skip="retry"`` (a
                held run never skips) and ``enforce=False`` (shadow mode never holds a run back).
                ``"replace"``: it takes the lease over from the oldest holder at once (a larger fencing
                token; the old run's lease is lost within one renewal interval and that run ends
                ``Skipped(reason="replaced")``, as does any retry of it). Refused with ``once``,
                ``unique``, ``on_skip="retry"`` and ``enforce=False`` likewise.
            debounce: seconds of quiet that close a window of calls (decided when a call is
                published: :mod:`taskguard.debounce`): calls of one key within it make one run, about
                ``debounce`` seconds after the last, with the last call's arguments; every call's
                handle is that run's. Celery: ``delay()`` / ``apply_async()``; RQ:
                ``fn.enqueue_debounced(queue, ...)`` (RQ's scheduler: ``rq worker --with-scheduler``).
                Refused with ``once``, ``unique``.
            debounce_max: the longest a window stays open, seconds from its first call, so a
                steady stream of calls still runs at least this often (>= ``debounce``; needs
                ``debounce``; default :data:`DEBOUNCE_MAX_DEFAULT`).
            replicas: the durability option: how many Redis replicas must acknowledge the
                run's lease (``WAIT``) before its body starts (``int`` 0-16; ``None``, the
                default: the locks' own, :class:`~taskguard.RedisLocks` ``replicas=``). A lease
                fewer replicas acknowledged within ``replica_timeout`` is released and the run
                skipped with reason ``"unreplicated"`` (``on_skip`` applies).
            replica_timeout: the longest wait for those replicas, seconds (float > 0, at most
                60; ``None``: the locks' own).
            replace_terminate: with ``overlap="replace"``, also stop the replaced run's
                execution (Celery: its result is stored as ``Skipped(reason="replaced")``, then
                it is revoked with ``terminate=True`` — a key-value result backend keeps that
                SUCCESS over the REVOKED the worker writes, while event consumers see
                ``task-revoked`` — refused on the threads and solo pools, which cannot
                terminate; RQ: ``send_stop_job_command``, the job ends STOPPED).

            noun: what the framework calls the task in messages (``"task"``; RQ: ``"job"``).
            locks: the :class:`~taskguard.Locks` the guard is declared with, when known then: the
                durability option is checked against their client here
                (:meth:`taskguard.Locks.check_durability`), not at the first run.

        Raises:
            ConfigError: naming the task and the bad option.
        """

        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{noun} {name!r}: {msg}")

        try:
            template = KeyTemplate(name if key is None else key, fn, skip_self=skip_self)
            ttl = check_ttl(ttl)
            wait = check_seconds("wait", wait, allow_zero=True)
            max_hold = None if max_hold is None else check_seconds("max_hold", max_hold)
            skip_retry_delay = None if skip_retry_delay is None else check_seconds("skip_retry_delay", skip_retry_delay)
            limit_fn = (
                PerCall("limit", limit, fn, check_limit, skip_self=skip_self, task=f"{noun} {name!r}")
                if callable(limit)
                else None
            )
            limit = 1 if limit_fn is not None else check_limit(limit)
            total_template = None
            if limit_total is None:
                if limit_total_key is not None:
                    raise ConfigError("limit_total_key needs limit_total= (e.g. limit=2, limit_total=10)")
            else:
                limit_total = check_limit(limit_total, "limit_total")
                if limit_fn is None and limit > limit_total:
                    raise ConfigError(
                        f"limit ({limit}) exceeds limit_total ({limit_total}): one key could never use its limit"
                    )
                if key is None:
                    raise ConfigError(
                        "limit_total needs key= naming the per-key lease (e.g. key='export:{tenant}'); "
                        "the total counts every key"
                    )
                spec = name if limit_total_key is None else limit_total_key
                if isinstance(spec, str) and spec == key:
                    raise ConfigError(f"limit_total_key must differ from key ({key!r}): they are two caps")
                total_template = KeyTemplate(spec, fn, skip_self=skip_self)
            rate = None if rate is None else check_rate(rate)
            if rate is None and (rate_key is not None or rate_burst is not None or rate_max_wait is not None):
                raise ConfigError("rate_key, rate_burst and rate_max_wait need rate= (e.g. rate='100/m')")
            rate_template = (
                None if rate is None else KeyTemplate(name if rate_key is None else rate_key, fn, skip_self=skip_self)
            )
            rate_burst = None if rate_burst is None else check_burst(rate_burst)
            if rate is None and not (type(cost) is int and cost == 1):
                raise ConfigError("cost needs rate= (e.g. rate='90000/m', cost=lambda prompt, **_: len(prompt))")
            run_cost: int | PerCall
            if callable(cost):
                run_cost = PerCall("cost", cost, fn, check_cost, skip_self=skip_self, task=f"{noun} {name!r}")
                if rate_burst is None:
                    rate_burst = cast("tuple[int, float]", rate)[0]  # one period's worth of cost units
            else:
                run_cost = check_cost(cost)
                if rate_burst is not None and run_cost > rate_burst:
                    raise ConfigError(
                        f"cost {run_cost} exceeds rate_burst {rate_burst}: such a run could never pass; "
                        f"raise rate_burst to at least {run_cost}"
                    )
            rate_max_wait = (
                None if rate_max_wait is None else check_seconds("rate_max_wait", rate_max_wait, allow_zero=True)
            )
            once_ttl = check_seconds("once_ttl", once_ttl)
            unique_ttl = None if unique_ttl is None else check_seconds("unique_ttl", unique_ttl)
            if once and key is None:
                raise ConfigError("once=True needs key= naming the business key (e.g. key='charge:{invoice_id}')")
            if not once and fingerprint is not None:
                raise ConfigError("fingerprint= needs once=True")
            if not once:  # (a value given equal to the default cannot be told apart, and is harmless)
                for option, value in (("once_ttl", once_ttl), ("once_max_bytes", once_max_bytes)):
                    if value != OPTION_DEFAULTS[option]:
                        raise ConfigError(f"{option}= needs once=True (it tunes the stored value of a once run)")
            fingerprint = Fingerprint(fingerprint, template) if once else None
            if replicas is not None or replica_timeout is not None:
                checked = check_replicas(
                    0 if replicas is None else replicas, 0.1 if replica_timeout is None else replica_timeout
                )
                replicas = None if replicas is None else checked[0]
                replica_timeout = None if replica_timeout is None else checked[1]
            if locks is not None:
                if isinstance(locks, type):
                    raise ConfigError(f"locks must be a taskguard.Locks, got the class {locks.__name__} (make one)")
                if not callable(getattr(locks, "check_durability", None)):
                    raise ConfigError(f"locks must be a taskguard.Locks, got {type(locks).__name__}")
                locks.check_durability(replicas, replica_timeout)
            if isinstance(once_max_bytes, bool) or not isinstance(once_max_bytes, int) or once_max_bytes < 1:
                raise ConfigError(f"once_max_bytes must be an int >= 1, got {once_max_bytes!r}")
        except ConfigError as e:
            raise bad(str(e)) from None
        if wait > 0 and not blocking_wait:
            retry_hint = (
                ", or use on_skip='retry' to try again later without blocking" if "retry" in allowed_on_skip else ""
            )
            raise bad(
                f"wait={wait} blocks a worker slot while it waits; pass blocking_wait=True to accept that{retry_hint}"
            )
        if on_skip not in allowed_on_skip:
            raise bad(f"on_skip must be one of {allowed_on_skip}, got {on_skip!r}")
        if on_lost not in ON_LOST:
            raise bad(f"on_lost must be one of {ON_LOST}, got {on_lost!r}")
        try:
            overlap = check_overlap(overlap)
            check_overlap_conflicts(
                overlap, once=once, unique=unique, on_skip=on_skip, enforce=enforce, limit_total=limit_total
            )
        except ConfigError as e:
            raise bad(str(e)) from None
        if not isinstance(replace_terminate, bool):
            raise bad(f"replace_terminate must be True or False, got {replace_terminate!r}")
        if replace_terminate and overlap != Overlap.REPLACE:
            raise bad("replace_terminate=True needs overlap='replace'")
        if debounce is None and debounce_max is not None:
            raise bad("debounce_max needs debounce= (seconds of quiet that close a window)")
        if debounce is not None:
            try:
                debounce = check_seconds("debounce", debounce)
                debounce_max = (
                    DEBOUNCE_MAX_DEFAULT if debounce_max is None else check_seconds("debounce_max", debounce_max)
                )
            except ConfigError as e:
                raise bad(str(e)) from None
            if debounce_max < debounce:
                raise bad(f"debounce_max ({debounce_max}) must be >= debounce ({debounce})")
            for conflict, given in (("once=True", once is True), ("unique=True", unique is True)):
                if given:
                    raise bad(
                        f"debounce= cannot be combined with {conflict}: a debounced call publishes at most one "
                        "message per window already"
                    )
        for flag, value in (
            ("renew", renew),
            ("continue_on_skip", continue_on_skip),
            ("blocking_wait", blocking_wait),
            ("once", once),
            ("enforce", enforce),
            ("unique", unique),
        ):
            if not isinstance(value, bool):
                raise bad(f"{flag} must be True or False, got {value!r}")
        if isinstance(skip_max_retries, bool) or not isinstance(skip_max_retries, int) or skip_max_retries < 0:
            raise bad(f"skip_max_retries must be an int >= 0, got {skip_max_retries!r}")
        return cls(
            template,
            ttl,
            wait,
            renew,
            OnSkip(on_skip),
            OnLost(on_lost),
            skip_retry_delay,
            skip_max_retries,
            max_hold,
            continue_on_skip,
            limit,
            rate,
            rate_template,
            rate_burst,
            rate_max_wait,
            once,
            once_ttl,
            fingerprint,
            once_max_bytes,
            enforce,
            unique,
            unique_ttl,
            Overlap(overlap),
            replace_terminate,
            debounce,
            debounce_max,
            run_cost,
            limit_fn,
            limit_total,
            total_template,
            replicas,
            replica_timeout,
        )

    def once_policy(self, args: tuple[Any, ...], kwargs: dict[str, Any], dumps: Any = None, loads: Any = None) -> Any:
        """The :class:`~taskguard.once.OncePolicy` of one call (``None`` without ``once``), its
        value stored with ``dumps`` / read with ``loads`` (default JSON). Raises what
        :meth:`taskguard.once.Fingerprint.of` raises when the call's arguments cannot be
        fingerprinted (their own error: ``TypeError``, ``KeyError``...)."""
        if not self.once:
            return None

        return OncePolicy(self.fingerprint.of(args, kwargs), self.once_ttl, dumps, loads, self.once_max_bytes)

    def cost_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """What one call costs under the rate (``int``). Raises ConfigError when a cost callable
        returns something other than an ``int`` from 1 to 10**9, TypeError when the arguments do
        not bind, and whatever the callable raises."""
        cost = self.cost
        return cost if type(cost) is int else cast(PerCall, cost).of(args, kwargs)

    def limit_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """How many runs of this call's key may run at once (``int``): ``limit``, or a limit
        callable's value for this call. Raises ConfigError for a value out of range (1..100),
        TypeError when the arguments do not bind, and whatever the callable raises."""
        return self.limit if self.limit_fn is None else self.limit_fn.of(args, kwargs)

    def total_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int] | None:
        """The total a call also needs a place in: ``(total key, limit_total)``, or ``None``
        without ``limit_total``. Raises what rendering the key raises (TypeError...) and
        ConfigError when it renders to the lease key itself (``key``)."""
        if self.limit_total is None:
            return None
        total_key = cast(KeyTemplate, self.limit_total_key).render(args, kwargs)
        if total_key == self.key.render(args, kwargs):
            raise ConfigError(f"limit_total_key rendered {total_key!r}, the lease key itself: they are two caps")
        return total_key, self.limit_total

    def retry_delay(self, holder_ttl: float | None) -> float:
        """Countdown for an ``on_skip="retry"`` retry, seconds."""
        if self.skip_retry_delay is not None:
            return self.skip_retry_delay
        return min(max(holder_ttl or 1.0, 1.0), self.ttl)


def check_overlap(value: Any, *, allowed: tuple[str, ...] = OVERLAP_BUILT, what: str = "overlap") -> Overlap:
    """The :class:`~taskguard.values.Overlap` member named ``value``, one of ``allowed`` (a task's:
    :data:`OVERLAP_BUILT`; a periodic entry's: :data:`ENTRY_OVERLAP`). The one validator of the
    option, for tasks and periodic entries alike. Raises ConfigError naming ``what``, with "did
    you mean" for a misspelt value; ``allow`` on a task says where it belongs."""
    if isinstance(value, str) and value in allowed:
        return Overlap(value)
    if value == Overlap.ALLOW.value:
        raise ConfigError(
            f"{what}='allow' is for periodic entries only (options['taskguard'] of a beat_schedule entry, "
            "meta['taskguard'] of an rq cron entry): a task's guard is its lease, so a task whose runs may "
            "overlap needs no guard (or takes limit=N)"
        )
    close = closest(value, allowed) if isinstance(value, str) else None
    hint = f" (did you mean {close!r}?)" if close else ""
    raise ConfigError(f"{what} must be one of {allowed}, got {value!r}{hint}")


def check_overlap_conflicts(
    overlap: Any,
    *,
    once: Any = False,
    unique: Any = False,
    on_skip: Any = "result",
    enforce: Any = True,
    limit_total: Any = None,
) -> None:
    """Refuse an ``overlap`` value beside the options it cannot work with (a task's own, or a
    periodic entry's laid over its task's): ``coalesce`` / ``replace`` with ``limit_total``,
    ``once``, ``unique``, ``on_skip="retry"`` or ``enforce=False``; ``allow`` with ``once``.
    Raises ConfigError saying why."""
    overlap = Overlap.of(overlap)
    table = _CONFLICTS.get(overlap.value if isinstance(overlap, Overlap) else str(overlap), {})
    for conflict, given in (
        ("limit_total", limit_total is not None),
        ("once=True", once is True),
        ("unique=True", unique is True),
        ("on_skip='retry'", on_skip == "retry"),
        ("enforce=False", enforce is False),
    ):
        if given and conflict in table:
            raise ConfigError(f"overlap={overlap.value!r} cannot be combined with {conflict}: " + table[conflict])


_CONFLICTS = {
    "allow": {
        "once=True": "a key's completion is recorded with its lease's release, and allow takes no lease",
        "limit_total": "allow takes no lease, so its runs would take no place in the total",
    },
    "coalesce": {
        "once=True": "the follow-up of a completed key would only return the stored value",
        "unique=True": (
            "a publish while a run is queued or running returns that run's handle, so nothing would coalesce"
        ),
        "on_skip='retry'": "a run finding the lease held becomes the pending follow-up instead of skipping",
        "enforce=False": "shadow mode never holds a run back, so there is nothing to coalesce",
        "limit_total": "a pending follow-up is woken when its key frees, not when the total does",
    },
    "replace": {
        "once=True": "a completed key's work is not redone, so there is no run to replace it with",
        "unique=True": (
            "a publish while a run is queued or running returns that run's handle, so nothing would replace it"
        ),
        "on_skip='retry'": "a run finding the lease held takes it over instead of skipping",
        "enforce=False": "shadow mode never takes a lease from a holder",
        "limit_total": "taking over a key's oldest holder would not give a place in the total",
    },
}


class PerCall:
    """A guard option given as a callable of the call's arguments (``cost=``, ``limit=``), bound
    to the task's signature: :meth:`of` gives its validated value for one call.

    The callable receives the call's bound arguments (defaults applied) as keyword arguments;
    its signature is checked against the task's at declaration (ConfigError)."""

    __slots__ = ("option", "fn", "template", "check", "task")

    def __init__(
        self,
        option: str,
        fn: Callable[..., Any],
        task_fn: Callable[..., Any],
        check: Callable[[Any, str], int],
        *,
        skip_self: bool = False,
        task: str = "",  # what its errors name: "task 'reports.daily'"
    ) -> None:
        self.option, self.fn, self.check, self.task = option, fn, check, task
        self.template = KeyTemplate(option, task_fn, skip_self=skip_self)  # (for its binding only)
        params = self.template.signature.parameters.values()
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            return  # the names a call passes are not known before it
        try:
            inspect.signature(fn).bind(**{p.name: None for p in params})
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"{option} callable {getattr(fn, '__name__', fn)!r} is called with the task's arguments "
                f"as keywords ({', '.join(p.name for p in params)}), which it does not take: {e}"
            ) from None

    def of(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
        """The value for one call. Raises ConfigError for a value out of range, TypeError when the
        arguments do not bind, and whatever the callable raises."""
        value = self.fn(**self.template.bind(tuple(args), kwargs))
        try:
            return self.check(
                value, f"the {self.option} callable's value ({getattr(self.fn, '__name__', self.option)})"
            )
        except ConfigError as e:
            raise ConfigError(f"{self.task}: {e}") from None


def _defaults() -> dict[str, Any]:
    params = inspect.signature(GuardOptions.build).parameters
    return {
        n: p.default
        for n, p in params.items()
        if n not in ("fn", "name", "skip_self", "allowed_on_skip", "noun", "locks")
    }


#: The guard options :meth:`GuardOptions.build` accepts, with their defaults (the one place each
#: default lives; adapters read them from here).
OPTION_DEFAULTS: dict[str, Any] = _defaults()
#: option names :meth:`GuardOptions.build` accepts (adapters pop them from task options)
OPTION_NAMES = tuple(OPTION_DEFAULTS)


def check_option_names(
    task: str,
    given: Iterable[str],
    *,
    supported: Collection[str] = OPTION_NAMES,
    elsewhere: Mapping[str, str] | None = None,
    known: Callable[[str], bool] | None = None,
    noun: str = "task",
    listing: str = "guard options",
) -> None:
    """Refuse, at declaration, option names a task adapter would otherwise drop or misread.

    Args:
        task: the task's name (for the message).
        given: the option names passed at declaration.
        supported: the guard options this adapter implements (a subset of :data:`OPTION_NAMES`).
        elsewhere: for a guard option the adapter does not take, where that feature lives for
            this framework (said in the error).
        known: ``None`` when the declaration takes guard options only (RQ's ``@guarded_job``):
            any other name is refused. Else a test for names that belong to the framework or to
            the user (Celery: an attribute of a class in the task's MRO, ``max_retries`` and
            ``rate_limit`` included); a name it does not know is refused only when it is close to
            a guard option (a misspelling: ``ttll``), since Celery keeps unknown task options as
            task attributes.
        noun: what the framework calls it, for the message (``"task"``; RQ: ``"job"``).
        listing: what the names ``supported`` lists are, for the message.

    Raises ConfigError naming the task and the option, with "did you mean ...?" for a close
    guard option, or where a guard option this adapter does not take lives.
    """
    elsewhere = elsewhere or {}
    for name in given:
        if name in supported:
            continue
        if name in OPTION_NAMES:
            where = elsewhere.get(name, "")
            raise ConfigError(
                f"{noun} {task!r}: option {name!r} is not supported here" + (f": {where}" if where else "")
            )
        if known is not None and known(name):
            continue
        close = closest(name, supported, loose=known is None)
        if known is not None and close is None:
            continue  # a framework option or a user's attribute, not a misspelt guard option
        hint = f"; did you mean {close!r}?" if close else f" ({listing}: {', '.join(sorted(supported))})"
        if known is not None:
            hint += " (an attribute of your own: define it on a class this one derives from, where it is kept)"
        raise ConfigError(f"{noun} {task!r}: unknown option {name!r}{hint}")
