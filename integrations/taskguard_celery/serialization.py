"""How a ``Skipped`` result travels through Celery's result serializers.

* ``json`` (Celery's default): ``Skipped`` is registered with kombu's JSON encoder
  (``kombu.utils.json.register_type``) under the marker ``taskguard.skipped``, so
  ``AsyncResult.get()`` returns a ``Skipped``.
* ``pickle``: natively.
* anything else (msgpack, yaml, ...): the task returns the tagged-dict form
  (:meth:`Skipped.to_dict`), which :func:`taskguard.is_skipped` accepts.
"""

from __future__ import annotations

from typing import Any

from kombu.utils.json import register_type

from taskguard import Skipped

__all__ = ["MARKER", "result_value"]

MARKER = "taskguard.skipped"
NATIVE = ("json", "application/json", "pickle", "application/x-python-serialize")

register_type(Skipped, MARKER, lambda s: s.to_dict(), Skipped.from_dict)


def result_value(skipped: Skipped, task: Any) -> Any:
    """What a skipped run returns, given the serializer its result backend uses."""
    serializer = getattr(getattr(task, "backend", None), "serializer", None) or task.app.conf.result_serializer
    return skipped if serializer in NATIVE else skipped.to_dict()
