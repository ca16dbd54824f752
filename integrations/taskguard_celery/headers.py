"""The message headers taskguard writes, and how a request exposes them."""

from __future__ import annotations

from typing import Any

__all__ = ["HEADER", "BEAT_HEADER", "DEFER_HEADER", "read_header"]

#: The handle of a lease kept for a retry, ``{"key", "owner", "fence", "expires"}``, plus ``"skips"``
#: (``on_skip="retry"`` attempts so far).
HEADER = "taskguard"
#: Header of messages published by the taskguard beat scheduler (see :mod:`taskguard_celery.beat`).
BEAT_HEADER = "taskguard_beat"
#: Header of a copy taskguard re-published to look again later while another execution of its task
#: id runs: ``{"chain", "nonce", "redelivered"}`` (see :mod:`taskguard_celery.identity`).
DEFER_HEADER = "taskguard_defer"


def read_header(request: Any, name: str = HEADER) -> Any:
    """The header ``name`` of a request, or ``None``. Custom headers are flat message headers under
    protocol 2 (``Context`` exposes them as attributes and, via ``_get_custom_headers``, in
    ``request.headers``); eager mode and protocol 1 only have ``request.headers``
    (celery/app/task.py, ``Context``)."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, name, None)
    return value
