"""The :class:`~taskguard.backend.Backend` in Redis (standalone or Cluster): the scripts of
:mod:`taskguard.scripts`, sent through the client's own ``execute_command``.

Every redis-py error becomes a :class:`~taskguard.LeaseBackendError` here, in :meth:`RedisBackend._call`
(and, for the per-lease outcomes of a pipelined renewal, :func:`backend_error`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis import connection as redis_connection
from redis.exceptions import NoScriptError, OutOfMemoryError, RedisError, ResponseError

from . import scripts
from .backend import (
    AcquireReply,
    AcquireRequest,
    AcquireStatus,
    ClaimReply,
    ClaimRequest,
    Health,
    LeaseWrite,
    QueueReply,
    RateMode,
    RateReply,
    RateVerdict,
    RecordCondition,
    RenewItem,
    new_nonce,
    not_a_counter,
)
from .errors import ConfigError, LeaseBackendError, TaskguardError, Unreplicated
from .lease import HolderInfo, slot_suffix
from .validate import WAIT_MARGIN, replica_timeout_fits

__all__ = ["RedisBackend", "backend_error", "DEFAULT_FENCE_IDLE_TTL", "RENEW_BATCH", "SIGNAL_TTL"]

log = logging.getLogger("taskguard")
R = TypeVar("R")

DEFAULT_FENCE_IDLE_TTL = 7 * 24 * 3600.0
#: Renewals sent in one pipelined round trip by the heartbeat, at most.
RENEW_BATCH = 1000
#: How long a release signal waits for a waiter, seconds. Longer only costs a spurious wake-up.
SIGNAL_TTL = 10.0

#: What a replica option on a Redis Cluster client is refused with.
CLUSTER_REPLICAS = (
    "replicas > 0 needs a standalone or Sentinel-managed Redis: redis-py's RedisCluster sends WAIT to "
    "an arbitrary node, not the one that took the write"
)

_ACQUIRE_STATUS = {1: AcquireStatus.ACQUIRED, 0: AcquireStatus.HELD, 2: AcquireStatus.FINISHED}
_RATE_VERDICT = {1: RateVerdict.ALLOWED, 0: RateVerdict.DENIED, 2: RateVerdict.BOOKED}
_LEASE_WRITE = {1: LeaseWrite.WRITTEN, 0: LeaseWrite.REFUSED, -1: LeaseWrite.NOT_HELD}


def ms(seconds: float) -> int:
    """Seconds as the whole milliseconds the scripts take (at least 1, rounded up)."""
    return max(1, math.ceil(seconds * 1000))


def _detail(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, OutOfMemoryError):
        # what refuses at maxmemory (noeviction): every first write that may grow memory -- a new
        # acquisition, a record, a rate -- while the holders' scripts go on (see taskguard.scripts)
        return (
            "Redis is at maxmemory (OOM) and refuses new writes: no new lease can be taken until memory "
            f"is freed or maxmemory raised; leases already held keep renewing ({text})"
        )
    return text


def backend_error(op: str, key: str | None, err: BaseException) -> LeaseBackendError:
    """The :class:`~taskguard.LeaseBackendError` of a redis-py error (its cause kept by the caller)."""
    return LeaseBackendError(op, key, _detail(err))


def _nonce() -> str:
    """A nonce unique to one script call, recorded with what the call wrote, so a client re-send
    of the call finds it and answers as the call did (see :mod:`taskguard.scripts`)."""
    return new_nonce()


def _text(raw: Any) -> Any:
    return raw.decode() if isinstance(raw, bytes) else raw


def _text_or_none(raw: Any) -> str | None:
    return None if raw is None else str(_text(raw))


def socket_timeout_of(client: Any) -> float | None:
    """The client's ``socket_timeout`` in seconds, or ``None`` when its reads never time out. A
    client made without one (``redis.Redis.from_url(url)``) has redis-py's own default:
    ``redis.connection.DEFAULT_SOCKET_TIMEOUT`` (5 s) in redis-py 8, which its connections apply
    without naming it in the pool's ``connection_kwargs``; none in redis-py 5-7."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        kwargs = getattr(pool, "connection_kwargs", {})
    else:  # RedisCluster
        kwargs = getattr(getattr(client, "nodes_manager", None), "connection_kwargs", {}) or {}
    value = (
        kwargs["socket_timeout"]
        if "socket_timeout" in kwargs
        else getattr(redis_connection, "DEFAULT_SOCKET_TIMEOUT", None)
    )
    return float(value) if value else None


