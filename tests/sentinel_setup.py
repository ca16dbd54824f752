"""A Sentinel-managed Redis made of real processes, for failover tests (tests/test_failover.py)
and the failover script (bench/failover.py): one primary, one replica whose replication link runs
through a :class:`~tests.tcp_proxy.TcpProxy` (so that it can be cut while the primary goes on
answering), and three sentinels (``redis-server --sentinel``), all on free loopback ports.

On loopback a replica keeps up within microseconds, so nothing would be in flight to lose at a
failover: :meth:`Failover.cut_replication` black-holes the link (the replica's ``master_link_status``
stays ``up`` and Sentinel still promotes it, but no write from then on reaches it, and its
acknowledgements never reach the primary, so ``WAIT`` answers 0).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import time
from pathlib import Path

import redis

from .servers import RedisServer, free_port, redis_server_binary, wait_ping
from .tcp_proxy import TcpProxy

MASTER = "tgfailover"
#: Sentinel timings: the primary is deemed down after this many ms without an answer, and a
#: failover is retried after ``FAILOVER_TIMEOUT_MS``; a promotion takes a few seconds.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
#: The primary starts a replica's full sync at once (Redis 7 waits 5 s for more replicas).
PRIMARY_OPTS = ("--repl-diskless-sync-delay", "0")


def acknowledged(primary_port: int) -> bool:
    """Does a replica acknowledge a write on the primary (a probe key, 10 s TTL, and ``WAIT`` on
    its connection)? Right after a sync the primary counts a replica only from its first ``ACK``."""
    with redis.Redis(port=primary_port, socket_timeout=2) as c:
        pipe = c.pipeline(transaction=False)
        pipe.set("tgfailover-probe", "1", px=10000)
        pipe.execute_command("WAIT", 1, 200)
        return int(pipe.execute()[1]) >= 1


class Sentinel:
    """One ``redis-server --sentinel`` process monitoring ``MASTER`` at ``primary_port``."""

    def __init__(self, primary_port: int, directory: Path) -> None:
        self.port = free_port()
        self.dir = directory
        self.conf = directory / f"sentinel-{self.port}.conf"
        self.conf.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {directory}\n"
            f"logfile {directory / f'sentinel-{self.port}.log'}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER} 1\n"
        )
        self.proc = subprocess.Popen(
            [redis_server_binary(), str(self.conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_ping(self.port)
        self.client = redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Failover:
    """Primary, replica (through a proxy) and three sentinels. Use as a context manager."""

    def __init__(self) -> None:
        self.primary = RedisServer(extra=PRIMARY_OPTS).start()
        self.proxy = TcpProxy(self.primary.port, nodelay=True)
        self.replica = RedisServer(extra=("--replicaof", "127.0.0.1", str(self.proxy.port))).start()
        self.dir = self.primary.dir
        self.sentinels: list[Sentinel] = []
        try:
            self._wait(self._replica_in_sync, 10, "the replica to sync")
            self.sentinels = [Sentinel(self.primary.port, self.dir) for _ in range(3)]
            self._wait(self._sentinels_ready, 20, "the sentinels to find each other and the replica")
        except BaseException:
            self.close()
            raise

    # -- addresses -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The sentinels, as a ``sentinel://`` URL (kombu's form)."""
        return ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels)

    def node(self, server: RedisServer) -> redis.Redis:
        """A plain client of one server (for looking at it directly, not through Sentinel)."""
        return redis.Redis(port=server.port, socket_timeout=2, socket_connect_timeout=2)

    # -- faults ------------------------------------------------------------------------------------
    def cut_replication(self) -> None:
        """Hold every byte on the replication link from now on (both directions)."""
        self.proxy.blackhole = True

    def kill_primary(self) -> None:
        """SIGKILL the primary."""
        self.primary.kill()

    def wait_promoted(self, timeout: float = 30.0) -> float:
        """Wait until every sentinel names the replica as the primary and it answers as one;
        returns the seconds waited. Raises TimeoutError."""
        started = time.monotonic()
        self._wait(self._promoted, timeout, "Sentinel to promote the replica")
        return time.monotonic() - started

    # -- conditions --------------------------------------------------------------------------------
    def _replica_in_sync(self) -> bool:
        with self.node(self.replica) as c:
            info = c.info("replication")
        return info.get("master_link_status") == "up" and acknowledged(self.primary.port)

    def _sentinels_ready(self) -> bool:
        for s in self.sentinels:
            try:
                if len(s.client.sentinel_sentinels(MASTER)) < 2 or not s.client.sentinel_slaves(MASTER):
                    return False
            except redis.RedisError:
                return False
        return True

    def _promoted(self) -> bool:
        for s in self.sentinels:
            try:
                addr = s.client.sentinel_get_master_addr_by_name(MASTER)
            except redis.RedisError:
                return False
            if addr is None or int(addr[1]) != self.replica.port:
                return False
        try:
            with self.node(self.replica) as c:
                return c.info("replication").get("role") == "master"
        except redis.RedisError:
            return False

    @staticmethod
    def _wait(cond: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.05)

    # -- life cycle --------------------------------------------------------------------------------
    def close(self) -> None:
        for s in self.sentinels:
            s.close()
        self.proxy.close()
        self.replica.close()
        self.primary.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Failover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass
