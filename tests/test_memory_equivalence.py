"""MemoryLocks behaves like RedisLocks: one hypothesis state machine drives both with the same
operations (acquire, renew, release, claim, restore, holder, verify, done markers, and the passing
of time) and compares every outcome. RedisLocks runs against the shared real Redis, never a mock;
each example uses its own key prefix and deletes its keys at teardown.

Time. MemoryLocks gets an injected virtual clock that the ``advance`` rule moves forward (each
operation may also let a tick pass first); for Redis the same advance sleeps until real time has
caught up with the virtual time. Time is counted in ticks (``TICK_MS``, 0.2 s): every TTL is an
odd number of half ticks (leases 1.5 / 3.5 ticks, done markers 2.5 ticks) and every advance a
whole number of ticks (1 or 2). So every operation runs at a virtual time that is a whole number
of ticks, while every expiry (start + TTL) falls half-way between two ticks: an expiry boundary
never comes closer than half a tick (100 ms) to any moment at which a lease is touched or
checked. Virtual time is either at least half a tick before an expiry or at least half a tick
after it.

Real time runs ahead of virtual time only by what the operations since the last ``advance`` took:
each ``advance`` sleeps to an absolute target, so that lag never accumulates across steps. While
the lag stays below the margin, Redis (real time) and MemoryLocks (virtual time) land on the same
side of every expiry boundary, so their outcomes must be identical: the comparison is
deterministic, not a matter of luck. The lag is measured after every step's operations, before
their outcomes are compared. A step whose operations ran with the lag past ``MAX_LAG`` (a
scheduler or GC pause; 15-80 ms were seen on this 2-CPU machine while other suites ran, and with
a 0.1 s tick the full parallel suite paused so many steps that the replays outran the test's
timeout) is not
compared: the machine replays every step of the example so far on fresh backends with a fresh
clock (outcomes depend only on the virtual schedule, so the replay reproduces the same handles),
and carries on. Rejecting such examples instead would not do: hypothesis treats an example that
stops early on a prefix where another continued as a flaky strategy. After ``MAX_REPLAYS`` pauses
in a row the test fails, saying the machine is too loaded, rather than pass vacuously.

Key ``c`` is acquired under ``limit=2`` (two holders at once, in slots 0 and 1): the same rules
apply to it, holders are compared slot by slot, and fences relate per (key, slot).

Fencing tokens are compared by *relative* facts only: RedisLocks tokens are floored by the
server clock in microseconds, MemoryLocks counts 1, 2, 3. Both must agree on which handles share
a token, on the order of the tokens of one key, and on which handle's token the holder shows;
and in each backend the tokens of successive acquisitions of a key strictly increase.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from hypothesis import HealthCheck, event as _hypothesis_event, settings, strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from taskguard import LeaseLost, MemoryLocks, RedisLocks

KEYS = ("a", "b", "c")
#: Holder limits per key: ``c`` admits two holders at once.
LIMITS = {"a": 1, "b": 1, "c": 2}
RUN_IDS = (None, "run-1", "run-2")
TICK_MS = 200
#: Lease TTLs: an odd number of half ticks (1.5 and 3.5 ticks), so expiries fall between ticks.
TTLS = (1.5 * TICK_MS / 1000, 3.5 * TICK_MS / 1000)
#: Done-marker TTL, also an odd number of half ticks (2.5 ticks).
DONE_TTL = 2.5 * TICK_MS / 1000
#: Advances: whole ticks (1 or 2), so operations happen on ticks.
ADVANCES_MS = (TICK_MS, 2 * TICK_MS)
#: Time that may pass right before an operation, besides the ``advance`` rule (hypothesis's rule
#: choice alone let time pass in too few steps): usually none, sometimes a tick.
ELAPSE = st.sampled_from((0, 0, 0, TICK_MS))
#: The margin between an expiry boundary and any operation is TICK/2 = 100 ms; real time must run
#: ahead of virtual time by less than that. 10 ms are kept for the client's send time and Redis's
#: millisecond expiry resolution.
MAX_LAG = TICK_MS / 2000 - 0.010
#: Replays in a row after pauses before the test gives up (the machine is too loaded).
MAX_REPLAYS = 20

SETTINGS = settings(
    max_examples=25,
    stateful_step_count=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class VirtualTime:
    """Virtual clock for MemoryLocks, and real sleeping so that Redis sees the same time pass.

    The clock starts at the real wall-clock time, so that both backends' timestamps (``since``,
    ``expires_at``) are on the same scale."""

    def __init__(self) -> None:
        self.sync()

    def sync(self) -> None:
        self.wall0 = time.time()
        self.mono0 = time.monotonic()
        self.ms = 0  # virtual milliseconds since wall0; an int, so no float drift

    def clock(self) -> float:
        return self.wall0 + self.ms / 1000.0

    def advance(self, ms: int) -> None:
        self.ms += ms
        target = self.mono0 + self.ms / 1000.0  # absolute target: lag never accumulates
        while True:
            left = target - time.monotonic()
            if left <= 0:
                return
            time.sleep(left)

    def lag(self) -> float:
        """Seconds real time is ahead of virtual time (>= 0: advances sleep to their target)."""
        return time.monotonic() - (self.mono0 + self.ms / 1000.0)


class Pair:
    """The same logical handle in both backends."""

    def __init__(self, idx: int, key: str, mem, red, how: str) -> None:
        self.idx, self.key, self.mem, self.red, self.how = idx, key, mem, red, how

    def __repr__(self) -> str:
        return f"<handle {self.idx} {self.how} {self.key!r}>"


class Paused(Exception):
    """A step's operations ran with real time past the margin ahead of virtual time."""


