#!/usr/bin/env python
"""A torture run of every guard: the faults of ``torture.py`` (SIGKILL, SIGSTOP, cut and delayed
connections; :mod:`torture_faults`) against ``limit=N``, ``once``, ``unique``, ``throttle`` and
the beat leader's slot claims, each checked by a ledger kept on Redis outside the proxy.

Run from the repository root:

    .venv/bin/python bench/torture_guards.py GUARD [--ops 10000] [--seconds 900] [--unguarded] [--url URL]

``GUARD`` is ``limit``, ``once``, ``unique``, ``throttle``, ``beat`` or ``all``. Worker processes
reach Redis through the suite's TCP proxy (``tests/tcp_proxy.py``) and write what they saw to
lists on Redis directly; the parent injects a fault every 0.1-0.3 s (beat: 0.5-1.5 s) until
``--ops`` operations are done or ``--seconds`` have passed, stops them and checks:

* ``limit``: 10 processes on 2 keys, ``acquire(limit=3, ttl=0.5, renew=True, wait=0.2)``; a
  holder records its entry after the acquire and its exit before the release, on a sequence
  counter. Among the holds that were held throughout (their release found them held), at most 3
  inside a key at once, and each slot's fencing tokens strictly increase in entry order.
* ``once``: 8 processes call ``Locks.once`` on keys that change every 16 calls (4 per group); a
  call that gets the stored value back (its body did not run) records it. Every value read for a
  key is the same, and is the key's completion record at the end: one stored value, never
  replaced.
* ``unique``: 4 publishers ``mark_queued`` then push to a queue list (5 % of publishes fail on
  purpose; cut connections fail others) and ``clear_queued`` a failed publish, as the adapters
  do; 4 runners pop and ``acquire`` with the task and run id in the holder metadata and the
  run's ``queued_mark`` (the acquisition clears it), ``clear_queued`` when skipped, then
  release. No publish is suppressed by a run whose mark was cleared before the publish asked
  (the run over, or its publish failed); no mark is left naming such a run, nor set for longer
  than its TTL; no mark outlives its run's acquisition (read directly after each acquisition,
  and at the end), whatever process is killed when.
* ``throttle``: 8 processes call ``Locks.throttle`` on an unweighted rate (20/s, burst 5) and a
  weighted one (60 units/s, burst 10, costs 1-4), each call bracketed by two reads of the Redis
  server's ``TIME``. For every window the admitted cost inside it is at most ``burst + rate x
  (the window's length)`` (the brackets make the check conservative: no false alarm).
* ``beat``: 4 scheduler processes (``PeriodicScheduler``, leader TTL 1 s, loop 0.2 s) publish 100
  entries every 4 s to a queue list; a consumer (not faulted) runs each message under the slot's
  run id as a worker does (``refuse_finished``), and a leader that finds its slot record confirmed
  writes a confirmation. Every slot is published (none lost), none is published again after its
  confirmation by a leader as recent, and none runs twice.

``--unguarded`` runs the same workers without the guard (the checks must then fail: the torture is
not vacuous). Prints operations, faults, the guard's figures and **violations** (must be 0; exits 1
otherwise). Keys live under a fresh prefix and are deleted at the end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import redis  # noqa: E402
from benchlib import arg_parser, cleanup, exit_on_sigterm, open_admin, run_prefix  # noqa: E402
from redis.backoff import NoBackoff  # noqa: E402
from redis.retry import Retry  # noqa: E402
from torture_faults import Chaos, exit_on_term, start_process  # noqa: E402

TTL = 0.5


def server_time(client) -> float:
    """The Redis server's clock, Unix seconds."""
    sec, usec = client.time()
    return sec + usec / 1e6


