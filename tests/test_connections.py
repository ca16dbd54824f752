"""The lease scripts' direct connection path (taskguard.connections) against real Redis: which
clients take it, that it bypasses the pool per call, and that it stays correct across threads,
fork, connections the server closed, decoded replies and close()."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import redis
from redis.cache import CacheConfig
from redis.cluster import RedisCluster as ClusterClient

from taskguard import ConfigError, RedisLocks
from taskguard.connections import DirectConnections


def _named_connections(admin: redis.Redis, name: str) -> list[dict]:
    return [c for c in admin.client_list() if c.get("name") == name]


def test_plain_clients_take_the_direct_path(redis_url, prefix):
    plain = redis.Redis.from_url(redis_url)
    blocking = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(redis_url, max_connections=4))
    unix = redis.Redis(unix_socket_path="/tmp/never-connected.sock")  # no I/O at construction
    for c in (plain, blocking, unix):
        assert isinstance(RedisLocks(c, prefix=prefix)._direct, DirectConnections)
    owned = RedisLocks.from_url(redis_url, prefix=prefix)
    assert isinstance(owned._direct, DirectConnections)
    for c in (plain, blocking, unix):
        c.close()
    owned.close()


class TracedRedis(redis.Redis):
    """Stands for a client whose execute_command is wrapped (tracing, metrics)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[str] = []

    def execute_command(self, *args, **options):
        self.seen.append(str(args[0]))
        return super().execute_command(*args, **options)


def test_clients_that_must_see_every_command_keep_execute_command(redis_url, prefix, cluster):
    traced = TracedRedis.from_url(redis_url)
    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    cached = redis.Redis.from_url(redis_url, protocol=3, cache_config=CacheConfig())
    clustered = ClusterClient(host="127.0.0.1", port=cluster.ports[0])
    plain = redis.Redis.from_url(redis_url)
    cases = {"traced": RedisLocks(traced, prefix=prefix), "single": RedisLocks(single, prefix=prefix),
             "cached": RedisLocks(cached, prefix=prefix), "cluster": RedisLocks(clustered, prefix=prefix),
             "turned off": RedisLocks(plain, prefix=prefix, direct_connections=False)}
    for name, locks in cases.items():
        assert locks._direct is None, name
        if name == "cached":  # client-side caching needs Redis >= 7.4 to connect at all
            continue
        lease = locks.acquire(f"k-{name}", ttl=5).lease  # and the scripts still work through it
        assert lease.fencing_token and lease.release(), name
    assert traced.seen.count("EVALSHA") == 2  # the wrapper saw both script calls
    for c in (traced, single, cached, clustered, plain):
        c.close()


def test_bad_direct_connections_option_is_refused(client, prefix):
    with pytest.raises(ConfigError, match="direct_connections must be a bool"):
        RedisLocks(client, prefix=prefix, direct_connections="yes")


def test_script_calls_skip_the_pool_and_reuse_one_connection(redis_url, prefix):
    name = f"direct-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url, client_name=name)
    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    sent_through_client: list[str] = []
    original = client.execute_command
    client.execute_command = lambda *a, **k: (sent_through_client.append(str(a[0])), original(*a, **k))[1]
    locks = RedisLocks(client, prefix=prefix)
    fences = []
    for _ in range(200):
        lease = locks.acquire("reuse", ttl=5).lease
        fences.append(lease.fencing_token)
        assert lease.release()
    assert sent_through_client == []  # no script call went through the pool
    assert fences == sorted(fences) and len(set(fences)) == 200
    assert len(locks._direct._free) == 1  # one connection served all 400 calls, sequentially
    assert len(_named_connections(admin, name)) == 1
    locks.close()
    assert _named_connections(admin, name) == []  # close() disconnects it
    client.close()
    admin.close()


def test_threads_never_share_a_connection(redis_url, prefix):
    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix)
    errors: list[BaseException] = []
    fences: dict[int, list[int]] = {}
    start = threading.Barrier(8)

    def worker(n: int) -> None:
        try:
            start.wait()
            mine = fences.setdefault(n, [])
            for i in range(100):
                acq = locks.acquire(f"t{n}", ttl=5)
                assert acq.acquired, acq  # each thread's own key: never held by anyone else
                mine.append(acq.lease.fencing_token)
                assert locks.holder(f"t{n}").fencing_token == acq.lease.fencing_token
                assert acq.lease.release()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    for n, fs in fences.items():  # a crossed reply would show as a wrong, repeated or falling fence
        assert len(fs) == 100 and all(a < b for a, b in zip(fs, fs[1:])), n
    assert 1 <= len(locks._direct._free) <= 8
    locks.close()
    client.close()


def test_a_forked_child_never_uses_the_parents_connections(redis_url, prefix):
    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix)
    locks.acquire("warm", ttl=5).lease.release()
    parents = list(locks._direct._free)
    assert len(parents) == 1
    pid = os.fork()
    if pid == 0:  # the child: its own connections, while the parent keeps using its own
        code = 1
        try:
            for _ in range(100):
                lease = locks.acquire("child", ttl=5).lease
                assert lease.release()
            code = 0 if all(c not in parents for c in locks._direct._free) else 2
        finally:
            os._exit(code)
    for _ in range(100):
        lease = locks.acquire("parent", ttl=5).lease
        assert lease.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert locks._direct._free == parents  # the parent's connection survived the child untouched
    locks.close()
    client.close()


def test_a_connection_the_server_closed_is_replaced_without_a_retry(redis_url, prefix):
    name = f"killed-{uuid.uuid4().hex[:8]}"
    sep = "&" if "?" in redis_url else "?"
    locks = RedisLocks.from_url(f"{redis_url}{sep}client_name={name}", prefix=prefix, retries=0)
    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    locks.acquire("k", ttl=5).lease.release()
    killed = _named_connections(admin, name)
    assert len(killed) == 1
    admin.client_kill_filter(_id=killed[0]["id"])
    lease = locks.acquire("k", ttl=5).lease  # retries=0: only the idle check can save this call
    assert lease.release()
    assert [c["id"] for c in _named_connections(admin, name)] != [killed[0]["id"]]
    locks.close()
    admin.close()


@pytest.mark.parametrize("direct", [True, False])
def test_decoded_replies_work_on_both_paths(redis_url, prefix, direct):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    locks = RedisLocks(client, prefix=prefix, direct_connections=direct)
    assert (locks._direct is not None) is direct
    lease = locks.acquire("dec", ttl=5, holder={"task": "t"}).lease
    info = locks.holder("dec")
    assert info.fencing_token == lease.fencing_token and info.holder["task"] == "t"
    claimed = locks.claim("dec", lease.owner_token, ttl=5)
    assert claimed.acquired and claimed.lease.fencing_token == lease.fencing_token
    assert claimed.lease.release()
    locks.close()
    client.close()
