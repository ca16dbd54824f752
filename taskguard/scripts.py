"""The Lua scripts of the Redis lease protocol, and how they are run.

Key layout for a user key ``K`` under prefix ``P`` (all keys share the hash tag ``{P:K}``;
everything that is not a key goes in ARGV):

* ``{P:K}``        **the lease and its fence, one hash**: ``f`` the last fencing token handed out
                   for ``K``; while held, ``o`` the secret owner token, ``x`` the expiry (server
                   time, ms), ``h`` the holder metadata (JSON), ``s`` since (server ms), ``r`` the
                   run id given at acquire/claim; a release deletes them all (a release by run
                   id leaves ``o`` = ``~``) and keeps ``n``, the release call's nonce, 8 hex digits
                   of the owner token's SHA1 and the answer (a client retry of that release
                   still answers as it did; another owner's call never matches), and ``l`` the
                   identity of the run that finished, if one did (the next acquisition drops
                   it), so an idle key holds ``f`` and ``n`` only; ``w`` (server ms) until
                   when someone waits for the lease;
                   ``q:TASK`` the queued mark of a ``unique=True`` publish of TASK ("<run id>
                   <expiry ms>");
                   ``d:NAME`` the lease records (:meth:`Lease.put_record`), written only by the
                   holder and kept across leases. Under a limit (``acquire(limit=N)``) each of
                   the N holders has a slot: slot 0 uses the fields above, slot ``i > 0`` the
                   same per-holder fields suffixed ``#i`` (``o#i``, ``x#i``, ``f#i``, ...; its
                   own fence, so storage can fence per slot), and ``m`` counts the slots in use;
                   a holder's owner token ends in ``#i`` for slot ``i > 0``, so every per-holder
                   script finds the slot from the token alone. The key
                   carries an idle TTL (``fence_idle_ttl``, default 7 days, never shorter than the
                   lease), set again by an acquisition that finds it run down by more than 1% (or
                   shorter than the lease), so Redis memory per distinct key is bounded and the
                   fence lives at least as long as the lease it fences.
* ``{P:K}:signal`` a one-element list pushed after a release when someone waits; waiters ``BLPOP``
                   it, so a waiter wakes on release instead of by polling. It expires by itself.
* ``{P:K}:done:R`` the finished marker of run ``R`` (a Celery task id and its publish stamp),
                   written on release only when the caller asks for one (``finished_ttl``): an
                   acquire that refuses finished runs is then refused for that long.
* ``{P:K}:r:NAME`` a record kept for the caller under ``K``'s hash tag (:meth:`Locks.put_record`).
* ``{P:K}:once``   the completion record of a ``once=True`` run (:mod:`taskguard.once`): its
                   fingerprint and stored value, written with the release, kept ``once_ttl``.
* ``{P:K}:t``      a throttle's theoretical arrival time (server µs, :meth:`Locks.throttle`), expiring
                   once it is in the past.

**One key per script, wherever the protocol allows.** On Redis Cluster, while a hash slot
migrates (``MIGRATING``/``IMPORTING``), a script that declares several keys gets ``TRYAGAIN`` as long
as some of them are missing on the source node — for the whole migration — while a single-key
command is redirected with ``ASK``, which redis-py follows. So acquire (of any limit), renew, release,
claim, holders and the records each touch one key. Two operations need a second key, only when asked:
an acquire that checks a run's finished marker and a release that writes one (the marker must be
set atomically with the release, or a copy of the run could slip in between). The client
retries those on ``TRYAGAIN`` until the caller's deadline. Waking a waiter is a separate
single-key call after the release, made only when the release saw someone waiting.

Fencing: ``next = max(stored + 1, server TIME in microseconds)``. The stored token gives strict
growth while the key exists; the server-clock floor keeps tokens growing when it is lost (expired
after idling, evicted, a restart without persistence), because every token ever handed out was at
most the server's clock in microseconds at that moment (one acquisition takes far more than one
microsecond). This relies on the Redis server's clock not stepping backwards (see the README's
deployment notes). ``TIME`` inside a script needs effects replication, the default since Redis 5
(https://redis.io/docs/latest/develop/interact/programmability/eval-intro/). Expiry is kept in
the hash (``x``) against the server clock, not as the key's TTL, so the fence survives the lease.

Scripts are run with ``EVALSHA``; on ``NOSCRIPT`` (after ``SCRIPT FLUSH``, a restart or a
failover) they are re-sent with ``EVAL``, which also caches them again. ``NOSCRIPT`` is never read
as a lease answer. Pipelines call ``EVALSHA`` directly, so redis-py's ``Pipeline.load_scripts``
(one ``SCRIPT EXISTS`` round trip per execute) is never involved.

**A re-sent call answers as its first send did.** redis-py may re-send a command after a timeout
or a dropped connection although the server ran it (its ``Retry`` policy: redis-py 6+ re-sends
and returns the second answer; redis-py 5 raises after the first run). So every call that writes
carries a nonce of its own, recorded with what it wrote, and a second run that finds it answers
as the first did: ACQUIRE and CLAIM by their fresh owner token, RELEASE / RELEASE_STORING /
RELEASE_WITHOUT_TOKEN by a nonce argument kept with the answer in the slot's release record
``n`` (until the slot's next release, so also after another holder took the slot), QUEUE by a
nonce in the mark and UNQUEUE by the "~<nonce>" it leaves in the cleared mark's place,
PUT_LEASE_RECORD by its value; RENEW only extends, SIGNAL always answers 1 (a re-send may wake
one more waiter, which looks again), HOLDERS and OWNS only read. The nonce records live in the
lease hash, bounded (one per slot or per task), and go with it. The exceptions, each said at its
script: THROTTLE (a re-send counts twice, on the strict side), and PUT_RECORD / DELETE_RECORD
(plain string records: a conditional write or a delete re-sent after it ran answers 0).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

__all__ = [
    "Script",
    "ACQUIRE",
    "RENEW",
    "RELEASE",
    "RELEASE_WITHOUT_TOKEN",
    "CLAIM",
    "HOLDERS",
    "OWNS",
    "SIGNAL",
    "PUT_RECORD",
    "DELETE_RECORD",
    "PUT_LEASE_RECORD",
    "THROTTLE",
    "RELEASE_STORING",
    "QUEUE",
    "UNQUEUE",
]


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


# Server time, as microseconds (now_us) and milliseconds (now).
_NOW = """
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now = math.floor(now_us / 1000)
"""

# KEYS[1] lease hash, optional KEYS[2] finished marker of the run asking (checked when refusing
# finished runs, cleared by a new run of the id)
# ARGV[1] owner token, ARGV[2] TTL ms, ARGV[3] holder JSON, ARGV[4] idle TTL ms of the key,
# ARGV[5] ms the caller will wait if the lease is held (0: it will not wait), ARGV[6] run id ('' if
# none), ARGV[7] '1' when a run that already finished must be refused (a redelivered copy), '0'
# when this is a new run, ARGV[8] the identity finished runs are recorded under ('' if none),
# ARGV[9] the limit N: how many holders may hold the key at once (absent or 1: a lease),
# optional ARGV[10] a task name and ARGV[11] a run id: when acquired, the task's queued mark
# (``q:TASK``, see QUEUE) is deleted if it names that run, atomically with the lease, so the run
# is never left marked as queued once it has started, whatever process dies when
# -> {1, fence, ttl_ms, slot} when acquired (the owner token of slot i > 0 is ARGV[1] .. '#i');
#    {0, ms until the soonest holder's expiry, the holder's run id if there is only one} when N
#    holders are in, or
#    {0, ms left, run id} naming the holder that is another execution of ARGV[6] (such a run
#    never takes a second slot); {2, 0} when ARGV[7] is '1' and the run asking already finished
#    (the key's last finished run, or its finished marker exists).
# Slots: slot 0 uses the plain fields, slot i > 0 the same fields suffixed '#i'; ``m`` is the
# number of slots in use (the limit of the latest acquisition, or more while holders sit in
# higher slots, so lowering a limit never admits more holders than the old ones plus the new).
# Idempotent: re-sent by a client retry after it ran, it finds its own owner token and says so.
ACQUIRE = Script(
    "acquire",
    _NOW
    + """
