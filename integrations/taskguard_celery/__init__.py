"""Celery adapter for taskguard (``guarded_task``, ``GuardedTask``).

Reserved: the adapter is built on the core's public API in its own change.
"""

__all__: list[str] = []
