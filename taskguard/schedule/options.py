"""Guard options of a periodic entry: the task's own options, some replaced for that entry's runs.

An entry may give its runs their own ``key``, ``ttl``, ``limit``, ``rate``, ``rate_key`` and
``overlap`` (:data:`ENTRY_OPTIONS`, the fields of :class:`taskguard.policy.GuardOptions` of those
names, with the same validators). They are checked when the scheduler starts
(:func:`check_entry_options`), travel in the slot's message, and the worker lays them over the
task's options (:func:`apply_entry_options`). One function checks each field:
:func:`check_entry_option`.

``overlap`` says what a slot's run does when the previous run of the entry still holds its lease
(:data:`taskguard.policy.ENTRY_OVERLAP`): ``skip`` (the default: the run ends
``Skipped(reason="held")``), ``coalesce`` (it becomes the key's one pending follow-up, superseded by
the next slot's run, and runs as soon as the holder ends), ``replace`` (it takes the lease over;
the old run ends ``Skipped(reason="replaced")``) or ``allow`` (no lease at all: the slot is still
published once and runs once, but its body runs beside any earlier run that is still going). The
value is checked with the task's own options (:func:`taskguard.policy.check_overlap_conflicts`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any, cast

from ..errors import ConfigError
from ..keys import KeyTemplate
from ..policy import ENTRY_OVERLAP, GuardOptions, check_overlap, check_overlap_conflicts
from ..validate import check_limit, check_rate, check_ttl, closest
from ..values import Overlap

__all__ = ["ENTRY_OPTIONS", "check_entry_option", "check_entry_options", "apply_entry_options"]

#: The guard options a periodic entry may set for its runs (names of :class:`GuardOptions` fields).
ENTRY_OPTIONS = ("key", "ttl", "limit", "rate", "rate_key", "overlap")

log = logging.getLogger("taskguard.schedule")

_templates: dict[tuple[Hashable, str], KeyTemplate] = {}


def _template(value: str, fn: Callable[..., Any], cache: Any) -> KeyTemplate:
    if cache is None:
        return KeyTemplate(value, fn)
    found = _templates.get((cache, value))
    if found is None:
        found = _templates[(cache, value)] = KeyTemplate(value, fn)
    return found


def check_entry_option(field: str, value: Any, fn: Callable[..., Any] | None = None, cache: Any = None) -> Any:
    """The checked value of one entry option (``field`` one of :data:`ENTRY_OPTIONS`): ``ttl`` a
    lease TTL in seconds (float), ``limit`` an int, ``rate`` ``(count, seconds)`` (a list is
    read as a tuple); ``key`` / ``rate_key`` a non-empty template ``str``, returned as a
    :class:`~taskguard.keys.KeyTemplate` bound to ``fn``'s signature when ``fn`` is given
    (``cache``: a hashable that names ``fn``, to reuse bound templates), else as the ``str``;
    ``overlap`` one of :data:`~taskguard.policy.ENTRY_OVERLAP`, returned as its ``str``. Raises
    ConfigError naming the field ("did you mean" for a misspelt overlap value)."""
    if field in ("key", "rate_key"):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{field} must be a non-empty template str, got {value!r}")
        if fn is None:
            return value
        try:
            return _template(value, fn, cache)
        except ConfigError as e:
            raise ConfigError(f"{field}: {e}") from None
    if field == "ttl":
        return check_ttl(value)
    if field == "limit":
        return check_limit(value)
    if field == "rate":
        return check_rate(tuple(value) if isinstance(value, list) else value)
    if field == "overlap":
        return check_overlap(value, allowed=ENTRY_OVERLAP).value
    raise ConfigError(f"unknown entry option {field!r} (entry options: {', '.join(ENTRY_OPTIONS)})")


def check_entry_options(
    where: str,
    options: Any,
    fn: Callable[..., Any] | None = None,
    container: str = "options",
    guard: GuardOptions | None = None,
) -> dict[str, Any]:
    """Check an entry's guard options when the scheduler starts: a dict with keys from
    :data:`ENTRY_OPTIONS` (a misspelt key gets "did you mean"); ``rate_key`` needs ``rate``; with
    ``fn`` (the body of a guarded task this process knows) the templates are bound to its
    signature too, and with ``guard`` (that task's own options) an ``overlap`` is checked against
    them (:func:`taskguard.policy.check_overlap_conflicts`). Returns them JSON-safe (a rate tuple
    as a list), for the slot's message. Raises ConfigError starting with ``where`` (e.g. ``"beat
    entry 'nightly'"``); ``container`` names the dict in the message."""
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: {container} must be a dict with keys {ENTRY_OPTIONS}, got {options!r}")
    for name in options:
        if name not in ENTRY_OPTIONS:
            close = closest(str(name), ENTRY_OPTIONS)
            hint = f"; did you mean {close!r}?" if close else ""
            raise ConfigError(
                f"{where}: {container} must be a dict with keys {ENTRY_OPTIONS}: unknown option {name!r}{hint}"
            )
    given = [field for field in ENTRY_OPTIONS if options.get(field) is not None]
    try:
        for field in given:
            check_entry_option(field, options[field])
        if options.get("rate_key") is not None and options.get("rate") is None:
            raise ConfigError("rate_key needs rate")
        for field in given:
            if fn is not None and field in ("key", "rate_key"):
                check_entry_option(field, options[field], fn)
        if guard is not None and options.get("overlap") is not None:
            _check_conflicts(guard, options["overlap"])
        if guard is not None and guard.limit_total is not None:
            _check_total(guard, options)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    out = dict(options)
    if isinstance(out.get("rate"), tuple):
        out["rate"] = list(out["rate"])  # JSON-safe in the message
    return out


def _check_conflicts(guard: GuardOptions, overlap: Any) -> None:
    check_overlap_conflicts(
        overlap,
        once=guard.once,
        unique=guard.unique,
        on_skip=guard.on_skip.value,
        enforce=guard.enforce,
        limit_total=guard.limit_total,
    )


def _check_total(guard: GuardOptions, options: Mapping[str, Any]) -> None:
    """An entry of a task with ``limit_total``: its ``limit`` must fit in the total, and its
    ``key`` must differ from the total's key (as at the task's declaration)."""
    total = cast(int, guard.limit_total)
    limit = options.get("limit")
    if isinstance(limit, int) and limit > total:
        raise ConfigError(
            f"limit ({limit}) exceeds the task's limit_total ({total}): one key could never use its limit"
        )
    key, spec = options.get("key"), getattr(guard.limit_total_key, "spec", None)
    if isinstance(key, str) and isinstance(spec, str) and key == spec:
        raise ConfigError(f"key must differ from the task's limit_total_key ({spec!r}): they are two caps")


def apply_entry_options(
    opts: GuardOptions, options: Mapping[str, Any], fn: Callable[..., Any], task: str, cache: Any = None
) -> GuardOptions:
    """The guard options of one run published for an entry: ``opts`` (the task's own) with the
    entry's options (``options``, e.g. a slot message's header; other keys are ignored) laid over
    them. Each field is checked on its own by :func:`check_entry_option`: a bad one is logged
    (naming ``task``) and the task's own value is kept, never dropping the entry's other options.
    A ``rate`` without a ``rate_key`` (the task having none) is keyed by the task's name; a
    ``rate_key`` without any rate is dropped."""
    changes: dict[str, Any] = {}
    for field in ENTRY_OPTIONS:
        value = options.get(field)
        if value is None:
            continue
        try:
            changes[field] = check_entry_option(field, value, fn, cache)
        except ConfigError as e:
            log.error("task %s: ignoring the beat entry's %s option: %s", task, field, e)
    if "rate" in changes and "rate_key" not in changes and opts.rate_key is None:
        changes["rate_key"] = _template(task, fn, cache)
    if "rate_key" in changes and "rate" not in changes and opts.rate is None:
        log.error("task %s: ignoring the beat entry's rate_key option: it needs rate", task)
        del changes["rate_key"]
    if "overlap" in changes:
        try:
            _check_conflicts(opts, changes["overlap"])
            changes["overlap"] = Overlap(changes["overlap"])
        except ConfigError as e:
            log.error("task %s: ignoring the beat entry's overlap option: %s", task, e)
            del changes["overlap"]
    if "limit" in changes:
        changes["limit_fn"] = None  # the entry's limit replaces a task's limit callable
    if "rate" in changes and opts.rate is None and not isinstance(opts.cost, int):
        changes["cost"] = 1  # (a task without a rate has the default cost)
    return dataclasses.replace(opts, **changes) if changes else opts