def event(name: str) -> None:
    if currently_in_test_context():  # the scripted scenarios drive the machine outside hypothesis
        _hypothesis_event(name)


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


class LocksEquivalence(RuleBasedStateMachine):
    redis_url = "redis://127.0.0.1:6379/0"  # replaced by the test with the redis_url fixture
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(self.redis_url)
        self.log: list[tuple[str, dict]] = []  # every step so far, to replay after a pause
        self.pair_objects: list[Pair] = []  # the Pair objects hypothesis holds, reused on replay
        self.replays = 0
        self.prefix = ""
        self._fresh_backends()

    def _fresh_backends(self) -> None:
        """New prefix, clock and backends (at the start, and before each replay)."""
        if self.prefix:
            self._delete_keys()
        self.vt = VirtualTime()
        self.prefix = f"tgeq-{uuid.uuid4().hex[:12]}"
        self.mem = MemoryLocks(clock=self.vt.clock, prefix=self.prefix)
        self.red = RedisLocks(self.client, prefix=self.prefix)
        self.pairs: list[Pair] = []
        self.max_fence: dict[str, dict[str, int]] = {"mem": {}, "red": {}}
        self.step_no = 0
        self.last = None  # the MemoryLocks outcome of the last operation (for scripted scenarios)
        # connect and load the scripts now, so that the first step is not slowed down by it
        self.red.holder("warm-up")
        self.vt.sync()

    def _delete_keys(self) -> None:
        keys = list(self.client.scan_iter(match="{" + self.prefix + ":*"))
        if keys:
            self.client.delete(*keys)

    def teardown(self) -> None:
        try:
            self._delete_keys()
        finally:
            self.client.close()

    # -- timing: steps, pauses and replays ---------------------------------------------------
    def _settle(self) -> None:
        """Call after a step's operations, before comparing outcomes (see the module doc)."""
        lag = self.vt.lag()
        if lag >= MAX_LAG:
            raise Paused(f"real time ran {lag * 1000:.0f} ms ahead of virtual time")

    def _step(self, name: str, **args):
        """Run one logged step; after a pause, replay everything so far instead."""
        self.log.append((name, args))
        try:
            result = getattr(self, "_" + name)(**args)
        except Paused:
            return self._replay()
        return result

    def _check(self, name: str) -> None:
        """Run an invariant; after a pause, replay (which also checks the invariants)."""
        try:
            getattr(self, name)()
        except Paused:
            self._replay()

    def _replay(self):
        """Redo every logged step on fresh backends with a fresh clock, checking the invariants
        after each as before. Outcomes depend only on the virtual schedule, so a replay without a
        pause reproduces the same handles (refilled into the same Pair objects) and results."""
        for _ in range(MAX_REPLAYS):
            self.replays += 1
            event("replayed after a pause")
            self._fresh_backends()
            try:
                self._check_invariants()
                result = None
                for name, args in self.log:
                    result = getattr(self, "_" + name)(**args)
                    self._check_invariants()
            except Paused:
                continue
            return result
        raise AssertionError(
            f"the test process paused past the {TICK_MS // 2} ms timing margin in {MAX_REPLAYS} replays in a row; "
            "the machine is too loaded for this test"
        )

    def _check_invariants(self) -> None:
        self._holders_agree()
        self._handles_agree()

    # -- helpers ---------------------------------------------------------------------------
    def _meta(self) -> dict:
        self.step_no += 1
        return {"step": self.step_no}

    def _compare_holder_ttl(self, m_ttl, r_ttl) -> None:
        assert (m_ttl is None) == (r_ttl is None), (m_ttl, r_ttl)
        if m_ttl is not None:
            # Redis counts real time, which runs less than MAX_LAG ahead of the virtual clock at
            # both the operation that set the expiry and the one reading it (1 ms for rounding)
            assert abs(m_ttl - r_ttl) <= MAX_LAG + 0.002, (m_ttl, r_ttl)

    def _new_pair(self, key: str, m_lease, r_lease, how: str) -> Pair:
        idx = len(self.pairs)
        if idx < len(self.pair_objects):  # a replay: refill the object hypothesis already holds
            pair = self.pair_objects[idx]
            assert (pair.key, pair.how) == (key, how), "a replay diverged from the original run"
            pair.mem, pair.red = m_lease, r_lease
        else:
            pair = Pair(idx, key, m_lease, r_lease, how)
            self.pair_objects.append(pair)
        assert m_lease.run_id == r_lease.run_id
        assert m_lease.slot == r_lease.slot, (m_lease.slot, r_lease.slot)
        # every earlier handle of this key's slot relates to the new one the same way in both backends
        for other in self.pairs:
            if other.key == key and other.mem.slot == m_lease.slot:
                m_rel = _sign(m_lease.fencing_token - other.mem.fencing_token)
                r_rel = _sign(r_lease.fencing_token - other.red.fencing_token)
                assert m_rel == r_rel, (pair, other, m_rel, r_rel)
        self.pairs.append(pair)
        return pair

    # -- rules -----------------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        self.vt.sync()  # setting up the machine took real time; start both sides in step

    @rule(
        target=handles,
        key=st.sampled_from(KEYS),
        ttl=st.sampled_from(TTLS),
        run_id=st.sampled_from(RUN_IDS),
        elapse=ELAPSE,
        refuse=st.booleans(),
    )
    def acquire(self, key, ttl, run_id, elapse, refuse=False):
        return self._step("acquire", key=key, ttl=ttl, run_id=run_id, elapse=elapse, refuse=refuse)

    def _acquire(self, key, ttl, run_id, elapse, refuse=False):
        self.vt.advance(elapse)
        meta = self._meta()
        limit = LIMITS[key]
        m = self.mem.acquire(key, ttl=ttl, holder=meta, run_id=run_id, refuse_finished=refuse, limit=limit)
        r = self.red.acquire(key, ttl=ttl, holder=meta, run_id=run_id, refuse_finished=refuse, limit=limit)
        self._settle()
        self.last = m
        assert m.acquired == r.acquired, (m, r)
        assert m.reason == r.reason, (m, r)
        event(f"acquire: {m.reason or 'acquired'}")
        if not m.acquired:
            assert m.reason in (("held", "duplicate") if limit == 1 else ("limit", "duplicate")), m
            assert m.holder_run == r.holder_run, (m, r)
            self._compare_holder_ttl(m.holder_ttl, r.holder_ttl)
            # the holder's time left is known for a held key, meaningless for a finished run
            assert (m.holder_ttl is not None) == (m.reason != "duplicate"), m
            return multiple()
        for side, lease in (("mem", m.lease), ("red", r.lease)):
            assert isinstance(lease.fencing_token, int) and not isinstance(lease.fencing_token, bool)
            assert 0 <= lease.slot < LIMITS[key]
            prev = self.max_fence[side].get((key, lease.slot))
            # fences of successive acquisitions of a (key, slot) strictly increase, in each backend
            assert prev is None or lease.fencing_token > prev, (side, key, prev, lease.fencing_token)
            self.max_fence[side][(key, lease.slot)] = lease.fencing_token
            assert lease.holder["step"] == meta["step"]
            assert lease.run_id == run_id
        return self._new_pair(key, m.lease, r.lease, "acquired")

    @rule(pair=handles, ttl=st.sampled_from(TTLS), elapse=ELAPSE)
    def renew(self, pair, ttl, elapse):
        return self._step("renew", pair=pair, ttl=ttl, elapse=elapse)

    def _renew(self, pair, ttl, elapse):
        self.vt.advance(elapse)
        m = pair.mem.renew(ttl)
        r = pair.red.renew(ttl)
        self._settle()
        self.last = m
        assert m == r, (pair, m, r)
        event(f"renew: {m}")

    @rule(pair=handles, finished=st.sampled_from([None, "recorded", "marker"]), elapse=ELAPSE)
    def release(self, pair, finished, elapse):
        return self._step("release", pair=pair, finished=finished, elapse=elapse)

    def _release(self, pair, finished, elapse):
        self.vt.advance(elapse)
        kw = {"finished": finished is not None, "finished_ttl": DONE_TTL if finished == "marker" else None}
        m = pair.mem.release(**kw)
        r = pair.red.release(**kw)
        self._settle()
        self.last = m
        assert m == r, (pair, m, r)
        event(f"release: {m}")
        assert pair.mem.released and pair.red.released

    @rule(
        target=handles,
        pair=handles,
        forged=st.booleans(),
        ttl=st.sampled_from(TTLS),
        run_id=st.sampled_from(RUN_IDS),
        elapse=ELAPSE,
    )
    def claim(self, pair, forged, ttl, run_id, elapse):
        return self._step("claim", pair=pair, forged=forged, ttl=ttl, run_id=run_id, elapse=elapse)

    def _claim(self, pair, forged, ttl, run_id, elapse):
        """A retry claims the lease with the owner token an earlier run persisted (or with a
        forged token, which must never succeed)."""
        self.vt.advance(elapse)
        meta = self._meta()
        if forged:
            m_token = r_token = "forged-" + uuid.uuid4().hex
        else:
            m_token, r_token = str(pair.mem.owner_token), str(pair.red.owner_token)
        m = self.mem.claim(pair.key, m_token, ttl=ttl, holder=meta, run_id=run_id)
        r = self.red.claim(pair.key, r_token, ttl=ttl, holder=meta, run_id=run_id)
        self._settle()
        self.last = m
        assert m.acquired == r.acquired, (pair, m, r)
        assert m.reason == r.reason, (pair, m, r)
        event(f"claim ({'forged' if forged else 'persisted'} token): {m.reason or 'claimed'}")
        if not m.acquired:
            assert m.reason in ("not_owner", "expired"), m
            self._compare_holder_ttl(m.holder_ttl, r.holder_ttl)
            assert (m.holder_ttl is None) == (m.reason == "expired"), m
            return multiple()
        assert not forged, "a forged owner token claimed a lease"
        # a claim keeps the fence of the lease it takes over and swaps the owner token
        assert m.lease.fencing_token == pair.mem.fencing_token
        assert r.lease.fencing_token == pair.red.fencing_token
        assert m.lease.owner_token != m_token and r.lease.owner_token != r_token
        assert m.lease.run_id == run_id
        return self._new_pair(pair.key, m.lease, r.lease, f"claimed from {pair.idx}")

    @rule(target=handles, pair=handles, ttl=st.sampled_from(TTLS))
    def restore(self, pair, ttl):
        return self._step("restore", pair=pair, ttl=ttl)

    def _restore(self, pair, ttl):
        """Rebuild a handle from the persisted values of an earlier one (no round trip)."""
        m = self.mem.restore(
            pair.key,
            str(pair.mem.owner_token),
            ttl=ttl,
            expires_at=pair.mem.expires_at,
            fencing_token=pair.mem.fencing_token,
        )
        r = self.red.restore(
            pair.key,
            str(pair.red.owner_token),
            ttl=ttl,
            expires_at=pair.red.expires_at,
            fencing_token=pair.red.fencing_token,
        )
        self._settle()
        assert m.fencing_token == pair.mem.fencing_token and r.fencing_token == pair.red.fencing_token
        return self._new_pair(pair.key, m, r, f"restored from {pair.idx}")

    @rule(pair=handles, elapse=ELAPSE)
    def verify(self, pair, elapse):
        return self._step("verify", pair=pair, elapse=elapse)

    def _verify(self, pair, elapse):
        self.vt.advance(elapse)
        outcomes = []
        for lease in (pair.mem, pair.red):
            try:
                lease.ensure_held(verify=True)
                outcomes.append(None)
            except LeaseLost as e:
                assert e.key == pair.key
                outcomes.append(e.reason)
        self._settle()
        self.last = outcomes[0]
        assert outcomes[0] == outcomes[1], (pair, outcomes)

    @precondition(lambda self: self.pairs)  # time passing before any lease exists tests nothing
    @rule(ms=st.sampled_from(ADVANCES_MS))
    def advance(self, ms):
        return self._step("advance", ms=ms)

    def _advance(self, ms):
        self.vt.advance(ms)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def holders_agree(self):
        self._check("_holders_agree")

    def _holders_agree(self):
        """holders(key) after every step: the same slots held in both, each by the same holder, of
        the same handle; never more than the key's limit; holder(key) is the lowest slot's."""
        holders = [(key, self.mem.holders(key), self.red.holders(key), self.red.holder(key)) for key in KEYS]
        self._settle()
        for key, hms, hrs, first in holders:
            assert [h.slot for h in hms] == [h.slot for h in hrs], (key, hms, hrs)
            assert len(hms) <= LIMITS[key]
            assert (first is None) == (not hrs) and (first is None or first.slot == hrs[0].slot)
            for hm, hr in zip(hms, hrs, strict=True):
                self._holder_agrees(key, hm, hr)

    def _holder_agrees(self, key, hm, hr):
        assert hm.key == hr.key == key
        assert hm.holder == hr.holder, (hm, hr)
        self._compare_holder_ttl(hm.ttl, hr.ttl)
        # "the holder's fence equals the fence of handle i": the same set of handles in both
        m_same = {
            p.idx
            for p in self.pairs
            if p.key == key and p.mem.slot == hm.slot and p.mem.fencing_token == hm.fencing_token
        }
        r_same = {
            p.idx
            for p in self.pairs
            if p.key == key and p.red.slot == hr.slot and p.red.fencing_token == hr.fencing_token
        }
        assert m_same == r_same, (key, m_same, r_same)
        assert m_same, "the holder must be one of the handles this machine made"
        # the holder is the newest acquired or claimed handle with that fence (a claim
        # supersedes the claimed one; a restored handle is a copy)
        newest = max(i for i in m_same if not self.pairs[i].how.startswith("restored"))
        assert self.pairs[newest].mem.holder["step"] == hm.holder["step"]

    @invariant()
    def handles_agree(self):
        self._check("_handles_agree")

    def _handles_agree(self):
        states = [
            (p, (p.mem.lost, p.mem.released, p.mem.lost_reason), (p.red.lost, p.red.released, p.red.lost_reason))
            for p in self.pairs
        ]
        self._settle()
        for p, m, r in states:
            assert m == r, (p, m, r)
            if m[0]:
                event("a handle is lost")


