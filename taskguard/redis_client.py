"""Building a redis-py client from a URL (for :meth:`taskguard.RedisLocks.from_url` and ``from_env``).

The URL is checked by :func:`taskguard.urls.check_url` (which runs redis-py's own parser) and
parsed by redis-py (``Redis.from_url`` / ``RedisCluster.from_url``); nothing here parses it again.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisError
from redis.retry import Retry
from redis.sentinel import Sentinel

from .errors import ConfigError
from .urls import ACCEPTED, check_url, is_sentinel_url, parse_sentinel_url, redact_url, scrub
from .validate import check_seconds

__all__ = ["client_from_url", "check_master_name"]


def client_from_url(
    url: str,
    *,
    db: int | None = None,
    connect_timeout: float = 5.0,
    socket_timeout: float = 5.0,
    retries: int = 1,
    cluster: bool = False,
    sentinel_master: str | None = None,
    sentinel_password: str | None = None,
) -> Any:
    """A ``redis.Redis`` (or, with ``cluster=True``, a ``redis.cluster.RedisCluster``) for ``url``.

    ``db`` (int >= 0) overrides the URL's database; ``connect_timeout`` and ``socket_timeout`` are
    seconds (float > 0); ``retries`` is how many times redis-py retries a command after a
    connection error or timeout (int >= 0, exponential backoff capped at 0.5 s). No round trip is
    made.

    A ``sentinel://host:26379;sentinel://host2:26379`` URL (kombu's form) gives the client of the
    primary that those sentinels manage under ``sentinel_master`` (required with such a URL):
    redis-py's ``Sentinel(...).master_for(...)``, whose connection pool asks the sentinels for the
    primary's address whenever it connects, so after a failover the next command reaches the
    new primary. The URL's user and password are the primary's; ``sentinel_password`` (optional)
    is the sentinels' own.

    Raises ConfigError (the URL shown with its password masked) for an invalid URL or option."""
    if is_sentinel_url(url):
        if cluster:
            raise ConfigError("url: a sentinel:// URL names a primary managed by Sentinel, not a Redis Cluster")
        return _sentinel_client(
            url, db, connect_timeout, socket_timeout, _retry(retries), sentinel_master, sentinel_password
        )
    if sentinel_master is not None or sentinel_password is not None:
        raise ConfigError(f"sentinel_master and sentinel_password need a sentinel:// URL, got {redact_url(url)}")
    check_url(url, "url")
    connect_timeout = check_seconds("connect_timeout", connect_timeout)
    socket_timeout = check_seconds("socket_timeout", socket_timeout)
    kwargs: dict[str, Any] = dict(
        socket_connect_timeout=connect_timeout,
        socket_timeout=socket_timeout,
        retry=_retry(retries),
    )
    if db is not None:
        if isinstance(db, bool) or not isinstance(db, int) or db < 0:
            raise ConfigError(f"db must be an int >= 0, got {db!r}")
        # the URL's own /db would win over a db= keyword in redis-py: put it in the URL
        parts = urlsplit(url)
        if parts.scheme == "unix":
            kwargs["db"] = db
        else:
            url = parts._replace(path=f"/{db}").geturl()
    problem = None
    try:
        if cluster:
            return RedisCluster.from_url(url, **kwargs)
        client = redis.Redis.from_url(url, **kwargs)
        pool = client.connection_pool  # a connection object is built without I/O: bad options fail here
        pool.connection_class(**pool.connection_kwargs)
        return client
    except (ValueError, TypeError, RedisError) as e:
        problem = f"{type(e).__name__}: {e}"
    raise ConfigError(f"url: cannot build a Redis client from {redact_url(url)} ({ACCEPTED}): {scrub(problem, url)}")


def _retry(retries: int) -> Retry:
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"retries must be an int >= 0, got {retries!r}")
    return Retry(ExponentialBackoff(cap=0.5, base=0.05), retries)


def check_master_name(name: str, value: object) -> str:
    """A Sentinel master name: 1-200 printable characters without spaces. Raises ConfigError."""
    if not isinstance(value, str) or not 0 < len(value) <= 200 or not value.isprintable() or " " in value:
        raise ConfigError(
            f"{name} must be the name Sentinel monitors the primary under (1-200 characters, no spaces), got {value!r}"
        )
    return value


def _sentinel_client(
    url: str,
    db: int | None,
    connect_timeout: float,
    socket_timeout: float,
    retry: Retry,
    master: str | None,
    sentinel_password: str | None,
) -> Any:
    parsed = parse_sentinel_url(url, "url")
    if master is None:
        raise ConfigError(
            f"url: {redact_url(url)} needs the master name Sentinel monitors the primary under "
            "(sentinel_master=, TASKGUARD_SENTINEL_MASTER; Celery: app.conf.taskguard_sentinel_master)"
        )
    master = check_master_name("sentinel_master", master)
    if sentinel_password is not None and not isinstance(sentinel_password, str):
        raise ConfigError(f"sentinel_password must be a str, got {type(sentinel_password).__name__}")
    connect_timeout = check_seconds("connect_timeout", connect_timeout)
    socket_timeout = check_seconds("socket_timeout", socket_timeout)
    if db is not None and (isinstance(db, bool) or not isinstance(db, int) or db < 0):
        raise ConfigError(f"db must be an int >= 0, got {db!r}")
    sentinel_kwargs: dict[str, Any] = dict(socket_connect_timeout=connect_timeout, socket_timeout=socket_timeout)
    if sentinel_password:
        sentinel_kwargs["password"] = sentinel_password
    sentinel = Sentinel(parsed.sentinels, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call,unused-ignore]  # (typed from redis-py 8.2)
    return sentinel.master_for(  # type: ignore[no-untyped-call,unused-ignore]  # (typed from redis-py 8.2)
        master,
        socket_connect_timeout=connect_timeout,
        socket_timeout=socket_timeout,
        retry=retry,
        username=parsed.username,
        password=parsed.password,
        db=parsed.db if db is None else db,
    )
