"""The storage beneath the policies: a narrow protocol and the typed values it speaks.

:class:`Backend` is what a store of leases offers (one method per atomic step: one Lua script on
Redis, one critical section in memory); the policies over it — leases
(:mod:`taskguard.leasing`), records (:mod:`taskguard.records`), rates
(:mod:`taskguard.throttle`), completions (:mod:`taskguard.completions`) and queue marks
(:mod:`taskguard.queue_marks`) — decide what to ask and what the answer means, and
:class:`~taskguard.Locks` composes them into the public API. Implemented by
:class:`~taskguard.redis_backend.RedisBackend` and
:class:`~taskguard.memory_backend.MemoryBackend`.

Every method raises :class:`~taskguard.LeaseBackendError` when the store fails (the Redis backend
converts redis-py's errors in one place) and nothing else for a failure of the store.
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from .errors import ConfigError, LeaseBackendError
from .lease import HolderInfo

__all__ = [
    "Backend",
    "AcquireRequest",
    "AcquireStatus",
    "AcquireReply",
    "ClaimRequest",
    "ClaimReply",
    "RateVerdict",
    "RateMode",
    "RateReply",
    "QueueReply",
    "RecordCondition",
    "LeaseWrite",
    "RenewItem",
    "Health",
    "not_a_counter",
    "new_nonce",
]


def new_nonce() -> str:
    """A nonce unique to one write (16 hex digits): recorded with what the call wrote, so that a
    client re-send of the call finds it and answers as the call did, and so that the caller can
    undo exactly its own write (a queued mark: :meth:`Backend.clear_queued` ``written_by``)."""
    return secrets.token_hex(8)


@dataclasses.dataclass(slots=True)
class AcquireRequest:
    """One acquisition, as the lease policy asks the backend for it (built once per
    :meth:`~taskguard.Locks.acquire`; every try of a waiting acquire sends the same request).

    Attributes:
        key: the user's lease key (validated).
        owner: the owner token of slot 0; slot ``i``'s is ``owner + slot_suffix(i)``.
        ttl: lease TTL, seconds.
        holder_json: the holder metadata, JSON text.
        run_id: the run asking, or ``None``.
        refuse_finished: refuse (``AcquireStatus.FINISHED``) when ``finished_id`` already finished.
        finished_id: what a finished run is recorded under (``run_id`` or ``run_id#delivery``).
        markers: with ``refuse_finished``, also look for the run's own finished marker.
        limit: holders admitted at once (1: a plain lease).
        replicas: replicas that must acknowledge the acquisition before it counts (0: none
            waited for; see :class:`~taskguard.RedisLocks`).
        replica_timeout: the longest wait for them, seconds.
        queued_mark: ``(task, run id)``: the queued mark of ``task`` on ``key``
            (:meth:`~taskguard.Locks.mark_queued`) cleared in the same atomic step as the
            acquisition, when it names that run id; ``None``: no mark is touched.
    """

    key: str
    owner: str
    ttl: float
    holder_json: str
    run_id: str | None = None
    refuse_finished: bool = False
    finished_id: str | None = None
    markers: bool = True
    limit: int = 1
    replicas: int = 0
    replica_timeout: float = 0.1
    queued_mark: tuple[str, str] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimRequest:
    """One claim of a kept lease (a persisted handle's), as the lease policy asks the backend for it.

    Attributes:
        key: the user's lease key (validated).
        owner: the kept owner token (its slot suffix names the slot).
        new_owner: the owner token that replaces it (same slot suffix).
        ttl: lease TTL from now, seconds.
        holder_json: the holder metadata, JSON text.
        run_id: the run claiming, or ``None``.
        replicas: replicas that must acknowledge the claim before it counts (0: none waited for).
        replica_timeout: the longest wait for them, seconds.
    """

    key: str
    owner: str
    new_owner: str
    ttl: float
    holder_json: str
    run_id: str | None = None
    replicas: int = 0
    replica_timeout: float = 0.1


class AcquireStatus(enum.Enum):
    ACQUIRED = 1
    HELD = 0
    FINISHED = 2  # the run ``finished_id`` already finished under the key (a duplicate)
    UNREPLICATED = 3  # acquired, but fewer replicas than asked acknowledged it in time: given back


class AcquireReply(NamedTuple):
    """The backend's answer to one try. ``fencing_token`` and ``slot`` when acquired;
    ``holder_ttl`` (seconds; the holder whose lease ends first) and ``holder_run`` (another
    execution of the run asking if one holds a slot, else the single holder's run id) when held."""

    status: AcquireStatus
    fencing_token: int | None = None
    holder_ttl: float | None = None
    holder_run: str | None = None
    slot: int = 0


class ClaimReply(NamedTuple):
    """``claimed`` with the kept ``fencing_token``; else ``expired`` (no lease exists) or held by
    another owner with ``holder_ttl`` seconds left; ``unreplicated``: claimed, but fewer replicas
    than asked acknowledged it in time, so it was given back."""

    claimed: bool
    fencing_token: int | None = None
    holder_ttl: float | None = None
    expired: bool = False
    unreplicated: bool = False


class RateVerdict(enum.Enum):
    ALLOWED = 1
    DENIED = 0
    BOOKED = 2  # denied, its turn reserved


class RateReply(NamedTuple):
    verdict: RateVerdict
    wait_us: int
    remaining: int
    paused: bool = False  # a back-off pause is on (the wait lasts at least until it ends)


class RateMode(enum.Enum):
    """What one throttle call does (the script's ARGV[4], :data:`taskguard.scripts.THROTTLE`)."""

    CALL = "0"  # a call: counted (or booked) when it passes
    PEEK = "1"  # check only: the answer a call would get, nothing counted
    TURN = "2"  # a booked turn re-checked: passes, counting nothing, unless a pause is on; then a call
    SETTLE = "3"  # add cost units to TAT without a check (negative: give back), never below now
    PAUSE = "4"  # a back-off: no call passes for ``book`` µs from now


class QueueReply(NamedTuple):
    """``marked``: this run is now the queued one; else ``run_id`` names the queued or running one."""

    marked: bool
    run_id: str


class RecordCondition(str, enum.Enum):
    """When a record write happens (the values are what the scripts read)."""

    ANY = "any"
    ABSENT = "absent"
    EQ = "eq"
    ABSENT_OR_EQ = "absent_or_eq"

    @classmethod
    def of(cls, if_absent: bool, if_value: str | None) -> RecordCondition:
        if if_value is not None:
            return cls.ABSENT_OR_EQ if if_absent else cls.EQ
        return cls.ABSENT if if_absent else cls.ANY


class LeaseWrite(enum.Enum):
    """The outcome of a fenced lease-record write."""

    WRITTEN = 1  # or it already held the value
    REFUSED = 0  # the condition did not hold
    NOT_HELD = -1  # the owner does not hold the lease: nothing written


#: One renewal of a batch: (key, owner token, TTL seconds).
RenewItem = tuple[str, str, float]


class Health:
    """Outcome of :meth:`~taskguard.Locks.check_health`: ``ok`` (bool; also the truthiness),
    ``latency`` (seconds, float, of the probe round trip, or ``None``), ``detail`` (readable,
    never a password)."""

    __slots__ = ("ok", "latency", "detail")

    def __init__(self, ok: bool, latency: float | None, detail: str) -> None:
        self.ok, self.latency, self.detail = ok, latency, detail

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Health(ok={self.ok}, latency={self.latency}, detail={self.detail!r})"


class Backend(Protocol):
    """Atomic steps on leases, records, rates, completions and queue marks. Keys are the user's
    (validated) keys; the backend adds its prefix. Durations are seconds (float)."""

    # -- leases
    def acquire(self, request: AcquireRequest, wait: float) -> AcquireReply:
        """One try. ``wait``: seconds the caller will go on waiting if held (0: it will not)."""

    def wait_signal(self, key: str, timeout: float) -> None:
        """Block up to ``timeout`` seconds or until a release of ``key`` is signalled."""

    def renew(self, key: str, owner: str, ttl: float) -> bool:
        """Extend the lease if ``owner`` holds it; never recreate it."""

    def renew_many(self, items: Sequence[RenewItem]) -> list[bool | LeaseBackendError]:
        """Renew several leases; one outcome each: ``True``, ``False`` or the error (not raised)."""

    def release(self, key: str, owner: str, finished_run: str | None = None, finished_ttl: float | None = None) -> bool:
        """Release if ``owner`` holds it; with ``finished_run``, record that run as finished (and
        with ``finished_ttl``, its own marker for that long)."""

    def release_storing(
        self, key: str, owner: str, finished_run: str, finished_ttl: float | None, record: str, record_ttl: float
    ) -> bool:
        """:meth:`release` and write the key's completion record in one atomic step."""

    def claim(self, request: ClaimRequest) -> ClaimReply:
        """Swap ``request.owner`` for ``request.new_owner`` if ``owner`` holds ``key``; with
        ``replicas`` > 0, give the claim back unless that many replicas acknowledge it within
        ``replica_timeout`` s."""

    def release_run(self, key: str, run_id: str, fencing_token: int | None = None) -> bool: ...

    def force_release(self, key: str) -> bool: ...

    def holders(self, key: str) -> list[HolderInfo]: ...

    def owns(self, key: str, owner: str) -> bool: ...

    # -- records
    def put_lease_record(
        self, key: str, owner: str, name: str, value: str, cond: RecordCondition, expect: str
    ) -> LeaseWrite: ...

    def get_lease_record(self, key: str, name: str) -> str | None: ...

    def put_record(self, key: str, name: str, value: str, ttl: float, cond: RecordCondition, expect: str) -> bool: ...

    def get_record(self, key: str, name: str) -> str | None: ...

    def delete_record(self, key: str, name: str, expect: str) -> bool: ...

    def count_record(self, key: str, name: str, by: int, ttl: float | None) -> int:
        """Raises ConfigError when the record is not an integer or the sum overflows."""

    # -- completions, queue marks, rates
    def get_completion(self, key: str) -> str | None: ...

    def mark_queued(self, key: str, run_id: str, ttl: float, task: str, nonce: str | None = None) -> QueueReply:
        """``nonce`` (:func:`new_nonce`; default a fresh one): the call's own, kept in the mark."""

    def clear_queued(self, key: str, run_id: str, task: str, written_by: str | None = None) -> bool:
        """Clear ``task``'s queued mark of ``key`` if it names ``run_id`` (and, with
        ``written_by``, only the mark written by the :meth:`mark_queued` call of that nonce)."""

    def throttle(
        self,
        key: str,
        interval_us: int,
        tau_us: int,
        book_us: int,
        consume: bool,
        shadow: bool,
        cost: int = 1,
        mode: RateMode = RateMode.CALL,
    ) -> RateReply:
        """One weighted GCRA step (:data:`taskguard.scripts.THROTTLE`, :func:`taskguard.throttle.gcra`):
        ``consume=False`` is mode PEEK whatever ``mode`` says; mode PAUSE takes its length as
        ``book_us``."""

    # -- clock, health, life cycle
    def server_time(self) -> float: ...

    def check_health(self) -> Health: ...

    def close(self) -> None: ...


def not_a_counter(key: str, name: str) -> ConfigError:
    """The error of :meth:`Backend.count_record` for a record that is not a counter."""
    return ConfigError(
        f"record {name!r} of key {key!r} does not hold an integer (or the sum leaves the "
        "signed 64-bit range): count_record counts only records it made"
    )