@pytest.mark.timeout(600)  # mostly sleeping (~30 s alone); replays after pauses on a loaded machine add to it
def test_memory_locks_match_redis_locks(redis_url):
    class Machine(LocksEquivalence):
        pass

    Machine.redis_url = redis_url
    run_state_machine_as_test(Machine, settings=SETTINGS)


def test_virtual_time_moves_only_on_advance_and_sleeps_to_an_absolute_target():
    """The harness itself: the injected clock moves only on advance, and an advance sleeps to an
    absolute target, so time already spent counts towards it and real time is not behind after."""
    vt = VirtualTime()
    c0 = vt.clock()
    time.sleep(0.03)
    assert vt.clock() == c0
    assert vt.lag() >= 0.03
    started = time.monotonic()
    vt.advance(100)
    slept = time.monotonic() - started
    assert abs(vt.clock() - c0 - 0.1) < 1e-6
    assert vt.lag() >= 0  # real time is never behind the virtual time after an advance
    assert slept < 0.1  # the 30 ms already spent counted towards the 100 ms


# -- scripted scenarios ----------------------------------------------------------------------------
# Hypothesis's choice of rules reaches some paths only rarely (a finished run refused as "duplicate",
# a claim answered "not_owner", a renewal that saves a lease from expiring). These scenarios walk
# the same machine through them, with the same comparisons and invariants after every step, and
# also check the outcome itself (MemoryLocks's; the machine has compared it with Redis's).

