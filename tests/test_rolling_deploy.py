"""Workers of the previous release and of this one on the same keys (a rolling deploy).

The previous release's Lua scripts are read from git (``git show OLD:taskguard/scripts.py``, the
commit before the lease hash's release record changed: a release now deletes the owner token and
keeps only ``n`` = "~<nonce><answer>", without the owner token's SHA1) and sent as that release's
workers send them, with the same arguments, while this release's workers go through
:class:`~taskguard.RedisLocks`. Every answer must be right on both sides, the fences must keep
growing across them, and no call may fail (a key type change would make the old scripts' ``HMGET``
fail with ``WRONGTYPE``).
"""

from __future__ import annotations

import subprocess
import types
import uuid
from pathlib import Path

import pytest
import redis

from taskguard import RedisLocks

ROOT = Path(__file__).resolve().parent.parent
#: main before the release record changed (taskguard.scripts of 0.1.0 as deployed)
OLD = "be3cc8dcb5df17f610952ba912de83ad4b3b5ba0"
IDLE_MS = 60_000
HOLDER = '{"host":"old-worker","pid":1}'


def old_scripts() -> types.ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{OLD}:taskguard/scripts.py"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    module = types.ModuleType("taskguard_old_scripts")
    exec(compile(source, f"{OLD}:taskguard/scripts.py", "exec"), module.__dict__)
    return module


class OldWorker:
    """The previous release's scripts, called with the arguments its backend sends."""

    def __init__(self, client: redis.Redis, locks: RedisLocks) -> None:
        self.s = old_scripts()
        self.c = client
        self.key = locks.backend.lease_key

    def acquire(self, key: str, owner: str, ttl_ms: int = 5000, run_id: str = "", limit: int = 1) -> list:
        args = (owner, ttl_ms, HOLDER, IDLE_MS, 0, run_id, "0", run_id, limit)
        return self.s.ACQUIRE(self.c, (self.key(key),), args)

    def release(self, key: str, owner: str, nonce: str) -> int:
        return int(self.s.RELEASE(self.c, (self.key(key),), (owner, IDLE_MS, 1000, nonce, "")))

    def release_run(self, key: str, run_id: str, nonce: str) -> int:
        return int(self.s.RELEASE_WITHOUT_TOKEN(self.c, (self.key(key),), (run_id, nonce)))

    def holders(self, key: str) -> list:
        return self.s.HOLDERS(self.c, (self.key(key),), ())

    def renew(self, key: str, owner: str, ttl_ms: int = 5000) -> int:
        return int(self.s.RENEW(self.c, (self.key(key),), (owner, ttl_ms, IDLE_MS)))

    def owns(self, key: str, owner: str) -> int:
        return int(self.s.OWNS(self.c, (self.key(key),), (owner,)))

    def claim(self, key: str, owner: str, new_owner: str) -> list:
        return self.s.CLAIM(self.c, (self.key(key),), (owner, new_owner, 5000, HOLDER, "", IDLE_MS))


@pytest.fixture
def both(redis_url, prefix):
    client = redis.Redis.from_url(redis_url)
    locks = RedisLocks(client, prefix=prefix, fence_idle_ttl=IDLE_MS / 1000)
    yield OldWorker(client, locks), locks
    locks.close()
    client.close()


def test_the_old_scripts_are_the_previous_release():
    s = old_scripts()
    assert "sha1hex" in s.RELEASE.source  # the previous layout of the release record
    from taskguard import scripts

    assert s.RELEASE.sha != scripts.RELEASE.sha


def test_leases_alternate_between_old_and_new_workers(both):
    old, new = both
    fences = []
    for _ in range(3):
        lease = new.acquire("k", ttl=5).lease
        fences.append(lease.fencing_token)
        assert old.acquire("k", "old-" + uuid.uuid4().hex)[0] == 0  # held by the new worker
        assert lease.release() is True
        owner = "old-" + uuid.uuid4().hex
        got = old.acquire("k", owner)
        assert got[0] == 1
        fences.append(int(got[1]))
        assert not new.acquire("k", ttl=5)  # held by the old worker
        assert old.renew("k", owner) == 1 and old.owns("k", owner) > 0
        assert old.release("k", owner, uuid.uuid4().hex[:16]) == 1
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    assert new.holder("k") is None and old.holders("k") == []


def test_an_old_worker_sees_a_released_key_as_free_and_a_new_holder_as_held(both):
    old, new = both
    lease = new.acquire("h", ttl=5, holder={"task": "t"}).lease
    flat = old.holders("h")
    assert len(flat) == 6 and int(flat[2]) == lease.fencing_token  # slot, holder, fence, ...
    assert old.owns("h", lease.owner_token) > 0
    assert old.claim("h", "not-the-owner", "x")[0] == 0
    lease.release()
    assert old.holders("h") == [] and old.owns("h", lease.owner_token) == -2
    assert old.claim("h", lease.owner_token, "x") == [0, -2]  # released: nothing to claim
    assert old.renew("h", lease.owner_token) == 0


def test_release_by_run_id_across_versions(both):
    old, new = both
    lease = new.acquire("r", ttl=5, run_id="run-new").lease
    assert old.release_run("r", "run-new", uuid.uuid4().hex[:16]) == 1
    assert lease.release() is False  # released on its behalf
    assert old.acquire("r", "old-owner", run_id="run-old")[0] == 1
    assert new.release_run("r", "run-old") is True
    assert new.acquire("r", ttl=5)


def test_resent_releases_answer_as_they_did_across_versions(both):
    old, new = both
    lease = new.acquire("n", ttl=5).lease
    nonce = "0123456789abcdef"
    rel = (lease.owner_token, IDLE_MS, 1000, nonce, "")
    key = (new.backend.lease_key("n"),)
    from taskguard import scripts

    assert scripts.RELEASE(new.client, key, rel) == 1
    assert old.acquire("n", "old-owner")[0] == 1  # an old worker takes the key over
    assert scripts.RELEASE(new.client, key, rel) == 1  # the re-send still answers as it did
    assert old.release("n", "old-owner", "fedcba9876543210") == 1
    assert old.release("n", "old-owner", "fedcba9876543210") == 1  # and the old one's too


def test_limit_slots_shared_by_old_and_new_holders(both):
    old, new = both
    got = old.acquire("pool", "old-owner", limit=2)
    assert got[0] == 1 and int(got[3]) == 0
    lease = new.acquire("pool", ttl=5, limit=2).lease
    assert lease.slot == 1
    assert not new.acquire("pool", ttl=5, limit=2)
    assert old.acquire("pool", "old-2", limit=2)[0] == 0
    assert lease.release() is True
    again = old.acquire("pool", "old-3", limit=2)
    assert again[0] == 1 and int(again[3]) == 1 and int(again[1]) > lease.fencing_token
    assert old.release("pool", "old-3#1", "aaaaaaaaaaaaaaaa") == 1
    assert old.release("pool", "old-owner", "bbbbbbbbbbbbbbbb") == 1
    assert len(new.holders("pool")) == 0


def test_a_released_key_stays_a_small_hash(both, client):
    """What a release leaves: the fence and the release record, in a hash (never another type,
    which the old scripts' HMGET would refuse with WRONGTYPE)."""
    old, new = both
    new.acquire("m", ttl=5).lease.release()
    k = new.backend.lease_key("m")
    assert client.type(k) == b"hash"
    assert set(client.hgetall(k)) == {b"f", b"n"}
    assert 0 < client.pttl(k) <= IDLE_MS
    assert old.acquire("m", "old-owner")[0] == 1
