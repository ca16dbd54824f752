"""A third-party scheduler made singleton with the mixin (for the beat tests)."""

from redbeat import RedBeatScheduler

from taskguard_celery.beat import SingletonBeatMixin


class SingletonRedBeat(SingletonBeatMixin, RedBeatScheduler):
    """RedBeat (schedule kept in Redis), each due run published once across beats."""