T = TICK_MS
SHORT, LONG = TTLS  # 1.5 and 3.5 ticks


def _run_scenario(redis_url, script) -> None:
    """Run ``script(step, m)`` on a fresh machine; ``step(rule, **args)`` applies a rule, then
    the invariants (as hypothesis does), and returns the rule's result."""

    class Machine(LocksEquivalence):
        pass

    Machine.redis_url = redis_url
    m = Machine()
    try:
        m.start()

        def step(rule, **args):
            result = getattr(m, rule)(**args)
            m.holders_agree()
            m.handles_agree()
            return result

        script(step, m)
    finally:
        m.teardown()


def test_scenario_finished_run_is_refused_until_its_done_marker_expires(redis_url):
    def script(step, m):
        h = step("acquire", key="a", ttl=LONG, run_id="run-1", elapse=0)
        step("release", pair=h, finished="marker", elapse=0)
        assert m.last is True
        step("acquire", key="a", ttl=LONG, run_id="run-1", elapse=0, refuse=True)
        assert m.last.reason == "duplicate" and m.last.holder_ttl is None
        step("acquire", key="a", ttl=SHORT, run_id="run-2", elapse=0, refuse=True)
        assert m.last.acquired  # another run is not affected by run-1's marker
        step("acquire", key="a", ttl=LONG, run_id="run-1", elapse=T, refuse=True)
        assert m.last.reason == "duplicate"  # the marker is checked before the holder
        step("acquire", key="a", ttl=LONG, run_id="run-1", elapse=2 * T, refuse=True)
        assert m.last.acquired  # at 3 ticks the marker (2.5) and run-2's lease (1.5) expired

    _run_scenario(redis_url, script)


