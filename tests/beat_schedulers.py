"""Schedulers for the beat tests: a third-party scheduler made singleton with the mixin, and a
taskguard scheduler that SIGKILLs itself once at a chosen point of a publish."""

import os
import signal

from celery.beat import PersistentScheduler
from redbeat import RedBeatScheduler

from taskguard_celery.beat import SingletonBeatMixin


class SingletonRedBeat(SingletonBeatMixin, RedBeatScheduler):
    """RedBeat (schedule kept in Redis), each due run published once across beats."""


class _CrashOnce:
    """Below the mixin: when the file ``$TG_TEST_CRASH_FLAG`` exists, the first beat to take it
    (an atomic rename) SIGKILLs itself at ``$TG_TEST_CRASH_MODE``: ``claim`` (the slot is
    claimed, nothing published) or ``publish`` (published, not confirmed)."""

    def apply_async(self, entry, producer=None, advance=True, **kwargs):
        flag, mode = os.environ.get("TG_TEST_CRASH_FLAG"), os.environ.get("TG_TEST_CRASH_MODE")
        if flag:
            try:
                os.rename(flag, flag + ".taken")
            except FileNotFoundError:
                pass
            else:
                if mode == "claim":
                    os.kill(os.getpid(), signal.SIGKILL)
                result = super().apply_async(entry, producer, advance, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
                return result
        return super().apply_async(entry, producer, advance, **kwargs)


class CrashingScheduler(SingletonBeatMixin, _CrashOnce, PersistentScheduler):
    """The taskguard scheduler, crashing once on demand (see :class:`_CrashOnce`)."""
