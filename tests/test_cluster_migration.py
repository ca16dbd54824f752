"""Redis Cluster while hash slots migrate: every lease operation keeps working and no lease is lost
or left behind. A script that declares several keys gets TRYAGAIN for the whole migration when
some are missing on the source node; the lease scripts declare one key (taskguard/scripts.py)."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

from taskguard import RedisLocks

from .servers import REDIS_CLI


def _node_ids(cl) -> dict[int, str]:
    return {p: c.execute_command("CLUSTER", "MYID").decode() for p, c in zip(cl.ports, cl.node_clients(), strict=True)}


def _owner_port(cl, slot: int) -> int:
    for c in cl.node_clients():
        for lo, hi, *nodes in c.execute_command("CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                return int(nodes[0][1])
    raise AssertionError(f"no owner for slot {slot}")


class _Migration:
    """Slot ``slot`` set MIGRATING on its owner and IMPORTING on another node, no key moved yet
    (the state ``redis-cli --cluster reshard`` leaves a slot in while it moves its keys)."""

    def __init__(self, cl, slot: int) -> None:
        self.cl, self.slot = cl, slot
        ids = _node_ids(cl)
        self.src = _owner_port(cl, slot)
        self.dst = next(p for p in cl.ports if p != self.src)
        self.src_c, self.dst_c = redis.Redis(port=self.src), redis.Redis(port=self.dst)
        self.src_id, self.dst_id = ids[self.src], ids[self.dst]

    def start(self) -> _Migration:
        self.dst_c.execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.src_id)
        self.src_c.execute_command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.dst_id)
        return self

    def finish(self) -> None:
        """Move the slot's remaining keys, then hand the slot to the target everywhere."""
        while True:
            keys = self.src_c.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 100)
            if not keys:
                break
            self.src_c.execute_command("MIGRATE", "127.0.0.1", self.dst, "", 0, 5000, "KEYS", *keys)
        for c in (self.dst_c, self.src_c, *[redis.Redis(port=p) for p in self.cl.ports]):
            c.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.dst_id)


@pytest.fixture
def cluster_locks(cluster, prefix):
    client = ClusterClient(host="127.0.0.1", port=cluster.ports[0])
    locks = RedisLocks(client, prefix=prefix, fence_idle_ttl=600)
    yield cluster, client, locks
    locks.close(timeout=2)
    client.close()


def test_every_operation_succeeds_while_its_slot_migrates(cluster_locks):
    """Before any key moved: acquiring a free key, renewing and releasing a held lease, reading the
    holder and writing a record all succeed (each key missing on the source is reached by ASK). They
    used to raise ``ClusterError: TTL exhausted`` after 0.4 s, and a failed release left the lease held."""
    cl, client, locks = cluster_locks
    held = locks.acquire("held", ttl=30).lease
    slot_of = lambda k: client.keyslot(locks.backend.lease_key(k))  # noqa: E731
    migrations = [_Migration(cl, slot_of(k)).start() for k in ("held", "free", "rec")]
    try:
        started = time.monotonic()
        free = locks.acquire("free", ttl=30)
        assert free.acquired  # created on the importing node
        assert held.renew() is True
        assert locks.holder("held").fencing_token == held.fencing_token
        assert locks.put_record("rec", "slot", "v", ttl=30, if_absent=True)
        assert locks.get_record("rec", "slot") == "v"
        assert held.put_record("slot", "claimed", if_absent=True)  # a lease record (beat slots)
        assert locks.get_lease_record("held", "slot") == "claimed"
        assert held.release() is True and locks.holder("held") is None
        assert free.lease.release() is True
        again = locks.acquire("held", ttl=30).lease  # the fence survives on the source node
        assert again.fencing_token > held.fencing_token
        assert again.release()
        assert time.monotonic() - started < 5
    finally:
        for m in migrations:
            m.finish()
    assert locks.holder("held") is None and locks.holder("free") is None
    assert locks.acquire("held", ttl=5).lease.release()  # after the move, via MOVED


@pytest.fixture
def private_cluster(prefix):
    """A cluster of its own for a test that reshards (the suite's shared cluster keeps its layout:
    a reshard returns before every node has learnt the new owners)."""
    from .servers import RedisCluster

    cl = RedisCluster().start()
    client = ClusterClient(host="127.0.0.1", port=cl.ports[0])
    locks = RedisLocks(client, prefix=prefix, fence_idle_ttl=600)
    try:
        yield cl, client, locks
    finally:
        locks.close(timeout=2)
        client.close()
        cl.close()