def test_scenario_done_marker_is_set_even_when_the_release_finds_the_lease_gone(redis_url):
    def script(step, m):
        h = step("acquire", key="b", ttl=SHORT, run_id="run-1", elapse=0)
        step("release", pair=h, finished="marker", elapse=2 * T)
        assert m.last is False and h.mem.lost and h.red.lost
        step("acquire", key="b", ttl=SHORT, run_id="run-1", elapse=0, refuse=True)
        assert m.last.reason == "duplicate"
        step("acquire", key="b", ttl=SHORT, run_id=None, elapse=0)
        assert m.last.acquired

    _run_scenario(redis_url, script)


def test_scenario_last_finished_run_of_a_key_is_refused_without_a_marker(redis_url):
    """Without a marker the fence record remembers the key's last finished run: its redelivered
    copy is refused until another acquisition of the key; a new run of the id (no refuse) runs."""

    def script(step, m):
        h = step("acquire", key="a", ttl=LONG, run_id="run-1", elapse=0)
        step("release", pair=h, finished="recorded", elapse=0)
        step("acquire", key="a", ttl=LONG, run_id="run-1", elapse=0, refuse=True)
        assert m.last.reason == "duplicate"
        h2 = step("acquire", key="a", ttl=LONG, run_id="run-1", elapse=0)
        assert m.last.acquired  # a new publish of the same id is a new run
        step("release", pair=h2, finished=None, elapse=0)  # handed back: not finished
        step("acquire", key="a", ttl=LONG, run_id="run-1", elapse=0, refuse=True)
        assert m.last.acquired  # its redelivery runs

    _run_scenario(redis_url, script)


