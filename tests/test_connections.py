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

from taskguard import ConfigError, LeaseBackendError, RedisLocks
from taskguard.connections import DirectConnections


def _named_connections(admin: redis.Redis, name: str) -> list[dict]:
    return [c for c in admin.client_list() if c.get("name") == name]


def test_plain_clients_take_the_direct_path(redis_url, prefix):
    plain = redis.Redis.from_url(redis_url)
    unix = redis.Redis(unix_socket_path="/tmp/never-connected.sock")  # no I/O at construction
    for c in (plain, unix):
        assert isinstance(RedisLocks(c, prefix=prefix)._direct, DirectConnections)
    owned = RedisLocks.from_url(redis_url, prefix=prefix)
    assert isinstance(owned._direct, DirectConnections)
    for c in (plain, unix):
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
    # a connection limit only the pool can keep
    blocking = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(redis_url, max_connections=4))
    capped = redis.Redis.from_url(redis_url, max_connections=4)
    cases = {"traced": RedisLocks(traced, prefix=prefix), "single": RedisLocks(single, prefix=prefix),
             "cached": RedisLocks(cached, prefix=prefix), "cluster": RedisLocks(clustered, prefix=prefix),
             "turned off": RedisLocks(plain, prefix=prefix, direct_connections=False),
             "blocking pool": RedisLocks(blocking, prefix=prefix), "max_connections": RedisLocks(capped, prefix=prefix)}
    for name, locks in cases.items():
        assert locks._direct is None, name
        if name == "cached":  # client-side caching needs Redis >= 7.4 to connect at all
            continue
        lease = locks.acquire(f"k-{name}", ttl=5).lease  # and the scripts still work through it
        assert lease.fencing_token and lease.release(), name
    assert traced.seen.count("EVALSHA") == 2  # the wrapper saw both script calls
    for c in (traced, single, cached, clustered, plain, blocking, capped):
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


class _Interrupt(BaseException):
    """Stands for an exception a signal handler raises (Celery's soft time limit, Ctrl-C)."""


@pytest.mark.parametrize("direct", [True, False])
def test_a_call_interrupted_between_send_and_read_leaves_no_reply_behind(redis_url, prefix, monkeypatch, direct):
    """The reply of an interrupted call must never be read as the next call's: here the next
    acquire is on a key another owner holds, and must say so, not return the first key's lease."""
    from urllib.parse import urlsplit

    from redis.connection import Connection

    from .tcp_proxy import TcpProxy

    parts = urlsplit(redis_url)
    proxy = TcpProxy(parts.port or 6379, parts.hostname or "127.0.0.1")
    client = redis.Redis.from_url(proxy.url.replace("/0", parts.path or "/0"))
    locks = RedisLocks(client, prefix=prefix, direct_connections=direct)
    other = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    held = other.acquire("B", ttl=30).lease
    locks.acquire("warm", ttl=5).lease.release()  # one idle connection, reused below
    original = Connection.send_command
    armed = [True]

    def send_then_interrupt(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if armed[0] and args and args[0] == "EVALSHA":
            armed[0] = False
            raise _Interrupt("landed between send and read")

    monkeypatch.setattr(Connection, "send_command", send_then_interrupt)
    proxy.delay = 0.05  # the reply is still on its way when the next call starts
    with pytest.raises(_Interrupt):
        locks.acquire("A", ttl=30)
    acq = locks.acquire("B", ttl=30)
    proxy.delay = 0.0
    assert not acq.acquired and acq.reason == "held", acq  # B's own answer, not A's
    assert locks.holder("B").fencing_token == held.fencing_token
    held.release()
    locks.close()
    other.close()
    client.close()
    other.client.close()
    proxy.close()


def test_a_child_forked_while_a_thread_holds_the_free_list_lock_does_not_hang(redis_url, prefix):
    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix)
    locks.acquire("warm", ttl=5).lease.release()
    locks._direct._lock.acquire()  # as if another thread were checking a connection out at fork time
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal_alarm = __import__("signal")
            signal_alarm.alarm(10)  # never hang the suite: a hung child dies by SIGALRM
            code = 0 if locks.holder("child") is None else 2
        finally:
            os._exit(code)
    locks._direct._lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    locks.close()
    client.close()


def test_close_keeps_no_connection_open_even_one_in_use(redis_url, prefix):
    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix)
    direct = locks._direct
    conn = direct._checkout()  # a call in progress in another thread
    conn.send_command("PING")
    conn.read_response()
    locks.close()
    direct._checkin(conn)  # that call ends after close()
    assert direct._free == [] and conn._sock is None
    assert locks.holder("after") is None  # still usable: connects anew
    assert direct._free == []
    client.close()


def test_no_more_connections_than_the_pool_allows(redis_url, prefix):
    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix)
    direct = locks._direct
    direct._max = 2  # as if the pool's max_connections were 2
    first, second = direct._checkout(), direct._checkout()  # two calls in progress
    with pytest.raises(redis.exceptions.MaxConnectionsError):
        direct._checkout()
    with pytest.raises(LeaseBackendError, match="MaxConnectionsError"):
        locks.acquire("k", ttl=5)  # reported as a backend error, never as held
    direct._checkin(first)
    lease = locks.acquire("k", ttl=5).lease  # one came back: calls go on
    assert lease.release()
    direct._checkin(second)
    assert len(direct._free) == 2
    locks.close()
    client.close()
