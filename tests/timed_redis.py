"""A Redis client for the suite's task bodies, signal receivers and job functions: every key it
writes gets a TTL (15 minutes, unless the key has one), so that a record a worker process writes
after its test ended — a warm shutdown finishing a task, a late retry — never stays in the shared
Redis without one (CI checks that no key of the suite's is left without a TTL)."""

from __future__ import annotations

from typing import Any

import redis

#: Seconds a key written through :class:`TimedRedis` lives at most (longer than any test).
KEEP = 900

#: The write commands the suite's helpers use, whose first argument is the key.
_WRITES = frozenset({"RPUSH", "LPUSH", "SADD", "INCR", "INCRBY", "SET", "HSET", "ZADD", "APPEND", "HINCRBY"})


class TimedRedis(redis.Redis):
    """``redis.Redis`` whose single-key writes also ``EXPIRE key KEEP NX`` (a key with a TTL keeps it)."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        result = super().execute_command(*args, **options)
        if str(args[0]).upper() in _WRITES and len(args) > 1:
            super().execute_command("EXPIRE", args[1], KEEP, "NX")
        return result