def test_scenario_held_reports_the_holders_run(redis_url):
    def script(step, m):
        step("acquire", key="a", ttl=LONG, run_id="run-1", elapse=0)
        step("acquire", key="a", ttl=LONG, run_id="run-2", elapse=0)
        assert m.last.reason == "held" and m.last.holder_run == "run-1"

    _run_scenario(redis_url, script)


def test_scenario_claims_expired_not_owner_and_one_shot(redis_url):
    def script(step, m):
        h0 = step("acquire", key="a", ttl=SHORT, run_id=None, elapse=0)
        h1 = step("claim", pair=h0, forged=False, ttl=LONG, run_id="retry-1", elapse=T)
        assert m.last.acquired and h1.mem.fencing_token == h0.mem.fencing_token
        step("claim", pair=h0, forged=False, ttl=LONG, run_id=None, elapse=0)
        assert m.last.reason == "not_owner"  # the persisted token stopped working at once
        step("renew", pair=h0, ttl=SHORT, elapse=0)
        assert m.last is False and h0.mem.lost
        step("claim", pair=h1, forged=True, ttl=LONG, run_id=None, elapse=0)
        assert m.last.reason == "not_owner"
        h2 = step("claim", pair=h1, forged=False, ttl=SHORT, run_id=None, elapse=T)
        assert m.last.acquired and h2.mem.fencing_token == h0.mem.fencing_token
        step("verify", pair=h2, elapse=0)
        assert m.last is None
        step("claim", pair=h2, forged=False, ttl=SHORT, run_id=None, elapse=2 * T)
        assert m.last.reason == "expired" and m.last.holder_ttl is None
        h3 = step("acquire", key="a", ttl=SHORT, run_id=None, elapse=0)
        assert h3.mem.fencing_token > h2.mem.fencing_token  # acquire afresh: a larger fence
        step("verify", pair=h1, elapse=0)
        assert m.last == "not held in Redis"

    _run_scenario(redis_url, script)


