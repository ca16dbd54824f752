"""The fault injection shared by the torture scripts (``torture.py``, ``torture_guards.py``).

:class:`Chaos` runs worker processes (``multiprocessing``, fork) whose Redis traffic goes through
the suite's TCP proxy (``tests/tcp_proxy.py``), and injects at random, every ``every`` seconds:
SIGKILL of a process (respawned), SIGSTOP of a process for ``stop_for`` seconds (then SIGCONT),
a cut of every proxied connection, or ``delay`` seconds of proxy delay for ``delay_for`` seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent

#: A process factory: ``(proxy_url, seed) -> started process``.
Factory = Callable[[str, int], Any]

KINDS = ("SIGKILL", "SIGSTOP", "cut", "delay")


def start_process(target: Callable[..., None], *args: Any) -> Any:
    """``target(*args)`` in a forked daemon process, started."""
    p = mp.get_context("fork").Process(target=target, args=args, daemon=True)
    p.start()
    return p


def exit_on_term() -> None:
    """For a worker process: SIGTERM ends it at once (no cleanup: the parent deletes the keys)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))


class Chaos:
    """Worker processes under injected faults.

    Args:
        url: the Redis URL the workers reach through the proxy.
        factories: one per process; ``factory(proxy_url, seed)`` starts it (again after a
            SIGKILL, with a new seed).
        stop_for: seconds a SIGSTOPped process stays stopped.
        every: the range (seconds) of the pause between two faults, drawn uniformly.
        kinds: the faults to draw from (default all four).
        faulted: how many of the processes (the first ones) faults target; the rest run undisturbed
            (default all).
        delay, delay_for: the proxy delay per chunk, and how long (seconds) a delay fault lasts.
        seed: the seed of the fault sequence.
    """

    def __init__(
        self,
        url: str,
        factories: list[Factory],
        *,
        stop_for: float,
        every: tuple[float, float] = (0.1, 0.3),
        kinds: tuple[str, ...] = KINDS,
        faulted: int | None = None,
        delay: float = 0.3,
        delay_for: float = 1.0,
        seed: int = 11,
    ) -> None:
        from tests.tcp_proxy import TcpProxy

        parts = urlsplit(url)
        self.proxy = TcpProxy(parts.port or 6379, parts.hostname or "127.0.0.1")
        self.proxy_url = f"redis://127.0.0.1:{self.proxy.port}{parts.path or '/0'}"
        self.factories = factories
        self.stop_for, self.every, self.kinds = stop_for, every, kinds
        self.faulted = len(factories) if faulted is None else faulted
        self.delay, self.delay_for = delay, delay_for
        self.rng = random.Random(seed)
        self.faults = {k: 0 for k in kinds}
        self.seed = len(factories)
        self.procs = [f(self.proxy_url, i) for i, f in enumerate(factories)]
        self.stopped: list[tuple[float, Any]] = []
        self.started = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the processes started (monotonic clock)."""
        return time.monotonic() - self.started

    def _resume_due(self) -> None:
        for until, p in list(self.stopped):
            if time.monotonic() >= until:
                os.kill(p.pid, signal.SIGCONT)
                self.stopped.remove((until, p))

    def inject(self) -> None:
        """One fault, drawn at random (a SIGSTOP of a process already stopped draws nothing)."""
        self._resume_due()
        fault = self.rng.choice(self.kinds)
        i = self.rng.randrange(self.faulted)
        p = self.procs[i]
        if fault == "SIGKILL":
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
            self.stopped[:] = [(u, q) for u, q in self.stopped if q is not p]
            self.seed += 1
            self.procs[i] = self.factories[i](self.proxy_url, self.seed)
        elif fault == "SIGSTOP":
            if any(q is p for _, q in self.stopped):
                return
            os.kill(p.pid, signal.SIGSTOP)
            self.stopped.append((time.monotonic() + self.stop_for, p))
        elif fault == "cut":
            self.proxy.cut()
        else:
            self.proxy.delay = self.delay
            time.sleep(self.delay_for)
            self.proxy.delay = 0.0
        self.faults[fault] += 1

    def run(self, done: Callable[[], bool], seconds: float) -> float:
        """Inject faults until ``done()`` or ``seconds`` have passed; returns the seconds elapsed."""
        while not done() and self.elapsed() < seconds:
            time.sleep(self.rng.uniform(*self.every))
            self.inject()
        return self.elapsed()

    def stop(self) -> None:
        """Resume the stopped processes, end every process, close the proxy."""
        for _, p in self.stopped:
            os.kill(p.pid, signal.SIGCONT)
        self.stopped = []
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join(5)
        self.proxy.close()

    def summary(self) -> str:
        """``"<n> SIGKILL, <n> SIGSTOP, <n> cut, <n> delay"``."""
        return ", ".join(f"{n} {k}" for k, n in self.faults.items())

    def total(self) -> int:
        return sum(self.faults.values())