def _clients(proxy_url: str, direct_url: str, prefix: str):
    from taskguard import RedisLocks

    logging.getLogger("taskguard").setLevel(logging.CRITICAL)  # the faults' warnings, by the thousand
    locks = RedisLocks(redis.Redis.from_url(proxy_url, socket_timeout=1, socket_connect_timeout=1), prefix=prefix)
    return locks, redis.Redis.from_url(direct_url, decode_responses=True)


def _no_retry(url: str) -> redis.Redis:
    """A client that never re-sends a command (a re-sent push would queue a message twice)."""
    return redis.Redis.from_url(
        url, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0), decode_responses=True
    )


# -- limit=N -----------------------------------------------------------------------------------------
LIMIT, LIMIT_KEYS = 3, 2
FENCED = """
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < last then
  redis.call('INCR', KEYS[2])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""


def limit_worker(proxy_url: str, url: str, prefix: str, seed: int, unguarded: bool) -> None:
    from taskguard import LeaseBackendError

    exit_on_term()
    rng = random.Random(seed)
    locks, store = _clients(proxy_url, url, prefix)
    ledger = store.register_script(FENCED)
    n = 0
    while True:
        key = f"k{rng.randrange(LIMIT_KEYS)}"
        if unguarded:
            n += 1
            lease, slot, fence = None, 0, n
        else:
            try:
                acq = locks.acquire(key, ttl=TTL, renew=True, wait=0.2, limit=LIMIT)
            except LeaseBackendError:
                time.sleep(0.05)
                continue
            if not acq.acquired:
                continue
            lease = acq.lease
            slot, fence = lease.slot, lease.fencing_token
        hold = f"{os.getpid()}-{slot}-{fence}"
        store.rpush(f"{prefix}:events:{key}", f"i {store.incr(f'{prefix}:seq')} {slot} {fence} {hold}")
        store.incr(f"{prefix}:ops")
        time.sleep(rng.uniform(0, 0.02))
        ledger(keys=[f"{prefix}:last:{key}:{slot}", f"{prefix}:rejected"], args=[fence])
        store.rpush(f"{prefix}:events:{key}", f"o {store.incr(f'{prefix}:seq')} {slot} {fence} {hold}")
        if lease is not None:
            try:
                held = lease.release()
            except LeaseBackendError:
                held = False
            if not held or lease.lost:
                continue
        store.sadd(f"{prefix}:clean:{key}", hold)


def check_limit(events: list[str], clean: set[str], limit: int) -> dict[str, int]:
    """The ledger of one key (``"<i|o> <seq> <slot> <fence> <hold>"`` lines) restricted to the holds
    held throughout (``clean``): ``peak`` holders inside at once, ``over`` entries that took it
    above ``limit``, ``regressions`` entries whose fence was not above the slot's previous one."""
    inside: set[str] = set()
    last: dict[int, int] = {}
    peak = over = regressions = 0
    for line in sorted(events, key=lambda e: int(e.split()[1])):
        kind, _seq, slot, fence, hold = line.split()
        if hold not in clean:
            continue
        if kind == "i":
            inside.add(hold)
            peak = max(peak, len(inside))
            over += len(inside) > limit
            if int(fence) <= last.get(int(slot), 0):
                regressions += 1
            last[int(slot)] = int(fence)
        else:
            inside.discard(hold)
    return {"peak": peak, "over": over, "regressions": regressions}


def limit_report(admin, prefix: str) -> tuple[list[str], int]:
    peak = over = regressions = holds = 0
    for k in range(LIMIT_KEYS):
        clean = admin.smembers(f"{prefix}:clean:k{k}")
        holds += len(clean)
        r = check_limit(admin.lrange(f"{prefix}:events:k{k}", 0, -1), clean, LIMIT)
        peak, over, regressions = max(peak, r["peak"]), over + r["over"], regressions + r["regressions"]
    rejected = int(admin.get(f"{prefix}:rejected") or 0)
    return [
        f"holds held throughout {holds:,}; peak holders of a key {peak} (limit {LIMIT})",
        f"stale writes rejected by the per-slot fence: {rejected}",
        f"violations: {over + regressions} ({over} entries above the limit, {regressions} fence regressions)",
    ], over + regressions


