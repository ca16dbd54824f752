"""Fenced leases in Redis (standalone or Cluster), via the scripts in :mod:`taskguard.scripts`."""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import NoScriptError, OutOfMemoryError, RedisError, ResponseError

from . import scripts
from .clock import Clock, ServerClock
from .errors import ConfigError, LeaseBackendError
from .events import Listener
from .lease import HolderInfo
from .locks import Health, Locks, _ms, check_seconds
from .urls import ACCEPTED, redact_url, scrub

if TYPE_CHECKING:
    from redis.cluster import RedisCluster

log = logging.getLogger("taskguard")

__all__ = ["RedisLocks"]

DEFAULT_FENCE_IDLE_TTL = 7 * 24 * 3600.0
#: Renewals sent in one pipelined round trip by the heartbeat, at most.
RENEW_BATCH = 1000
#: How long a release signal waits for a waiter, seconds. Longer only costs a spurious wake-up.
SIGNAL_TTL = 10.0


def _detail(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, OutOfMemoryError):
        # what refuses at maxmemory (noeviction): every first write that may grow memory -- a new
        # acquisition, a record, a rate -- while the holders' scripts go on (see taskguard.scripts)
        return ("Redis is at maxmemory (OOM) and refuses new writes: no new lease can be taken until memory "
                f"is freed or maxmemory raised; leases already held keep renewing ({text})")
    return text


def _nonce() -> str:
    """A nonce unique to one script call (16 hex digits), recorded with what the call wrote, so a
    client re-send of the call finds it and answers as the call did (see :mod:`taskguard.scripts`)."""
    return secrets.token_hex(8)


