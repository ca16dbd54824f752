"""Exceptions raised by taskguard.

Every exception keeps the values it was built from in ``self.args`` and rebuilds from them
(``type(e)(*e.args)``), so it survives pickling and a Celery result backend's exception
round trip. None of them ever carries an owner token.
"""

from __future__ import annotations

from typing import cast

from .skipped import Skipped

__all__ = [
    "TaskguardError",
    "ConfigError",
    "LeaseBackendError",
    "Unreplicated",
    "LeaseLost",
    "TaskSkipped",
    "IdempotencyConflict",
    "RateLimited",
]


class TaskguardError(Exception):
    """Base class of every error taskguard raises."""


class ConfigError(TaskguardError, ValueError):
    """Invalid configuration: an option, an environment variable or a task declaration.

    ``ConfigError(message)``. The message names the setting and the accepted form and never
    contains a password taken from a URL.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __str__(self) -> str:
        return str(self.args[0])


class LeaseBackendError(TaskguardError):
    """Redis could not be reached or failed while running a lease operation.

    ``LeaseBackendError(operation, key, detail)``: ``operation`` is ``"acquire"``, ``"renew"``,
    ``"release"``, ``"claim"``, ``"holder"``, ``"health"`` or ``"time"`` (reading the server
    clock); ``key`` is the user's lease key (or ``None``); ``detail`` is the redis-py error type and
    message. The redis-py exception is kept as ``__cause__`` (it does not survive pickling).

    This is never a "lease is held" answer: callers must not treat it as a skip.
    """

    def __init__(self, operation: str, key: str | None, detail: str) -> None:
        super().__init__(operation, key, detail)

    @property
    def operation(self) -> str:
        return cast("str", self.args[0])

    @property
    def key(self) -> str | None:
        return cast("str | None", self.args[1])

    def __str__(self) -> str:
        op, key, detail = self.args
        where = f" of lease {key!r}" if key is not None else ""
        return f"Redis failed during {op}{where}: {detail}"


class Unreplicated(LeaseBackendError):
    """A write reached the primary, but fewer replicas than asked acknowledged it within
    ``replica_timeout`` (the durability option, ``replicas=``; Redis ``WAIT``,
    https://redis.io/docs/latest/commands/wait/). Raised by a lease record written with the option
    (:meth:`taskguard.Lease.put_record`; beat's and ``rq-cron``'s slot claims are such records):
    the write stays on the primary, where a failover may lose it. Acquisitions and claims do not
    raise it: they answer ``reason="unreplicated"`` and give the lease back.

    ``Unreplicated(operation, key, detail)``, as :class:`LeaseBackendError`, whose handlers it
    reaches; Redis itself answered.
    """

    def __str__(self) -> str:
        op, key, detail = self.args
        where = f" of lease {key!r}" if key is not None else ""
        return f"not replicated in time during {op}{where}: {detail}"


class LeaseLost(TaskguardError):
    """The lease is no longer held by this owner (expired, taken over, or released by force).

    ``LeaseLost(key, reason)``; ``reason`` is a short readable phrase.
    """

    def __init__(self, key: str, reason: str = "lease no longer held") -> None:
        super().__init__(key, reason)

    @property
    def key(self) -> str:
        return cast("str", self.args[0])

    @property
    def reason(self) -> str:
        return cast("str", self.args[1])

    def __str__(self) -> str:
        return f"lease {self.args[0]!r} lost: {self.args[1]}"


class IdempotencyConflict(TaskguardError):
    """A ``once=True`` call found its key completed by a call with another fingerprint: the same
    business key was used for different work (e.g. one invoice charged with two amounts).

    ``IdempotencyConflict(key, task=None)``: plain values only (picklable, JSON-safe); it names
    the key, never the arguments' values.
    """

    def __init__(self, key: str, task: str | None = None) -> None:
        super().__init__(key, task)

    @property
    def key(self) -> str:
        return cast("str", self.args[0])

    @property
    def task(self) -> str | None:
        return cast("str | None", self.args[1])

    def __str__(self) -> str:
        who = f"{self.args[1]}: " if self.args[1] else ""
        return (
            f"{who}key {self.args[0]!r} was already completed by a call with other arguments "
            f"(another fingerprint); the stored value is not returned"
        )


class RateLimited(TaskguardError):
    """Raised by a guarded body after an upstream answered ``429 Too Many Requests``: the rate is
    paused cluster-wide and this run deferred past the pause.

    ``RateLimited(retry_after, key=None)``: ``retry_after`` seconds (float > 0; the upstream's
    ``Retry-After``) during which no worker admits a call on the rate key
    (:meth:`taskguard.Locks.back_off`, on the Redis server's clock); ``key`` the rate key to
    pause (default: the task's ``rate_key`` as rendered for this run). A guarded task defers
    the run past the pause without consuming Celery's ``max_retries`` or RQ's ``Retry`` (reason
    ``"backoff"``), also under Celery's ``autoretry_for=(Exception,)``. A ``retry_after`` that is
    not a positive number of seconds makes the run fail with ConfigError. Plain values only
    (picklable, JSON-safe).
    """

    def __init__(self, retry_after: float, key: str | None = None) -> None:
        super().__init__(retry_after, key)

    @property
    def retry_after(self) -> float:
        return cast("float", self.args[0])

    @property
    def key(self) -> str | None:
        return cast("str | None", self.args[1])

    def __str__(self) -> str:
        where = f" {self.args[1]!r}" if self.args[1] is not None else ""
        return f"upstream rate limit{where}: retry after {self.args[0]!r}s"


class TaskSkipped(TaskguardError):
    """Raised instead of returning a :class:`~taskguard.Skipped` value (``on_skip="raise"``).

    ``TaskSkipped(key, reason, task=None, holder_ttl=None, follow_up=None)``: plain values only,
    so the error rebuilds through a JSON result backend (one stored by an earlier release, with
    four values, too). :attr:`skipped` gives the equivalent ``Skipped``.
    """

    def __init__(
        self,
        key: str,
        reason: str,
        task: str | None = None,
        holder_ttl: float | None = None,
        follow_up: str | None = None,
    ) -> None:
        if follow_up is None:  # four values, as earlier releases stored it
            super().__init__(key, reason, task, holder_ttl)
        else:
            super().__init__(key, reason, task, holder_ttl, follow_up)

    @property
    def key(self) -> str:
        return cast("str", self.args[0])

    @property
    def reason(self) -> str:
        return cast("str", self.args[1])

    @property
    def skipped(self) -> Skipped:
        key, reason, task, ttl, *rest = self.args
        return Skipped(key=key, reason=reason, task=task, holder_ttl=ttl, follow_up=rest[0] if rest else None)

    def __str__(self) -> str:
        key, reason, task, ttl, *_ = self.args
        who = f"{task} " if task else ""
        left = f", holder's lease has {ttl:.1f}s left" if ttl is not None else ""
        return f"{who}skipped: lease {key!r} {reason}{left}"