# -- once ---------------------------------------------------------------------------------------------
ONCE_GROUP, ONCE_KEYS = 16, 4


def once_key(prefix: str, key: str) -> str:
    """The completion record's Redis key (``{P:K}:once``, :mod:`taskguard.scripts`)."""
    return f"{{{prefix}:{key}}}:once"


def stored_value(raw: str | None):
    return None if raw is None else json.loads(json.loads(raw)["v"])


def once_worker(proxy_url: str, url: str, prefix: str, seed: int, unguarded: bool) -> None:
    from taskguard import LeaseBackendError, LeaseLost, Skipped

    exit_on_term()
    rng = random.Random(seed)
    locks, store = _clients(proxy_url, url, prefix)
    while True:
        c = store.incr(f"{prefix}:calls")
        key = f"g{c // ONCE_GROUP}:{rng.randrange(ONCE_KEYS)}"
        ran = []

        def body(lease, key=key, ran=ran):
            value = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            ran.append(value)
            store.incr(f"{prefix}:bodies")
            time.sleep(rng.uniform(0, 0.02))
            return value

        if unguarded:
            got = stored_value(store.get(once_key(prefix, key)))
            if got is None:
                value = body(None)
                store.set(once_key(prefix, key), json.dumps({"fp": "", "v": json.dumps(value)}), ex=600)
                got = value
        else:
            try:
                got = locks.once(key, body, ttl=TTL, wait=0.2, renew=True, once_ttl=600)
            except (LeaseBackendError, LeaseLost):
                continue
            if isinstance(got, Skipped):
                continue
        store.incr(f"{prefix}:ops")
        store.sadd(f"{prefix}:keys", key)
        if not ran:  # the stored value, read back (the body did not run in this call)
            store.rpush(f"{prefix}:read:{key}", got)


def check_once(reads: dict[str, list[str]], stored: dict[str, str | None]) -> dict[str, int]:
    """``replaced``: keys whose reads saw more than one value, or a value other than the stored one."""
    replaced = sum(1 for k, vs in reads.items() if vs and (len(set(vs)) > 1 or stored.get(k) != vs[0]))
    return {"replaced": replaced, "reads": sum(len(v) for v in reads.values())}


def once_report(admin, prefix: str) -> tuple[list[str], int]:
    keys = sorted(admin.smembers(f"{prefix}:keys"))
    reads = {k: admin.lrange(f"{prefix}:read:{k}", 0, -1) for k in keys}
    stored = {k: stored_value(admin.get(once_key(prefix, k))) for k in keys}
    r = check_once(reads, stored)
    bodies = int(admin.get(f"{prefix}:bodies") or 0)
    completed = sum(v is not None for v in stored.values())
    return [
        f"keys {len(keys):,}, completed {completed:,}; bodies run {bodies:,} (a body whose run was killed or "
        "lost before its release stores nothing: the next call runs it again)",
        f"stored values read back {r['reads']:,}",
        f"violations: {r['replaced']} (keys whose stored value was seen to change)",
    ], r["replaced"]


# -- unique -------------------------------------------------------------------------------------------
TASK, UNIQUE_KEYS, MARK_TTL, PUBLISHERS = "torture.unique", 6, 2.0, 4


