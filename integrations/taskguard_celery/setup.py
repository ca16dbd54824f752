"""The adapter's process-wide set-up: Celery signal receivers, connected by :func:`install`.

Importing :mod:`taskguard_celery` connects nothing (an app that imports it without guarded tasks
is untouched). The modules that react to Celery's signals declare their receivers with
:func:`receiver`; the first :class:`~taskguard_celery.GuardedTask` bound to an app
(``Task.bind``: when the app finalizes, or at first use of a task of an unfinalized app) calls
:func:`install`, which connects them all, once per process — as sentry-python's Celery
integration does in ``setup_once()``.

Binding happens early enough for the worker-side signals: a worker finalizes its app (binding
every task) before it sends ``worker_init`` (celery/apps/worker.py ``on_before_init``;
``WorkController.setup_includes`` reads ``app.tasks``), so the receivers are connected in the
main process before the pool is built; prefork children forked from it inherit them, and a
child started as a fresh interpreter finalizes its app before ``worker_process_init``
(celery/concurrency/prefork.py ``process_initializer``).

What is connected (each receiver filters on guarded tasks or on the app's settings):

* ``worker_init``: the pool and settings check (:mod:`.pools`) and the worker's metrics
  (:mod:`.metrics`);
* ``worker_process_init``: the metrics in each prefork child (:mod:`.metrics`);
* ``task_failure``, ``task_revoked``: lease release from the worker's main process
  (:mod:`.supervision`).

With ``TASKGUARD_METRICS=1`` :func:`install` also installs the metrics listener in the process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from celery.utils.dispatch import Signal

from taskguard import metrics

__all__ = ["install", "receiver"]

F = TypeVar("F", bound=Callable[..., Any])

_receivers: list[tuple[Signal, Callable[..., Any]]] = []
_installed = False
_lock = threading.Lock()


def receiver(signal: Signal) -> Callable[[F], F]:
    """Declare the decorated function a receiver of ``signal`` (a ``celery.signals`` signal), to
    be connected (strongly referenced) by :func:`install`; declared after :func:`install` ran,
    it is connected at once. Returns the function unchanged."""

    def declare(fn: F) -> F:
        with _lock:
            _receivers.append((signal, fn))
            if _installed:
                signal.connect(fn, weak=False)
        return fn

    return declare


def install(app: Any = None) -> None:
    """Connect taskguard's Celery signal receivers in this process; later calls do nothing
    (thread-safe). Called by ``GuardedTask.bind``, so there is seldom a need to call it: call it
    when a process must react to Celery's signals for guarded tasks before any of them is bound
    to an app.

    ``app`` (a ``celery.Celery``, optional) is the app being set up; the receivers are
    process-wide and find the app of each signal from its sender, so one call serves every app.
    Raises ImportError when ``TASKGUARD_METRICS=1`` asks for metrics and ``prometheus_client`` is
    missing."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        if metrics.enabled_by_env():
            metrics.install()
        for signal, fn in _receivers:
            signal.connect(fn, weak=False)
        _installed = True


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # a fork while another thread held it must not leave it held


os.register_at_fork(after_in_child=_after_fork)
