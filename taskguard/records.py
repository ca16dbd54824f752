"""The record policy over a :class:`~taskguard.backend.Backend`: small values kept for callers
under a lease key's hash tag (a beat slot's marker, an RQ job's persisted handle, a deferred
copy's nonce), and reading the fenced lease records a holder writes (:meth:`Lease.put_record`)."""

from __future__ import annotations

from .backend import Backend, RecordCondition
from .errors import ConfigError
from .validate import check_key, check_name, check_seconds, check_value

__all__ = ["Records"]


class Records:
    """:meth:`taskguard.Locks.put_record` and its siblings (see there)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def put(
        self, key: str, name: str, value: str, *, ttl: float, if_absent: bool = False, if_value: str | None = None
    ) -> bool:
        if if_value is not None and not isinstance(if_value, str):
            raise ConfigError("if_value must be a str or None")
        return self.backend.put_record(
            check_key(key),
            check_name(name),
            check_value(value),
            check_seconds("ttl", ttl),
            RecordCondition.of(if_absent, if_value),
            if_value or "",
        )

    def get(self, key: str, name: str) -> str | None:
        return self.backend.get_record(check_key(key), check_name(name))

    def delete(self, key: str, name: str, *, if_value: str | None = None) -> bool:
        return self.backend.delete_record(check_key(key), check_name(name), if_value or "")

    def count(self, key: str, name: str, *, by: int = 1, ttl: float | None = None) -> int:
        if isinstance(by, bool) or not isinstance(by, int):
            raise ConfigError("by must be an int")
        return self.backend.count_record(
            check_key(key), check_name(name), by, None if ttl is None else check_seconds("ttl", ttl)
        )

    def get_lease_record(self, key: str, name: str) -> str | None:
        return self.backend.get_lease_record(check_key(key), check_name(name))
