"""The lease of the guarded body running in this thread (or asyncio task), for the adapters.

Adapters push a *run* object (anything with a ``lease`` attribute) while a guarded body runs;
:func:`current_lease` returns the innermost one's lease. Context variables make this local to
the running request: a thread (threads pool) or task sees only its own.
"""

from __future__ import annotations

import contextvars
from typing import Any

from .lease import Lease

__all__ = ["current_lease", "current_runs", "running"]

_runs: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("taskguard_runs", default=())


def current_lease() -> Lease | None:
    """The lease of the innermost guarded body running here, or ``None``."""
    runs = _runs.get()
    return runs[-1].lease if runs else None


def current_runs() -> tuple[Any, ...]:
    """The run objects pushed here, outermost first."""
    return _runs.get()


class running:
    """``with running(run):`` pushes ``run`` (an object with a ``lease`` attribute) for the
    duration of the block. (A class rather than a generator: it is on every guarded call.)"""

    __slots__ = ("run", "_token")

    def __init__(self, run: Any) -> None:
        self.run = run

    def __enter__(self) -> Any:
        self._token = _runs.set((*_runs.get(), self.run))
        return self.run

    def __exit__(self, *exc: Any) -> None:
        _runs.reset(self._token)
