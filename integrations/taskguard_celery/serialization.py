"""How a ``Skipped`` result travels through Celery's result serializers.

* ``pickle``: natively (a ``Skipped``).
* anything else — ``json`` (Celery's default), msgpack, yaml: the tagged-dict form
  (:meth:`Skipped.to_dict`), plain values that :func:`taskguard.is_skipped` accepts and
  :meth:`Skipped.from_dict` turns back into a ``Skipped``. A plain value, not a registered kombu
  type: a client that never imports taskguard decodes results with the same subscription (the
  Redis backend's pub/sub carries every result a client waits for), and one unknown type in it
  would make every result unreadable to that client (``kombu.exceptions.DecodeError:
  Unsupported type``). Flower shows it as the task's result.
* a direct call or an eager run (nothing serialized): a ``Skipped``.

The kombu type ``taskguard.skipped`` stays registered for decoding results stored by earlier
releases, which encoded ``Skipped`` with it.
"""

from __future__ import annotations

from typing import Any

from kombu.utils.json import register_type

from taskguard import Skipped

__all__ = ["MARKER", "result_value"]

MARKER = "taskguard.skipped"
NATIVE = ("pickle", "application/x-python-serialize")

register_type(Skipped, MARKER, lambda s: s.to_dict(), Skipped.from_dict)


def result_value(skipped: Skipped, task: Any) -> Any:
    """What a skipped run returns, given how it was called and the serializer its result
    backend uses (see the module docstring)."""
    req = task.request
    if req.called_directly or req.is_eager:
        return skipped
    serializer = getattr(getattr(task, "backend", None), "serializer", None) or task.app.conf.result_serializer
    return skipped if serializer in NATIVE else skipped.to_dict()
