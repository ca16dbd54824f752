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

Only a plain ``redis.Redis`` (``execute_command`` not overridden) on a plain ``ConnectionPool``
without a ``max_connections`` limit, of ``Connection`` / ``SSLConnection`` /
``UnixDomainSocketConnection``, without client-side caching, gets this path. Anything else keeps
using ``client.execute_command``: Redis Cluster, Sentinel, a ``BlockingConnectionPool`` or a
connection limit (only the pool can keep it), a single-connection client, a subclass that wraps
``execute_command`` for tracing. ``RedisLocks(client, direct_connections=False)`` turns it off.
These connections are separate from the client's pool: closing the client does not close them;
:meth:`RedisLocks.close` does.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import redis
from redis.connection import Connection, ConnectionPool, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

__all__ = ["DirectConnections"]

_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)
#: The ``max_connections`` redis-py gives a ``ConnectionPool`` nobody asked to limit (100 in
#: redis-py 8, 2**31 before); read from a throwaway pool, which makes no connection.
_DEFAULT_MAX = ConnectionPool().max_connections
#: raised when a call would exceed the pool's ``max_connections`` (as the pool itself raises)
_TooMany = getattr(redis.exceptions, "MaxConnectionsError", ConnectionError)


class DirectConnections:
    """A free list of redis-py connections for one client's pool settings.

    ``execute_command(*args)`` has the signature and results of ``Redis.execute_command`` for
    commands without response callbacks (``EVALSHA`` / ``EVAL``), and raises the same redis-py
    exceptions. Thread-safe: each call has a connection to itself; the list keeps as many
    connections as calls ever ran at once (as redis-py's pool does), at most the pool's
    ``max_connections`` (one call more raises ``MaxConnectionsError``, as the pool would). A
    call interrupted between sending and reading (a signal handler raising, e.g. Celery's soft
    time limit, or ``KeyboardInterrupt``) disconnects its connection, so no later call can read
    its reply.
    After ``fork`` the child starts with an empty list and a fresh lock (the parent's sockets
    are left to the parent). After :meth:`close` no connection is kept: each call connects anew.
    """

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._max = pool.max_connections  # no more connections than the pool would make
        self._lock = threading.Lock()
        self._free: list[Any] = []
        self._made = 0  # connections made and not dropped: idle in the list or in use
        self._pid = os.getpid()
        self._closed = False

    @classmethod
    def for_client(cls, client: Any) -> "DirectConnections | None":
        """A :class:`DirectConnections` for ``client``, or ``None`` where this path does not apply
        (see the module docstring)."""
        if type(client).execute_command is not redis.Redis.execute_command:  # a subclass wraps it
            return None
        if getattr(client, "connection", None) is not None:  # single_connection_client=True
            return None
        pool = getattr(client, "connection_pool", None)
        # a BlockingConnectionPool, or a max_connections the user set, caps the connections to
        # Redis: only the pool itself can keep that promise
        if type(pool) is not ConnectionPool or getattr(pool, "max_connections", 0) < _DEFAULT_MAX:
            return None
        if pool.connection_class not in _CONNECTIONS:
            return None
        if getattr(pool, "cache", None) is not None:  # client-side caching wraps each connection
            return None
        return cls(pool)

    def execute_command(self, *args: Any) -> Any:
        conn = self._checkout()
        complete = False  # the reply was read in full (a value or an error reply)
        try:
            result = conn.retry.call_with_retry(lambda: _send_and_read(conn, args), lambda _error: conn.disconnect())
            complete = True
            return result
        except ResponseError:
            complete = True
            raise
        finally:
            if not complete:
                # redis-py disconnects on errors inside send or read, not on an exception that
                # lands between the two: the reply may still be on its way
                conn.disconnect()
            self._checkin(conn)

    def _checkout(self) -> Any:
        if os.getpid() != self._pid:
            self._after_fork()
        conn = None
        with self._lock:
            if self._free:
                conn = self._free.pop()
            elif self._made >= self._max:
                raise _TooMany("Too many connections")
            else:
                self._made += 1
        if conn is None:
            pool = self._pool
            try:
                return pool.connection_class(**pool.connection_kwargs)
            except BaseException:
                with self._lock:
                    self._made -= 1
                raise
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

    def _after_fork(self) -> None:
        # checked before taking the lock: a thread of the parent may have held it at fork time,
        # and no thread here will ever release it. The parent's connections are not ours.
        self._lock = threading.Lock()
        self._free = []
        self._made = 0
        self._pid = os.getpid()

    def _checkin(self, conn: Any) -> None:
        if os.getpid() != self._pid:  # made before a fork: the parent's, not ours to keep or close
            return
        with self._lock:
            if not self._closed:
                self._free.append(conn)
                return
            self._made -= 1
        conn.disconnect()  # closed meanwhile: keep nothing open

    def close(self) -> None:
        """Disconnect the idle connections and keep none from now on (a call in progress
        disconnects its connection when it ends; a later call connects anew)."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
            self._made -= len(free)
        for conn in free:
            try:
                conn.disconnect()
            except Exception:  # pragma: no cover - closing is best effort
                pass


def _send_and_read(conn: Any, args: tuple) -> Any:
    conn.send_command(*args)
    return conn.read_response()
