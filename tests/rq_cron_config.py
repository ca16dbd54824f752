"""An ``rq cron`` configuration for the rq-cron tests, loaded by ``taskguard rq-cron`` and by
plain ``rq cron`` alike. ``$TG_TEST_CRON`` is a JSON list of register(...) keyword dicts (the
function named by ``"job"``: ``tick`` or ``guarded``; queue ``$TG_TEST_QUEUE``).

``$TG_TEST_CRASH_FLAG``: when that file exists, the first taskguard scheduler to take it (an
atomic rename) SIGKILLs itself right after enqueuing a slot's job, before confirming the slot."""

import json
import os
import signal

from rq import cron

from tests import rq_jobs

_JOBS = {"tick": rq_jobs.cron_tick, "guarded": rq_jobs.cron_guarded, "overlap": rq_jobs.cron_overlap}

for spec in json.loads(os.environ.get("TG_TEST_CRON", "[]")):
    spec = dict(spec)
    fn = _JOBS[spec.pop("job", "tick")]
    cron.register(fn, queue_name=os.environ["TG_TEST_QUEUE"], **spec)

if os.environ.get("TG_TEST_CRASH_FLAG"):
    from taskguard_rq.cron import RQCronScheduler

    _enqueue = RQCronScheduler.enqueue

    def _crash_after_enqueue(self, entry, slot):
        job = _enqueue(self, entry, slot)
        flag = os.environ["TG_TEST_CRASH_FLAG"]
        try:
            os.rename(flag, flag + ".taken")
        except FileNotFoundError:
            return job
        os.kill(os.getpid(), signal.SIGKILL)
        return job

    RQCronScheduler.enqueue = _crash_after_enqueue
