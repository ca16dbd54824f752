"""Step the wall clock of real processes with libfaketime (Debian package ``faketime``), leaving
their monotonic clock alone: what NTP correcting a drifted host does.

A process started with :attr:`SteppedClock.env` reads its wall-clock offset from a file on every
clock read (``FAKETIME_TIMESTAMP_FILE`` with ``FAKETIME_NO_CACHE=1``), so :meth:`SteppedClock.step`
moves it while the process runs; ``FAKETIME_DONT_FAKE_MONOTONIC=1`` keeps ``CLOCK_MONOTONIC``
true. Without libfaketime the test fails (``./run test`` installs it where apt-get is available).
"""

from __future__ import annotations

import glob
import os
import uuid
from pathlib import Path

import pytest

SITE = str(Path(__file__).resolve().parent / "faketime_site")
PATTERNS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
    "/usr/lib64/faketime/libfaketime.so.1",
)


def libfaketime() -> str:
    """The path of ``libfaketime.so.1``; fails the test when it is not installed."""
    explicit = os.environ.get("TASKGUARD_LIBFAKETIME")
    if explicit and os.path.exists(explicit):
        return explicit
    for pattern in PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    pytest.fail(
        "libfaketime is not installed: the clock-step tests need it (Debian/Ubuntu: apt-get install "
        "faketime; ./run test installs it where apt-get is available; or set TASKGUARD_LIBFAKETIME "
        "to the path of libfaketime.so.1)"
    )


class SteppedClock:
    """One process's (or process tree's) wall-clock offset, in whole seconds, stepped at will."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / f"faketime-{uuid.uuid4().hex[:8]}.rc"
        self.offset = 0
        self._write(0)
        self.env = {
            "LD_PRELOAD": libfaketime(),
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH", "")) if p),
        }

    def _write(self, offset: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{offset:+d}\n")
        os.replace(tmp, self.path)  # a reader never sees a half-written file

    def step(self, offset: int) -> None:
        """Set the wall clock of the processes started with :attr:`env` to ``offset`` seconds
        from the true time (their monotonic clock does not move)."""
        self.offset = int(offset)
        self._write(self.offset)