def publisher(proxy_url: str, url: str, prefix: str, seed: int, unguarded: bool) -> None:
    from taskguard import LeaseBackendError

    exit_on_term()
    rng = random.Random(seed)
    locks, store = _clients(proxy_url, url, prefix)
    broker = _no_retry(proxy_url)
    n = 0
    while True:
        n += 1
        key, run = f"k{rng.randrange(UNIQUE_KEYS)}", f"{os.getpid()}-{n}"
        asked = store.incr(f"{prefix}:seq")
        try:
            marked, existing = locks.mark_queued(key, run, ttl=MARK_TTL, task=TASK)
        except LeaseBackendError:
            continue
        store.incr(f"{prefix}:ops")
        if not marked:
            store.rpush(f"{prefix}:suppressed", f"{asked} {key} {existing}")
            time.sleep(rng.uniform(0, 0.01))
            continue
        refused = rng.random() < 0.05
        try:
            if refused:
                raise RuntimeError("the broker refused the message")
            broker.rpush(f"{prefix}:queue", f"{key} {run}")
        except (RuntimeError, redis.RedisError):
            store.incr(f"{prefix}:publish_failed")
            try:
                cleared = unguarded or locks.clear_queued(key, run, TASK)
            except LeaseBackendError:
                store.incr(f"{prefix}:clear_failed")  # its TTL bounds it
                continue
            if refused and cleared:  # certainly not queued (a cut push may have gone through)
                store.hset(f"{prefix}:cleared", run, store.incr(f"{prefix}:seq"))


def runner(proxy_url: str, url: str, prefix: str, seed: int, unguarded: bool) -> None:
    from taskguard import LeaseBackendError

    exit_on_term()
    rng = random.Random(seed)
    locks, store = _clients(proxy_url, url, prefix)
    broker = _no_retry(proxy_url)
    while True:
        try:
            item = broker.blpop([f"{prefix}:queue"], timeout=0.5)
        except redis.RedisError:
            time.sleep(0.05)
            continue
        if item is None:
            continue
        key, run = item[1].split()
        try:
            # as the adapters do: the acquisition itself clears the run's mark (one script)
            mark = None if unguarded else (TASK, run)
            acq = locks.acquire(
                key, ttl=TTL, renew=True, holder={"task": TASK, "task_id": run}, run_id=run, queued_mark=mark
            )
        except LeaseBackendError:
            continue  # it will not run (or its lease runs out): a worker would get the message again
        if acq.acquired:
            store.hset(f"{prefix}:started", run, 1)
            # read past the proxy: the mark must be gone by the time the acquisition answered
            left = store.hget(f"{{{prefix}:{key}}}", f"q:{TASK}")
            if left is not None and left.split(" ")[0] == run:
                store.incr(f"{prefix}:outlived")
            cleared = True
        else:  # skipped (the key is held): it will not run, no longer queued
            try:
                cleared = unguarded or locks.clear_queued(key, run, TASK)
            except LeaseBackendError:
                store.incr(f"{prefix}:clear_failed")
                cleared = False
        store.incr(f"{prefix}:runs" if acq.acquired else f"{prefix}:skipped")
        held = True
        if acq.acquired:
            time.sleep(rng.uniform(0, 0.02))
            try:
                held = acq.lease.release()
            except LeaseBackendError:
                held = False
        if cleared and held:  # over, and no longer marked
            store.hset(f"{prefix}:cleared", run, store.incr(f"{prefix}:seq"))


def check_unique(suppressed: list[str], cleared: dict[str, str]) -> int:
    """Publishes (``"<seq asked> <key> <existing run>"``) suppressed by a run whose mark was cleared
    (and which was over, or never published) before the publish asked."""
    stale = 0
    for line in suppressed:
        asked, _key, existing = line.split()
        if existing in cleared and int(cleared[existing]) < int(asked):
            stale += 1
    return stale


def left_marks(marks: dict[str, str | None], cleared: dict[str, str], now_ms: int) -> int:
    """Marks (``"<run> <expiry ms> ~<nonce>"``) left naming a cleared run, or expiring later than a
    mark's TTL from ``now_ms``."""
    bad = 0
    for mark in marks.values():
        parts = (mark or "").split()
        if len(parts) < 2 or parts[0].startswith("~"):
            continue
        run, expiry = parts[0], int(parts[1])
        bad += run in cleared or expiry > now_ms + MARK_TTL * 1000
    return bad


