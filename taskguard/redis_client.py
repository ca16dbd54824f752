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

from .errors import ConfigError
from .urls import ACCEPTED, check_url, redact_url, scrub
from .validate import check_seconds

__all__ = ["client_from_url"]


def client_from_url(
    url: str,
    *,
    db: int | None = None,
    connect_timeout: float = 5.0,
    socket_timeout: float = 5.0,
    retries: int = 1,
    cluster: bool = False,
) -> Any:
    """A ``redis.Redis`` (or, with ``cluster=True``, a ``redis.cluster.RedisCluster``) for ``url``.

    ``db`` (int >= 0) overrides the URL's database; ``connect_timeout`` and ``socket_timeout`` are
    seconds (float > 0); ``retries`` is how many times redis-py retries a command after a
    connection error or timeout (int >= 0, exponential backoff capped at 0.5 s). No round trip is
    made.

    Raises ConfigError (the URL shown with its password masked) for an invalid URL or option."""
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
