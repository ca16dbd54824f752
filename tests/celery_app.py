"""Celery apps for the adapter tests: ``make_app`` builds one per test (own queue, own key prefix);
the module-level ``app`` is what ``celery -A tests.celery_app worker`` subprocesses load, configured
by ``TG_TEST_*`` environment variables."""

from __future__ import annotations

import os
import signal
import time

import redis
from celery import Celery, chain, group
from celery.exceptions import Reject, SoftTimeLimitExceeded
from celery.signals import task_prerun

from taskguard import LeaseBackendError, RateLimited, RedisLocks, settle_cost
from taskguard_celery import GuardedTask, current_lease

from .timed_redis import TimedRedis

REDIS_URL = os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")


class Flaky(Exception):
    pass


def _gevent_patched() -> bool:
    try:
        from gevent import monkey
    except ImportError:
        return False
    return bool(monkey.is_module_patched("threading"))


def make_app(queue: str, prefix: str, *, broker: str | None = None, **conf) -> Celery:
    app = Celery(f"tg-{queue}", broker=broker or REDIS_URL, backend=REDIS_URL, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        # events of this test's workers only: on the shared Redis broker every app's events go
        # through one fanout exchange, so a Flower or an event receiver of one test would count
        # the task events of tests running beside it (RabbitMQ tests keep Celery's default
        # exchange: a durable exchange per test would be left behind in the vhost)
        **({} if broker else {"event_exchange": f"celeryev.{queue}"}),
        taskguard_locks=RedisLocks(redis.Redis.from_url(REDIS_URL), prefix=prefix),
        broker_connection_retry_on_startup=True,
        result_expires=600,
        worker_hijack_root_logger=False,
    )
    app.conf.update(conf)
    if not broker:
        # Every test's Redis-transport workers share kombu's one restore mutex (the `unacked_mutex`
        # key, a redis-py lock held while a worker sweeps unacked messages back to their queues).
        # A worker SIGKILLed inside its sweep leaves that lock for `unacked_mutex_expire`, 300 s
        # by default, and until then no worker of any test restores anything (kombu/transport/
        # redis.py `Mutex`, `QoS.restore_visible`; celery/kombu#1816): a test killing workers
        # would stall the redeliveries of every test running beside it.
        app.conf.broker_transport_options = {"unacked_mutex_expire": 10, **(app.conf.broker_transport_options or {})}
    r = TimedRedis.from_url(REDIS_URL)
    log = f"{prefix}:log"  # what bodies did, in order: "name:fence" entries

    def note(entry: str) -> None:
        # with a TTL: a session of an older suite ending on the shared Redis deletes untimed tgtest- keys
        r.pipeline().rpush(log, entry).expire(log, 600).execute()

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.slow", ttl=5, key="slow:{n}")
    def slow(self, n, seconds=1.5):
        note(f"slow:{n}:start:{self.lease.fencing_token}")
        time.sleep(seconds)
        note(f"slow:{n}:end")
        return {"n": n, "fence": self.lease.fencing_token, "same": current_lease() is self.lease}

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.slow_or_retry", ttl=0.8, key="sr:{n}", max_retries=3)
    def slow_or_retry(self, n, seconds=0.0, retry_once=False):
        """Sleeps ``seconds``; with ``retry_once`` its first attempt retries (0.3 s). A short TTL: a
        copy deferred behind a run of its task id looks again every 0.5-0.8 s."""
        note(f"sr:{n}:start:{self.request.retries}:{self.lease.fencing_token}")
        time.sleep(seconds)
        if retry_once and self.request.retries == 0:
            raise self.retry(countdown=0.3)
        note(f"sr:{n}:end:{self.request.retries}")
        return self.request.retries

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.short_ttl", ttl=0.6, key="short")
    def short_ttl(self, seconds=2.0):
        time.sleep(seconds)  # longer than the TTL: the heartbeat must keep the lease
        return self.lease.fencing_token

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.retrying", ttl=2, key="retry:{job}", max_retries=5)
    def retrying(self, job, fail_times=2, countdown=0.5):
        note(
            f"retrying:{job}:{self.request.retries}:{self.lease.fencing_token}:"
            f"{sorted(k for k in (self.request.headers or {}) if k != 'taskguard')}"
        )
        if self.request.retries < fail_times:
            raise self.retry(countdown=countdown, headers={"attempt_note": self.request.retries})
        return self.lease.fencing_token

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.autoretry",
        ttl=2,
        key="auto",
        autoretry_for=(Flaky,),
        retry_kwargs={"countdown": 0.3, "max_retries": 3},
    )
    def autoretry(self):
        note(f"auto:{self.request.retries}:{self.lease.fencing_token}")
        if self.request.retries < 2:
            raise Flaky("transient")
        return self.lease.fencing_token

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.boom", ttl=5, key="boom")
    def boom(self):
        raise ValueError("body failed")

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.soft", ttl=5, key="soft", soft_time_limit=0.5)
    def soft(self):
        try:
            time.sleep(3)
        except SoftTimeLimitExceeded:
            note("soft:limit")
            raise

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.loses", ttl=5, key="loses")
    def loses(self):
        r.hset("{" + prefix + ":loses}", "o", "someone-else")  # taken over mid-body
        return "finished"

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.loses_warn", ttl=5, key="loses", on_lost="warn")
    def loses_warn(self):
        r.hset("{" + prefix + ":loses}", "o", "someone-else")
        return "finished"

    for mode in ("ignore", "raise", "retry"):

        def body(self, n=0, seconds=0.0, _mode=mode):
            note(f"{_mode}:{n}:ran")
            time.sleep(seconds)
            return f"{_mode} ran"

        app.task(
            base=GuardedTask,
            bind=True,
            shared=False,
            name=f"tg.on_skip_{mode}",
            ttl=5,
            key="modes",
            on_skip=mode,
            skip_retry_delay=0.4,
            skip_max_retries=2,
            max_retries=0,
        )(body)

    @app.task(
        base=GuardedTask, bind=True, shared=False, name="tg.continuing", ttl=5, key="slow:{n}", continue_on_skip=True
    )
    def continuing(self, n, seconds=0.0):
        return n

    @app.task(shared=False, name="tg.after")
    def after(value):
        note(f"after:{value!r}")
        return "after ran"

    @app.task(shared=False, name="tg.collect")
    def collect(values):
        return values

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.noresult", ttl=5, key="slow:{n}", ignore_result=True)
    def noresult(self, n, seconds=0.0):
        time.sleep(seconds)
        return n

    @app.task(base=GuardedTask, shared=False, name="tg.unguarded_noop", ttl=5)
    def guarded_noop():
        return 1

    @app.task(shared=False, name="tg.noop")
    def noop():
        return 1

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.retry_nothrow", ttl=3, key="nothrow", max_retries=1)
    def retry_nothrow(self):
        note(f"nothrow:{self.request.retries}:start:{time.time():.3f}")
        if self.request.retries == 0:
            self.retry(countdown=0, throw=False)  # the retry is out, the body goes on
            time.sleep(1.0)
        note(f"nothrow:{self.request.retries}:end:{time.time():.3f}")
        return self.request.retries

    @app.task(
        base=GuardedTask, bind=True, shared=False, name="tg.retry_odd_times", ttl=3, key="odd:{how}", max_retries=2
    )
    def retry_odd_times(self, how):
        note(f"odd:{how}:{self.request.retries}")
        if self.request.retries == 0:
            if how == "negative":
                raise self.retry(countdown=-10)
            from datetime import datetime, timedelta, timezone

            raise self.retry(eta=(datetime.now(timezone.utc) + timedelta(seconds=0.3)).isoformat())
        return "ok"

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.hung_then_retry",
        ttl=0.4,
        key="hung",
        max_hold=0.5,
        max_retries=1,
        on_lost="warn",
    )
    def hung_then_retry(self):
        note(f"hung:{self.request.retries}")
        if self.request.retries == 0:
            time.sleep(1.5)  # outlives max_hold: the lease is gone when it retries
            raise self.retry(countdown=0.2)
        return "second run"

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.sleeper",
        ttl=3,
        key="sleeper:{name}",
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def sleeper(self, name, seconds=4.0, fenced=True):
        fence = self.lease.fencing_token
        note(f"sleeper:{name}:start:{fence}:{os.getpid()}")
        time.sleep(seconds)
        if fenced:  # storage-side check: accept a token >= the last one seen, reject a lower one
            accepted = r.eval(FENCED_SET, 1, f"{prefix}:store:{name}", fence, f"written with {fence}")
            note(f"sleeper:{name}:write:{fence}:{'accepted' if accepted else 'rejected'}")
        note(f"sleeper:{name}:end:{fence}")
        return fence

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.limited", ttl=30, key="limited", time_limit=1)
    def limited(self):
        note(f"limited:start:{os.getpid()}")
        time.sleep(10)

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.long_holder", ttl=30, key="long")
    def long_holder(self, seconds=10.0):
        note(f"long:start:{self.lease.fencing_token}:{os.getpid()}")
        time.sleep(seconds)
        return self.lease.fencing_token

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.long_cleanup", ttl=30, key="long")
    def long_cleanup(self, seconds=10.0, cleanup=3.0):
        """Holds ``long`` for ``seconds``; a ``revoke(terminate=True, signal="SIGUSR1")`` (Celery's
        soft cancel: ``SoftTimeLimitExceeded`` in the body) is caught and cleaned up after for
        ``cleanup`` seconds, still under the lease, before the body ends."""
        note(f"long:start:{self.lease.fencing_token}:{os.getpid()}")
        try:
            time.sleep(seconds)
        except SoftTimeLimitExceeded:
            note(f"long:cancelled:{time.time():.3f}")
            time.sleep(cleanup)
            note(f"long:cleaned:{time.time():.3f}")
            return "cleaned"
        note(f"long:end:{time.time():.3f}")
        return "ran"

    @app.task(shared=False, name="tg.tick", bind=True)
    def tick(self):
        beat = (self.request.headers or {}).get("taskguard_beat") or getattr(self.request, "taskguard_beat", None) or {}
        note(f"tick:{beat.get('slot')}:{beat.get('leader_fence')}:{time.time():.3f}")

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.clock_held", ttl=2, key="clock-held")
    def clock_held(self, seconds=6.0):
        """Holds a ttl=2 lease for ``seconds`` (monotonic), checking it is held every 0.1 s, as a
        body does before each fenced write (a clock-step test steps this worker's wall clock)."""
        note(f"clock_held:start:{self.lease.fencing_token}")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.lease.ensure_held()
            time.sleep(0.1)
        return self.lease.fencing_token

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.hold4", ttl=4, key="hold4")
    def hold4(self, seconds=12.0):
        """Holds a ttl=4 lease for ``seconds``; the heartbeat must renew it (the gevent test)."""
        fence = self.lease.fencing_token
        time.sleep(seconds)
        return {"fence": fence, "lost": self.lease.lost, "pool_patched": _gevent_patched()}

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.lease_autoretry",
        ttl=3,
        key="lar:{name}",
        autoretry_for=(LeaseBackendError,),
        retry_backoff=1,
        retry_backoff_max=2,
        retry_jitter=False,
        max_retries=6,
    )
    def lease_autoretry(self, name):
        """Retried by autoretry_for while the lease store is down (backoff 1, 2, 2... s)."""
        note(f"lar:{name}:{self.request.retries}:{self.lease.fencing_token}")
        return self.request.retries

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.lease_autoretry_short",
        ttl=3,
        key="lars:{name}",
        autoretry_for=(LeaseBackendError,),
        retry_kwargs={"countdown": 0.2, "max_retries": 2},
    )
    def lease_autoretry_short(self, name):
        note(f"lars:{name}:{self.request.retries}")
        return self.request.retries

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.any_autoretry",
        ttl=3,
        key=lambda name, amount=0: "" if name == "bad" else f"aar:{name}",
        once=True,
        fingerprint=("name", "amount"),
        on_skip="raise",
        autoretry_for=(Exception,),
        retry_kwargs={"countdown": 0.2},
        max_retries=3,
    )
    def any_autoretry(self, name, amount=0):
        """autoretry_for=(Exception,): only a LeaseBackendError before the body is retried."""
        note(f"aar:{name}:{self.request.retries}")
        return {"name": name, "amount": amount, "retries": self.request.retries}

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.rated_autoretry",
        ttl=3,
        key="rar:{name}",
        rate=(100, 1.0),
        rate_key="rar",
        autoretry_for=(LeaseBackendError,),
        retry_kwargs={"countdown": 0.3},
        max_retries=30,
    )
    def rated_autoretry(self, name):
        note(f"rar:{name}:{self.request.retries}")
        return self.request.retries

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.retry_then_claim",
        ttl=5,
        key="rtc:{name}",
        autoretry_for=(LeaseBackendError,),
        retry_kwargs={"countdown": 0.3},
        max_retries=30,
    )
    def retry_then_claim(self, name):
        note(f"rtc:{name}:{self.request.retries}:{self.lease.fencing_token}")
        if self.request.retries == 0:
            raise self.retry(countdown=1.0)  # keeps the lease; its retry claims it
        return self.lease.fencing_token

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.late_lease",
        ttl=3,
        key="ll:{name}",
        acks_late=True,
        autoretry_for=(LeaseBackendError,),
        retry_kwargs={"countdown": 0.5},
        max_retries=10,
    )
    def late_lease(self, name):
        """acks_late, its broker the lease Redis (the acks_late fallback test)."""
        note(f"ll:{name}:{self.request.retries}:{self.lease.fencing_token}")
        return name

    @task_prerun.connect(weak=False)
    def late_lease_pause(sender=None, task_id=None, **_):
        # the first execution of tg.late_lease pauses before its guard: the test stops Redis then
        if getattr(sender, "app", None) is app and sender.name == "tg.late_lease" and attempt(f"ll:{task_id}") == 1:
            time.sleep(3.0)

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.hold3", ttl=3, key="hold3")
    def hold3(self, name, seconds=11.0):
        """Holds a ttl=3 lease for ``seconds`` (the maxmemory test): logs its start and end."""
        fence = self.lease.fencing_token
        note(f"hold3:{name}:start:{fence}:{time.time():.3f}")
        time.sleep(seconds)
        note(f"hold3:{name}:end:{fence}:{time.time():.3f}")
        return {"fence": fence, "lost": self.lease.lost}

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.hold3_wait",
        ttl=3,
        key="hold3",
        wait=1.5,
        blocking_wait=True,
    )
    def hold3_wait(self, name, seconds=0.0):
        note(f"hold3:{name}:start:{self.lease.fencing_token}:{time.time():.3f}")
        time.sleep(seconds)
        note(f"hold3:{name}:end:{self.lease.fencing_token}:{time.time():.3f}")
        return name

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.slot_tick", ttl=30, key="slot-tick")
    def slot_tick(self, seconds=0.0):
        """A guarded beat task: logs its slot, leader fence, time and task id."""
        beat = (self.request.headers or {}).get("taskguard_beat") or getattr(self.request, "taskguard_beat", None) or {}
        note(f"stick:{beat.get('slot')}:{beat.get('leader_fence')}:{time.time():.3f}:{self.request.id}")
        time.sleep(seconds)

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.guarded_tick", ttl=30, key="gtick")
    def guarded_tick(self, seconds=0.0):
        note(f"gtick:{self.lease.key}:{self.lease.ttl}")
        time.sleep(seconds)
        return self.lease.key

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.unit",
        ttl=2,
        key="unit:{key}",
        acks_late=True,
        reject_on_worker_lost=True,
        on_skip="retry",
        skip_retry_delay=0.3,
        skip_max_retries=10000,
    )
    def unit(self, unit_id, key, seconds=0.5):
        """One unit of work of the soak: checks nobody else entered the key while it ran."""
        fence = self.lease.fencing_token
        occ = f"{prefix}:occ:{key}"
        r.set(occ, fence)
        r.rpush(f"{prefix}:ledger:{key}", f"{fence}:{time.time():.6f}")
        time.sleep(seconds)
        if int(r.get(occ) or 0) != fence:
            r.rpush(f"{prefix}:violations", f"{key}:{fence}:{r.get(occ)}")
        r.sadd(f"{prefix}:done", unit_id)
        return fence

    # -- run identity: every way a task id runs again -----------------------------------------------
    def attempt(name: str) -> int:
        return int(r.incr(f"{prefix}:attempt:{name}"))

    @task_prerun.connect(weak=False)
    def count_executions(sender=None, task_id=None, **_):
        if getattr(sender, "app", None) is app:  # every execution, also the ignored copies
            r.rpush(f"{prefix}:executions", f"{sender.name}:{task_id}")

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.late_long", ttl=6, key="late:{name}", acks_late=True)
    def late_long(self, name, seconds=24.0):
        note(f"late:{name}:start:{self.lease.fencing_token}")
        time.sleep(seconds)
        note(f"late:{name}:end")
        return f"body of {name}"

    @app.task(
        base=GuardedTask, bind=True, shared=False, name="tg.rejecting", ttl=5, key="reject:{name}", acks_late=True
    )
    def rejecting(self, name):
        n = attempt(name)
        note(f"reject:{name}:{n}:{self.lease.fencing_token}")
        if n == 1:
            raise Reject("handed back", requeue=True)
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.timed_out",
        ttl=20,
        key="timed:{name}",
        acks_late=True,
        acks_on_timeout=False,
        time_limit=1,
    )
    def timed_out(self, name):
        n = attempt(name)
        note(f"timed:{name}:{n}:{self.lease.fencing_token}")
        if n == 1:
            time.sleep(10)  # killed by the hard time limit; the message is handed back
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.lost_retried",
        ttl=20,
        key="lostr:{name}",
        acks_late=True,
        retry_on_worker_lost=True,
        max_retries=3,
        default_retry_delay=0,
    )
    def lost_retried(self, name):
        n = attempt(name)
        note(f"lostr:{name}:{n}:{self.lease.fencing_token}")
        if n == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the main process publishes a retry, no failure
        return n

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.replacement", ttl=5, key="repl:{name}")
    def replacement(self, name, part):
        note(f"repl:{name}:{part}:{self.lease.fencing_token}")
        return f"{name}:{part}"

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.replacing", ttl=5, key="repl:{name}")
    def replacing(self, name, how="task"):
        note(f"repl:{name}:replacing:{self.lease.fencing_token}")
        if how == "task":
            return self.replace(replacement.s(name, "single"))
        if how == "chain":
            # (the chain's last step takes over this task id: celery/app/task.py, replace)
            return self.replace(chain(replacement.si(name + "-1", "a"), replacement.si(name, "b")))
        return self.replace(group(replacement.si(name + "-1", "g1"), replacement.si(name + "-2", "g2")))

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.counted", ttl=5, key="counted:{name}")
    def counted(self, name):
        n = attempt(name)
        note(f"counted:{name}:{n}:{self.lease.fencing_token}")
        return n

    @app.task(base=GuardedTask, shared=False, name="tg.default_noop")
    def default_noop():
        return 1

    @app.task(base=GuardedTask, shared=False, name="tg.default_noop_noresult", ignore_result=True)
    def default_noop_noresult():
        return 1

    def ledger(kind: str, key: str, lease) -> None:
        # entry / exit records of a limited key's holders: "<in|out> <time> <pid> <slot> <fence>"
        r.rpush(f"{prefix}:ledger:{key}", f"{kind} {time.time():.6f} {os.getpid()} {lease.slot} {lease.fencing_token}")

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.export", ttl=5, key="export:{tenant}", limit=2)
    def export(self, tenant, seconds=0.3):
        return export_body(self.lease, tenant, seconds)

    def export_body(lease, tenant, seconds):
        ledger("in", f"export:{tenant}", lease)
        time.sleep(seconds)
        ledger("out", f"export:{tenant}", lease)
        return lease.slot

    @app.task(
        base=GuardedTask, bind=True, shared=False, name="tg.rebuild", ttl=3, key="index:{shop}", overlap="coalesce"
    )
    def rebuild(self, shop, n, seconds=0.3, until=None):
        # overlap="coalesce": the ledger shows who ran, when, never two at once; "ran" the calls' n.
        # until: a key under the test's prefix; the body then runs until it exists (at most seconds)
        ledger("in", f"index:{shop}", self.lease)
        ran = f"{prefix}:ran:{shop}"
        r.pipeline().rpush(ran, f"{n} {time.time():.6f}").expire(ran, 600).execute()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and r.exists(f"{prefix}:{until}")):
            time.sleep(0.05 if until else max(0.0, deadline - time.monotonic()))
        ledger("out", f"index:{shop}", self.lease)
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.search",
        ttl=5,
        key="search:{shop}",
        debounce=1.0,
        debounce_max=2.0,
    )
    def search(self, shop, n):
        # debounce=: the calls that ran (n) and when
        ran = f"{prefix}:searched:{shop}"
        r.pipeline().rpush(ran, f"{n} {time.time():.6f}").expire(ran, 600).execute()
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.digest",
        ttl=5,
        key="digest:{user}",
        debounce=0.5,
        debounce_max=2.0,
    )
    def digest(self, user, n, seconds=0.0, fail_first=False):
        # debounce= with a body that takes a while or retries its first attempt: the n that ran
        tag = f"{prefix}:digested:{user}"
        if fail_first:
            attempts = r.incr(tag + ":attempts")
            r.expire(tag + ":attempts", 600)
            if attempts == 1:
                raise self.retry(countdown=0.5)
        r.pipeline().rpush(tag, str(n)).expire(tag, 600).execute()
        time.sleep(seconds)
        return n

    def digested(user, n):
        tag = f"{prefix}:digested:{user}"
        r.pipeline().rpush(tag, str(n)).expire(tag, 600).execute()

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.digest_acked",
        ttl=3,
        key="da:{user}",
        debounce=0.5,
        debounce_max=2.0,
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def digest_acked(self, user, n, seconds=0.0):
        # debounce= with acks_late: a window's run whose pool child dies is redelivered
        digested(user, n)
        time.sleep(seconds)
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.digest_coalesced",
        ttl=5,
        key="dc:{user}",
        debounce=0.5,
        debounce_max=2.0,
        overlap="coalesce",
    )
    def digest_coalesced(self, user, n, seconds=0.0):
        # debounce= with overlap="coalesce": a window closing while the key is held pends
        digested(user, n)
        time.sleep(seconds)
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.digest_rated",
        ttl=5,
        key="dr:{user}",
        debounce=0.5,
        debounce_max=2.0,
        rate=(1, 4.0),
    )
    def digest_rated(self, user, n, upstream_429=False):
        # debounce= under a rate of one run per 4 s; with upstream_429 the first attempt gets a 429
        if upstream_429 and r.incr(f"{prefix}:digest-429:{user}") == 1:
            r.expire(f"{prefix}:digest-429:{user}", 600)
            raise RateLimited(retry_after=1.0)
        digested(user, n)
        return n

    @app.task(
        base=GuardedTask, bind=True, shared=False, name="tg.report", ttl=1.5, key="report:{user}", overlap="replace"
    )
    def report(self, user, n, seconds=5.0):
        return report_body(self.lease, user, n, seconds)

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.report_raise",
        ttl=1.5,
        key="report:{user}",
        overlap="replace",
        on_skip="raise",
    )
    def report_raise(self, user, n, seconds=5.0):
        return report_body(self.lease, user, n, seconds)

    def report_body(lease, user, n, seconds):
        # overlap="replace": "<start|lost|end> <n> <fence> <time>" entries
        entries = f"{prefix}:report:{user}"
        r.pipeline().rpush(entries, f"start {n} {lease.fencing_token} {time.time():.6f}").expire(entries, 600).execute()
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                lease.ensure_held()
                time.sleep(0.02)
        except LeaseBackendError:
            raise
        except Exception:
            r.rpush(entries, f"lost {n} {lease.fencing_token} {time.time():.6f}")
            raise
        r.rpush(entries, f"end {n} {lease.fencing_token} {time.time():.6f}")
        return {"n": n, "fence": lease.fencing_token}

    if os.environ.get("TG_TEST_REPLACE_TERMINATE"):  # (a worker with it refuses the threads and solo pools)

        @app.task(
            base=GuardedTask,
            bind=True,
            shared=False,
            name="tg.report_term",
            ttl=1.5,
            key="report:{user}",
            overlap="replace",
            replace_terminate=True,
        )
        def report_term(self, user, n, seconds=5.0):
            # overlap="replace", replace_terminate=True: as tg.report; the replaced run is killed
            return report_body(self.lease, user, n, seconds)

        @app.task(
            base=GuardedTask,
            bind=True,
            shared=False,
            name="tg.report_term_raise",
            ttl=1.5,
            key="report:{user}",
            overlap="replace",
            replace_terminate=True,
            on_skip="raise",
        )
        def report_term_raise(self, user, n, seconds=5.0):
            return report_body(self.lease, user, n, seconds)

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.export_retrying",
        ttl=5,
        key="export:{tenant}",
        limit=2,
        on_skip="retry",
        skip_retry_delay=0.3,
        skip_max_retries=50,
    )
    def export_retrying(self, tenant, seconds=0.3):
        return export_body(self.lease, tenant, seconds)

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.export_total",
        ttl=5,
        key="export:{tenant}",
        limit=2,
        limit_total=3,
        limit_total_key="exports",
        on_skip="retry",
        skip_retry_delay=0.2,
        skip_max_retries=400,
    )
    def export_total(self, tenant, seconds=0.3, retry_first=False):
        # a limit per key and a total: both ledgers, each with its own lease's slot and fence
        lease = self.lease
        if retry_first and not self.request.retries:
            fences = f"{prefix}:fences:{self.request.id}"
            r.rpush(fences, f"{lease.fencing_token} {lease.total.fencing_token}")
            raise self.retry(countdown=0.3)
        if retry_first:
            r.rpush(f"{prefix}:fences:{self.request.id}", f"{lease.fencing_token} {lease.total.fencing_token}")
        ledger("in", "exports", lease.total)
        export_body(lease, tenant, seconds)
        ledger("out", "exports", lease.total)
        return lease.total.slot

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.export_total_shadow",
        ttl=5,
        key="export:{tenant}",
        limit=1,
        limit_total=1,
        limit_total_key="exports-shadow",
        enforce=False,
    )
    def export_total_shadow(self, tenant, seconds=1.0):
        # shadow mode: always runs; "<tenant> <held: 1 | 0>"
        r.rpush(f"{prefix}:shadow-runs", f"{tenant} {int(self.lease is not None)}")
        time.sleep(seconds)
        return tenant

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.export_total_overrun",
        ttl=30,
        key="export:{tenant}",
        limit=2,
        limit_total=3,
        limit_total_key="exports",
        time_limit=1,
    )
    def export_total_overrun(self, tenant):
        # killed by the hard time limit: the worker's main process releases both holds by task id
        time.sleep(10)

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.export_tiered",
        ttl=5,
        key="export:{tenant}",
        limit=lambda tenant, **_: int(r.get(f"{prefix}:limit:{tenant}") or 1),
        on_skip="retry",
        skip_retry_delay=0.2,
        skip_max_retries=200,
    )
    def export_tiered(self, tenant, seconds=0.4):
        # the tenant's limit is read per run (a plan change applies to the next run)
        return export_body(self.lease, tenant, seconds)

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.api_call",
        ttl=5,
        key="api:{n}",
        rate=(6, 1.0),
        rate_key="api",
        rate_burst=2,
        max_retries=0,
    )
    def api_call(self, n):
        # when the call passed the rate: now, or the turn it booked (it may start a little later)
        turn = (self.request.headers or {}).get("taskguard_rate") or getattr(self.request, "taskguard_rate", None)
        admitted = turn["turn"] if isinstance(turn, dict) and turn.get("turn") else time.time()
        r.rpush(f"{prefix}:calls", f"{time.time():.6f} {n} {admitted:.6f}")
        return n

    def server_now() -> float:
        secs, micros = r.time()
        return secs + micros / 1e6

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.llm",
        ttl=5,
        key="llm:{n}",
        rate=(400, 1.0),
        rate_key="llm",
        cost=lambda tokens, **_: tokens,
        rate_burst=100,
        max_retries=0,
    )
    def llm(self, n, tokens, actual=None):
        # admitted: now, or the turn it booked (server clock); cost: what it was admitted at
        turn = (self.request.headers or {}).get("taskguard_rate") or getattr(self.request, "taskguard_rate", None)
        admitted = turn["turn"] if isinstance(turn, dict) and turn.get("turn") else server_now()
        r.rpush(f"{prefix}:llm", f"{server_now():.6f} {n} {admitted:.6f} {tokens}")
        if actual is not None:
            settle_cost(actual)
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.upstream",
        ttl=5,
        key="up:{n}",
        rate=(10, 1.0),
        rate_key="up",
        rate_burst=2,
        autoretry_for=(Exception,),
        max_retries=0,
    )
    def upstream(self, n, fail_on=None, pause=2.0):
        now = server_now()
        r.rpush(f"{prefix}:up", f"{now:.6f} {n} {self.request.retries}")
        if n == fail_on and r.set(f"{prefix}:429:{n}", 1, nx=True, ex=600):
            r.rpush(f"{prefix}:up", f"{server_now():.6f} 429 {pause}")
            raise RateLimited(retry_after=pause)
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.upstream_shadow",
        ttl=5,
        key="ups:{n}",
        rate=(100, 1.0),
        rate_key="ups",
        cost=lambda n, **_: 60,
        enforce=False,
    )
    def upstream_shadow(self, n, pause=None):
        if pause is not None:
            raise RateLimited(retry_after=pause)
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.api_hourly",
        ttl=5,
        key="apih:{n}",
        rate="1/h",
        rate_key="apih",
    )
    def api_hourly(self, n):
        r.rpush(f"{prefix}:hourly", n)
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.api_bounded",
        ttl=5,
        key="apib:{n}",
        rate="1/m",
        rate_key="apib",
        rate_max_wait=2,
    )
    def api_bounded(self, n):
        return n

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.rated_retry",
        ttl=5,
        key="rr:{i}",
        rate=(1, 1.0),
        rate_key="rr",
        max_retries=3,
    )
    def rated_retry(self, i, retry_first=False):
        r.rpush(f"{prefix}:rr", f"{time.time():.6f} {i} {self.request.retries}")
        if retry_first and self.request.retries == 0:
            raise self.retry(countdown=0.05)
        return i

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.unique_slow",
        ttl=2,
        key="u:{name}",
        unique=True,
        unique_ttl=60,
    )
    def unique_slow(self, name, seconds=0.5):
        note(f"unique:{name}:{self.request.id}")
        time.sleep(seconds)
        return self.request.id

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.unique_limited",
        ttl=30,
        key="ul:{name}",
        unique=True,
        unique_ttl=60,
        time_limit=1,
    )
    def unique_limited(self, name, seconds=10.0):
        note(f"unique-limited:{name}:{self.request.id}")
        time.sleep(seconds)
        return self.request.id

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.unique_short",
        ttl=5,
        key="us:{name}",
        unique=True,
        unique_ttl=1,
    )
    def unique_short(self, name):
        return name

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.ucharge",
        ttl=5,
        key="uc:{invoice_id}",
        once=True,
        unique=True,
        unique_ttl=60,
    )
    def ucharge(self, invoice_id, amount):
        return {"invoice": invoice_id, "amount": amount}

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.shadow_retry",
        ttl=5,
        key="sr:{name}",
        enforce=False,
        max_retries=2,
    )
    def shadow_retry(self, name):
        note(f"sr:{name}:{self.request.retries}:{self.lease.fencing_token if self.lease else None}")
        if self.request.retries == 0:
            raise self.retry(countdown=0.2)
        return self.lease is not None

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.setvalue", ttl=5, key="sv:{name}", once=True)
    def setvalue(self, name):
        return {"s": {1, 2}}

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.charge",
        ttl=5,
        key="charge:{invoice_id}",
        once=True,
        fingerprint=("invoice_id", "amount"),
    )
    def charge(self, invoice_id, amount, fail=False, seconds=0.0):
        n = attempt(f"charge:{invoice_id}")
        time.sleep(seconds)
        if fail:
            raise Flaky(f"declined {invoice_id}")
        return {"invoice": invoice_id, "amount": amount, "n": n, "fence": self.lease.fencing_token}

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.shadowed",
        ttl=5,
        key="shadow:{name}",
        enforce=False,
        limit=2,
    )
    def shadowed(self, name, seconds=0.5):
        time.sleep(seconds)
        return {"leased": self.lease is not None, "slot": self.lease.slot if self.lease else None}

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.shadow_rated",
        ttl=5,
        key="srate:{n}",
        enforce=False,
        rate=(1, 2.0),
        rate_key="srate",
    )
    def shadow_rated(self, n):
        return {"n": n, "leased": self.lease is not None}

    @app.task(
        base=GuardedTask,
        bind=True,
        shared=False,
        name="tg.shadow_unique",
        ttl=5,
        key="su:{name}",
        enforce=False,
        unique=True,
        unique_ttl=60,
    )
    def shadow_unique(self, name, seconds=0.0):
        time.sleep(seconds)
        return {"name": name, "leased": self.lease is not None}

    @app.task(base=GuardedTask, bind=True, shared=False, name="tg.overlap_tick", ttl=2, key="otick")
    def overlap_tick(self, seconds=0.0):
        """A guarded beat task for the per-entry overlap tests: logs ``otick|start|slot|fence|time|id``
        (fence ``-`` without a lease), then ``lost`` (its lease taken over) or ``end`` likewise."""
        beat = (self.request.headers or {}).get("taskguard_beat") or getattr(self.request, "taskguard_beat", None) or {}
        lease = self.lease
        fence = "-" if lease is None else str(lease.fencing_token)

        def mark(what: str) -> None:
            note(f"otick|{what}|{beat.get('slot')}|{fence}|{time.time():.3f}|{self.request.id}")

        mark("start")
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                if lease is not None:
                    lease.ensure_held()
                time.sleep(0.05)
        except LeaseBackendError:
            raise
        except Exception:
            mark("lost")
            raise
        mark("end")
        return fence

    if os.environ.get("TG_TEST_BEAT"):
        import json

        app.conf.beat_schedule = {
            "tick": {
                "task": os.environ.get("TG_TEST_BEAT_TASK", "tg.tick"),
                "schedule": float(os.environ["TG_TEST_BEAT"]),
                "kwargs": json.loads(os.environ.get("TG_TEST_BEAT_KWARGS", "{}")),
                "options": json.loads(os.environ.get("TG_TEST_BEAT_OPTIONS", "{}")),
            },
        }

    app.tg_log = log
    return app


# compare-and-set on a fence: the protected resource's own check (the recipe in examples/fencing.py)
from examples.fencing import FENCED_SET_SCRIPT as FENCED_SET  # noqa: E402

if os.environ.get("TG_TEST_QUEUE"):
    import json

    app = make_app(
        os.environ["TG_TEST_QUEUE"],
        os.environ["TG_TEST_PREFIX"],
        broker=os.environ.get("TG_TEST_BROKER"),
        **json.loads(os.environ.get("TG_TEST_CONF", "{}")),
    )
