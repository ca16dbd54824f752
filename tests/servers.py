"""Real redis-server processes the suite owns: a single server on a free port (for outage and
restart tests, never the shared 6379) and a 3-primary Redis Cluster."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

REDIS_SERVER = os.environ.get("TASKGUARD_REDIS_SERVER", "redis-server")
#: The command-line client beside the server (``redis-cli``; ``valkey-cli`` beside a valkey-server).
REDIS_CLI = os.environ.get("TASKGUARD_REDIS_CLI") or (
    os.path.join(os.path.dirname(REDIS_SERVER), "valkey-cli")
    if os.path.basename(REDIS_SERVER) == "valkey-server"
    else "redis-cli"
)


def redis_server_binary() -> str:
    path = shutil.which(REDIS_SERVER)
    if not path:
        raise RuntimeError(
            f"{REDIS_SERVER!r} is not on PATH; these tests start their own Redis servers. "
            "Install it (apt-get install redis-server, brew install redis) or set TASKGUARD_REDIS_SERVER."
        )
    return path


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and, for cluster nodes, its bus port +10000 free too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port found")


def wait_ping(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    c = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    while True:
        try:
            if c.ping():
                return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            c.close()


def serves(port: int, proc: subprocess.Popen) -> bool:
    """Whether the server answering on ``port`` is the process ``proc`` (and not another one that
    took the port first)."""
    c = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)
    try:
        return proc.poll() is None and int(c.info("server")["process_id"]) == proc.pid
    finally:
        c.close()


class RedisServer:
    """One redis-server on a free loopback port in a temporary directory.

    ``appendonly=True`` (with ``appendfsync always``) keeps leases across :meth:`restart`, like a
    production server with persistence; without it a restart loses every key."""

    def __init__(self, *, appendonly: bool = False, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="taskguard-redis-"))
        self.appendonly = appendonly
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.started = False  # once started, restarts keep the port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        self.proc = subprocess.Popen([*args, *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ping(self.port)
        if not serves(self.port, self.proc):
            # another process took the free port in between (parallel test workers): a first start
            # moves to another port; a restart cannot (its clients know the port)
            self.kill()
            if self.started:
                raise RuntimeError(f"port {self.port} was taken by another process while the server was down")
            self.port = free_port()
            return self.start()
        self.started = True
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster:
    """A 3-primary Redis Cluster of local redis-server processes (no replicas)."""

    def __init__(self, nodes: int = 3) -> None:
        self.ports = [free_port(cluster_bus=True) for _ in range(nodes)]
        self.dir = Path(tempfile.mkdtemp(prefix="taskguard-cluster-"))
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> RedisCluster:
        binary = redis_server_binary()
        for port in self.ports:
            d = self.dir / str(port)
            d.mkdir()
            self.procs.append(
                subprocess.Popen(
                    [
                        binary,
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--dir",
                        str(d),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "5000",
                        "--logfile",
                        str(d / "redis.log"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port, proc in zip(self.ports, self.procs, strict=True):
            wait_ping(port)
            if not serves(port, proc):
                self.close()
                raise RuntimeError(f"cluster node port {port} was taken by another process")
        clients = [redis.Redis(port=p) for p in self.ports]
        n = len(self.ports)
        for i, c in enumerate(clients):
            lo, hi = i * 16384 // n, (i + 1) * 16384 // n - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for p in self.ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", p)
        deadline = time.monotonic() + 30
        while True:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t and f"cluster_known_nodes:{n}" in t for t in texts):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not form: {texts}")
            time.sleep(0.1)
        for c in clients:
            c.close()
        return self

    def node_clients(self) -> list[redis.Redis]:
        return [redis.Redis(port=p) for p in self.ports]

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def fill_to_maxmemory(client: redis.Redis, prefix: str = "filler") -> int:
    """Bring the private server ``client`` talks to to maxmemory with ``noeviction`` (what the
    README asks for): maxmemory just above what it uses, then filler keys (expiring in an hour)
    until Redis refuses a write; then maxmemory is pinned 128 KiB under what it uses, so it stays
    refusing while client buffers come and go. Returns the number of filler keys. Never for the
    shared Redis."""
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 64 * 1024)
    for i in range(100000):
        try:
            client.set(f"{prefix}:{i}", "x" * 1024, ex=3600)
        except redis.exceptions.OutOfMemoryError:
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 128 * 1024)
            return i
    raise RuntimeError("the server never reached maxmemory")


def free_maxmemory(client: redis.Redis) -> None:
    """Lift the limit :func:`fill_to_maxmemory` set (the filler keys stay until they expire)."""
    client.config_set("maxmemory", 0)
