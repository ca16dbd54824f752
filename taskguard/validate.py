"""Every validator of taskguard's options and arguments, and the bounds they apply.

Each check raises :class:`~taskguard.ConfigError` naming what it checks and what it accepts, and
never echoes a secret (an owner token is never shown; URLs are checked in :mod:`taskguard.urls`,
which masks passwords). Adapters and the environment parser call these; nothing else validates.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
from collections.abc import Collection, Iterable
from typing import Any

from .errors import ConfigError

__all__ = [
    "MAX_SECONDS",
    "MIN_TTL",
    "check_seconds",
    "check_queued_mark",
    "replica_timeout_fits",
    "WAIT_MARGIN",
    "check_ttl",
    "check_fraction",
    "check_key",
    "check_token",
    "check_name",
    "check_value",
    "check_run_id",
    "check_rate",
    "check_burst",
    "check_cost",
    "MAX_COST",
    "check_prefix",
    "check_callback",
    "check_setting_names",
    "closest",
    "edit_distance",
    "check_replicas",
    "MAX_REPLICAS",
    "encodable",
]

#: Longest duration accepted anywhere, seconds (about 31 years; far inside Redis's PEXPIRE range).
MAX_SECONDS = 1e9
#: Shortest lease TTL accepted, seconds. The heartbeat renews a lease every ``ttl * renew_fraction``
#: seconds, each renewal one round trip; below this a lease can expire before any renewal reaches
#: Redis (a loaded worker, a slow network) and guards nothing, so it is refused, not clamped.
MIN_TTL = 0.1


def is_instant(value: Any) -> bool:
    """Is ``value`` an instant, Unix epoch seconds: a finite ``int`` or ``float`` (never a ``bool``)?"""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int too large for a float
        return False


def check_seconds(name: str, value: Any, *, allow_zero: bool = False, minimum: float = 0.0) -> float:
    """Validate a duration in seconds: a finite number, > 0 (>= 0 with ``allow_zero``), at least
    ``minimum`` and at most :data:`MAX_SECONDS`. Returns it as a float."""
    kind = type(value)
    if (kind is float or kind is int) and minimum < value <= MAX_SECONDS:  # the common case, fast
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero) or v > MAX_SECONDS or (0 < v < minimum):
        bound = f">= {minimum:g}" if minimum else (">= 0" if allow_zero else "> 0")
        raise ConfigError(
            f"{name} must be a finite number of seconds {bound} and at most {MAX_SECONDS:.0e}, got {value!r}"
        )
    return v


def check_ttl(value: Any, name: str = "ttl") -> float:
    """Validate a lease TTL: seconds, at least :data:`MIN_TTL` (a shorter lease could expire
    before its first renewal) and at most :data:`MAX_SECONDS`."""
    return check_seconds(name, value, minimum=MIN_TTL)


def check_fraction(value: Any, name: str = "renew_fraction") -> float:
    """Validate the heartbeat's renew fraction: a number in (0, 0.5]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < float(value) <= 0.5):
        raise ConfigError(f"{name} must be a number in (0, 0.5] (a fraction of the TTL), got {value!r}")
    return float(value)


def encodable(name: str, value: str) -> str:
    """``value`` unchanged if it can be sent to Redis as UTF-8 (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{name} must be valid Unicode text (it holds a lone surrogate), got {value!r}") from None
    return value


_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")


def check_prefix(prefix: Any, name: str = "prefix") -> str:
    """A key prefix: 1-64 characters of ``A-Z a-z 0-9 _ - . :`` — the one rule for a prefix given
    in code (``RedisLocks(prefix=)``), ``TASKGUARD_PREFIX``, ``app.conf.taskguard_prefix`` and the
    CLI's ``--prefix``, so leases taken anywhere can be listed and released with the CLI. Raises
    ConfigError naming ``name`` and showing the value (cut at 40 characters)."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        shown = (
            repr(prefix if len(prefix) <= 40 else prefix[:37] + "...")
            if isinstance(prefix, str)
            else f"a value of type {type(prefix).__name__}"
        )
        raise ConfigError(f"{name} must be 1-64 characters of A-Z a-z 0-9 _ - . :, got {shown}")
    return prefix


def check_callback(name: str, callback: Any, *args: Any) -> Any:
    """``callback`` if it can be called with ``args`` (positionally), per
    :func:`inspect.signature`; else ConfigError naming ``name``, the arguments it is called with
    and why. A callable whose signature cannot be read (some builtins) is accepted."""
    if not callable(callback):
        raise ConfigError(f"{name} must be callable, got a value of type {type(callback).__name__}")
    try:
        sig = inspect.signature(callback)
    except (TypeError, ValueError):
        return callback
    try:
        sig.bind(*args)
    except TypeError as e:
        raise ConfigError(
            f"{name} is called with {len(args)} positional arguments "
            f"({', '.join(type(a).__name__ for a in args)}), but its signature {sig} does not "
            f"take them: {e}"
        ) from None
    return callback