def unique_report(admin, prefix: str) -> tuple[list[str], int]:
    cleared = admin.hgetall(f"{prefix}:cleared")
    suppressed = admin.lrange(f"{prefix}:suppressed", 0, -1)
    stale = check_unique(suppressed, cleared)
    marks = {f"k{k}": admin.hget(f"{{{prefix}:k{k}}}", f"q:{TASK}") for k in range(UNIQUE_KEYS)}
    left = left_marks(marks, cleared, int(server_time(admin) * 1000))
    n = {
        k: int(admin.get(f"{prefix}:{k}") or 0)
        for k in ("runs", "skipped", "publish_failed", "clear_failed", "outlived")
    }
    started = set(admin.hkeys(f"{prefix}:started"))
    left_started = sum(1 for m in marks.values() if m and m.split(" ")[0] in started)
    outlived = n["outlived"] + left_started
    bad = stale + left + outlived
    return [
        f"suppressed publishes {len(suppressed):,}; runs {n['runs']:,} (+{n['skipped']:,} skipped: key held); "
        f"publishes failed {n['publish_failed']:,}",
        f"clears of a skipped run's or failed publish's mark that failed (left to its {MARK_TTL:g} s TTL) "
        f"{n['clear_failed']:,}",
        f"violations: {bad} ({stale} publishes suppressed by a cleared run, {left} marks left, "
        f"{outlived} marks that outlived their run's acquisition)",
    ], bad


# -- throttle -----------------------------------------------------------------------------------------
#: key -> (count, period, burst, largest cost)
RATES = {"unweighted": (20, 1.0, 5, 1), "weighted": (60, 1.0, 10, 4)}


def throttle_worker(proxy_url: str, url: str, prefix: str, seed: int, unguarded: bool) -> None:
    from taskguard import LeaseBackendError

    exit_on_term()
    rng = random.Random(seed)
    locks, store = _clients(proxy_url, url, prefix)

    while True:
        key = rng.choice(list(RATES))
        count, period, burst, most = RATES[key]
        cost = rng.randint(1, most)
        before = server_time(store)
        if unguarded:
            allowed, wait = True, 0.0
        else:
            try:
                t = locks.throttle(key, rate=(count, period), burst=burst, cost=cost)
            except LeaseBackendError:
                time.sleep(0.05)
                continue
            allowed, wait = t.allowed, t.retry_after
        after = server_time(store)
        store.incr(f"{prefix}:ops")
        if allowed:
            store.rpush(f"{prefix}:admitted:{key}", f"{before:.6f} {after:.6f} {cost}")
        if not allowed:
            time.sleep(min(wait, 0.02))


def check_throttle(admitted: list[str], count: int, period: float, burst: int, horizon: float = 30.0) -> dict:
    """Admissions ``"<before> <after> <cost>"`` (server seconds bracketing each admitted call). For
    every window ``[a, b]`` (``a`` a ``before``, ``b`` an ``after``, at most ``horizon`` long), the
    cost of the calls certainly inside it (bracket within it) must be at most ``burst + (b - a) x
    count / period``. Returns ``violations`` (windows over) and ``excess``: the largest admitted cost
    minus its bound over all windows, in units (> 0: over; close to 0: a window filled to the bound)."""
    calls = sorted((float(b), float(a), int(c)) for b, a, c in (x.split() for x in admitted))
    by_after = sorted(calls, key=lambda x: x[1])
    violations, excess = 0, -math.inf
    lo = 0
    for start, _, _ in calls:
        while lo < len(by_after) and by_after[lo][1] < start:
            lo += 1
        total = 0
        for before, after, cost in by_after[lo:]:
            if after - start > horizon:
                break
            if before < start:
                continue
            total += cost
            over = total - (burst + (after - start) * count / period)
            violations += over > 1e-6
            excess = max(excess, over)
    return {"violations": violations, "excess": excess, "admitted": sum(c for _, _, c in calls)}


