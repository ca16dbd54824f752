"""Prometheus metrics from lease events (taskguard's ``prometheus`` extra).

==========================================  =========  ====================================
metric                                      type       labels
==========================================  =========  ====================================
``taskguard_skips_total``                   counter    ``task``, ``reason``, ``shadow``
``taskguard_publishes_suppressed_total``    counter    ``task``
``taskguard_leases_acquired_total``         counter    ``task``
``taskguard_leases_restored_total``         counter    ``task``
``taskguard_leases_lost_total``             counter    ``task``
``taskguard_lease_renewals_failed_total``   counter    (none)
``taskguard_acquire_duration_seconds``      histogram  (none)
==========================================  =========  ====================================

Labels are task / job names and skip reasons only — never lock keys or task arguments, whose
values are unbounded. A lease taken outside a task is labelled ``task="-"``.

:func:`install` registers one global listener (:func:`taskguard.add_listener`) in the calling
process. Celery prefork children and RQ work-horses are separate processes: use
``prometheus_client``'s multiprocess mode — set ``PROMETHEUS_MULTIPROC_DIR`` to an empty
directory shared by the worker's processes before they start — and serve ``/metrics`` from one
process with :func:`serve` (it aggregates every process's files, in that directory and in its
subdirectories). prometheus_client names each process's files by its PID, which is unique only
within one host or container: processes of several containers sharing a volume each need a
directory of their own (one subdirectory per container, e.g. ``/data/metrics/worker-1``;
:func:`install` creates it), and :func:`serve`, pointed at the parent, adds them up. The adapters call
:func:`install` in each worker process when ``TASKGUARD_METRICS=1`` is set (Celery: also
``app.conf.taskguard_metrics = True``). See https://prometheus.github.io/client_python/multiprocess/.
"""

from __future__ import annotations

import glob
import os
import threading
from typing import Any

from .events import LeaseEvent, add_listener
from .extras import missing_extra

__all__ = ["install", "serve", "Metrics", "enabled_by_env"]

_installed: Metrics | None = None
_lock = threading.Lock()


def enabled_by_env() -> bool:
    """``TASKGUARD_METRICS`` is set to ``1``/``true``/``yes``."""
    return os.environ.get("TASKGUARD_METRICS", "").strip().lower() in ("1", "true", "yes")


class Metrics:
    """The metric objects and the listener that feeds them."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        registry = REGISTRY if registry is None else registry
        self.skips = Counter(
            "taskguard_skips_total",
            'Runs skipped by their guard (shadow="true": would have been, in shadow mode)',
            ["task", "reason", "shadow"],
            registry=registry,
        )
        self.suppressed = Counter(
            "taskguard_publishes_suppressed_total",
            "Publishes not made because a run of the key was queued or running (unique=True)",
            ["task"],
            registry=registry,
        )
        self.restored = Counter(
            "taskguard_leases_restored_total",
            "Leases claimed by a retry of the run that held them (same fencing token)",
            ["task"],
            registry=registry,
        )
        self.acquired = Counter(
            "taskguard_leases_acquired_total",
            "Leases acquired afresh (a new fencing token)",
            ["task"],
            registry=registry,
        )
        self.lost = Counter("taskguard_leases_lost_total", "Leases found lost while held", ["task"], registry=registry)
        self.renewals_failed = Counter(
            "taskguard_lease_renewals_failed_total",
            "Renewals that failed (Redis error, or another owner)",
            registry=registry,
        )
        self.acquire_duration = Histogram(
            "taskguard_acquire_duration_seconds",
            "Time to get an answer to an acquire, waiting included",
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )

    def __call__(self, event: LeaseEvent) -> None:
        task = event.task or "-"
        if event.kind == "acquire":
            if event.status in ("acquired", "held", "limit", "wait_timeout", "duplicate", "unreplicated"):
                self.acquire_duration.observe(event.duration)
            if event.status == "acquired":
                self.acquired.labels(task=task).inc()
        elif event.kind == "claim" and event.status == "claimed":
            self.restored.labels(task=task).inc()
        elif event.kind == "publish" and event.status == "suppressed":
            if event.shadow:  # shadow mode: published anyway; counted as a would-be skip
                self.skips.labels(task=task, reason="unique", shadow="true").inc()
            else:
                self.suppressed.labels(task=task).inc()
        elif event.kind == "skip":
            self.skips.labels(task=task, reason=event.status, shadow="true" if event.shadow else "false").inc()
        elif event.kind == "lost":
            self.lost.labels(task=task).inc()
        elif event.kind == "renew" and event.status in ("error", "not_owner"):
            self.renewals_failed.inc()


def install(registry: Any = None) -> Metrics:
    """Create the metrics (once per process) and feed them from every lease event.

    Raises ImportError (with the install hint) when ``prometheus_client`` is missing."""
    global _installed
    with _lock:
        if _installed is None:
            where = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            if where:  # (a container's own subdirectory of a shared volume: made on first use)
                os.makedirs(where, exist_ok=True)
            try:
                metrics = Metrics(registry)
            except ImportError as e:
                raise ImportError(missing_extra("taskguard metrics", "prometheus", e)) from e
            add_listener(metrics)
            _installed = metrics
        return _installed


def _after_fork() -> None:
    global _lock
    # the child keeps the parent's listener (same metric objects); in multiprocess mode
    # prometheus_client writes the child's samples to files of its own pid
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def serve(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` on ``addr:port`` from this process: in multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR`` set) every process's samples, in that directory and in its
    subdirectories (one per container sharing a volume), summed; else this process's registry.
    Returns what ``prometheus_client.start_http_server`` returns."""
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    where = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if where:
        registry = CollectorRegistry()
        registry.register(_SampleFiles(where))
        return start_http_server(port, addr=addr, registry=registry)
    return start_http_server(port, addr=addr, registry=REGISTRY)


class _SampleFiles:
    """A collector of the multiprocess sample files (``*.db``) in a directory and in its direct
    subdirectories, merged as prometheus_client's ``MultiProcessCollector`` merges one directory's
    (its ``merge`` static method: counters summed, histograms accumulated;
    prometheus_client/multiprocess.py)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Any:
        from prometheus_client import multiprocess

        files = glob.glob(os.path.join(self.path, "*.db")) + glob.glob(os.path.join(self.path, "*", "*.db"))
        return multiprocess.MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