#: Endings that make another form of an option's word (``renewal``, ``waits``, ``enforced``).
_INFLECTIONS = ("s", "es", "d", "ed", "al", "ing", "er")


def closest(name: str, options: Collection[str], *, loose: bool = True) -> str | None:
    """The option ``name`` most likely misspells, or ``None``.

    First an option ``name`` is a slip of, ignoring case: at most one edit away — a letter
    changed, added or dropped, or two adjacent letters swapped (``tll``, ``kye``, ``TTL``), what
    the similarity ratio misses in names as short as ``key`` and ``ttl`` (``difflib`` rates
    ``tll`` against ``ttl`` 0.67) — keeping the first letter of an option of four letters or
    fewer (``host`` and ``date`` are other words, not slips of ``cost`` and ``rate``); at most
    two edits from an option of eight letters or more; or another form of the option's word
    (``renewal``, ``waits``). Then, with ``loose`` (where any unknown name is refused anyway and
    only the hint is at stake), the closest by ``difflib``'s ratio (at least 0.75), which also
    finds ``title`` for ``ttl``: too loose to refuse a name by."""
    low = name.lower()
    slip = next((option for option in options if _slip(low, option.lower())), None)
    if slip is not None or not loose:
        return slip
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
    return close[0] if close else None


def _slip(name: str, option: str) -> bool:
    if name == option or any(name == option + end for end in _INFLECTIONS):
        return True
    if len(option) <= 4 and name[:1] != option[:1]:
        return False
    distance = edit_distance(name, option)
    return distance <= 1 or (distance <= 2 and len(option) >= 8)


def edit_distance(a: str, b: str) -> int:
    """The optimal string alignment distance of ``a`` and ``b``: the fewest substitutions,
    insertions, deletions and swaps of two adjacent letters that turn one into the other (no
    substring edited twice)."""
    before: list[int] = []
    row = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, row = row, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], before[j - 2] + 1)
        before = prev
    return row[-1]


def check_setting_names(given: Iterable[str], known: Collection[str], where: str) -> None:
    """Refuse a setting name that is not one of ``known`` but close to one (a misspelling such
    as ``TASKGUARD_PREFX``), which would otherwise be ignored while the default applies. Names
    far from every known one (another tool's variables) pass. Raises ConfigError naming the
    setting, ``where`` it was found and the name meant."""
    for name in given:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            raise ConfigError(f"{where}: {name} is not a taskguard setting; did you mean {close[0]}?")


def check_key(key: Any) -> str:
    """A lease key: a non-empty ``str``."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"lease key must be a non-empty str, got {key!r}")
    return encodable("lease key", key)


def check_token(token: Any) -> str:
    """An owner token: a non-empty ``str`` (never shown in the error)."""
    if not isinstance(token, str) or not token:
        raise ConfigError("owner_token must be a non-empty str")
    try:
        token.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("owner_token must be valid Unicode text") from None
    return token


def check_name(name: Any) -> str:
    """A record name: a non-empty ``str``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"record name must be a non-empty str, got {name!r}")
    return encodable("record name", name)


def check_value(value: Any) -> str:
    """A record value: a ``str``."""
    if not isinstance(value, str):
        raise ConfigError(f"record value must be a str, got {type(value).__name__}")
    return encodable("record value", value)


def check_run_id(run_id: Any) -> str | None:
    """A run id: a non-empty ``str`` or ``None``."""
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise ConfigError(f"run_id must be a non-empty str or None, got {run_id!r}")
    return run_id if run_id is None else encodable("run_id", run_id)


#: Seconds a ``replica_timeout`` must stay below the client's socket timeout: Redis ends a
#: ``WAIT`` on an event-loop tick (``hz`` 10 by default: up to 0.1 s late,
#: https://redis.io/docs/latest/commands/wait/), and the script and the round trip come on top.
WAIT_MARGIN = 0.5


def replica_timeout_fits(replica_timeout: float, socket_timeout: float) -> bool:
    """Can ``WAIT`` for ``replica_timeout`` seconds answer before a ``socket_timeout`` fires?"""
    return replica_timeout + WAIT_MARGIN <= socket_timeout


