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

import base64
from typing import Any

from kombu.serialization import dumps, loads
from kombu.utils.json import register_type

from taskguard import Skipped

__all__ = ["MARKER", "result_value", "stored_form", "encode", "decode"]

MARKER = "taskguard.skipped"
NATIVE = ("pickle", "application/x-python-serialize")

register_type(Skipped, MARKER, lambda s: s.to_dict(), Skipped.from_dict)


def result_value(skipped: Skipped, task: Any) -> Any:
    """What a skipped run returns, given how it was called and the serializer its result
    backend uses (see the module docstring)."""
    req = task.request
    if req.called_directly or req.is_eager:
        return skipped
    return stored_form(skipped, task)


def stored_form(skipped: Skipped, task: Any) -> Any:
    """``skipped`` as the task's result backend stores it (see the module docstring)."""
    serializer = getattr(getattr(task, "backend", None), "serializer", None) or task.app.conf.result_serializer
    return skipped if serializer in NATIVE else skipped.to_dict()


def encode(task: Any, value: Any) -> dict:
    """``value`` in the task's serializer, as a JSON value (kept in a Redis record: a debounce
    window's call, a pending follow-up's message)."""
    content_type, encoding, body = dumps(value, serializer=task.serializer)
    if isinstance(body, bytes):
        return {"ct": content_type, "enc": encoding, "b64": base64.b64encode(body).decode()}
    return {"ct": content_type, "enc": encoding, "body": body}


def decode(m: dict) -> Any:
    """What :func:`encode` made, decoded (only its own content type is accepted)."""
    data = base64.b64decode(m["b64"]) if "b64" in m else m["body"]
    return loads(data, m["ct"], m["enc"], accept=[m["ct"]])
