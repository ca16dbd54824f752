"""The lease scripts' round trips on redis-py connections checked out without the pool's extras.

Every ``Redis.execute_command`` checks a connection out of the client's ``ConnectionPool`` and back
in: a lock, observability hooks, and a ``poll`` system call asking whether the idle connection
holds unread data (redis/connection.py, ``ConnectionPool.get_connection``), then the retry
wrapper (redis/client.py, ``Redis._execute_command``). On a small VM that costs about 30 us of CPU
per command, as much as the loopback round trip's own system calls. A guarded task makes two
script calls, so :class:`DirectConnections` sends them on redis-py ``Connection`` objects it keeps
in its own free list, built exactly as the pool builds its own (``pool.connection_class(
**pool.connection_kwargs)``: same address, credentials, TLS, timeouts, protocol, parser and
``Retry`` policy). A call checks an idle connection as the pool does (``can_read``: one ``poll``,
dropping a connection the server closed), then runs ``Connection.send_command`` +
``Connection.read_response`` under the connection's ``Retry``, disconnecting on a failed attempt,
which is what redis-py does per command; only the pool's bookkeeping is left out.
``bench/bench_core.py`` measures both paths side by side.

Only a plain ``redis.Redis`` (``execute_command`` not overridden) on a plain ``ConnectionPool`` or
``BlockingConnectionPool`` of ``Connection`` / ``SSLConnection`` / ``UnixDomainSocketConnection``
without client-side caching gets this path; anything else (Redis Cluster, Sentinel, a
single-connection client, a subclass that wraps ``execute_command`` for tracing) keeps using
``client.execute_command``. ``RedisLocks(client, direct_connections=False)`` turns it off.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import redis
from redis.exceptions import ConnectionError, TimeoutError
from redis.connection import BlockingConnectionPool, Connection, ConnectionPool, SSLConnection, \
    UnixDomainSocketConnection

__all__ = ["DirectConnections"]

_POOLS = (ConnectionPool, BlockingConnectionPool)
_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)


class DirectConnections:
    """A free list of redis-py connections for one client's pool settings.

    ``execute_command(*args)`` has the signature and results of ``Redis.execute_command`` for
    commands without response callbacks (``EVALSHA`` / ``EVAL``), and raises the same redis-py
    exceptions. Thread-safe: each call has a connection to itself. After ``fork`` the child
    starts with an empty list (the parent's sockets are left to the parent).
    """

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._free: list[Any] = []
        self._pid = os.getpid()

    @classmethod
    def for_client(cls, client: Any) -> "DirectConnections | None":
        """A :class:`DirectConnections` for ``client``, or ``None`` where this path does not apply
        (see the module docstring)."""
        if type(client).execute_command is not redis.Redis.execute_command:  # a subclass wraps it
            return None
        if getattr(client, "connection", None) is not None:  # single_connection_client=True
            return None
        pool = getattr(client, "connection_pool", None)
        if type(pool) not in _POOLS or pool.connection_class not in _CONNECTIONS:
            return None
        if getattr(pool, "cache", None) is not None:  # client-side caching wraps each connection
            return None
        return cls(pool)

    def execute_command(self, *args: Any) -> Any:
        conn = self._checkout()
        try:
            return conn.retry.call_with_retry(lambda: _send_and_read(conn, args), lambda _error: conn.disconnect())
        finally:
            self._checkin(conn)

    def _checkout(self) -> Any:
        pid = os.getpid()
        conn = None
        with self._lock:
            if pid != self._pid:  # forked: the parent's connections are not ours to use or close
                self._free, self._pid = [], pid
            if self._free:
                conn = self._free.pop()
        if conn is None:
            pool = self._pool
            return pool.connection_class(**pool.connection_kwargs)
        # The pool's own check before handing out an idle connection (one poll() call): a
        # connection the server closed meanwhile (a restart, a timeout, CLIENT KILL) or one
        # holding unread data is dropped here and reconnects on send, so it costs no retry.
        if getattr(conn, "_sock", None) is not None:
            try:
                if conn.can_read():
                    conn.disconnect()
            except (ConnectionError, TimeoutError, OSError):
                conn.disconnect()
        return conn

    def _checkin(self, conn: Any) -> None:
        with self._lock:
            if os.getpid() == self._pid:
                self._free.append(conn)

    def close(self) -> None:
        """Disconnect the idle connections. One in use at that moment stays connected until it
        is garbage-collected; a later call reconnects on demand."""
        with self._lock:
            free, self._free = self._free, []
        for conn in free:
            try:
                conn.disconnect()
            except Exception:  # pragma: no cover - closing is best effort
                pass


def _send_and_read(conn: Any, args: tuple) -> Any:
    # redis-py's send/read disconnect the connection themselves on a socket error or any
    # interruption mid-reply (redis/connection.py, send_packed_command and read_response), so a
    # connection never goes back to the free list with an unread reply on it
    conn.send_command(*args)
    return conn.read_response()