def _socket_timeout(client: Any) -> float | None:
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        kwargs = getattr(pool, "connection_kwargs", {})
    else:  # RedisCluster
        kwargs = getattr(getattr(client, "nodes_manager", None), "connection_kwargs", {}) or {}
    value = kwargs.get("socket_timeout")
    return float(value) if value else None


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

    Raises ConfigError for invalid options. No round trip is made at construction.
    """

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
    ) -> None:
        super().__init__(prefix=prefix, renew_fraction=renew_fraction, max_hold=max_hold,
                         shutdown_timeout=shutdown_timeout, listeners=listeners)
        if client is None or not hasattr(client, "evalsha"):
            raise ConfigError("client must be a redis-py client (redis.Redis or redis.cluster.RedisCluster)")
        self.client = client
        self.poll_interval = check_seconds("poll_interval", poll_interval)
        self.fence_idle_ttl = check_seconds("fence_idle_ttl", fence_idle_ttl)
        self._cluster = hasattr(client, "nodes_manager")  # redis.cluster.RedisCluster
        st = _socket_timeout(client)
        # A blocking BLPOP must return before the client's socket timeout fires. When the client
        # does not say (redis-py 8 applies its default elsewhere), slices stay at 1 s.
        self._slice = max(0.01, min(self.poll_interval, st / 2 if st else 1.0))
        self._owns_client = False
        self._server_clock: ServerClock | None = None

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
        **opts: Any,
    ) -> RedisLocks:
        """Build from a ``redis://``, ``rediss://`` or ``unix://`` URL.

        ``connect_timeout`` and ``socket_timeout`` are seconds (float > 0); ``retries`` is how
        many times redis-py retries a command after a connection error or timeout (int >= 0,
        exponential backoff capped at 0.5 s); ``cluster=True`` builds a ``RedisCluster``.
        Remaining keyword options go to :class:`RedisLocks`. No round trip is made.

        Raises ConfigError (the URL is shown with its password masked) for an invalid URL or option.
        """
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        from .urls import check_url

        check_url(url, "url")
        connect_timeout = check_seconds("connect_timeout", connect_timeout)
        socket_timeout = check_seconds("socket_timeout", socket_timeout)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"retries must be an int >= 0, got {retries!r}")
        kwargs: dict[str, Any] = dict(
            socket_connect_timeout=connect_timeout,
            socket_timeout=socket_timeout,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
        )
        if db is not None:
            if isinstance(db, bool) or not isinstance(db, int) or db < 0:
                raise ConfigError(f"db must be an int >= 0, got {db!r}")
            # the URL's own /db would win over a db= keyword in redis-py: put it in the URL
            from urllib.parse import urlsplit

            parts = urlsplit(url)
            if parts.scheme == "unix":
                kwargs["db"] = db
            else:
                url = parts._replace(path=f"/{db}").geturl()
        problem = None
        client: redis.Redis | RedisCluster
        try:
            if cluster:
                from redis.cluster import RedisCluster

                client = RedisCluster.from_url(url, **kwargs)
            else:
                client = redis.Redis.from_url(url, **kwargs)
                pool = client.connection_pool  # a connection object is built without I/O: bad options fail here
                pool.connection_class(**pool.connection_kwargs)
        except (ValueError, TypeError, RedisError) as e:
            problem = f"{type(e).__name__}: {e}"
        if problem is not None:
            raise ConfigError(f"url: cannot build a Redis client from {redact_url(url)} ({ACCEPTED}): "
                              f"{scrub(problem, url)}")
        locks = cls(client, prefix=prefix, **opts)
        locks._owns_client = True
        return locks

    def __repr__(self) -> str:
        return f"<RedisLocks prefix={self.prefix!r}>"

    # -- keys ----------------------------------------------------------------------------------
    def _lease_key(self, key: str) -> str:
        return "{" + self.prefix + ":" + key + "}"

    def _signal_key(self, key: str) -> str:
        return self._lease_key(key) + ":signal"

    def _run(self, op: str, key: str | None, script: scripts.Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            if len(keys) > 1:
                return self._run_retrying_tryagain(script, keys, args)
            return script(self.client, keys, args)
        except RedisError as e:
            raise LeaseBackendError(op, key, _detail(e)) from e
        except BaseException:
            self._drop_idle_pool_connections()
            raise

    def _run_retrying_tryagain(self, script: scripts.Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """A script that declares two keys gets ``TRYAGAIN`` on Redis Cluster while its slot migrates
        and one of them is missing on the source node (see :mod:`taskguard.scripts`): try again,
        with a short backoff, until the client's socket timeout (or 5 s) has passed."""
        deadline = time.monotonic() + (_socket_timeout(self.client) or 5.0)
        pause = 0.01
        while True:
            try:
                return script(self.client, keys, args)
            except RedisError as e:
                if "TRYAGAIN" not in str(e) or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _drop_idle_pool_connections(self) -> None:
        """After a call through ``client.execute_command`` was interrupted by a non-Redis
        exception (a signal handler raising between send and read, e.g. Celery's soft time
        limit): redis-py has already put that connection back in its pool, possibly with the
        reply still to come, where the next command would read it as its own. Disconnect the
        pool's idle connections (they reconnect on use)."""
        try:
            pool = getattr(self.client, "connection_pool", None)
            if pool is not None:
                pools = [pool]
            else:  # Redis Cluster: one pool per node
                pools = [n.redis_connection.connection_pool for n in self.client.get_nodes() if n.redis_connection]
            for p in pools:
                p.disconnect(inuse_connections=False)  # other threads' calls in flight are left alone
        except Exception:  # pragma: no cover - best effort, the original exception matters
            log.debug("could not drop idle connections", exc_info=True)

    # -- primitives ---------------------------------------------------------------------------
    def _done_key(self, key: str, run_id: str) -> str:
        return self._lease_key(key) + ":done:" + run_id

    def _try_acquire(self, key: str, owner: str, ttl: float, holder_json: str, run_id: str | None,
                     wait: float = 0.0, refuse_finished: bool = False, finished_id: str | None = None,
                     markers: bool = True, limit: int = 1) -> tuple[int, int | None, float | None, str | None, int]:
        finished_id = finished_id or run_id
        keys: tuple[str, ...] = (self._lease_key(key),)
        if finished_id is not None and markers and refuse_finished:
            keys += (self._done_key(key, finished_id),)
        wait_ms = _ms(wait + 1.0) if wait > 0 else 0  # the waiting mark outlives the wait by a second
        res = self._run("acquire", key, scripts.ACQUIRE, keys,
                        (owner, _ms(ttl), holder_json, _ms(self.fence_idle_ttl), wait_ms, run_id or "",
                         "1" if refuse_finished else "0", finished_id or "", limit))
        code = int(res[0])
        if code == 1:
            return 1, int(res[1]), None, None, int(res[3])  # (a retried acquire that ran: its expiry may be older)
        if code == 2:
            return 2, None, None, None, 0
        run = res[2].decode() if isinstance(res[2], bytes) else res[2]
        return 0, None, int(res[1]) / 1000.0, (run or None), 0

    def _wait_signal(self, key: str, timeout: float) -> None:
        timeout = max(0.01, min(timeout, self._slice))  # never 0: BLPOP 0 blocks forever
        try:
            self.client.blpop([self._signal_key(key)], timeout=timeout)
        except RedisError as e:
            raise LeaseBackendError("acquire", key, _detail(e)) from e
        except BaseException:
            self._drop_idle_pool_connections()  # a BLPOP reply may still be on its way
            raise

    def _renew_one(self, key: str, owner: str, ttl: float) -> bool:
        return int(self._run("renew", key, scripts.RENEW, (self._lease_key(key),),
                             (owner, _ms(ttl), _ms(self.fence_idle_ttl)))) == 1

    def _renew_many(self, items: Sequence[tuple[str, str, float]]) -> list[Any]:
        """Renewals pipelined, :data:`RENEW_BATCH` per round trip (plus one more only after a
        NOSCRIPT), so 10,000 leases never hold Redis in one long burst. On a Cluster the batches
        are cut per node (:meth:`_pipeline_renew_by_node`)."""
        if len(items) > RENEW_BATCH and not self._cluster:
            out: list[Any] = []
            for i in range(0, len(items), RENEW_BATCH):
                out.extend(self._renew_many(items[i:i + RENEW_BATCH]))
            return out
        if not items:
            return []
        try:
            results = self._pipeline_renew(items, use_eval=False)
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:
                again = self._pipeline_renew([items[i] for i in missing], use_eval=True)
                for i, r in zip(missing, again, strict=True):
                    results[i] = r
        except RedisError as e:
            return [LeaseBackendError("renew", None, _detail(e))] * len(items)
        out = []
        for (key, _, _), r in zip(items, results, strict=True):
            if isinstance(r, Exception):
                out.append(LeaseBackendError("renew", key, _detail(r)))
            else:
                out.append(int(r) == 1)
        return out

    def _pipeline_renew(self, items: Sequence[tuple[str, str, float]], use_eval: bool) -> list[Any]:
        if self._cluster:
            return self._pipeline_renew_by_node(items, use_eval)
        pipe = self.client.pipeline(transaction=False)
        idle = _ms(self.fence_idle_ttl)
        for key, owner, ttl in items:
            queue = scripts.RENEW.queue_eval if use_eval else scripts.RENEW.queue
            queue(pipe, (self._lease_key(key),), (owner, _ms(ttl), idle))
        return list(pipe.execute(raise_on_error=False))

    def _pipeline_renew_by_node(self, items: Sequence[tuple[str, str, float]], use_eval: bool) -> list[Any]:
        """Redis Cluster: one plain pipeline per node that owns the keys' slots (routed by the
        slot map redis-py keeps) and per :data:`RENEW_BATCH` of that node's leases, so a renewal
        round costs one round trip per node, as on one Redis. redis-py's
        ``ClusterPipeline`` would ask the server ``COMMAND GETKEYS`` for every ``EVALSHA`` (a
        movable-keys command to it), one more round trip per lease. A renewal answered ``MOVED``
        or ``ASK`` (a slot moved or moving) is sent again alone through the cluster client, which
        follows the redirection."""
        client = self.client
        by_node: dict[Any, list[int]] = {}
        for i, (key, _, _) in enumerate(items):
            node = client.nodes_manager.get_node_from_slot(client.keyslot(self._lease_key(key)))
            by_node.setdefault(node.name, []).append(i)
        results: list[Any] = [None] * len(items)
        idle = _ms(self.fence_idle_ttl)
        queue = scripts.RENEW.queue_eval if use_eval else scripts.RENEW.queue
        for name, node_idx in by_node.items():
            node = client.get_node(node_name=name)
            conn = node.redis_connection if node is not None else None
            if conn is None:
                conn = client.get_redis_connection(node)
            for start in range(0, len(node_idx), RENEW_BATCH):
                idx = node_idx[start:start + RENEW_BATCH]
                pipe = conn.pipeline(transaction=False)
                for i in idx:
                    key, owner, ttl = items[i]
                    queue(pipe, (self._lease_key(key),), (owner, _ms(ttl), idle))
                try:
                    replies = pipe.execute(raise_on_error=False)
                except RedisError as e:  # this node unreachable: its leases fall back one by one below
                    replies = [e] * len(idx)
                for i, r in zip(idx, replies, strict=True):
                    results[i] = r
        for i, r in enumerate(results):
            if isinstance(r, RedisError) and not isinstance(r, NoScriptError):
                key, owner, ttl = items[i]
                try:  # through the cluster client: it follows MOVED / ASK and refreshes its slot map
                    results[i] = scripts.RENEW(client, (self._lease_key(key),), (owner, _ms(ttl), idle))
                except RedisError as e:
                    results[i] = e
        return results

    def _release_one(self, key: str, owner: str, finished_run: str | None = None,
                     finished_ttl: float | None = None) -> bool:
        keys: tuple[str, ...] = (self._lease_key(key),)
        if finished_run is not None and finished_ttl is not None:
            keys += (self._done_key(key, finished_run),)
        args = (owner, _ms(self.fence_idle_ttl), _ms(finished_ttl or 1.0), _nonce(), finished_run or "")
        return self._signalled(key, int(self._run("release", key, scripts.RELEASE, keys, args)))

    def _mark_queued_one(self, key: str, run_id: str, ttl: float, task: str) -> tuple[bool, str]:
        res = self._run("queue", key, scripts.QUEUE, (self._lease_key(key),),
                        (run_id, _ms(ttl), _ms(self.fence_idle_ttl), task, _nonce()))
        found = res[1].decode() if isinstance(res[1], bytes) else res[1]
        return int(res[0]) == 1, found

    def _clear_queued_one(self, key: str, run_id: str, task: str) -> bool:
        return int(self._run("queue", key, scripts.UNQUEUE, (self._lease_key(key),),
                             (run_id, task, _nonce()))) == 1

    def _completion_key(self, key: str) -> str:
        return self._lease_key(key) + ":once"

    def _release_storing_one(self, key: str, owner: str, finished_run: str, finished_ttl: float | None,
                             record: str, record_ttl: float) -> bool:
        keys: tuple[str, ...] = (self._lease_key(key), self._completion_key(key))
        if finished_run and finished_ttl is not None:
            keys += (self._done_key(key, finished_run),)
        args = (owner, _ms(self.fence_idle_ttl), _ms(finished_ttl or 1.0), _nonce(), finished_run, record,
                _ms(record_ttl))
        return self._signalled(key, int(self._run("release", key, scripts.RELEASE_STORING, keys, args)))

    def _get_completion(self, key: str) -> str | None:
        try:
            raw = self.client.get(self._completion_key(key))
        except RedisError as e:
            raise LeaseBackendError("once", key, _detail(e)) from e
        return raw.decode() if isinstance(raw, bytes) else raw

    def _signalled(self, key: str, code: int) -> bool:
        """After a release that answered 2 (released, someone waits): wake one waiter."""
        if code == 2:
            try:
                self._run("release", key, scripts.SIGNAL, (self._signal_key(key),), (_ms(SIGNAL_TTL),))
            except LeaseBackendError as e:  # the waiter still wakes at its next poll or the lease's expiry
                log.warning("could not signal the waiters of %r: %s", key, e)
        return code >= 1

    def _claim_one(self, key: str, owner: str, new_owner: str, ttl: float, holder_json: str,
                   run_id: str | None = None) -> tuple[bool, int | None, float | None]:
        res = self._run("claim", key, scripts.CLAIM, (self._lease_key(key),),
                        (owner, new_owner, _ms(ttl), holder_json, run_id or "", _ms(self.fence_idle_ttl)))
        if int(res[0]) == 1:
            return True, (int(res[1]) if res[1] is not None else None), None
        pttl = int(res[1])
        return False, None, (pttl / 1000.0 if pttl >= 0 else float(pttl))

    def _release_run(self, key: str, run_id: str) -> bool:
        code = int(self._run("release", key, scripts.RELEASE_WITHOUT_TOKEN, (self._lease_key(key),),
                             (run_id, _nonce())))
        return self._signalled(key, code)

    def _force_release_one(self, key: str) -> bool:
        return self._signalled(key, int(self._run("release", key, scripts.RELEASE_WITHOUT_TOKEN,
                                                  (self._lease_key(key),), ("", _nonce()))))

    def leases(self, pattern: str = "*", count: int = 1000) -> list[HolderInfo]:
        """Held leases whose key matches the glob ``pattern`` (SCAN; at most ``count`` results),
        one entry per holder (a key under a limit may have several, by slot). Never returns
        owner tokens. Raises LeaseBackendError."""
        match = "{" + self.prefix + ":" + pattern + "}"
        out: list[HolderInfo] = []
        try:
            for raw in self.client.scan_iter(match=match, _type="hash", count=500):
                name = raw.decode() if isinstance(raw, bytes) else raw
                key = name[len(self.prefix) + 2:-1]
                out.extend(self._holders_one(key))
                if len(out) >= count:
                    break
        except RedisError as e:
            raise LeaseBackendError("scan", None, _detail(e)) from e
        return sorted(out, key=lambda i: (i.key, i.slot))[:count]

    def _holders_one(self, key: str) -> list[HolderInfo]:
        flat = self._run("holder", key, scripts.HOLDERS, (self._lease_key(key),), ())
        out = []
        for i in range(0, len(flat), 6):
            slot, holder_raw, fence, pttl, since, run = flat[i:i + 6]
            if isinstance(holder_raw, bytes):
                holder_raw = holder_raw.decode()
            try:
                holder = json.loads(holder_raw) if holder_raw else {}
            except ValueError:
                holder = {}
            out.append(HolderInfo(
                key=key,
                holder=holder,
                fencing_token=int(fence) if fence else None,
                ttl=int(pttl) / 1000.0,
                since=int(since) / 1000.0 if since else None,
                run_id=(run.decode() if isinstance(run, bytes) else run) or None,
                slot=int(slot),
            ))
        return out

    def _owns_one(self, key: str, owner: str) -> bool:
        return int(self._run("renew", key, scripts.OWNS, (self._lease_key(key),), (owner,))) != -2

    # -- rates -----------------------------------------------------------------------------------
    def _throttle_one(self, key: str, interval_us: int, tau_us: int, book_us: int,
                      consume: bool = True, shadow: bool = False) -> tuple[int, int, int]:
        # the shadow state (shadow mode's calls) is a key of its own, beside the enforced one
        res = self._run("throttle", key, scripts.THROTTLE, (self._lease_key(key) + (":ts" if shadow else ":t"),),
                        (interval_us, tau_us, book_us, "0" if consume else "1"))
        return int(res[0]), int(res[1]), int(res[2])

    # -- records ---------------------------------------------------------------------------------
    def _put_lease_record_one(self, key: str, owner: str, name: str, value: str, cond: str, expect: str) -> int:
        return int(self._run("record", key, scripts.PUT_LEASE_RECORD, (self._lease_key(key),),
                             (owner, "d:" + name, value, cond, expect)))

    def _get_lease_record(self, key: str, name: str) -> str | None:
        try:
            raw = self.client.hget(self._lease_key(key), "d:" + name)
        except RedisError as e:
            raise LeaseBackendError("record", key, _detail(e)) from e
        return raw.decode() if isinstance(raw, bytes) else raw

    def _record_key(self, key: str, name: str) -> str:
        return self._lease_key(key) + ":r:" + name

    def _put_record(self, key: str, name: str, value: str, ttl: float, cond: str, expect: str) -> bool:
        return int(self._run("record", key, scripts.PUT_RECORD, (self._record_key(key, name),),
                             (value, _ms(ttl), cond, expect))) == 1

    def _get_record(self, key: str, name: str) -> str | None:
        try:
            raw = self.client.get(self._record_key(key, name))
        except RedisError as e:
            raise LeaseBackendError("record", key, _detail(e)) from e
        return raw.decode() if isinstance(raw, bytes) else raw

    def _delete_record(self, key: str, name: str, expect: str) -> bool:
        return int(self._run("record", key, scripts.DELETE_RECORD, (self._record_key(key, name),), (expect,))) == 1

    def _count_record(self, key: str, name: str, by: int, ttl: float | None) -> int:
        k = self._record_key(key, name)
        try:
            if ttl is None:
                return int(self.client.incrby(k, by))
            pipe = self.client.pipeline(transaction=True)
            pipe.incrby(k, by)
            pipe.pexpire(k, _ms(ttl))
            return int(pipe.execute()[0])
        except ResponseError as e:
            if "not an integer" in str(e) or "overflow" in str(e):
                raise self._not_a_counter(key, name) from None
            raise LeaseBackendError("record", key, _detail(e)) from e
        except RedisError as e:
            raise LeaseBackendError("record", key, _detail(e)) from e

    def server_clock(self) -> Clock:
        found = self._server_clock
        if found is None:
            found = self._server_clock = ServerClock(self.server_time, local=self.clock)
        return found

    def server_time(self) -> float:
        """The Redis server's clock (``TIME``): Unix epoch seconds (float). Raises
        LeaseBackendError when Redis fails."""
        try:
            answer = self.client.time()
        except RedisError as e:
            raise LeaseBackendError("time", None, _detail(e)) from e
        if isinstance(answer, dict):  # a cluster may answer per node: any node's clock will do
            answer = next(iter(answer.values()))
        secs, micros = answer
        return int(secs) + int(micros) / 1e6

    # -- health and shutdown -------------------------------------------------------------------
    def check_health(self) -> Health:
        """PING Redis once. Returns :class:`~taskguard.locks.Health`; never raises.

        Starts no background work and touches no lease, so it suits readiness endpoints."""
        started = time.monotonic()
        try:
            self.client.ping()
        except RedisError as e:
            return Health(False, None, _detail(e))
        return Health(True, time.monotonic() - started, "PONG")

    def close(self, timeout: float | None = None) -> None:
        """Release this object's live leases, then close the client if :meth:`from_url` made it."""
        super().close(timeout)
        if self._owns_client:
            try:
                self.client.close()
            except RedisError:  # pragma: no cover
                pass
