"""The lease scripts go through the client's own ``execute_command`` (redis-py's pool, its
``Retry``, credential providers, observability hooks): decoded replies, and a call interrupted
between send and read (a signal handler raising, e.g. Celery's soft time limit) never leaves its
reply for the next call."""

from __future__ import annotations

import pytest
import redis

from taskguard import RedisLocks


def test_scripts_go_through_the_clients_execute_command(redis_url, prefix, monkeypatch):
    client = redis.Redis.from_url(redis_url)
    seen = []
    original = redis.Redis.execute_command

    def spy(self, *args, **kwargs):
        seen.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "execute_command", spy)
    locks = RedisLocks(client, prefix=prefix)
    locks.acquire("spy", ttl=5).lease.release()
    assert seen.count("EVALSHA") + seen.count("EVAL") >= 2  # acquire and release, both seen
    client.close()


def test_decoded_replies_work(redis_url, prefix):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    locks = RedisLocks(client, prefix=prefix)
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


def test_a_call_interrupted_between_send_and_read_leaves_no_reply_behind(redis_url, prefix, monkeypatch):
    """The reply of an interrupted call must never be read as the next call's: here the next
    acquire is on a key another owner holds, and must say so, not return the first key's lease."""
    from urllib.parse import urlsplit

    from redis.connection import Connection

    from .tcp_proxy import TcpProxy

    parts = urlsplit(redis_url)
    proxy = TcpProxy(parts.port or 6379, parts.hostname or "127.0.0.1")
    client = redis.Redis.from_url(proxy.url.replace("/0", parts.path or "/0"))
    locks = RedisLocks(client, prefix=prefix)
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
