"""Lease keys derived from a task's arguments, validated when the task is declared."""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ConfigError

__all__ = ["KeyTemplate", "same_kind"]


def same_kind(exc: BaseException, context: str) -> BaseException:
    """``exc`` again, its message prefixed with ``context``, keeping its type: an error that the
    call's own arguments cause (wrong arguments, a key or fingerprint that cannot be made from
    them) is the caller's, raised as what it is, never as a :class:`ConfigError` (which is the
    guard's own configuration). An exception type that cannot be made from one message is
    returned unchanged."""
    try:
        return type(exc)(f"{context}: {exc}")
    except TypeError:  # a constructor taking other arguments
        return exc


class KeyTemplate:
    """Turns a call's arguments into a lease key.

    ``spec`` is either a ``str.format`` template such as ``"report:{customer_id}"`` whose fields
    name parameters of ``fn`` (attribute and index access allowed: ``"{order.id}"``,
    ``"{ids[0]}"``), or a callable receiving the bound arguments as keyword arguments
    (``lambda customer_id, **_: f"sync:{customer_id}"``) and returning a non-empty ``str``.
    A template without fields is a fixed key. Arguments are bound against ``fn``'s signature
    with its defaults applied.

    Args:
        spec: the template or callable.
        fn: the task function whose signature the template binds to.
        skip_self: ``True`` for bound tasks (``bind=True``): the first parameter is the task.

    Raises:
        ConfigError: at construction, when a template names a parameter ``fn`` does not have
            (and ``fn`` takes no ``**kwargs``), is not a valid format string, or ``spec`` is
            neither a ``str`` nor a callable; at :meth:`render`, when a callable returns
            something other than a non-empty ``str`` (the guard's own configuration).
        TypeError: at :meth:`bind` and :meth:`render`, when the call's arguments do not bind to
            the signature, as calling ``fn`` with them would (Python's message, prefixed with
            ``fn``'s name and signature).
        Exception: at :meth:`render`, what the call's arguments make the key fail with, with its
            own type: a template's field or attribute they lack (``KeyError``,
            ``AttributeError``, ``IndexError``, ...), whatever a key callable raises.
    """

    def __init__(self, spec: str | Callable[..., str], fn: Callable[..., Any], *, skip_self: bool = False) -> None:
        self.spec = spec
        self.fn_name = getattr(fn, "__qualname__", repr(fn))
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"cannot read the signature of {self.fn_name}: {e}") from None
        params = list(sig.parameters.values())
        if skip_self and params:
            params = params[1:]
        self.signature = sig.replace(parameters=params)
        #: the function takes ``**kwargs``: keyword arguments it does not name are still its own
        self.has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        # Fast binding for the common signature (no *args, **kwargs or positional-only
        # parameters); anything unusual in a call falls back to Signature.bind, which also
        # words the errors.
        kinds = {p.kind for p in params}
        self._simple = kinds <= {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}
        self._positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
        self._names = frozenset(p.name for p in params)
        self._defaults = tuple((p.name, p.default) for p in params if p.default is not p.empty)
        self.fields: tuple[str, ...] = ()
        if isinstance(spec, str):
            if not spec:
                raise ConfigError("key must be a non-empty template or a callable")
            self.fields = self._parse(spec)
            names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
            unknown = [f for f in self.fields if f not in names]
            if unknown and not self.has_var_kw:
                raise ConfigError(
                    f"key template {spec!r} names {', '.join(map(repr, unknown))}, which "
                    f"{self.fn_name}{self.signature} has no parameter for"
                )
        elif not callable(spec):
            raise ConfigError(f"key must be a str template or a callable, got {type(spec).__name__}")

    @staticmethod
    def _parse(template: str) -> tuple[str, ...]:
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as e:
            raise ConfigError(f"key template {template!r} is not a valid format string: {e}") from None
        fields = []
        for _, field, _, _ in parsed:
            if field is None:
                continue
            root = field.split(".", 1)[0].split("[", 1)[0]
            if not root or root.isdigit():
                raise ConfigError(f"key template {template!r}: fields must name parameters, got {{{field}}}")
            fields.append(root)
        return tuple(fields)

    @property
    def is_fixed(self) -> bool:
        return isinstance(self.spec, str) and not self.fields

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults applied (``**kwargs`` flattened).
        Raises TypeError when they do not bind to the signature (as calling the function would)."""
        if self._simple and len(args) <= len(self._positional):
            values = dict(zip(self._positional, args, strict=False))  # args may be fewer: defaults below
            for name, value in kwargs.items():
                if name not in self._names or name in values:
                    break  # unknown or given twice: Signature.bind says which
                values[name] = value
            else:
                for name, default in self._defaults:
                    if name not in values:
                        values[name] = default
                if len(values) == len(self._names):  # else a required argument is missing
                    return values
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            # the caller's wrong arguments, not the guard's configuration: what calling fn would raise
            raise same_kind(e, f"{self.fn_name}{self.signature}") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        for p in self.signature.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                values.update(values.pop(p.name, {}))
        return values

    def render(self, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The lease key for one call. Raises TypeError, ConfigError or what the arguments make
        the key fail with (see the class docstring)."""
        if self.is_fixed:
            return self.spec  # type: ignore[return-value]
        values = self.bind(tuple(args), kwargs or {})
        if isinstance(self.spec, str):
            missing = [f for f in self.fields if f not in values]
            if missing:
                raise KeyError(f"key template {self.spec!r} needs {', '.join(map(repr, missing))}, not passed")
            try:
                return self.spec.format_map(values)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
                raise same_kind(e, f"key template {self.spec!r} failed on the call's arguments") from None
        key = self.spec(**values)
        if not isinstance(key, str) or not key:
            raise ConfigError(f"key callable {self.spec!r} must return a non-empty str, got {type(key).__name__}")
        return key