def throttle_report(admin, prefix: str) -> tuple[list[str], int]:
    lines, bad = [], 0
    for key, (count, period, burst, most) in RATES.items():
        admitted = admin.lrange(f"{prefix}:admitted:{key}", 0, -1)
        r = check_throttle(admitted, count, period, burst)
        bad += r["violations"]
        span = 0.0
        if admitted:
            times = [float(x.split()[0]) for x in admitted]
            span = max(times) - min(times)
        lines.append(
            f"{key} ({count}/{period:g}s, burst {burst}, cost 1-{most}): {len(admitted):,} calls admitted, "
            f"{r['admitted']:,} units in {span:.0f} s (bound {burst + span * count / period:,.0f}); "
            f"windows over the bound {r['violations']} (the fullest window: {r['excess']:+.2f} units from its bound)"
        )
    lines.append(f"violations: {bad}")
    return lines, bad


# -- the beat leader ----------------------------------------------------------------------------------
ENTRIES, INTERVAL, LEADER_TTL, LOOP, CATCH_UP = 100, 4.0, 1.0, 0.2, 4.0


def scheduler(proxy_url: str, url: str, prefix: str, seed: int, unguarded: bool) -> None:
    from taskguard import LeaseBackendError
    from taskguard.schedule import Interval, PeriodicEntry, PeriodicScheduler, SettingNames, schedule_settings
    from taskguard.schedule.claims import PUBLISHED, read_record

    exit_on_term()
    locks, store = _clients(proxy_url, url, prefix)
    broker = _no_retry(proxy_url)
    queue = f"{prefix}:queue"
    entries = [PeriodicEntry(f"e{i}", Interval(INTERVAL)) for i in range(ENTRIES)]

    class Adapter:
        def entries(self):
            return entries

        def publish(self, entry, slot):
            broker.rpush(queue, f"p {entry.name} {slot.id} {slot.leader_fence} {slot.keep:g}")
            return slot

    class Scheduler(PeriodicScheduler):
        def publish(self, entry, send=None, before=None):
            slot = super().publish(entry, send, before)
            if slot is not None:
                try:
                    rec = read_record(self.locks, self.leader_key, entry.name)
                except LeaseBackendError:
                    return slot
                if rec.state == PUBLISHED and rec.instant == slot.instant and rec.fence == slot.leader_fence:
                    store.rpush(queue, f"c {entry.name} {slot.id} {slot.leader_fence}")
            return slot

    names = SettingNames(leader_ttl="leader_ttl", catch_up="catch_up", name="name", loop="loop", role="torture")
    settings = schedule_settings(
        names, leader_ttl=LEADER_TTL, catch_up=CATCH_UP, default_name="torture", loop_interval=LOOP
    )
    if unguarded:  # every scheduler publishes every due slot, no leader, no claim
        done: set[str] = set()
        while True:
            now = server_time(store)
            for entry in entries:
                instant, _ = entry.schedule.latest(now, settings.allowed_lateness)
                slot = None if instant is None else entry.schedule.slot_id(instant)
                if slot is not None and f"{entry.name} {slot}" not in done:
                    done.add(f"{entry.name} {slot}")
                    try:
                        broker.rpush(queue, f"p {entry.name} {slot} 0 {entry.schedule.keep:g}")
                    except redis.RedisError:
                        continue
                    store.rpush(queue, f"c {entry.name} {slot} 0")
            time.sleep(LOOP)
    sched = Scheduler(locks, settings, adapter=Adapter(), role="torture")
    while True:
        time.sleep(sched.tick())


