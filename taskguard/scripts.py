"""The Lua scripts of the Redis lease protocol, and how they are run.

Key layout for a user key ``K`` under prefix ``P`` (all keys share the hash tag ``{P:K}``, so
every script touches one Redis Cluster slot; everything that is not a key goes in ARGV):

* ``{P:K}``        the lease: a hash ``owner`` (secret owner token), ``fence`` (fencing token),
                   ``holder`` (JSON holder metadata), ``since`` (server time, ms), ``run`` (the
                   run id given at acquire/claim, e.g. a task id); it carries the lease TTL
                   (``PEXPIRE``).
* ``{P:K}:fence``  the fence record: the last fencing token handed out for ``K``, followed, once
                   a run that held ``K`` finished, by that run's id (``"<token> <run id>"``); the
                   next acquisition overwrites it. It carries an idle TTL (``fence_idle_ttl``,
                   default 7 days) so Redis memory per distinct key is bounded.
* ``{P:K}:signal`` a one-element list pushed on release; waiters ``BLPOP`` it, so a waiter wakes
                   on release instead of by polling. It expires by itself.
* ``{P:K}:released`` the owner token and call nonce of the last release without a done marker,
                   for 10 s (makes a retried release idempotent).
* ``{P:K}:waiting`` set (with the longest pending wait as its TTL) by an acquire that found the
                   lease held and will wait; a release pushes the signal only while it exists, so
                   the common uncontended release does no signalling work.
* ``{P:K}:done:R`` the finished marker of run ``R`` (a Celery task id and its publish stamp), written on release
                   only when the caller asks for one (``finished_ttl``): an acquire that refuses
                   finished runs (a redelivered copy) is then refused for that long. Its value is
                   the nonce of the release call that set it (it doubles as that call's tombstone).
                   A new run of ``R`` clears it when it acquires.
* ``{P:K}:r:NAME`` a record kept for the caller under ``K``'s hash tag (:meth:`Locks.put_record`).

Fencing: ``next = max(stored + 1, server TIME in microseconds)``. The stored counter gives strict
growth while it exists; the server-clock floor keeps tokens growing when the counter is lost
(expired after idling, evicted, a restart without persistence), because every token ever handed
out was at most the server's clock in microseconds at that moment (one acquisition takes far more
than one microsecond). This relies on the Redis server's clock not stepping backwards (see the
README's deployment notes). ``TIME`` inside a script needs effects replication, the default since
Redis 5 (https://redis.io/docs/latest/develop/interact/programmability/eval-intro/).

Scripts are run with ``EVALSHA``; on ``NOSCRIPT`` (after ``SCRIPT FLUSH``, a restart or a
failover) they are re-sent with ``EVAL``, which also caches them again. ``NOSCRIPT`` is never read
as a lease answer. Pipelines call ``EVALSHA`` directly, so redis-py's ``Pipeline.load_scripts``
(one ``SCRIPT EXISTS`` round trip per execute) is never involved.

Every script is idempotent: redis-py may re-send a command after a timeout or a dropped
connection although the server ran it (its ``Retry`` policy), so a second run of the same call
must give the same answer.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from redis.exceptions import NoScriptError

__all__ = ["Script", "ACQUIRE", "RENEW", "RELEASE", "RELEASE_WITHOUT_TOKEN", "CLAIM", "HOLDER", "OWNS", "PUT_RECORD",
           "DELETE_RECORD"]


class Script:
    """A Lua script with its SHA1, run by ``EVALSHA`` with an ``EVAL`` fallback on ``NOSCRIPT``."""

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return client.execute_command("EVAL", self.source, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Queue an ``EVALSHA`` on a pipeline (no ``SCRIPT EXISTS`` round trip).

        Sent through ``execute_command``: redis-py's ``ClusterPipeline`` blocks its ``evalsha``
        method (redis/cluster.py, ``PIPELINE_BLOCKED_COMMANDS``) but routes a raw ``EVALSHA`` by
        its keys, which is all a single-slot script needs."""
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def queue_eval(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        pipe.execute_command("EVAL", self.source, len(keys), *keys, *args)


# Wake one waiter, if any waits (KEYS[2] release signal, KEYS[3] waiting flag): a one-element
# list that a blocked BLPOP pops, expiring by itself.
_SIGNAL_ONE_WAITER = """
  if redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('DEL', KEYS[2])
    redis.call('RPUSH', KEYS[2], '1')
    redis.call('PEXPIRE', KEYS[2], {ttl})
  end"""

# KEYS[1] lease, KEYS[2] fence record, KEYS[3] waiting flag, optional KEYS[4] finished marker of
# the run asking
# ARGV[1] owner token, ARGV[2] TTL ms, ARGV[3] holder JSON, ARGV[4] fence record idle TTL ms,
# ARGV[5] ms the caller will wait if the lease is held (0: it will not wait), ARGV[6] run id ('' if
# none), ARGV[7] '1' when a run that already finished must be refused (a redelivered copy), '0'
# when this is a new run of that id (its finished marker, if any, is cleared once it acquires),
# ARGV[8] the identity finished runs are recorded under (the run id, or run id + '#' + delivery)
# -> {1, fence, ttl_ms} when acquired; {0, holder's PTTL, holder's run id} when held (-1: held
#    without expiry); {2, 0} when ARGV[7] is '1' and the run asking already finished (its finished
#    marker exists, or it is the last run recorded as finished in the fence record).
# Idempotent: re-sent by a client retry after it ran, it finds its own owner token and says so.
ACQUIRE = Script(
    "acquire",
    """
local fence_rec = redis.call('GET', KEYS[2])
if ARGV[7] == '1' and ARGV[8] ~= '' then
  if KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1 then
    return {2, 0}
  end
  if fence_rec and string.match(fence_rec, '^%d+ (.*)$') == ARGV[8] then
    return {2, 0}
  end
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  local v = redis.call('HMGET', KEYS[1], 'owner', 'fence', 'run')
  if v[1] == ARGV[1] then
    -- ours already: this is a client-side retry of an acquire that did run (idempotent)
    return {1, tonumber(v[2]), pttl}
  end
  local wait_ms = tonumber(ARGV[5])
  if wait_ms > 0 and redis.call('PTTL', KEYS[3]) < wait_ms then
    redis.call('SET', KEYS[3], '1', 'PX', wait_ms)
  end
  return {0, pttl, v[3] or ''}
end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local stored = tonumber(fence_rec and string.match(fence_rec, '^%d+') or '0') or 0
local fence = math.max(stored + 1, now_us)
local fence_s = string.format('%.0f', fence)
redis.call('SET', KEYS[2], fence_s, 'PX', ARGV[4])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence_s, 'holder', ARGV[3],
           'since', string.format('%.0f', math.floor(now_us / 1000)), 'run', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if KEYS[4] and ARGV[7] == '0' then
  redis.call('DEL', KEYS[4])
end
return {1, fence, tonumber(ARGV[2])}
""",
)

# KEYS[1] lease; ARGV[1] owner token, ARGV[2] TTL ms -> 1 renewed, 0 not the owner (or gone).
# A missing key is never recreated, and a renewal only ever extends: a late renewal with a short
# TTL (a heartbeat round racing a retry's stretch) cannot cut a longer expiry back.
RENEW = Script(
    "renew",
    """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return 1
end
return 0
""",
)

# KEYS[1] lease, KEYS[2] release signal, KEYS[3] waiting flag, KEYS[4] release tombstone,
# KEYS[5] fence record, optional KEYS[6] finished marker of the finishing run
# ARGV[1] owner token, ARGV[2] signal TTL ms, ARGV[3] finished marker TTL ms (with KEYS[6]),
# ARGV[4] a random nonce unique to this release call, ARGV[5] the identity of the run that finished
# (see ACQUIRE's ARGV[8]; '': the run did not finish, e.g. it hands its message back)
# -> 1 released (and, when someone waits, one waiter signalled), 0 not the owner (or gone).
# A finishing run is recorded as the key's last finished run in the fence record (no extra key:
# the next acquire of the key overwrites it) and, with KEYS[6], in its own finished marker. The
# marker is set whether or not the lease was still held: the run is over either way.
# Idempotent: a release that did run leaves a mark of this very call, so a client retry of it
# still answers 1 (a new release call with the same token answers 0). The mark is the finished
# marker itself when there is one (holding the call's nonce: one key per finished run, not two),
# else the tombstone KEYS[4] (owner token + nonce, for 10 s).
RELEASE = Script(
    "release",
    """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[5] ~= '' then
    local rec = redis.call('GET', KEYS[5])
    if rec then
      redis.call('SET', KEYS[5], string.match(rec, '^%d+') .. ' ' .. ARGV[5], 'KEEPTTL')
    end
  end
  if KEYS[6] then
    redis.call('SET', KEYS[6], ARGV[4], 'PX', ARGV[3])
  else
    redis.call('SET', KEYS[4], ARGV[1] .. ' ' .. ARGV[4], 'PX', 10000)
  end
""" + _SIGNAL_ONE_WAITER.format(ttl="ARGV[2]") + """
  return 1
end
if KEYS[6] then
  if redis.call('GET', KEYS[6]) == ARGV[4] then
    return 1
  end
  redis.call('SET', KEYS[6], '1', 'PX', ARGV[3])
  return 0
end
if redis.call('GET', KEYS[4]) == ARGV[1] .. ' ' .. ARGV[4] then
  return 1
end
return 0
""",
)

# One-shot claim of a persisted handle: swap the owner token, keep the fence, record the holder.
# KEYS[1] lease; ARGV[1] persisted owner token, ARGV[2] new owner token, ARGV[3] TTL ms,
# ARGV[4] holder JSON, ARGV[5] run id ('' if none)
# -> {1, fence} claimed; {0, PTTL} not the owner (-2: no lease at all).
CLAIM = Script(
    "claim",
    """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'holder', ARGV[4], 'run', ARGV[5])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, tonumber(redis.call('HGET', KEYS[1], 'fence'))}
end
if owner == ARGV[2] then  -- a client retry of this very claim, which did run (idempotent)
  return {1, tonumber(redis.call('HGET', KEYS[1], 'fence'))}
end
return {0, redis.call('PTTL', KEYS[1])}
""",
)

# Release without the owner token: on behalf of a run known to be over (e.g. by a Celery worker's
# main process after its child died), or by an operator's force. KEYS[1] lease, KEYS[2] release
# signal, KEYS[3] waiting flag; ARGV[1] the run id whose lease to release ('' = whoever holds it),
# ARGV[2] signal TTL ms -> 1 released, 0 the lease is not that run's (or there is none).
RELEASE_WITHOUT_TOKEN = Script(
    "release_without_token",
    """
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'run') ~= ARGV[1] then
  return 0
end
if redis.call('DEL', KEYS[1]) == 1 then
""" + _SIGNAL_ONE_WAITER.format(ttl="ARGV[2]") + """
  return 1
end
return 0
""",
)

# KEYS[1] lease -> {holder JSON, fence, PTTL, since ms, run id}; PTTL -2 when there is no lease.
# Never returns the owner token.
HOLDER = Script(
    "holder",
    """
local v = redis.call('HMGET', KEYS[1], 'holder', 'fence', 'since', 'run')
return {v[1], v[2], redis.call('PTTL', KEYS[1]), v[3], v[4]}
""",
)

# KEYS[1] lease; ARGV[1] owner token -> PTTL when owned (>= 0, or -1), -2 when not owned.
OWNS = Script(
    "owns",
    """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  return redis.call('PTTL', KEYS[1])
end
return -2
""",
)


# KEYS[1] record; ARGV[1] value, ARGV[2] TTL ms, ARGV[3] condition: 'any' (always), 'absent' (only
# if no record exists), 'eq' (only if the record exists and equals ARGV[4]), 'absent_or_eq' (no
# record, or one equal to ARGV[4]) -> 1 written, 0 the condition did not hold.
# A conditional write re-sent by a client retry after it ran answers 0: callers that must tell
# that apart write a value unique to the call and read it back.
PUT_RECORD = Script(
    "put_record",
    """
local cur = redis.call('GET', KEYS[1])
local cond = ARGV[3]
if cond == 'absent' and cur then return 0 end
if cond == 'eq' and cur ~= ARGV[4] then return 0 end
if cond == 'absent_or_eq' and cur and cur ~= ARGV[4] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
""",
)

# KEYS[1] record; ARGV[1] '' (delete whatever is there) or the value it must hold -> 1 deleted,
# 0 absent or holding another value.
DELETE_RECORD = Script(
    "delete_record",
    """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
return redis.call('DEL', KEYS[1])
""",
)
