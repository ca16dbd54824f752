"""A publisher of one debounced call that SIGKILLs itself at a chosen step of the publish, for
the crash tests of ``debounce=`` (tests/test_debounce_crash.py).

``python -m tests.debounce_crash celery|rq STEP SHOP N``: sets up, prints ``ready``, waits for a
line on stdin, then calls ``search(SHOP, N)`` through the debounce window (Celery:
``tg.search.delay``; RQ: ``rq_jobs.search.enqueue_debounced``) and SIGKILLs itself at ``STEP``:

* ``before_record``: before the window's record is written (or updated);
* ``after_record``: right after it was written (a new window: before its message is published);
* ``after_publish``: after the message was published, before the window is marked published.

Environment: ``TASKGUARD_REDIS_URL``, ``TASKGUARD_PREFIX`` (RQ), ``TG_TEST_QUEUE`` and
``TG_TEST_PREFIX`` (Celery)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _patch(locks: Any, step: str) -> None:
    from taskguard import debounce

    put = locks.put_record

    def put_record(key: str, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "debounce" and step == "before_record":
            _die()
        written = put(key, name, *args, **kwargs)
        if name == "debounce" and written and step == "after_record":
            _die()
        return written

    locks.put_record = put_record
    mark = debounce.published  # (the publish protocol every adapter goes through)

    def window_published(*args: Any, **kwargs: Any) -> Any:
        if step == "after_publish":
            _die()
        return mark(*args, **kwargs)

    debounce.published = window_published


def main(framework: str, step: str, shop: str, n: int) -> None:
    if framework == "celery":
        from .celery_app import make_app

        app = make_app(os.environ["TG_TEST_QUEUE"], os.environ["TG_TEST_PREFIX"])
        task = app.tasks["tg.search"]
        _patch(task.taskguard_locks, step)

        def call() -> Any:
            return task.delay(shop, n)
    else:
        import redis
        from rq import Queue

        from taskguard_rq import locks_for

        from . import rq_jobs

        queue = Queue(os.environ["TG_TEST_QUEUE"], connection=redis.Redis.from_url(os.environ["TASKGUARD_REDIS_URL"]))
        _patch(locks_for(), step)

        def call() -> Any:
            return rq_jobs.search.enqueue_debounced(queue, shop, n)

    print("ready", flush=True)
    sys.stdin.readline()
    handle = call()
    print(f"survived {handle.id}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