def consumer(_proxy_url: str, url: str, prefix: str, _seed: int, _unguarded: bool) -> None:
    """Runs each slot message as a worker does: under the slot's run id, refusing a finished run."""
    from taskguard import RedisLocks
    from taskguard.schedule import slot_run

    exit_on_term()
    store = redis.Redis.from_url(url, decode_responses=True)
    locks = RedisLocks(redis.Redis.from_url(url), prefix=prefix)
    seen = 0
    while True:
        items = store.lrange(f"{prefix}:queue", seen, seen + 499)
        seen += len(items)
        if not items:
            time.sleep(0.05)
        for item in items:
            kind, entry, slot, _fence, *rest = item.split()
            if kind != "p":
                continue
            run_id, keep = slot_run({"entry": entry, "slot": slot, "keep": float(rest[0])}, prefix="torture")
            acq = locks.acquire(f"run:{entry}", ttl=5, run_id=run_id, refuse_finished=True)
            if acq.acquired:
                store.rpush(f"{prefix}:runs", f"{entry} {slot}")
                acq.lease.release(finished=True, finished_ttl=keep)


def check_beat(log: list[str], runs: list[str], entries: list[str], first: int, last: int) -> dict[str, int]:
    """``log``: the queue in order, ``"p <entry> <slot> <fence> <keep>"`` (published) and ``"c <entry>
    <slot> <fence>"`` (a leader found its publish confirmed); ``runs``: ``"<entry> <slot>"`` per run.
    Slots are ``every<s>s:<n>``; those with ``first <= n <= last`` of every entry in ``entries``
    must be published. Returns ``lost``, ``after_confirm`` (published again after a confirmation, by a
    leader whose fence is not lower), ``late`` (published again after it by a deposed leader: run
    once), ``republished`` (published more than once), ``twice`` (run more than once), ``slots``
    (published) and ``terms`` (the leader fences that published)."""
    published: dict[tuple[str, str], int] = defaultdict(int)
    confirmed: dict[tuple[str, str], int] = {}
    after_confirm = late = 0
    for line in log:
        kind, entry, slot, fence, *_ = line.split()
        k = (entry, slot)
        if kind == "c":
            confirmed.setdefault(k, int(fence))
            continue
        published[k] += 1
        if k in confirmed:
            if int(fence) >= confirmed[k]:
                after_confirm += 1
            else:
                late += 1
    numbered = {(e, int(s.rsplit(":", 1)[1])) for e, s in published}
    lost = sum(1 for e in entries for n in range(first, last + 1) if (e, n) not in numbered)
    count: dict[str, int] = defaultdict(int)
    for r in runs:
        count[r] += 1
    return {
        "lost": lost,
        "after_confirm": after_confirm,
        "late": late,
        "republished": sum(n - 1 for n in published.values() if n > 1),
        "twice": sum(1 for n in count.values() if n > 1),
        "slots": len(published),
        "terms": len({line.split()[3] for line in log if line.startswith("p ")}),
    }


def beat_report(admin, prefix: str, first: int, last: int) -> tuple[list[str], int]:
    log = admin.lrange(f"{prefix}:queue", 0, -1)
    runs = admin.lrange(f"{prefix}:runs", 0, -1)
    r = check_beat(log, runs, [f"e{i}" for i in range(ENTRIES)], first, last)
    bad = r["lost"] + r["after_confirm"] + r["twice"]
    return [
        f"slots published {r['slots']:,} ({ENTRIES} entries every {INTERVAL:g} s) by {r['terms']} leader terms "
        f"(fencing tokens), runs {len(runs):,}; "
        f"checked for loss: slots {first}-{last} of every entry",
        f"published again: {r['republished']} (claimed but not confirmed when the leader was stopped or cut; "
        f"{r['late']} by a deposed leader after its successor confirmed): each run once by its run id",
        f"violations: {bad} ({r['lost']} slots lost, {r['after_confirm']} published after their confirmation, "
        f"{r['twice']} run twice)",
    ], bad


# -- the runs -----------------------------------------------------------------------------------------
def _factory(target, url: str, prefix: str, unguarded: bool):
    return lambda proxy_url, seed: start_process(target, proxy_url, url, prefix, seed, unguarded)


