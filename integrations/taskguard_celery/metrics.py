"""Prometheus metrics in Celery worker processes (see :mod:`taskguard.metrics`).

Enabled by ``TASKGUARD_METRICS=1`` or ``app.conf.taskguard_metrics = True``: each worker process
(the main process and every prefork child) installs the listener; with ``TASKGUARD_METRICS=1``
so does any process that binds a guarded task (:func:`taskguard_celery.setup.install`). With the
prefork pool set ``PROMETHEUS_MULTIPROC_DIR`` for the worker and serve ``/metrics`` from one process:
``app.conf.taskguard_metrics_port`` makes the worker's main process serve it, or run
``taskguard metrics --port PORT`` beside the worker with the same directory.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_init, worker_process_init

from taskguard import metrics

from .setup import receiver

log = logging.getLogger("taskguard.celery")


def _wanted(app: Any) -> bool:
    return metrics.enabled_by_env() or bool(app is not None and app.conf.get("taskguard_metrics"))


def install_if_wanted(app: Any) -> None:
    """Install the metrics listener in this process when ``TASKGUARD_METRICS=1`` or
    ``app.conf.taskguard_metrics`` asks for it. Worker processes do it at start; a process that
    only publishes (where ``unique=True`` suppressions are counted) does it on its first report."""
    if _wanted(app):
        metrics.install()


@receiver(worker_init)
def _main_process(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if not _wanted(app):
        return
    metrics.install()
    port = app.conf.get("taskguard_metrics_port") if app is not None else None
    if port:
        metrics.serve(int(port))
        log.warning("taskguard metrics served on port %s", port)


@receiver(worker_process_init)
def _pool_child(**_: Any) -> None:
    from celery import current_app

    if _wanted(current_app):
        metrics.install()