def test_leases_stay_exclusive_and_nothing_is_left_through_a_live_reshard(private_cluster):
    """``redis-cli --cluster reshard`` moves 600 slots while 4 threads acquire, renew and release
    leases on 40 keys: no operation fails, no two holders overlap, no lease is left behind."""
    cl, client, locks = private_cluster
    ids = _node_ids(cl)
    keys = [f"k{i}" for i in range(40)]
    holding: dict[str, int] = {}
    guard = threading.Lock()
    errors: list[BaseException] = []
    overlaps: list[str] = []
    counts = [0]
    stop = threading.Event()

    def worker(seed: int) -> None:
        import random

        rng = random.Random(seed)
        while not stop.is_set():
            key = rng.choice(keys)
            try:
                acq = locks.acquire(key, ttl=5)
                if not acq.acquired:
                    continue
                with guard:
                    if holding.get(key):
                        overlaps.append(key)
                    holding[key] = 1
                acq.lease.renew()
                time.sleep(0.002)
                with guard:
                    holding[key] = 0
                assert acq.lease.release()
                counts[0] += 1
            except BaseException as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        src, dst = cl.ports[0], cl.ports[1]
        out = subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "reshard",
                f"127.0.0.1:{src}",
                "--cluster-from",
                ids[src],
                "--cluster-to",
                ids[dst],
                "--cluster-slots",
                "600",
                "--cluster-yes",
                "--cluster-pipeline",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    print(f"    a live reshard of 600 slots: {counts[0]} acquire+renew+release cycles, errors {errors[:3]}")
    assert errors == [] and overlaps == []
    assert counts[0] > 50
    assert all(locks.holder(k) is None for k in keys)


def _getkeys_calls(cl) -> int:
    total = 0
    for c in cl.node_clients():
        stats = c.info("commandstats")
        total += int(stats.get("cmdstat_command|getkeys", {}).get("calls", 0))
    return total


def test_cluster_renewals_cost_one_round_trip_per_node(cluster_locks):
    """A heartbeat round of 300 leases on a 3-primary cluster: one pipeline per node, no
    ``COMMAND GETKEYS`` per lease (redis-py's ClusterPipeline asks it for every EVALSHA)."""
    cl, client, locks = cluster_locks
    leases = [locks.acquire(f"r{i}", ttl=30).lease for i in range(300)]
    before = _getkeys_calls(cl)
    outcomes = locks.backend.renew_many([(lease.key, lease.owner_token, 30.0) for lease in leases])
    assert outcomes == [True] * 300
    assert _getkeys_calls(cl) == before
    for lease in leases:
        assert lease.release()


def test_cluster_renewal_batches_are_cut_per_node(cluster_locks, monkeypatch):
    """2,400 leases (more than RENEW_BATCH in all, fewer on each node) are renewed in exactly one
    pipeline per node: the batch limit applies per node, not before the leases are routed."""
    from redis.client import Pipeline

    from taskguard.redis_backend import RENEW_BATCH

    cl, client, locks = cluster_locks
    n = 2400
    assert RENEW_BATCH < n < RENEW_BATCH * len(cl.ports)
    leases = [locks.acquire(f"b{i}", ttl=30).lease for i in range(n)]
    items = [(lease.key, lease.owner_token, 30.0) for lease in leases]
    assert locks.backend.renew_many(items) == [True] * n  # the first round also loads RENEW (NOSCRIPT, EVAL)
    sizes: list[int] = []
    orig = Pipeline.execute

    def counting(pipe, *a, **k):
        sizes.append(len(pipe.command_stack))
        return orig(pipe, *a, **k)

    monkeypatch.setattr(Pipeline, "execute", counting)
    outcomes = locks.backend.renew_many(items)
    monkeypatch.setattr(Pipeline, "execute", orig)
    assert outcomes == [True] * n
    assert len(sizes) == len(cl.ports) and sum(sizes) == n and max(sizes) <= RENEW_BATCH
    for lease in leases:
        assert lease.release()


def test_cluster_renewals_follow_a_slot_that_moves(cluster_locks):
    """A renewal whose slot is migrating (ASK) or moved (MOVED) is sent again through the cluster
    client and succeeds; the lease is never reported lost."""
    cl, client, locks = cluster_locks
    lease = locks.acquire("moving", ttl=30).lease
    m = _Migration(cl, client.keyslot(locks.backend.lease_key("moving"))).start()
    try:
        src = m.src_c
        src.execute_command("MIGRATE", "127.0.0.1", m.dst, locks.backend.lease_key("moving"), 0, 5000)  # moved: ASK
        assert locks.backend.renew_many([(lease.key, lease.owner_token, 30.0)]) == [True]
    finally:
        m.finish()
    assert locks.backend.renew_many([(lease.key, lease.owner_token, 30.0)]) == [True]  # MOVED, then the new owner
    assert lease.release()