local v = redis.call('HMGET', KEYS[1], 'o', 'x', 'f', 'r', 'l', 'w', 'm')
if ARGV[7] == '1' and ARGV[8] ~= '' then
  if v[5] == ARGV[8] then
    return {2, 0}
  end
  if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then
    return {2, 0}
  end
end
local limit = tonumber(ARGV[9] or '1')
local slots = tonumber(v[7]) or 1
local n = math.max(limit, slots)
local rest = {}
if n > 1 then  -- the other slots' fields, in one call
  local names = {}
  for i = 1, n - 1 do
    local sfx = '#' .. i
    names[#names + 1] = 'o' .. sfx
    names[#names + 1] = 'x' .. sfx
    names[#names + 1] = 'f' .. sfx
    names[#names + 1] = 'r' .. sfx
  end
  rest = redis.call('HMGET', KEYS[1], unpack(names))
end
local live, top, free, free_f, soon, soon_run, same = 0, 0, nil, nil, nil, '', nil
for i = 0, n - 1 do
  local sfx, o, x, f, r = '', v[1], v[2], v[3], v[4]
  if i > 0 then
    local j = (i - 1) * 4
    sfx = '#' .. i
    o, x, f, r = rest[j + 1], rest[j + 2], rest[j + 3], rest[j + 4]
  end
  local exp = tonumber(x)
  if exp and exp > now then
    if o == ARGV[1] .. sfx then
      -- ours already: this is a client-side retry of an acquire that did run (idempotent)
      return {1, tonumber(f), exp - now, i}
    end
    live = live + 1
    top = i + 1
    if ARGV[6] ~= '' and r == ARGV[6] then
      same = {exp - now, r}
    end
    if not soon or exp - now < soon then
      soon, soon_run = exp - now, r or ''
    end
  elseif not free and i < limit then
    free, free_f = i, f
  end
end
if same or live >= limit or not free then
  local wait_ms = tonumber(ARGV[5])
  if wait_ms > 0 and (tonumber(v[6]) or 0) < now + wait_ms then
    -- pcall: at maxmemory the mark is refused and the caller waits all the same (it polls instead
    -- of being woken by the release signal); the answer stays "held"
    redis.pcall('HSET', KEYS[1], 'w', string.format('%.0f', now + wait_ms))
  end
  if same then
    return {0, same[1], same[2]}
  end
  if live > 1 then
    soon_run = ''
  end
  return {0, soon, soon_run}
end
local sfx = ''
if free > 0 then
  sfx = '#' .. free
end
local fence = math.max((tonumber(free_f) or 0) + 1, now_us)
local ttl = tonumber(ARGV[2])
-- integral numbers go to redis.call as such: Redis writes them with '%.17g', all their digits
redis.call('HSET', KEYS[1], 'o' .. sfx, ARGV[1] .. sfx, 'x' .. sfx, now + ttl, 'f' .. sfx, fence,
           'h' .. sfx, ARGV[3], 's' .. sfx, now, 'r' .. sfx, ARGV[6])
if v[5] then
  redis.call('HDEL', KEYS[1], 'l')
end
local m = math.max(limit, top, free + 1)
if m ~= slots then
  if m == 1 then
    redis.call('HDEL', KEYS[1], 'm')
  else
    redis.call('HSET', KEYS[1], 'm', m)
  end
end
-- the key's idle TTL, set again once it has run down by 1% (a read instead of a write when the
-- key is acquired often), and always when it would end before the lease
local idle = math.max(tonumber(ARGV[4]), ttl)
if redis.call('PTTL', KEYS[1]) < math.max(idle - math.floor(idle / 100), ttl) then
  redis.call('PEXPIRE', KEYS[1], idle)
end
if KEYS[2] and ARGV[7] == '0' then
  redis.call('DEL', KEYS[2])
end
if ARGV[10] then
  local q = redis.call('HGET', KEYS[1], 'q:' .. ARGV[10])
  if q and (string.match(q, '^(.*) %d+ ~%w+$') or string.match(q, '^(.*) %d+$')) == ARGV[11] then
    redis.call('HDEL', KEYS[1], 'q:' .. ARGV[10])
  end
end
return {1, fence, ttl, free}
""",
)

# The scripts below act on one holder's slot, named by its owner token: a token ending in '#i'
# is slot i's (its fields are suffixed '#i'); any other token is slot 0's (the plain fields). A
# plain search for '#' first: slot 0's tokens (URL-safe base64) never hold one, and the search is
# cheaper than the pattern.
_SLOT = """
local s = ''
if string.find(ARGV[1], '#', 1, true) then
  s = string.match(ARGV[1], '#%d+$') or ''
end
"""

# Redis at maxmemory (``noeviction``) refuses a script's *first* command that may grow memory
# (``HSET``, ``SET``...), never a later one: once a script has written, Redis cannot stop it half-way
# (Redis 6.2 and 7.x, Valkey). A holder's scripts (renew, claim, a lease record, the records a
# release writes) therefore write first with ``keep_ttl``: the lease key's TTL set again (kept, or
# raised to ``to`` ms when under ``floor`` ms), a write that never grows memory. A holder keeps its
# lease at maxmemory; an acquisition, whose first write is its ``HSET``, is refused: new leases fail
# closed. (``#!lua flags=allow-oom`` would need Redis 7.0, and a ``#!lua`` script without it is
# refused at maxmemory even when it only reads.)
_KEEP_TTL = """
local function keep_ttl(floor, to)
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl < floor then pttl = to end
  redis.call('PEXPIRE', KEYS[1], pttl)
end
"""

# A release re-sent by the client after it ran: the slot's release record (field ``n`` + slot
# suffix, read as v[4]) holds the call's mark ``tomb`` followed by the answer it gave (1 or 2);
# it stays until the slot's next release, so it is found even after another holder took the
# slot in between. The mark is '~' and the call's nonce (a random 64-bit value: a call of another
# owner never carries it); a holder's release is told apart before the record is read. (Older
# versions' marks also held 8 hex digits of the owner token's SHA1, and their oldest left only
# ``o`` = mark: answered 1.)
_RELEASED = """
if v[4] and string.sub(v[4], 1, #tomb) == tomb then
  return tonumber(string.sub(v[4], #tomb + 1)) or 1
end
if v[1] == tomb then
  return 1
end
"""

# KEYS[1] lease; ARGV[1] owner token, ARGV[2] TTL ms, ARGV[3] idle TTL ms of the key -> 1 renewed,
# 0 not the owner (or expired). An expired lease is never revived, and a renewal only ever extends:
# a late renewal with a short TTL (a heartbeat round racing a retry's stretch) cannot cut a longer
# expiry back. When the key's own life runs shorter than the lease, it is given the idle TTL again
# (once per idle period, not per renewal), so the fence and the lease records outlive a holder that
# held the lease for longer than the idle TTL and then died. Works at maxmemory (see ``_KEEP_TTL``).
RENEW = Script(
    "renew",
    _NOW
    + _SLOT
    + _KEEP_TTL
    + """
local v = redis.call('HMGET', KEYS[1], 'o' .. s, 'x' .. s)
local exp = tonumber(v[2])
if v[1] ~= ARGV[1] or not exp or exp <= now then
  return 0
end
local ttl = tonumber(ARGV[2])
if now + ttl > exp then
  keep_ttl(ttl, math.max(ttl, tonumber(ARGV[3])))  -- first: at maxmemory the HSET then goes through
  redis.call('HSET', KEYS[1], 'x' .. s, now + ttl)
end
return 1
""",
)

# KEYS[1] lease, optional KEYS[2] finished marker of the finishing run
# ARGV[1] owner token, ARGV[2] idle TTL ms of the key, ARGV[3] finished marker TTL ms (with
# KEYS[2]), ARGV[4] a random nonce unique to this release call, ARGV[5] the identity of the run
# that finished ('': the run did not finish, e.g. it hands its message back)
# -> 1 released, 2 released and someone waits (the caller then signals), 0 not the owner (or
#    expired). A finishing run is named the key's last finished run (field ``l``) and, with
#    KEYS[2], gets its own marker, set whether or not the lease was still held: the run is over.
# Re-sent: the slot's release record ``n`` (``_RELEASED``) keeps the call's nonce with its answer,
# so a client re-send of this very call answers as it did (also after the next holder took the
# slot); a new release call with the same token answers 0; another owner's call never matches.
# At maxmemory: the holder's first write is the HDEL, the marker's is ``keep_ttl`` (``_KEEP_TTL``), so
# the release and its marker go through.
RELEASE = Script(
    "release",
    _NOW
    + _SLOT
    + """
local v = redis.call('HMGET', KEYS[1], 'o' .. s, 'x' .. s, 'w', 'n' .. s)
-- this call's mark: its nonce and 8 hex digits of the owner token's SHA1 (never the token), so
-- that a re-send of this very call answers as it did and another owner's call never matches
local tomb = '~' .. ARGV[4] .. string.sub(redis.sha1hex(ARGV[1]), 1, 8)
local exp = tonumber(v[2])
if v[1] == ARGV[1] and exp and exp > now then
  local code = 1
  if (tonumber(v[3]) or 0) > now then
    code = 2
  end
  -- the held fields go (the owner token too: an idle key keeps only its fence and release record)
  redis.call('HDEL', KEYS[1], 'o' .. s, 'x' .. s, 'h' .. s, 's' .. s, 'r' .. s, 'w')
  if ARGV[5] ~= '' then
    redis.call('HSET', KEYS[1], 'n' .. s, tomb .. code, 'l', ARGV[5])
  else
    redis.call('HSET', KEYS[1], 'n' .. s, tomb .. code)
  end
  if KEYS[2] then
    redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[3])
  end
  return code
end
"""
    + _RELEASED
    + _KEEP_TTL
    + """
if KEYS[2] then
  keep_ttl(1, tonumber(ARGV[2]))  -- first: at maxmemory the marker then goes through
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
end
return 0
""",
)

# A release that also stores the run's completion record (``once=True``, :mod:`taskguard.once`),
# atomically: no call can find the lease free and the record missing after a run completed.
# KEYS[1] lease, KEYS[2] the completion record, optional KEYS[3] finished marker
# ARGV[1] owner token, ARGV[2] idle TTL ms of the key, ARGV[3] finished marker TTL ms (with KEYS[3]), ARGV[4] a
# nonce unique to this call, ARGV[5] the identity of the run that finished, ARGV[6] the record,
# ARGV[7] the record's TTL ms
# -> as RELEASE (and re-sent, answers as RELEASE does). The record is written whether or not the
#    lease was still held (the run did complete), and never over an existing record: the first
#    completion stored stays (a run that lost its lease and one that took the key over cannot
#    replace each other's record). At maxmemory the record is written all the same (its first
#    write never grows memory, as for RELEASE): its size is bounded by ``once_max_bytes``.
RELEASE_STORING = Script(
    "release_storing",
    _NOW
    + _SLOT
    + """
local v = redis.call('HMGET', KEYS[1], 'o' .. s, 'x' .. s, 'w', 'n' .. s)
-- this call's mark: its nonce and 8 hex digits of the owner token's SHA1 (never the token), so
-- that a re-send of this very call answers as it did and another owner's call never matches
local tomb = '~' .. ARGV[4] .. string.sub(redis.sha1hex(ARGV[1]), 1, 8)
local exp = tonumber(v[2])
if v[1] == ARGV[1] and exp and exp > now then
  local code = 1
  if (tonumber(v[3]) or 0) > now then
    code = 2
  end
  redis.call('HDEL', KEYS[1], 'o' .. s, 'x' .. s, 'h' .. s, 's' .. s, 'r' .. s, 'w')
  redis.call('HSET', KEYS[1], 'n' .. s, tomb .. code, 'l', ARGV[5])
  redis.call('SET', KEYS[2], ARGV[6], 'PX', ARGV[7], 'NX')
  if KEYS[3] then
    redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[3])
  end
  return code
end
"""
    + _RELEASED
    + _KEEP_TTL
    + """
keep_ttl(1, tonumber(ARGV[2]))  -- first: at maxmemory the record then goes through
redis.call('SET', KEYS[2], ARGV[6], 'PX', ARGV[7], 'NX')
if KEYS[3] then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
end
return 0
""",
)

# A queued mark "<run id> <expiry ms> ~<nonce>" (or "<run id> <expiry ms>", written by older
# versions) -> run id, expiry, nonce (nil for an old mark); nil for anything else (a cleared mark).
_MARK = """
local function mark(q)
  local id, exp, nonce = string.match(q, '^(.*) (%d+) ~(%w+)$')
  if id then
    return id, exp, nonce
  end
  id, exp = string.match(q, '^(.*) (%d+)$')
  return id, exp, nil
end
"""

# Publish-time uniqueness (``unique=True``): one queued run per (key, task), marked in the lease
# hash itself (field ``q:TASK`` = "<run id> <expiry ms>"), so the check and the mark are one
# single-key script, atomic with the lease: a publish finds the run of the same task that is
# queued (an unexpired mark) or running (a live holder whose metadata names the task: its task /
# job id), else marks itself. Another task sharing the key never suppresses it.
# KEYS[1] lease; ARGV[1] the new run's id, ARGV[2] mark TTL ms, ARGV[3] idle TTL ms of the key,
# ARGV[4] the task (job) name, ARGV[5] a nonce unique to this call (letters and digits)
# -> {1, ARGV[1]} marked: publish it; {0, id} a run is queued or running: that one's id.
# The mark is "<run id> <expiry ms> ~<nonce>" (``_MARK`` reads it, and the nonce-less marks of
# older versions): a client re-send of this very call finds its own nonce and answers {1, ARGV[1]}
# again (a new call with the same run id answers {0, run id}: that run is queued).
QUEUE = Script(
    "queue",
    _NOW
    + _MARK
    + """
local v = redis.call('HMGET', KEYS[1], 'q:' .. ARGV[4], 'm')
if v[1] then
  local id, exp, nonce = mark(v[1])
  if id and tonumber(exp) > now then
    if nonce and nonce == ARGV[5] then
      return {1, id}
    end
    return {0, id}
  end
end
local n = tonumber(v[2]) or 1
for i = 0, n - 1 do
  local s = ''
  if i > 0 then s = '#' .. i end
  local h = redis.call('HMGET', KEYS[1], 'x' .. s, 'h' .. s)
  local exp = tonumber(h[1])
  if exp and exp > now and h[2] then
    local ok, meta = pcall(cjson.decode, h[2])
    if ok and type(meta) == 'table' and (meta['task'] == ARGV[4] or meta['job'] == ARGV[4]) then
      local id = meta['task_id'] or meta['job_id']
      if type(id) == 'string' and id ~= '' then
        return {0, id}
      end
    end
  end
end
local ttl = tonumber(ARGV[2])
-- the key lives at least as long as the mark; a key made only for the mark goes with it (an
-- acquisition gives it the idle TTL of a fence)
local pttl = redis.call('PTTL', KEYS[1])
redis.call('HSET', KEYS[1], 'q:' .. ARGV[4], ARGV[1] .. ' ' .. string.format('%.0f', now + ttl) .. ' ~' .. ARGV[5])
if pttl < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {1, ARGV[1]}
""",
)

# KEYS[1] lease; ARGV[1] a run id, ARGV[2] the task name, ARGV[3] a nonce unique to this call,
# ARGV[4] the nonce of the QUEUE call whose mark to clear ('' or absent: whichever call wrote it;
# given by a publish that failed before it read QUEUE's answer, so that it never clears the mark of
# an earlier publish of the same run id)
# -> 1 the task's queued mark named that run (written by that call) and is cleared, 0 it did not.
# The cleared mark is replaced by "~<nonce>" (never read as a mark; overwritten by the next mark,
# gone with the key), so a client re-send of this very call answers 1 again.
UNQUEUE = Script(
    "unqueue",
    _MARK
    + """
local q = redis.call('HGET', KEYS[1], 'q:' .. ARGV[2])
if q == '~' .. ARGV[3] then
  return 1
end
local id, _, nonce
if q then
  id, _, nonce = mark(q)
end
if id == ARGV[1] and (not ARGV[4] or ARGV[4] == '' or nonce == ARGV[4]) then
  redis.call('HDEL', KEYS[1], 'q:' .. ARGV[2])
  redis.call('HSET', KEYS[1], 'q:' .. ARGV[2], '~' .. ARGV[3])
  return 1
end
return 0
""",
)

# KEYS[1] release signal; ARGV[1] signal TTL ms: wake one waiter (a one-element list that a
# blocked BLPOP pops, expiring by itself). Sent after a release that answered 2.
SIGNAL = Script(
    "signal",
    """
redis.call('DEL', KEYS[1])
redis.call('RPUSH', KEYS[1], '1')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
""",
)

# One-shot claim of a persisted handle: swap the owner token, keep the fence, record the holder.
# KEYS[1] lease; ARGV[1] persisted owner token, ARGV[2] new owner token (same slot suffix), ARGV[3] TTL ms,
# ARGV[4] holder JSON, ARGV[5] run id ('' if none), ARGV[6] idle TTL ms of the key (as for RENEW)
# -> {1, fence} claimed; {0, ms left} another owner holds it; {0, -2} no live lease. Works at
# maxmemory (``_KEEP_TTL``).
CLAIM = Script(
    "claim",
    _NOW
    + _SLOT
    + _KEEP_TTL
    + """
local v = redis.call('HMGET', KEYS[1], 'o' .. s, 'x' .. s, 'f' .. s)
local exp = tonumber(v[2])
if not exp or exp <= now then
  return {0, -2}
end
if v[1] == ARGV[1] then
  local ttl = tonumber(ARGV[3])
  keep_ttl(ttl, math.max(ttl, tonumber(ARGV[6])))  -- first: at maxmemory the HSET then goes through
  redis.call('HSET', KEYS[1], 'o' .. s, ARGV[2], 'h' .. s, ARGV[4], 'r' .. s, ARGV[5], 'x' .. s,
             string.format('%.0f', now + ttl))
  return {1, tonumber(v[3])}
end
if v[1] == ARGV[2] then  -- a client retry of this very claim, which did run (idempotent)
  return {1, tonumber(v[3])}
end
return {0, exp - now}
""",
)

# Release without the owner token: on behalf of a run known to be over (e.g. by a Celery worker's
# main process after its child died), or by an operator's force. KEYS[1] lease; ARGV[1] the run
# id whose lease to release ('' = every holder), ARGV[2] a nonce unique to this call, ARGV[3] the
# fencing token that lease must carry ('' or absent = any: a supervisor that checked the holder passes the
# token it saw, so a later lease of the same run id, taken meanwhile, is never released)
# -> 1 released, 2 released and someone waits, 0 no slot is held by that run (or none is held).
# Re-sent: each slot it released keeps "~<nonce>:" and the answer as its release record (``n``,
# as RELEASE), so a client re-send of this very call answers as it did.
RELEASE_WITHOUT_TOKEN = Script(
    "release_without_token",
    _NOW
    + """
local n = tonumber(redis.call('HGET', KEYS[1], 'm')) or 1
local tomb = '~' .. ARGV[2] .. ':'
local freed = {}
for i = 0, n - 1 do
  local s = ''
  if i > 0 then s = '#' .. i end
  local v = redis.call('HMGET', KEYS[1], 'x' .. s, 'r' .. s, 'n' .. s, 'f' .. s)
  if v[3] and string.sub(v[3], 1, #tomb) == tomb then
    return tonumber(string.sub(v[3], #tomb + 1)) or 1
  end
  local exp = tonumber(v[1])
  if exp and exp > now and (ARGV[1] == '' or v[2] == ARGV[1])
     and (not ARGV[3] or ARGV[3] == '' or tonumber(v[4]) == tonumber(ARGV[3])) then
    freed[#freed + 1] = s
    if ARGV[1] ~= '' then break end
  end
end
if #freed == 0 then
  return 0
end
local code = 1
if (tonumber(redis.call('HGET', KEYS[1], 'w')) or 0) > now then
  code = 2
end
for _, s in ipairs(freed) do
  redis.call('HDEL', KEYS[1], 'x' .. s, 'h' .. s, 's' .. s, 'r' .. s)
  redis.call('HSET', KEYS[1], 'o' .. s, '~', 'n' .. s, tomb .. code)
end
if code == 2 then
  redis.call('HDEL', KEYS[1], 'w')
end
return code
""",
)

# KEYS[1] lease -> the live holders, flat: {slot, holder JSON, fence, ms left, since ms, run id, ...}
# (empty when none). Never returns an owner token.
HOLDERS = Script(
    "holders",
    _NOW
    + """
local n = tonumber(redis.call('HGET', KEYS[1], 'm')) or 1
local out = {}
for i = 0, n - 1 do
  local s = ''
  if i > 0 then s = '#' .. i end
  local v = redis.call('HMGET', KEYS[1], 'h' .. s, 'f' .. s, 'x' .. s, 's' .. s, 'r' .. s)
  local exp = tonumber(v[3])
  if exp and exp > now then
    for _, e in ipairs({i, v[1] or '', v[2] or '', exp - now, v[4] or '', v[5] or ''}) do
      table.insert(out, e)
    end
  end
end
return out
""",
)

# KEYS[1] lease; ARGV[1] owner token -> ms left when owned, -2 when not owned.
OWNS = Script(
    "owns",
    _NOW
    + _SLOT
    + """
local v = redis.call('HMGET', KEYS[1], 'o' .. s, 'x' .. s)
local exp = tonumber(v[2])
if v[1] == ARGV[1] and exp and exp > now then
  return exp - now
end
return -2
""",
)


# KEYS[1] record; ARGV[1] value, ARGV[2] TTL ms, ARGV[3] condition: 'any' (always), 'absent' (only
# if no record exists), 'eq' (only if the record exists and equals ARGV[4]), 'absent_or_eq' (no
# record, or one equal to ARGV[4]) -> 1 written, 0 the condition did not hold.
# Not answered as the first send when re-sent (with DELETE_RECORD, the only ones besides THROTTLE):
# a plain string record has no room for a call's nonce that its readers would not see, and two
# calls writing the same value must stay apart (``if_absent`` with a fixed value is a claim). A
# conditional write re-sent after it ran answers 0: callers that must tell that apart write a
# value unique to the call and read it back (the adapters' deferral records do).
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
# 0 absent or holding another value (so 0 when re-sent after it deleted: see PUT_RECORD).
DELETE_RECORD = Script(
    "delete_record",
    """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
return redis.call('DEL', KEYS[1])
""",
)


# A write fenced by the lease itself: the record lives in the lease's hash (field ``d:NAME``), so
# the ownership check and the write are one single-key script.
# KEYS[1] lease; ARGV[1] owner token, ARGV[2] field, ARGV[3] value, ARGV[4] condition (as for
# PUT_RECORD), ARGV[5] the value expected by 'eq' / 'absent_or_eq'
# -> 1 written (or it already holds exactly this value: a client retry of this call), 0 the
#    condition did not hold, -1 this owner does not hold the lease (nothing written). Works at
#    maxmemory (``_KEEP_TTL``): a holder's records (beat's slot claims) go on being written.
PUT_LEASE_RECORD = Script(
    "put_lease_record",
    _NOW
    + _SLOT
    + _KEEP_TTL
    + """
local v = redis.call('HMGET', KEYS[1], 'o' .. s, 'x' .. s, ARGV[2])
local exp = tonumber(v[2])
if v[1] ~= ARGV[1] or not exp or exp <= now then
  return -1
end
local cur = v[3]
if cur == ARGV[3] then return 1 end
local cond = ARGV[4]
if cond == 'absent' and cur then return 0 end
if cond == 'eq' and cur ~= ARGV[5] then return 0 end
if cond == 'absent_or_eq' and cur and cur ~= ARGV[5] then return 0 end
keep_ttl(exp - now, exp - now)  -- first: at maxmemory the HSET then goes through
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
""",
)


# A cluster-wide rate, by the generic cell rate algorithm (GCRA), weighted: one key holding the
# theoretical arrival time (TAT) of the next cost unit, in server microseconds, and, while a back-off
# pause is on, the instant it ends ("TAT" or "TAT PAUSE", both server µs). A call of cost ``c`` at
# ``now`` passes when ``max(TAT, now) - tau <= now`` (``tau = (burst - c) x interval``) and no pause
# is on, and moves TAT on by ``c`` emission intervals. A pause acts as if the rate's clock stood at
# its end: ``tat = max(TAT, now, PAUSE)`` and the wait is at least until the pause ends, so a call
# denied during a pause books a turn after it.
# KEYS[1] throttle; ARGV[1] emission interval µs of one cost unit (period / count), ARGV[2] tau µs
# ((burst - cost) x interval), ARGV[3] booking horizon µs (0: never book; mode '4': the pause µs),
# ARGV[4] mode: '0' a call (counted; absent: '0'), '1' check only (shadow mode: the answer a call
# would get, nothing counted or booked), '2' the re-check of a booked turn (passes, counting
# nothing, unless a pause is on; then a call), '3' settle: add ARGV[5] cost units (may be
# negative) to TAT without a check (never below now), '4' pause: no call passes for ARGV[3] µs
# from now (a longer pause already on stays); ARGV[5] the call's cost in units (absent: 1)
# -> {1, 0, remaining units, 0} passed; {0, wait µs, 0, paused} denied; {2, wait µs, 0, paused}
#    denied and booked: the caller's turn is reserved ``wait`` from now (TAT moved on for it), so
#    denied callers get distinct turns instead of all coming back at once; ``paused`` 1 when a pause
#    is on (the wait lasts at least until it ends). Mode '4' answers {0, µs until the pause ends, 0, 1}.
# Not idempotent under a client retry (a re-sent call counts twice, erring on the strict side).
THROTTLE = Script(
    "throttle",
    _NOW
    + """
local interval = tonumber(ARGV[1])
local tau = tonumber(ARGV[2])
local mode = ARGV[4] or '0'
local cost = tonumber(ARGV[5] or '1')
local raw = redis.call('GET', KEYS[1])
local stored, pause = 0, 0
if raw then
  local a, b = string.match(raw, '^(%d+) ?(%d*)$')
  stored = tonumber(a) or 0
  pause = tonumber(b) or 0
end
local function store(tat, p)
  local value = string.format('%.0f', tat)
  local last = tat
  if p > now_us then
    value = value .. ' ' .. string.format('%.0f', p)
    if p > last then last = p end
  end
  redis.call('SET', KEYS[1], value, 'PX', math.floor((last - now_us) / 1000) + 1)
end
if mode == '4' then
  local p = math.max(pause, now_us + tonumber(ARGV[3]))
  store(math.max(stored, now_us), p)
  return {0, p - now_us, 0, 1}
end
if mode == '3' then
  store(math.max(math.max(stored, now_us) + cost * interval, now_us), pause)
  return {1, 0, 0, 0}
end
local paused = 0
if pause > now_us then paused = 1 end
if mode == '2' and paused == 0 then
  return {1, 0, 0, 0}
end
local tat = math.max(stored, now_us, pause)
local wait = math.max(tat - tau - now_us, pause - now_us)
local new_tat = tat + interval * cost
if wait <= 0 then
  if mode ~= '1' then store(new_tat, pause) end
  local remaining = math.floor((now_us + tau - tat) / interval)
  if remaining < 0 then remaining = 0 end
  return {1, 0, remaining, 0}
end
if tonumber(ARGV[3]) > 0 and wait <= tonumber(ARGV[3]) and mode ~= '1' then
  store(new_tat, pause)
  return {2, wait, 0, paused}
end
return {0, wait, 0, paused}
""",
)
