"""The completion records of ``once=True`` over a :class:`~taskguard.backend.Backend`: the value
of a key's first successful run, written atomically with its lease's release and read by later
runs of the key. What a record holds (fingerprint, value) is :mod:`taskguard.once`'s business."""

from __future__ import annotations

from .backend import Backend
from .lease import Lease
from .leasing import Leases

__all__ = ["Completions"]


class Completions:
    """Reading and storing completion records (``locks.completions``)."""

    def __init__(self, backend: Backend, leases: Leases) -> None:
        self.backend = backend
        self.leases = leases

    def get(self, key: str) -> str | None:
        """The completion record of ``key`` (``str``), or ``None``. Raises LeaseBackendError."""
        return self.backend.get_completion(key)

    def store(self, lease: Lease, record: str, ttl: float, finished_ttl: float | None = None) -> bool:
        """Release ``lease`` as finished and store ``record`` for ``ttl`` seconds, in one atomic step
        (a record already there stays). Returns what :meth:`Lease.release` returns."""
        return self.leases.release(lease, finished=True, finished_ttl=finished_ttl, store=(record, ttl))
