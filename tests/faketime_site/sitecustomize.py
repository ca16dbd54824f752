"""Loaded (through PYTHONPATH) by the processes whose wall clock a test steps with libfaketime
(:mod:`tests.faketime`).

libfaketime 0.9.10 (Debian 12's) breaks ``time.sleep`` on Python 3.11+ when the monotonic clock
is left alone (``FAKETIME_DONT_FAKE_MONOTONIC=1``): Python sleeps with
``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ...)`` and libfaketime shifts that absolute
monotonic deadline as if it were a faked one, into an invalid value, so ``time.sleep`` raises
``OSError: [Errno 22]`` (libfaketime issue 426). Relative waits (``select``, lock and condition
timeouts) are unaffected, so here ``time.sleep`` waits with ``select`` on the monotonic clock.
"""

import os
import select
import time

if "faketime" in os.environ.get("LD_PRELOAD", ""):

    def _sleep(secs: float) -> None:
        if secs < 0:
            raise ValueError("sleep length must be non-negative")
        end = time.monotonic() + secs
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            select.select([], [], [], left)

    time.sleep = _sleep
