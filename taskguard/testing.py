"""Helpers for testing code that uses taskguard (also offered as pytest fixtures by the plugin in
:mod:`taskguard.pytest_plugin`, installed with the package).

* :func:`assert_skipped` — assert that a task or job result is a skip, optionally of a reason.
* :class:`CapturedEvents` — the lease events recorded during a test (the ``taskguard_events``
  fixture), with filters.

Nothing here imports Celery or RQ.
"""

from __future__ import annotations

import threading
from typing import Any

from .events import LeaseEvent, add_listener
from .skipped import Skipped, as_skipped

__all__ = ["assert_skipped", "CapturedEvents"]


def assert_skipped(value: Any, reason: str | None = None, *, key: str | None = None) -> Skipped:
    """Assert that ``value`` is a skipped run — a :class:`Skipped` or its tagged-dict form (what a
    Celery JSON result carries) — with ``reason`` and ``key`` when given. Returns the
    :class:`Skipped`. Raises ``AssertionError`` saying what was found instead."""
    skipped = as_skipped(value)
    if skipped is None:
        raise AssertionError(f"expected a skipped run, got {value!r}")
    if reason is not None and skipped.reason != reason:
        raise AssertionError(f"expected a skip with reason {reason!r}, got {skipped.reason!r} ({skipped.describe()})")
    if key is not None and skipped.key != key:
        raise AssertionError(f"expected a skip of lease {key!r}, got {skipped.key!r} ({skipped.describe()})")
    return skipped


class CapturedEvents(list[LeaseEvent]):
    """The :class:`~taskguard.LeaseEvent` s of every locks object in this process, in order, from
    :meth:`start` to :meth:`stop` (thread-safe: the heartbeat thread emits renewals)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._remove: Any = None

    def _record(self, event: LeaseEvent) -> None:
        with self._lock:
            self.append(event)

    def start(self) -> CapturedEvents:
        self._remove = add_listener(self._record)
        return self

    def stop(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

    def of(self, kind: str, status: str | None = None) -> list[LeaseEvent]:
        """The events of ``kind`` (``"acquire"``, ``"skip"``, ...), with ``status`` when given."""
        with self._lock:
            return [e for e in self if e.kind == kind and (status is None or e.status == status)]

    @property
    def skips(self) -> list[LeaseEvent]:
        """The ``skip`` events (their ``status`` is the reason)."""
        return self.of("skip")
