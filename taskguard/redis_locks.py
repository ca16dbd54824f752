"""Fenced leases in Redis (standalone or Cluster): :class:`~taskguard.Locks` over a
:class:`~taskguard.redis_backend.RedisBackend`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .clock import Clock, ServerClock
from .errors import ConfigError
from .events import Listener
from .lease import HolderInfo
from .locks import Locks
from .redis_backend import CLUSTER_REPLICAS, DEFAULT_FENCE_IDLE_TTL, RedisBackend, check_replica_timeout
from .redis_client import client_from_url
from .validate import check_prefix, check_replicas, check_seconds

__all__ = ["RedisLocks", "DEFAULT_FENCE_IDLE_TTL"]


class RedisLocks(Locks):
    """Fenced leases stored in Redis.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (redis-py >= 5). Any
            ``decode_responses`` setting works. Its timeouts and retry policy bound every call.
        prefix: prefix of every key (default ``"taskguard"``); keys look like ``{prefix:key}``.
        renew_fraction: heartbeat renews every ``ttl * renew_fraction`` seconds; (0, 0.5].
        poll_interval: longest a waiter sleeps without re-checking, seconds (default 1.0).
            Waiters normally wake on the release signal or at the holder's expiry; this is the
            fallback. Blocking waits are also sliced below the client's ``socket_timeout``.
        fence_idle_ttl: seconds a key's fencing counter is kept after its last acquisition
            (default 7 days). It bounds Redis memory per distinct key; tokens still grow after
            it expires because of the server-clock floor (see :mod:`taskguard.scripts`).
        max_hold: default bound on heartbeat renewal per lease, seconds (``None``: none).
        listeners: callables receiving :class:`~taskguard.events.LeaseEvent` s.
        replicas: the durability option: how many replicas must acknowledge each acquisition
            and claim (``WAIT``, sent with the script on one connection) before a body may start
            on it (``int`` 0-16; default 0, none waited for). When fewer do within
            ``replica_timeout``, the lease is released again and the acquisition answers
            ``reason="unreplicated"`` (a guarded run is skipped, or raises, per ``on_skip``).
            Renewals and releases are not waited for. A guard or a call may set its own.
            Refused (ConfigError) on a Redis Cluster client.
        replica_timeout: the longest wait for those replicas, seconds (float > 0, at most 60 and
            below the client's ``socket_timeout``; default 0.1).

    Raises ConfigError for invalid options. No round trip is made at construction.
    """

    backend: RedisBackend

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "taskguard",
        renew_fraction: float = 1 / 3,
        poll_interval: float = 1.0,
        fence_idle_ttl: float = DEFAULT_FENCE_IDLE_TTL,
        max_hold: float | None = None,
        shutdown_timeout: float = 5.0,
        listeners: Iterable[Listener] = (),
        replicas: int = 0,
        replica_timeout: float = 0.1,
    ) -> None:
        prefix = check_prefix(prefix)
        if client is None or not hasattr(client, "evalsha"):
            raise ConfigError("client must be a redis-py client (redis.Redis or redis.cluster.RedisCluster)")
        self.replicas, self.replica_timeout = check_replicas(replicas, replica_timeout)
        self.client = client
        self.check_durability(self.replicas, self.replica_timeout)
        self.poll_interval = check_seconds("poll_interval", poll_interval)
        self.fence_idle_ttl = check_seconds("fence_idle_ttl", fence_idle_ttl)
        super().__init__(
            RedisBackend(client, prefix, self.poll_interval, self.fence_idle_ttl),
            prefix=prefix,
            renew_fraction=renew_fraction,
            max_hold=max_hold,
            shutdown_timeout=shutdown_timeout,
            listeners=listeners,
        )
        self.backend.replicas, self.backend.replica_timeout = self.replicas, self.replica_timeout
        self._owns_client = False
        self._server_clock: ServerClock | None = None

    def check_durability(self, replicas: int | None, replica_timeout: float | None) -> None:
        """Raise ConfigError when ``replicas`` > 0 cannot be honoured on this client: a Redis
        Cluster client (redis-py sends ``WAIT`` to an arbitrary node), or a ``replica_timeout``
        (``None``: the locks' own) that does not fit in the client's socket timeout
        (:func:`~taskguard.redis_backend.check_replica_timeout`). Called when the locks are made
        and when a guard declared with these locks is; every ``WAIT`` checks again."""
        if not replicas:
            return
        if hasattr(self.client, "nodes_manager"):
            raise ConfigError(CLUSTER_REPLICAS)
        check_replica_timeout(self.client, self.replica_timeout if replica_timeout is None else replica_timeout)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "taskguard",
        db: int | None = None,
        connect_timeout: float = 5.0,
        socket_timeout: float = 5.0,
        retries: int = 1,
        cluster: bool = False,
        sentinel_master: str | None = None,
        sentinel_password: str | None = None,
        **opts: Any,
    ) -> RedisLocks:
        """Build from a ``redis://``, ``rediss://``, ``unix://`` or ``sentinel://`` URL.

        ``connect_timeout`` and ``socket_timeout`` are seconds (float > 0); ``retries`` is how
        many times redis-py retries a command after a connection error or timeout (int >= 0,
        exponential backoff capped at 0.5 s); ``cluster=True`` builds a ``RedisCluster``.
        A ``sentinel://host:26379;sentinel://host2:26379`` URL (kombu's form; the user,
        password and ``/db`` given in it are the primary's) reaches the primary the sentinels
        manage under ``sentinel_master`` (required then) through redis-py's
        ``Sentinel.master_for``; ``sentinel_password`` is the sentinels' own password, if any.
        After a failover the next command goes to the new primary.
        Remaining keyword options go to :class:`RedisLocks`. No round trip is made.

        Raises ConfigError (the URL is shown with its password masked) for an invalid URL or option.
        """
        client = client_from_url(
            url,
            db=db,
            connect_timeout=connect_timeout,
            socket_timeout=socket_timeout,
            retries=retries,
            cluster=cluster,
            sentinel_master=sentinel_master,
            sentinel_password=sentinel_password,
        )
        locks = cls(client, prefix=prefix, **opts)
        locks._owns_client = True
        return locks

    def __repr__(self) -> str:
        return f"<RedisLocks prefix={self.prefix!r}>"

    def leases(self, pattern: str = "*", count: int = 1000) -> list[HolderInfo]:
        """Held leases whose key matches the glob ``pattern`` (SCAN; at most ``count`` results),
        one entry per holder (a key under a limit may have several, by slot). Never returns
        owner tokens. Raises LeaseBackendError."""
        return self.backend.scan_holders(pattern, count)

    def server_clock(self) -> Clock:
        found = self._server_clock
        if found is None:
            found = self._server_clock = ServerClock(self.server_time, local=self.clock)
        return found

    def close(self, timeout: float | None = None) -> None:
        """Release this object's live leases, then close the client if :meth:`from_url` made it."""
        super().close(timeout)
        if self._owns_client:
            self.backend.close()