def test_scenario_renewal_keeps_a_lease_past_its_first_expiry(redis_url):
    def script(step, m):
        h = step("acquire", key="a", ttl=SHORT, run_id=None, elapse=0)
        step("renew", pair=h, ttl=LONG, elapse=T)
        assert m.last is True
        step("acquire", key="a", ttl=SHORT, run_id=None, elapse=2 * T)
        assert m.last.reason == "held"  # 3 ticks: alive only thanks to the renewal (to 4.5)
        assert not h.mem.lost
        step("advance", ms=2 * T)
        assert h.mem.lost and h.mem.lost_reason == "expired without renewal"
        step("renew", pair=h, ttl=LONG, elapse=0)
        assert m.last is False  # a renewal never recreates an expired lease
        step("acquire", key="a", ttl=SHORT, run_id=None, elapse=0)
        assert m.last.acquired

    _run_scenario(redis_url, script)


# -- regressions: divergences found while this file was written, fixed in a4b3fd9 ---------------------


def test_scenario_a_shorter_renewal_never_cuts_a_lease_short(redis_url):
    """Renewals only ever extend, in both backends: after renew(1.5 ticks) of a 3.5-tick lease the
    key is still held at 2 ticks. (MemoryLocks used to set ``expires = now + ttl`` while Redis's RENEW
    kept the longer expiry.)"""

    def script(step, m):
        h = step("acquire", key="a", ttl=LONG, run_id=None, elapse=0)
        step("renew", pair=h, ttl=SHORT, elapse=0)
        assert m.last is True
        step("acquire", key="a", ttl=SHORT, run_id=None, elapse=2 * T)
        assert m.last.reason == "held"  # at 2 ticks the 3.5-tick lease still stands

    _run_scenario(redis_url, script)


def test_scenario_releasing_a_restored_copy_of_a_released_handle(redis_url):
    """The same persisted owner token, restored after its lease was released: the release says
    False in both backends ("True when this call released it"). (Redis's release tombstone for
    client retries used to answer True for 10 s, MemoryLocks False.)"""

    def script(step, m):
        h = step("acquire", key="b", ttl=LONG, run_id=None, elapse=0)
        step("release", pair=h, finished=None, elapse=0)
        assert m.last is True
        copy = step("restore", pair=h, ttl=LONG)
        step("release", pair=copy, finished=None, elapse=0)
        assert m.last is False

    _run_scenario(redis_url, script)


def test_memory_locks_handles_follow_the_injected_clock():
    """MemoryLocks's ``clock`` drives expiry in tests without sleeping, handles included: a fresh
    lease under a clock that is not wall time is held, and lost once the clock passes its TTL.
    (``Lease.lost`` used to compare ``time.time()`` with the injected clock's ``expires_at``.)"""
    now = [1000.0]
    locks = MemoryLocks(clock=lambda: now[0])
    lease = locks.acquire("k", ttl=10).lease
    assert not lease.lost
    lease.ensure_held()
    now[0] += 11
    assert locks.holder("k") is None  # the backend follows the clock ...
    assert lease.lost  # ... and so does the handle


# -- rates: the weighted GCRA, settling and back-off pauses give the same answers ----------------

_RATE_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("call"),
            st.integers(1, 3),
            st.sampled_from([None, 3, 5]),
            st.sampled_from([0.0, 2.5, 6.5]),
            st.booleans(),
        ),
        st.tuples(st.just("turn"), st.integers(1, 3), st.sampled_from([None, 3, 5]), st.sampled_from([0.0, 6.5])),
        st.tuples(st.just("settle"), st.integers(-3, 3)),
        st.tuples(st.just("pause"), st.sampled_from([1, 2, 4])),
    ),
    min_size=1,
    max_size=8,
)