def run_guard(guard: str, args, admin) -> int:
    prefix = run_prefix()
    ops_key = f"{prefix}:ops"
    every, stop_for, faulted = (0.1, 0.3), 2 * TTL, None
    if guard == "limit":
        factories = [_factory(limit_worker, args.url, prefix, args.unguarded)] * 10
    elif guard == "once":
        factories = [_factory(once_worker, args.url, prefix, args.unguarded)] * 8
    elif guard == "unique":
        factories = [_factory(publisher, args.url, prefix, args.unguarded)] * PUBLISHERS
        factories += [_factory(runner, args.url, prefix, args.unguarded)] * 4
    elif guard == "throttle":
        factories = [_factory(throttle_worker, args.url, prefix, args.unguarded)] * 8
    else:
        factories = [_factory(scheduler, args.url, prefix, args.unguarded)] * 4
        factories.append(_factory(consumer, args.url, prefix, args.unguarded))
        every, stop_for, faulted = (0.5, 1.5), 2 * LEADER_TTL, 4
    start_instant = None

    def done() -> bool:
        if guard == "beat":
            return admin.llen(f"{prefix}:queue") >= 2.05 * args.ops  # a publish and its confirmation
        return int(admin.get(ops_key) or 0) >= args.ops

    try:
        if guard == "beat":
            start_instant = server_time(admin)
        chaos = Chaos(args.url, factories, stop_for=stop_for, every=every, faulted=faulted)
        try:
            elapsed = chaos.run(done, args.seconds)
            if guard == "beat":
                end_instant = server_time(admin)
                time.sleep(2.0)  # the consumer's last messages
        finally:
            chaos.stop()
        ops = int(admin.get(ops_key) or 0)
        if guard == "limit":
            lines, bad = limit_report(admin, prefix)
            what = "acquisitions"
        elif guard == "once":
            lines, bad = once_report(admin, prefix)
            what = "once() calls answered"
        elif guard == "unique":
            lines, bad = unique_report(admin, prefix)
            what = "mark_queued() calls answered"
        elif guard == "throttle":
            lines, bad = throttle_report(admin, prefix)
            what = "throttle() calls answered"
        else:
            assert start_instant is not None
            # the slots that must have been published: from the first due a second after the start
            # (a scheduler publishes no slot due before it started) to the last due more than the
            # catch-up window before the end (later than that a slot is no longer published)
            first = math.ceil((start_instant + 1.0) / INTERVAL)
            last = math.floor((end_instant - CATCH_UP - LOOP) / INTERVAL)
            lines, bad = beat_report(admin, prefix, first, last)
            ops = len([x for x in admin.lrange(f"{prefix}:queue", 0, -1) if x.startswith("p ")])
            what = "slot publishes"
    finally:
        cleanup(admin, prefix)
    mode = " UNGUARDED" if args.unguarded else ""
    print(f"torture {guard}{mode}: {len(factories)} processes, {elapsed:.0f} s")
    print(f"   {what} {ops:,} ({ops / elapsed:,.0f}/s)")
    print(f"   faults injected: {chaos.summary()} ({chaos.total()} in all)")
    for line in lines:
        print("   " + line)
    sys.stdout.flush()
    return bad


GUARDS = ("limit", "once", "unique", "throttle", "beat")


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("guard", choices=(*GUARDS, "all"))
    ap.add_argument("--ops", type=int, default=10_000, help="operations per guard (default 10,000)")
    ap.add_argument("--seconds", type=float, default=900.0, help="time limit per guard, seconds (default 900)")
    ap.add_argument("--unguarded", action="store_true", help="the workers without the guard: the checks must fail")
    args = ap.parse_args(argv)
    opened = open_admin(args.url)
    if opened is None:
        return 1
    admin, _ = opened
    exit_on_sigterm()
    bad = 0
    for guard in GUARDS if args.guard == "all" else (args.guard,):
        bad += run_guard(guard, args, admin)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