class Trial:
    """One failover trial (:func:`run_trial`).

    Attributes:
        replicas: the durability option the lease was acquired with.
        acquired: the acquisition under test answered "acquired" (a body would have started).
        reason: its reason when not acquired.
        on_promoted: that lease exists on the promoted replica (looked up there directly).
        control_on_promoted: the lease taken (and ``WAIT`` ed for) before the cut is there.
        second: after the promotion, an acquisition of the same key through Sentinel (with the
            same option) answered "acquired" (it reached the new primary).
        second_reason: its reason when not.
        fences: the fencing tokens of the first and the second holder, where both were had.
        promotion: seconds from the SIGKILL until every sentinel named the new primary.
    """

    replicas: int
    acquired: bool
    reason: str | None
    on_promoted: bool
    control_on_promoted: bool
    second: bool
    second_reason: str | None
    fences: tuple[int | None, int | None]
    promotion: float

    @property
    def lost(self) -> bool:
        """A body would have started on a lease the promoted primary does not have."""
        return self.acquired and not self.on_promoted


def run_trial(
    replicas: int, *, replica_timeout: float = 0.1, latency_samples: int = 0
) -> tuple[Trial, dict[int, list[float]]]:
    """Set up a :class:`Failover`, take a lease (and ``WAIT`` for it) while replication works
    (the control), cut the replication link, acquire the key under test with ``replicas``, SIGKILL
    the primary, let Sentinel promote the replica, then look for both leases on it and acquire
    the key again through Sentinel. With ``latency_samples``, first time that many acquisitions
    with ``replicas=0`` and as many with ``replicas=1``, alternately, while the link works
    (seconds each, by option; each lease released untimed)."""
    from taskguard import RedisLocks

    with Failover() as f:
        locks = RedisLocks.from_url(
            f.url,
            sentinel_master=MASTER,
            prefix="tgfailover",
            replicas=replicas,
            replica_timeout=replica_timeout,
            connect_timeout=1.0,
            socket_timeout=2.0,
            retries=3,
            shutdown_timeout=0.5,
        )
        try:
            samples: dict[int, list[float]] = {0: [], 1: []}
            for i in range(2 * latency_samples):
                option = (i + i // 2) % 2  # 0 1 1 0 0 1 1 0 ...: neither always goes first
                t0 = time.perf_counter()
                lease = locks.acquire("latency", ttl=60, replicas=option).lease
                samples[option].append(time.perf_counter() - t0)
                assert lease is not None and lease.release()
            control = locks.acquire("control", ttl=120, replicas=1)
            assert control.acquired, f"the replica did not acknowledge a lease before the cut: {control.reason}"
            f.cut_replication()
            first = locks.acquire("job", ttl=120)
            f.kill_primary()
            promotion = f.wait_promoted()
            with f.node(f.replica) as promoted:
                on_promoted = promoted.exists(locks.backend.lease_key("job")) == 1
                control_there = promoted.exists(locks.backend.lease_key("control")) == 1
            second = locks.acquire("job", ttl=120)  # through Sentinel: the new primary
            fences = (
                first.lease.fencing_token if first.lease else None,
                second.lease.fencing_token if second.lease else None,
            )
            return Trial(
                replicas,
                first.acquired,
                first.reason,
                on_promoted,
                control_there,
                second.acquired,
                second.reason,
                fences,
                promotion,
            ), samples
        finally:
            locks.close(timeout=0.5)