def test_memory_rates_match_redis_rates(redis_url):
    """A random sequence of weighted calls (cost, burst, booking horizon, check only), booked
    turns re-checked, settlements and back-off pauses, on MemoryLocks and RedisLocks side by side:
    the same verdicts, remaining units and pause flags, and waits within 50 ms (both run on real
    clocks a few ms apart; one unit is 1 s and horizons fall between whole units, so no answer
    sits on a boundary)."""
    from hypothesis import given

    client = redis.Redis.from_url(redis_url)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops=_RATE_OPS)
    def check(ops):
        prefix = f"tgtest-rates-{uuid.uuid4().hex[:12]}"
        pair = (RedisLocks(client, prefix=prefix), MemoryLocks(prefix=prefix))
        rate = (1, 1.0)
        try:
            for op in ops:
                answers = []
                for lk in pair:
                    if op[0] == "call":
                        _, cost, burst, book, peek = op
                        if burst is not None and cost > burst:
                            burst = cost
                        answers.append(
                            lk.throttle("r", rate=rate, cost=cost, burst=burst, book_within=book, consume=not peek)
                        )
                    elif op[0] == "turn":
                        _, cost, burst, book = op
                        burst = None if burst is None else max(burst, cost)
                        answers.append(
                            lk.rates.throttle("r", rate=rate, cost=cost, burst=burst, book_within=book, turn=True)
                        )
                    elif op[0] == "settle":
                        answers.append(lk.settle_cost("r", rate=rate, by=op[1]))
                    else:
                        answers.append(round(lk.back_off("r", op[1]), 1))
                red, mem = answers
                if op[0] in ("call", "turn"):
                    assert (red.allowed, red.booked, red.paused, red.remaining) == (
                        mem.allowed,
                        mem.booked,
                        mem.paused,
                        mem.remaining,
                    ), op
                    assert abs(red.retry_after - mem.retry_after) < 0.05, op
                else:
                    assert red == mem, op
        finally:
            for k in client.scan_iter(match="{" + prefix + ":*"):
                client.delete(k)

    try:
        check()
    finally:
        client.close()


_TOTAL_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("begin"), st.sampled_from(["t1", "t2", "t3"]), st.booleans()),
        st.tuples(st.just("end"), st.integers(0, 9), st.sampled_from(["finish", "hand_back", "keep"])),
    ),
    min_size=1,
    max_size=14,
)


def test_memory_locks_match_redis_locks_under_a_limit_per_key_and_a_total(redis_url):
    """A random sequence of guarded runs under ``limit=2`` per tenant and a total of 3 (begun
    fresh or, for a kept run, from its handle; ended by finish, hand back or keep), on MemoryLocks
    and RedisLocks side by side: the same answers (ran, reason), the same holders of every key
    and of the total after every step, and the same handle shapes. TTLs are long: no expiry."""
    from hypothesis import given

    from taskguard.run import GuardedRun, RunRequest

    client = redis.Redis.from_url(redis_url)

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops=_TOTAL_OPS)
    def check(ops):
        prefix = f"tgtest-total-{uuid.uuid4().hex[:12]}"
        pair = (RedisLocks(client, prefix=prefix), MemoryLocks(prefix=prefix))
        runs: list[list[GuardedRun]] = [[], []]
        kept: list[list[tuple[str, dict]]] = [[], []]
        try:
            for op in ops:
                answers = []
                for side, lk in enumerate(pair):
                    if op[0] == "begin":
                        _, tenant, from_handle = op
                        handle = None
                        if from_handle and kept[side]:
                            tenant, handle = kept[side].pop(0)
                        run = GuardedRun(lk, RunRequest(f"export:{tenant}", 60.0, limit=2, total=("exports", 3)))
                        ran = run.begin(handle=handle)
                        runs[side].append(run)
                        answers.append((ran, run.reason, None if not ran else run.lease.total.key))
                    else:
                        _, index, how = op
                        live = [r for r in runs[side] if r.state == "running"]
                        run = live[index % len(live)] if live else None
                        if run is None:
                            answers.append(None)
                        elif how == "keep":
                            handle = run.keep(60.0)
                            kept[side].append((run.key.split(":")[1], handle))
                            answers.append(sorted(handle))
                        else:
                            getattr(run, how)()
                            answers.append(how)
                    holders = {k: len(lk.holders(k)) for k in ("export:t1", "export:t2", "export:t3", "exports")}
                    answers.append(holders)
                assert answers[: len(answers) // 2] == answers[len(answers) // 2 :], op
                assert answers[-1]["exports"] <= 3 and all(answers[-1][f"export:{t}"] <= 2 for t in ("t1", "t2", "t3"))
        finally:
            for side in (0, 1):
                for r in runs[side]:
                    r.hand_back()
            for k in client.scan_iter(match="{" + prefix + ":*"):
                client.delete(k)

    try:
        check()
    finally:
        client.close()
