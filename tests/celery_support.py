"""Helpers for the Celery adapter tests: embedded workers, an event receiver, subprocess workers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis
from celery.contrib.testing.worker import start_worker
from kombu.asynchronous import set_event_loop

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def embedded_worker(app, pool: str = "threads", concurrency: int = 4, **kwargs):
    try:
        with start_worker(
            app,
            pool=pool,
            concurrency=concurrency,
            perform_ping_check=False,
            loglevel="WARNING",
            shutdown_timeout=15,
            **kwargs,
        ) as w:
            yield w
    finally:
        # the worker's event loop is process-global in kombu (kombu.asynchronous): Celery before
        # 5.5 leaves the stopped worker's loop there, and the next embedded worker of the process
        # would schedule its ETA / countdown messages on it, never to run
        set_event_loop(None)


class EventLog:
    """Captures the Celery events of one test's tasks in a background thread. The event
    exchange is shared by everything on the broker, so only events of task ids this test
    published (``track(result)``) or of tasks named in ``tasks`` are kept."""

    def __init__(self, app, tasks=()):
        self.app = app
        self.tasks = set(tasks)
        self.ids: set[str] = set()
        self.all: list[dict] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._receiver = None

    def _run(self):
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self.all.append})
            self._ready.set()
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self):
        self._thread.start()
        self._ready.wait(10)
        time.sleep(0.5)  # the receiver's queue is bound
        return self

    def __exit__(self, *exc):
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(5)

    def track(self, *results):
        for r in results:
            self.ids.add(r.id)
        return results[0] if len(results) == 1 else results

    @property
    def events(self) -> list[dict]:
        return [e for e in self.all if e.get("uuid") in self.ids or e.get("name") in self.tasks]

    def of(self, type_: str) -> list[dict]:
        return [e for e in self.events if e.get("type") == type_]

    def wait_for(self, type_: str, count: int = 1, timeout: float = 10.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.of(type_)) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.of(type_)


def delete_amqp_queue(app, queue: str) -> None:
    """Remove a test's queue from RabbitMQ (best effort: the broker may be gone already)."""
    try:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
    except Exception:
        pass


def body_log(app) -> list[str]:
    r = redis.Redis.from_url(
        app.conf.broker_url
        if app.conf.broker_url.startswith("redis")
        else os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    return [x.decode() for x in r.lrange(app.tg_log, 0, -1)]


def wait_for_body(app, start: str, timeout: float = 30.0) -> None:
    """Waits until a body of ``app`` wrote a log entry beginning with ``start`` (so its run holds
    its lease): a fixed sleep after publishing was too short while a worker's children were still
    starting on a loaded machine, and the call meant to be skipped ran after the holder ended."""
    deadline = time.monotonic() + timeout
    while not any(e.startswith(start) for e in body_log(app)):
        assert time.monotonic() < deadline, f"no {start!r} within {timeout} s: {body_log(app)}"
        time.sleep(0.05)


class WorkerProcess:
    """A real ``celery -A tests.celery_app worker`` subprocess for one test's queue and prefix."""

    def __init__(
        self,
        queue: str,
        prefix: str,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        broker: str | None = None,
        extra: tuple[str, ...] = (),
        env: dict | None = None,
        conf: dict | None = None,
    ):
        self.queue, self.prefix = queue, prefix
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.celery_app",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-Q",
            queue,
            "-n",
            f"w-{queue}-{os.getpid()}-{time.time_ns()}@%h",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            *extra,
        ]
        self.env = {**os.environ, "TG_TEST_QUEUE": queue, "TG_TEST_PREFIX": prefix, **(env or {})}
        if broker:
            self.env["TG_TEST_BROKER"] = broker
        if conf:
            import json

            self.env["TG_TEST_CONF"] = json.dumps(conf)
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"tg-worker-{queue}-{time.time_ns()}.log"

    def start(self, wait_ready: bool = True) -> WorkerProcess:
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if wait_ready:
            deadline = time.monotonic() + 60
            while b" ready." not in self.log_path.read_bytes():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker did not start:\n{self.output()}")
                time.sleep(0.1)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to the worker's whole process group (main process and pool children)."""
        os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 20) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc:
            try:  # pool children left behind by a killed main process
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
        return self.proc.returncode if self.proc else 0

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class BeatProcess:
    """A real ``celery -A tests.celery_app beat -S taskguard`` with its own schedule file."""

    def __init__(
        self,
        queue: str,
        prefix: str,
        schedule_dir: Path,
        name: str,
        every: float = 1.0,
        env: dict | None = None,
        scheduler: str = "taskguard",
    ):
        self.name = name
        self.log_path = Path(tempfile.gettempdir()) / f"tg-beat-{queue}-{name}-{time.time_ns()}.log"
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.celery_app",
            "beat",
            "-S",
            scheduler,
            "-s",
            str(schedule_dir / f"schedule-{name}"),
            "--loglevel",
            "INFO",
        ]
        self.env = {
            **os.environ,
            "TG_TEST_QUEUE": queue,
            "TG_TEST_PREFIX": prefix,
            "TG_TEST_BEAT": str(every),
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None

    def start(self) -> BeatProcess:
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def leader_pid(app, timeout=20.0):
    """The pid of the beat process holding the app's beat leader lease (waits up to ``timeout`` s)."""
    locks = app.conf.taskguard_locks
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = locks.holder("beat-leader:" + app.main)
        if info is not None:
            return info.holder["pid"]
        time.sleep(0.05)
    raise AssertionError("no beat became the leader")
