"""Run once per business key: the first *successful* completion's value, kept and handed back.

A guarded run with a once policy (:class:`OncePolicy`) looks for its key's *completion record*
before it takes the lease, and again once it holds it (a run of the key may have completed
between the two). A record with the same fingerprint means the work is done: the run does not
run the body and gives back the stored value (reason ``"once"``). A record with another
fingerprint means the key was used for different work: :class:`~taskguard.IdempotencyConflict`.
No record: the body runs under the lease, and its value is written atomically with the lease's
release (:data:`taskguard.scripts.RELEASE_STORING`), kept ``once_ttl`` seconds. A run that fails
stores nothing, so the next call runs.

This is "completed once", not exactly-once: a run that crashes after its side effects and before
its release runs them again on the next call (fencing tokens and idempotent writes cover that).

The fingerprint says which work a call asks for: by default the call's bound arguments (defaults
applied), JSON-normalised (``sort_keys``, tuples as lists) so that a direct call and a worker's
call of the same arguments agree, then hashed (SHA-256); or only the named arguments; or what a
callable returns from the bound arguments.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import ConfigError
from .keys import same_kind

__all__ = [
    "Fingerprint",
    "OncePolicy",
    "fingerprint_of",
    "encode_record",
    "decode_record",
    "DEFAULT_ONCE_TTL",
    "DEFAULT_ONCE_MAX_BYTES",
]

#: How long a completion record is kept by default, seconds (1 day).
DEFAULT_ONCE_TTL = 86400.0
#: The largest stored value by default, bytes (after serialisation).
DEFAULT_ONCE_MAX_BYTES = 1 << 20


def fingerprint_of(values: Any) -> str:
    """SHA-256 (hex) of ``values`` JSON-normalised: keys sorted, tuples as lists, no spaces.
    Raises what ``json.dumps`` raises for a value with no JSON form (``TypeError`` naming its
    type, ``ValueError`` for NaN or infinity; pass ``fingerprint=`` then): the call's arguments
    cannot be serialised, which is the caller's error, not a :class:`ConfigError`."""
    try:
        text = json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise same_kind(
            e,
            "cannot fingerprint the call's arguments for once=True; pass fingerprint= "
            "(argument names, or a callable returning a str)",
        ) from None
    return hashlib.sha256(text.encode()).hexdigest()


class Fingerprint:
    """Which arguments say what work a call asks for (validated at declaration).

    ``spec``: ``None`` (every bound argument), a sequence of argument names, or a callable
    receiving the bound arguments as keyword arguments and returning a ``str``.
    ``template``: the task's :class:`~taskguard.keys.KeyTemplate` (its signature binds the call).
    Raises ConfigError for a name the function has no parameter for, or a bad ``spec``."""

    def __init__(self, spec: Any, template: Any) -> None:
        self.template = template
        self.spec = spec
        if spec is None or callable(spec):
            return
        if (
            isinstance(spec, str)
            or not isinstance(spec, Sequence)
            or not spec
            or not all(isinstance(n, str) and n for n in spec)
        ):
            raise ConfigError("fingerprint must be None, a non-empty sequence of argument names, or a callable")
        names = {
            p.name for p in template.signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        unknown = [n for n in spec if n not in names]
        if unknown and not template.has_var_kw:
            raise ConfigError(
                f"fingerprint names {', '.join(map(repr, unknown))}, which "
                f"{template.fn_name}{template.signature} has no parameter for"
            )
        self.spec = tuple(spec)

    def of(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The fingerprint of one call. Raises what the call's arguments cause with its own type:
        ``TypeError`` when they do not bind to the signature (:meth:`KeyTemplate.bind`) or have
        no JSON form (:func:`fingerprint_of`), ``KeyError`` when a named argument is not passed,
        whatever a fingerprint callable raises; ConfigError when the callable returns something
        other than a non-empty ``str``."""
        values = self.template.bind(tuple(args), kwargs)
        if callable(self.spec):
            out = self.spec(**values)
            if not isinstance(out, str) or not out:
                raise ConfigError(
                    f"fingerprint callable {self.spec!r} must return a non-empty str, got {type(out).__name__}"
                )
            return hashlib.sha256(out.encode()).hexdigest()
        if self.spec is not None:
            missing = [n for n in self.spec if n not in values]
            if missing:
                raise KeyError(f"fingerprint needs {', '.join(map(repr, missing))}, not passed")
            values = {n: values[n] for n in self.spec}
        return fingerprint_of(values)


@dataclasses.dataclass(frozen=True)
class OncePolicy:
    """One run's once policy.

    Attributes:
        fingerprint: this call's fingerprint (``str``).
        ttl: seconds the completion record is kept.
        dumps: value -> ``(content_type, content_encoding, data: str | bytes)``.
        loads: ``(data, content_type, content_encoding)`` -> value.
        max_bytes: the largest serialised value stored; a larger one fails the run's finish
            with ConfigError (nothing is stored; the next call runs again).
    """

    fingerprint: str
    ttl: float = DEFAULT_ONCE_TTL
    dumps: Callable[[Any], tuple[str, str, Any]] | None = None
    loads: Callable[[Any, str, str], Any] | None = None
    max_bytes: int = DEFAULT_ONCE_MAX_BYTES


def _json_dumps(value: Any) -> tuple[str, str, str]:
    try:
        return "application/json", "utf-8", json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"once=True: the value cannot be stored as JSON ({e})") from None


def _json_loads(data: Any, content_type: str, encoding: str) -> Any:
    return json.loads(data)


def encode_record(policy: OncePolicy, value: Any, key: str) -> str:
    """The completion record of ``value`` (JSON text). Raises ConfigError when the value cannot
    be serialised or is larger than ``policy.max_bytes``."""
    content_type, encoding, data = (policy.dumps or _json_dumps)(value)
    raw = data if isinstance(data, bytes) else data.encode("utf-8")
    if len(raw) > policy.max_bytes:
        raise ConfigError(
            f"once=True: the value of {key!r} is {len(raw)} bytes serialised, over the "
            f"{policy.max_bytes}-byte bound (once_max_bytes); nothing was stored"
        )
    record = {"fp": policy.fingerprint, "ct": content_type, "enc": encoding, "at": round(time.time(), 3)}
    if isinstance(data, bytes):
        record["b64"] = base64.b64encode(data).decode()
    else:
        record["v"] = data
    return json.dumps(record, separators=(",", ":"))


def decode_record(raw: str) -> dict[str, Any] | None:
    """A stored record's fields (``fp``, ``ct``, ``enc``, ``at``, and ``v`` or ``b64``), or
    ``None`` for one that is not a record (never raised over)."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("fp"), str):
        return None
    return record


def record_value(policy: OncePolicy, record: Mapping[str, Any]) -> Any:
    """The stored value of ``record``, deserialised by the policy (JSON by default)."""
    data: Any = base64.b64decode(record["b64"]) if "b64" in record else record.get("v")
    return (policy.loads or _json_loads)(data, record.get("ct") or "application/json", record.get("enc") or "utf-8")