def check_queued_mark(mark: Any) -> tuple[str, str] | None:
    """An acquisition's queued mark to clear: ``(task, run id)``, both non-empty ``str``, or ``None``."""
    if mark is None:
        return None
    if not isinstance(mark, tuple) or len(mark) != 2 or not all(isinstance(x, str) and x for x in mark):
        raise ConfigError(f"queued_mark must be a (task, run id) pair of non-empty str or None, got {mark!r}")
    return encodable("task", mark[0]), encodable("run_id", mark[1])


_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def check_rate(rate: Any) -> tuple[int, float]:
    """A rate: ``"N/s"``, ``"N/m"``, ``"N/h"``, ``"N/d"`` (N a positive integer) or ``(count,
    seconds)``. Returns ``(count, period seconds)``; the emission interval (period / count) must be
    at least 1 microsecond and the period at most :data:`MAX_SECONDS`. Spaces around N and the unit
    are allowed (``"100 / m"``). Raises ConfigError naming the value (or, for another type, the type)."""
    shown = repr(rate) if isinstance(rate, (str, tuple, list)) else f"a value of type {type(rate).__name__}"
    count: Any = None
    period: Any = None
    if isinstance(rate, str):
        n, sep, unit = rate.strip().partition("/")
        if sep and unit.strip() in _PERIODS and n.strip().isdigit():
            count, period = int(n), _PERIODS[unit.strip()]
    elif isinstance(rate, (tuple, list)) and len(rate) == 2:
        count, period = rate
    if (
        isinstance(count, bool)
        or not isinstance(count, int)
        or count < 1
        or isinstance(period, bool)
        or not isinstance(period, (int, float))
        or not math.isfinite(period)
        or period <= 0
        or period > MAX_SECONDS
        or period / count < 1e-6
    ):
        raise ConfigError(
            f"rate must be 'N/s', 'N/m', 'N/h', 'N/d' or (count, seconds) with count >= 1 and at "
            f"most one event per microsecond, got {shown}"
        )
    return count, float(period)


#: The largest ``limit`` (holders of one key at once) an acquisition may ask for: every
#: acquisition of a key reads each of its slots in one script, so Redis time grows with the limit
#: (about 10 µs per slot at 50, ``bench/bench_limits.py``); a cap in the hundreds belongs to a
#: dedicated queue and its workers' concurrency, not to one key. A task's ``limit_total`` has the
#: same bound for the same reason (its total key is acquired by the same script); beyond about
#: 2,000 slots that script could not run at all (Lua's ``unpack`` of 4 fields per slot, measured).
MAX_LIMIT = 100


def check_limit(limit: Any, name: str = "limit") -> int:
    """A holder limit: an ``int`` from 1 (a lease) to :data:`MAX_LIMIT`."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigError(f"{name} must be an int from 1 to {MAX_LIMIT} (how many holders at once), got {limit!r}")
    return limit


def check_burst(burst: Any) -> int:
    """A throttle's burst: a positive integer (how many cost units may pass at once; with
    ``cost=1``, how many calls)."""
    if isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= 10**9:
        raise ConfigError(f"burst must be an int from 1 to 10**9 (cost units), got {burst!r}")
    return burst


#: The largest cost of one call under a rate, in cost units (and of one :meth:`Locks.settle_cost`).
MAX_COST = 10**9


def check_cost(cost: Any, name: str = "cost") -> int:
    """A call's cost under a rate: an ``int`` from 1 to :data:`MAX_COST` (cost units: tokens,
    query points...)."""
    if isinstance(cost, bool) or not isinstance(cost, int) or not 1 <= cost <= MAX_COST:
        raise ConfigError(f"{name} must be an int from 1 to {MAX_COST} (cost units of one call), got {cost!r}")
    return cost


#: The most replicas an acquisition can wait for (``replicas=``).
MAX_REPLICAS = 16


def check_replicas(replicas: Any, replica_timeout: Any) -> tuple[int, float]:
    """The durability option: ``replicas`` an ``int`` from 0 (none waited for) to
    :data:`MAX_REPLICAS`, ``replica_timeout`` seconds (float > 0, at most 60). Raises ConfigError."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= MAX_REPLICAS:
        raise ConfigError(
            f"replicas must be an int from 0 to {MAX_REPLICAS} (replicas that must acknowledge an "
            f"acquisition before its body starts), got {replicas!r}"
        )
    try:
        timeout = check_seconds("replica_timeout", replica_timeout)
    except ConfigError:
        timeout = math.nan
    if not 0 < timeout <= 60:
        raise ConfigError(f"replica_timeout must be a number of seconds > 0 and at most 60, got {replica_timeout!r}")
    return replicas, timeout
