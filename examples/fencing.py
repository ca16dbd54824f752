"""Storage-side fencing: the check that makes a fencing token a correctness boundary.

A lease holder may write many times with one token, so the store accepts a token equal to or
above the last one it saw and rejects a lower one. A holder that lost its lease (paused past its
TTL, partitioned away) still carries its old token; the next holder's token is larger; once the
newer holder has written, every write of the older one is rejected — whatever the older one
believes about its lease.

    from examples.fencing import sql_fenced_update, redis_fenced_set
    ok = sql_fenced_update(conn, "reports", "daily", lease.fencing_token, body="...")
    ok = redis_fenced_set(client, "report:daily", "...", lease.fencing_token)

Both return ``False`` for a rejected (stale) write; treat that as "this run lost its lease":
stop, do not retry the write.
"""

from __future__ import annotations

import re
from typing import Any

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def sql_fenced_update(conn: Any, table: str, row_id: Any, fence: int, **values: Any) -> bool:
    """``UPDATE table SET ..., fence = :t WHERE id = :id AND fence <= :t``; ``True`` when the row
    count is 1. The table needs an integer ``fence`` column (start it at 0) and an ``id`` column.
    Works with any DB-API connection using the ``?`` or ``%s`` paramstyle (sqlite3, psycopg)."""
    for name in (table, *values):
        if not _IDENT.fullmatch(name):
            raise ValueError(f"not a plain SQL identifier: {name!r}")
    mark = "%s" if type(conn).__module__.startswith(("psycopg", "pg8000")) else "?"
    sets = ", ".join(f"{col} = {mark}" for col in values)
    sql = f"UPDATE {table} SET {sets}{', ' if sets else ''}fence = {mark} WHERE id = {mark} AND fence <= {mark}"
    cur = conn.cursor()
    cur.execute(sql, (*values.values(), fence, row_id, fence))
    return cur.rowcount == 1


# KEYS[1] the protected key (a hash: value, fence); ARGV[1] fence, ARGV[2] value -> 1 written, 0 stale
FENCED_SET_SCRIPT = """
local last = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) >= last then
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
  return 1
end
return 0
"""


def redis_fenced_set(client: Any, key: str, value: str, fence: int) -> bool:
    """Compare-and-set on a fence in Redis: the hash ``key`` keeps ``value`` and the highest
    ``fence`` written; a write with a lower fence is rejected atomically (one Lua script)."""
    return int(client.eval(FENCED_SET_SCRIPT, 1, key, fence, value)) == 1