def check_replica_timeout(client: Any, replica_timeout: float) -> None:
    """Raise ConfigError unless ``replica_timeout`` (seconds) fits in ``client``'s socket timeout
    (:func:`~taskguard.validate.replica_timeout_fits`): ``WAIT`` blocks the connection that long,
    and a socket timeout firing first would turn an unreplicated lease into a Redis error (and
    leave the lease held to its TTL)."""
    st = socket_timeout_of(client)
    if st is not None and not replica_timeout_fits(replica_timeout, st):
        raise ConfigError(
            f"replica_timeout ({replica_timeout} s) must be below the client's socket_timeout ({st} s) by at least "
            f"{WAIT_MARGIN} s: WAIT blocks that long, and Redis ends it only on its next event-loop tick"
        )


class RedisBackend:
    """Leases, records, rates, completions and queue marks in Redis.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster``.
        prefix: the key prefix (validated by the caller); keys look like ``{prefix:key}``.
        poll_interval: longest a waiter blocks without re-checking, seconds.
        fence_idle_ttl: seconds a key's fencing counter is kept after its last acquisition.
    """

    #: The locks' durability option (set by :class:`~taskguard.RedisLocks`): what lease records
    #: (:meth:`put_lease_record`) wait for. Acquisitions and claims carry their own.
    replicas: int = 0
    replica_timeout: float = 0.1

    def __init__(self, client: Any, prefix: str, poll_interval: float, fence_idle_ttl: float) -> None:
        self.client = client
        self.prefix = prefix
        self.fence_idle_ttl = fence_idle_ttl
        self._idle_ms = ms(fence_idle_ttl)
        self.cluster = hasattr(client, "nodes_manager")  # redis.cluster.RedisCluster
        st = socket_timeout_of(client)
        #: Longest blocking wait, seconds: a BLPOP must return before the client's socket timeout
        #: fires. When the client does not say (redis-py 8 applies its default elsewhere), 1 s.
        self.slice = max(0.01, min(poll_interval, st / 2 if st else 1.0))

    # -- keys ----------------------------------------------------------------------------------
    def lease_key(self, key: str) -> str:
        """The Redis key of ``key``'s lease (a hash with its holders and fences)."""
        return "{" + self.prefix + ":" + key + "}"

    def signal_key(self, key: str) -> str:
        return self.lease_key(key) + ":signal"

    def done_key(self, key: str, run_id: str) -> str:
        return self.lease_key(key) + ":done:" + run_id

    def completion_key(self, key: str) -> str:
        return self.lease_key(key) + ":once"

    def record_key(self, key: str, name: str) -> str:
        return self.lease_key(key) + ":r:" + name

    # -- the one place redis-py errors become LeaseBackendError ------------------------------------
    def _call(self, op: str, key: str | None, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        try:
            return fn(*args, **kwargs)
        except RedisError as e:
            raise backend_error(op, key, e) from e
        except TaskguardError:
            raise
        except BaseException:
            self._drop_idle_pool_connections()
            raise

    def _run(self, op: str, key: str | None, script: scripts.Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if len(keys) > 1:
            return self._call(op, key, self._run_retrying_tryagain, script, keys, args)
        return self._call(op, key, script, self.client, keys, args)

    def _run_retrying_tryagain(self, script: scripts.Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """A script that declares two keys gets ``TRYAGAIN`` on Redis Cluster while its slot migrates
        and one of them is missing on the source node (see :mod:`taskguard.scripts`): try again,
        with a short backoff, until the client's socket timeout (or 5 s) has passed."""
        deadline = time.monotonic() + (socket_timeout_of(self.client) or 5.0)
        pause = 0.01
        while True:
            try:
                return script(self.client, keys, args)
            except RedisError as e:
                if "TRYAGAIN" not in str(e) or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _run_waiting(
        self,
        op: str,
        key: str,
        script: scripts.Script,
        keys: Sequence[str],
        args: Sequence[Any],
        replicas: int,
        timeout: float,
    ) -> tuple[Any, int]:
        """``script`` and then ``WAIT replicas timeout`` in one non-transactional pipeline, so both
        go down one connection: ``WAIT`` counts the replicas that acknowledged the writes of *its
        own* connection (a ``WAIT`` sent on another pooled connection may answer at once, and
        inside ``MULTI`` it never waits). Returns the script's reply and how many replicas
        acknowledged. Raises ConfigError on a Redis Cluster client, LeaseBackendError when Redis fails."""
        if self.cluster:
            raise ConfigError(CLUSTER_REPLICAS)
        check_replica_timeout(self.client, timeout)  # (one given per call or per guard, too)

        def send(use_eval: bool) -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            (script.queue_eval if use_eval else script.queue)(pipe, keys, args)
            pipe.execute_command("WAIT", replicas, ms(timeout))
            return list(pipe.execute(raise_on_error=False))

        def run() -> tuple[Any, int]:
            replies = send(False)
            if isinstance(replies[0], NoScriptError):
                replies = send(True)
            for r in replies:
                if isinstance(r, Exception):
                    raise r
            return replies[0], int(replies[1])

        return self._call(op, key, run)

    def _give_back(self, key: str, owner: str, acked: int, wanted: int) -> None:
        """Release a lease that fewer than ``wanted`` replicas acknowledged in time (fenced by its
        owner token). When the release fails the lease expires by its TTL; the caller still
        reports it as not acquired."""
        log.warning(
            "lease %r was acknowledged by %d of the %d replicas asked for in time: given back", key, acked, wanted
        )
        try:
            self.release(key, owner)
        except LeaseBackendError as e:
            log.warning("could not give back the unreplicated lease %r (it expires by its TTL): %s", key, e)

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

    # -- leases --------------------------------------------------------------------------------
    def acquire(self, request: AcquireRequest, wait: float) -> AcquireReply:
        finished_id = request.finished_id or request.run_id
        keys: tuple[str, ...] = (self.lease_key(request.key),)
        if finished_id is not None and request.markers and request.refuse_finished:
            keys += (self.done_key(request.key, finished_id),)
        wait_ms = ms(wait + 1.0) if wait > 0 else 0  # the waiting mark outlives the wait by a second
        args = (
            request.owner,
            ms(request.ttl),
            request.holder_json,
            self._idle_ms,
            wait_ms,
            request.run_id or "",
            "1" if request.refuse_finished else "0",
            finished_id or "",
            request.limit,
            *(request.queued_mark or ()),
        )
        acked = None
        if request.replicas > 0:
            res, acked = self._run_waiting(
                "acquire", request.key, scripts.ACQUIRE, keys, args, request.replicas, request.replica_timeout
            )
        else:
            res = self._run("acquire", request.key, scripts.ACQUIRE, keys, args)
        status = _ACQUIRE_STATUS[int(res[0])]
        if status is AcquireStatus.ACQUIRED:  # (a retried acquire that ran: its expiry may be older)
            slot = int(res[3])
            if acked is not None and acked < request.replicas:
                self._give_back(request.key, request.owner + slot_suffix(slot), acked, request.replicas)
                return AcquireReply(AcquireStatus.UNREPLICATED, slot=slot)
            return AcquireReply(status, int(res[1]), slot=slot)
        if status is AcquireStatus.FINISHED:
            return AcquireReply(status)
        return AcquireReply(status, None, int(res[1]) / 1000.0, _text(res[2]) or None)

    def wait_signal(self, key: str, timeout: float) -> None:
        timeout = max(0.01, min(timeout, self.slice))  # never 0: BLPOP 0 blocks forever
        self._call("acquire", key, self.client.blpop, [self.signal_key(key)], timeout=timeout)

    def renew(self, key: str, owner: str, ttl: float) -> bool:
        return int(self._run("renew", key, scripts.RENEW, (self.lease_key(key),), (owner, ms(ttl), self._idle_ms))) == 1

    def renew_many(self, items: Sequence[RenewItem]) -> list[Any]:
        """Renewals pipelined, :data:`RENEW_BATCH` per round trip (plus one more only after a
        NOSCRIPT), so 10,000 leases never hold Redis in one long burst. On a Cluster the batches
        are cut per node (:meth:`_pipeline_renew_by_node`)."""
        if len(items) > RENEW_BATCH and not self.cluster:
            out: list[Any] = []
            for i in range(0, len(items), RENEW_BATCH):
                out.extend(self.renew_many(items[i : i + RENEW_BATCH]))
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
            return [backend_error("renew", None, e)] * len(items)
        out = []
        for (key, _, _), r in zip(items, results, strict=True):
            out.append(backend_error("renew", key, r) if isinstance(r, Exception) else int(r) == 1)
        return out

    def _pipeline_renew(self, items: Sequence[RenewItem], use_eval: bool) -> list[Any]:
        if self.cluster:
            return self._pipeline_renew_by_node(items, use_eval)
        pipe = self.client.pipeline(transaction=False)
        idle = self._idle_ms
        queue = scripts.RENEW.queue_eval if use_eval else scripts.RENEW.queue
        for key, owner, ttl in items:
            queue(pipe, (self.lease_key(key),), (owner, ms(ttl), idle))
        return list(pipe.execute(raise_on_error=False))

    def _pipeline_renew_by_node(self, items: Sequence[RenewItem], use_eval: bool) -> list[Any]:
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
            node = client.nodes_manager.get_node_from_slot(client.keyslot(self.lease_key(key)))
            by_node.setdefault(node.name, []).append(i)
        results: list[Any] = [None] * len(items)
        idle = self._idle_ms
        queue = scripts.RENEW.queue_eval if use_eval else scripts.RENEW.queue
        for name, node_idx in by_node.items():
            node = client.get_node(node_name=name)
            conn = node.redis_connection if node is not None else None
            if conn is None:
                conn = client.get_redis_connection(node)
            for start in range(0, len(node_idx), RENEW_BATCH):
                idx = node_idx[start : start + RENEW_BATCH]
                pipe = conn.pipeline(transaction=False)
                for i in idx:
                    key, owner, ttl = items[i]
                    queue(pipe, (self.lease_key(key),), (owner, ms(ttl), idle))
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
                    results[i] = scripts.RENEW(client, (self.lease_key(key),), (owner, ms(ttl), idle))
                except RedisError as e:
                    results[i] = e
        return results

    def release(self, key: str, owner: str, finished_run: str | None = None, finished_ttl: float | None = None) -> bool:
        keys: tuple[str, ...] = (self.lease_key(key),)
        if finished_run is not None and finished_ttl is not None:
            keys += (self.done_key(key, finished_run),)
        args = (owner, self._idle_ms, ms(finished_ttl or 1.0), _nonce(), finished_run or "")
        return self._signalled(key, int(self._run("release", key, scripts.RELEASE, keys, args)))

    def release_storing(
        self, key: str, owner: str, finished_run: str, finished_ttl: float | None, record: str, record_ttl: float
    ) -> bool:
        keys: tuple[str, ...] = (self.lease_key(key), self.completion_key(key))
        if finished_run and finished_ttl is not None:
            keys += (self.done_key(key, finished_run),)
        args = (owner, self._idle_ms, ms(finished_ttl or 1.0), _nonce(), finished_run, record, ms(record_ttl))
        return self._signalled(key, int(self._run("release", key, scripts.RELEASE_STORING, keys, args)))

    def _signalled(self, key: str, code: int) -> bool:
        """After a release that answered 2 (released, someone waits): wake one waiter."""
        if code == 2:
            try:
                self._run("release", key, scripts.SIGNAL, (self.signal_key(key),), (ms(SIGNAL_TTL),))
            except LeaseBackendError as e:  # the waiter still wakes at its next poll or the lease's expiry
                log.warning("could not signal the waiters of %r: %s", key, e)
        return code >= 1

    def claim(self, request: ClaimRequest) -> ClaimReply:
        r = request
        key, replicas = r.key, r.replicas
        keys = (self.lease_key(key),)
        args = (r.owner, r.new_owner, ms(r.ttl), r.holder_json, r.run_id or "", self._idle_ms)
        if replicas > 0:
            res, acked = self._run_waiting("claim", key, scripts.CLAIM, keys, args, replicas, r.replica_timeout)
            if int(res[0]) == 1 and acked < replicas:
                self._give_back(key, r.new_owner, acked, replicas)
                return ClaimReply(False, unreplicated=True)
        else:
            res = self._run("claim", key, scripts.CLAIM, keys, args)
        if int(res[0]) == 1:
            return ClaimReply(True, int(res[1]) if res[1] is not None else None)
        pttl = int(res[1])
        if pttl == -2:
            return ClaimReply(False, expired=True)
        return ClaimReply(False, None, pttl / 1000.0 if pttl >= 0 else float(pttl))

    def release_run(self, key: str, run_id: str, fencing_token: int | None = None) -> bool:
        fence = "" if fencing_token is None else str(fencing_token)
        args = (run_id, _nonce(), fence)
        return self._signalled(
            key, int(self._run("release", key, scripts.RELEASE_WITHOUT_TOKEN, (self.lease_key(key),), args))
        )

    def force_release(self, key: str) -> bool:
        return self._signalled(
            key,
            int(self._run("release", key, scripts.RELEASE_WITHOUT_TOKEN, (self.lease_key(key),), ("", _nonce(), ""))),
        )

    def holders(self, key: str) -> list[HolderInfo]:
        flat = self._run("holder", key, scripts.HOLDERS, (self.lease_key(key),), ())
        out = []
        for i in range(0, len(flat), 6):
            slot, holder_raw, fence, pttl, since, run = flat[i : i + 6]
            holder_raw = _text(holder_raw)
            try:
                holder = json.loads(holder_raw) if holder_raw else {}
            except ValueError:
                holder = {}
            out.append(
                HolderInfo(
                    key=key,
                    holder=holder,
                    fencing_token=int(fence) if fence else None,
                    ttl=int(pttl) / 1000.0,
                    since=int(since) / 1000.0 if since else None,
                    run_id=_text(run) or None,
                    slot=int(slot),
                )
            )
        return out

    def scan_holders(self, pattern: str, count: int) -> list[HolderInfo]:
        """Holders of the keys matching the glob ``pattern`` (SCAN), at most ``count``, by key and slot."""
        match = "{" + self.prefix + ":" + pattern + "}"

        def scan() -> list[HolderInfo]:
            out: list[HolderInfo] = []
            for raw in self.client.scan_iter(match=match, _type="hash", count=500):
                out.extend(self.holders(_text(raw)[len(self.prefix) + 2 : -1]))
                if len(out) >= count:
                    break
            return out

        return sorted(self._call("scan", None, scan), key=lambda i: (i.key, i.slot))[:count]

    def owns(self, key: str, owner: str) -> bool:
        return int(self._run("renew", key, scripts.OWNS, (self.lease_key(key),), (owner,))) != -2

    # -- records ---------------------------------------------------------------------------------
    def put_lease_record(
        self, key: str, owner: str, name: str, value: str, cond: RecordCondition, expect: str
    ) -> LeaseWrite:
        """With :attr:`replicas` > 0 (the locks' durability option) the write is ``WAIT`` ed for
        like an acquisition (beat's and ``rq-cron``'s slot claims are lease records: a slot is
        published only once its claim is on the replicas); a write fewer replicas acknowledged
        in time raises :class:`~taskguard.Unreplicated` (it stays written on the primary)."""
        keys, args = (self.lease_key(key),), (owner, "d:" + name, value, cond.value, expect)
        if not self.replicas:
            return _LEASE_WRITE[int(self._run("record", key, scripts.PUT_LEASE_RECORD, keys, args))]
        res, acked = self._run_waiting(
            "record", key, scripts.PUT_LEASE_RECORD, keys, args, self.replicas, self.replica_timeout
        )
        outcome = _LEASE_WRITE[int(res)]
        if outcome is LeaseWrite.WRITTEN and acked < self.replicas:
            raise Unreplicated(
                "record",
                key,
                f"lease record {name!r} written but acknowledged by {acked} of the {self.replicas} replicas "
                f"asked for within {self.replica_timeout} s: a failover may lose it",
            )
        return outcome

    def get_lease_record(self, key: str, name: str) -> str | None:
        return _text_or_none(self._call("record", key, self.client.hget, self.lease_key(key), "d:" + name))

    def put_record(self, key: str, name: str, value: str, ttl: float, cond: RecordCondition, expect: str) -> bool:
        return (
            int(
                self._run(
                    "record",
                    key,
                    scripts.PUT_RECORD,
                    (self.record_key(key, name),),
                    (value, ms(ttl), cond.value, expect),
                )
            )
            == 1
        )

    def get_record(self, key: str, name: str) -> str | None:
        return _text_or_none(self._call("record", key, self.client.get, self.record_key(key, name)))

    def delete_record(self, key: str, name: str, expect: str) -> bool:
        return int(self._run("record", key, scripts.DELETE_RECORD, (self.record_key(key, name),), (expect,))) == 1

    def count_record(self, key: str, name: str, by: int, ttl: float | None) -> int:
        k = self.record_key(key, name)

        def count() -> int:
            try:
                if ttl is None:
                    return int(self.client.incrby(k, by))
                pipe = self.client.pipeline(transaction=True)
                pipe.incrby(k, by)
                pipe.pexpire(k, ms(ttl))
                return int(pipe.execute()[0])
            except ResponseError as e:
                if "not an integer" in str(e) or "overflow" in str(e):
                    raise not_a_counter(key, name) from None
                raise

        return self._call("record", key, count)

    # -- completions, queue marks, rates -----------------------------------------------------------
    def get_completion(self, key: str) -> str | None:
        return _text_or_none(self._call("once", key, self.client.get, self.completion_key(key)))

    def mark_queued(self, key: str, run_id: str, ttl: float, task: str, nonce: str | None = None) -> QueueReply:
        args = (run_id, ms(ttl), self._idle_ms, task, nonce or _nonce())
        res = self._run("queue", key, scripts.QUEUE, (self.lease_key(key),), args)
        return QueueReply(int(res[0]) == 1, _text(res[1]))

    def clear_queued(self, key: str, run_id: str, task: str, written_by: str | None = None) -> bool:
        args = (run_id, task, _nonce(), written_by or "")
        return int(self._run("queue", key, scripts.UNQUEUE, (self.lease_key(key),), args)) == 1

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
        # the shadow state (shadow mode's calls) is a key of its own, beside the enforced one
        code = RateMode.PEEK.value if not consume else mode.value
        args: tuple[Any, ...] = (
            (interval_us, tau_us, book_us, code) if cost == 1 else (interval_us, tau_us, book_us, code, cost)
        )
        res = self._run("throttle", key, scripts.THROTTLE, (self.lease_key(key) + (":ts" if shadow else ":t"),), args)
        return RateReply(_RATE_VERDICT[int(res[0])], int(res[1]), int(res[2]), len(res) > 3 and int(res[3]) == 1)

    # -- clock, health, life cycle -------------------------------------------------------------------
    def server_time(self) -> float:
        """The Redis server's clock (``TIME``): Unix epoch seconds (float)."""
        answer = self._call("time", None, self.client.time)
        if isinstance(answer, dict):  # a cluster may answer per node: any node's clock will do
            answer = next(iter(answer.values()))
        secs, micros = answer
        return int(secs) + int(micros) / 1e6

    def check_health(self) -> Health:
        """PING once; never raises."""
        started = time.monotonic()
        try:
            self.client.ping()
        except RedisError as e:
            return Health(False, None, _detail(e))
        return Health(True, time.monotonic() - started, "PONG")

    def close(self) -> None:
        try:
            self.client.close()
        except RedisError:  # pragma: no cover
            pass
