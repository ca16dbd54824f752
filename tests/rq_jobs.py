"""RQ job functions for the adapter tests (imported by ``rq worker`` subprocesses too). Leases
come from ``taskguard.from_env()``: TASKGUARD_REDIS_URL and the test's own TASKGUARD_PREFIX."""

from __future__ import annotations

import os
import signal
import time

import redis
from rq import Retry

from taskguard import RedisLocks
from taskguard_rq import current_lease, guarded_job

from .timed_redis import TimedRedis


def _attempt(name: str) -> int:
    """How many times the job of ``name`` started so far, this start included."""
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return int(r.incr("{" + os.environ["TASKGUARD_PREFIX"] + ":attempts:" + name + "}"))


def _log(entry: str) -> None:
    # TG_TEST_LOG_URL: a log kept apart from the leases (a test that fills the lease store)
    r = TimedRedis.from_url(
        os.environ.get("TG_TEST_LOG_URL") or os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    key = "{" + os.environ["TASKGUARD_PREFIX"] + ":log}"
    # with a TTL: another pytest session ending on the shared Redis deletes untimed tgtest- keys
    r.pipeline().rpush(key, entry).expire(key, 600).execute()


@guarded_job(ttl=5, key="slow:{n}")
def slow(n, seconds=1.5):
    lease = current_lease()
    _log(f"slow:{n}:start:{lease.fencing_token}")
    time.sleep(seconds)
    _log(f"slow:{n}:end")
    return {"n": n, "fence": lease.fencing_token}


@guarded_job(ttl=5, key="raise:{n}", on_skip="raise")
def strict(n, seconds=0.0):
    time.sleep(seconds)
    return n


@guarded_job(ttl=0.6, key="short")
def short_ttl(seconds=2.0):
    time.sleep(seconds)  # longer than the TTL: the work-horse's heartbeat must renew
    return current_lease().fencing_token


@guarded_job(ttl=2, key="clock:{name}")
def clock_held(name, seconds=6.0):
    """Holds a ttl=2 lease for ``seconds`` (monotonic), checking it is held every 0.1 s (a
    clock-step test steps the work horse's wall clock meanwhile)."""
    lease = current_lease()
    _log(f"clock_held:{name}:start:{lease.fencing_token}")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        lease.ensure_held()
        time.sleep(0.1)
    return lease.fencing_token


@guarded_job(ttl=2, key="flaky:{name}")
def flaky(name, fail_times=1):
    attempt = _attempt(name)
    _log(f"flaky:{name}:{attempt}:{current_lease().fencing_token}")
    if attempt <= fail_times:
        raise RuntimeError(f"attempt {attempt} fails")
    return current_lease().fencing_token


@guarded_job(ttl=3, key="kill:{name}")
def killed(name):
    attempt = _attempt(name)
    _log(f"kill:{name}:{attempt}:{current_lease().fencing_token}")
    if attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the work-horse dies without any finally
    return current_lease().fencing_token


@guarded_job(ttl=2, key="timeout")
def overrun(seconds=5.0):
    time.sleep(seconds)
    return "never"


@guarded_job(ttl=10, key="rr:{name}")
def returns_retry(name):
    attempt = _attempt(name)
    _log(f"rr:{name}:{attempt}:{current_lease().fencing_token}")
    if attempt == 1:
        return Retry(max=2)  # RQ >= 2.1 runs the job again
    return "second run"


@guarded_job(ttl=3, key="stall:{name}")
def stalls_once(name):
    attempt = _attempt(name)
    _log(f"stall:{name}:{attempt}:{current_lease().fencing_token}:{os.getpid()}")
    if attempt == 1:
        time.sleep(60)  # the whole worker dies meanwhile
    return {"attempt": attempt, "fence": current_lease().fencing_token}


@guarded_job(ttl=30, key="long:{name}")
def long_running(name, seconds=20.0):
    """Holds its lease for ``seconds`` (stopped or killed from outside by the tests)."""
    _log(f"long:{name}:start:{current_lease().fencing_token}")
    time.sleep(seconds)
    return name


def _ledger(kind: str, key: str, lease) -> None:
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    r.rpush(
        "{" + os.environ["TASKGUARD_PREFIX"] + ":ledger:" + key + "}",
        f"{kind} {time.time():.6f} {os.getpid()} {lease.slot} {lease.fencing_token}",
    )


@guarded_job(ttl=5, key="export:{tenant}", limit=2)
def export(tenant, seconds=0.5):
    lease = current_lease()
    _ledger("in", f"export:{tenant}", lease)
    time.sleep(seconds)
    _ledger("out", f"export:{tenant}", lease)
    return lease.slot


@guarded_job(ttl=5, key="export:{tenant}", limit=2, limit_total=3, limit_total_key="exports")
def export_total(tenant, seconds=0.5):
    """A limit per key and a total: both ledgers, each with its own lease's slot and fence."""
    lease = current_lease()
    _ledger("in", "exports", lease.total)
    _ledger("in", f"export:{tenant}", lease)
    time.sleep(seconds)
    _ledger("out", f"export:{tenant}", lease)
    _ledger("out", "exports", lease.total)
    return lease.total.slot


@guarded_job(ttl=5, key="export:{tenant}", limit=2, limit_total=3, limit_total_key="exports")
def export_total_flaky(tenant):
    """Fails its first attempt (a Retry keeps both holds): "<key fence> <total fence>" per attempt."""
    lease = current_lease()
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    fences = "{" + os.environ["TASKGUARD_PREFIX"] + ":fences:" + tenant + "}"
    r.pipeline().rpush(fences, f"{lease.fencing_token} {lease.total.fencing_token}").expire(fences, 600).execute()
    if _attempt("export_total_flaky:" + tenant) == 1:
        raise RuntimeError("first attempt fails")
    return lease.total.slot


@guarded_job(ttl=30, key="export:{tenant}", limit=2, limit_total=3, limit_total_key="exports")
def export_total_killed(tenant):
    """Its work-horse dies (SIGKILL) on the first attempt: "<attempt> <key fence> <total fence>"."""
    lease = current_lease()
    attempt = _attempt("export_total_killed:" + tenant)
    _log(f"ek:{tenant}:{attempt}:{lease.fencing_token}:{lease.total.fencing_token}")
    if attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return lease.total.fencing_token


@guarded_job(ttl=3, key="index:{shop}", overlap="coalesce")
def rebuild(shop, n, seconds=0.3, until=None):
    """overlap="coalesce": ledger entries for the key, and the calls that ran (``n``) with when.
    ``until``: a key under the test's prefix; the body then runs until it exists (at most
    ``seconds``)."""
    lease = current_lease()
    _ledger("in", f"index:{shop}", lease)
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    r.rpush("{" + os.environ["TASKGUARD_PREFIX"] + ":ran:" + shop + "}", f"{n} {time.time():.6f}")
    if until is None:
        time.sleep(seconds)
    else:
        deadline = time.monotonic() + seconds
        while not r.exists("{" + os.environ["TASKGUARD_PREFIX"] + ":" + until + "}") and time.monotonic() < deadline:
            time.sleep(0.05)
    _ledger("out", f"index:{shop}", lease)
    return n


@guarded_job(ttl=5, key="search:{shop}", debounce=1.0, debounce_max=2.5)
def search(shop, n):
    """debounce=: the calls that ran (n) and when."""
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    r.rpush("{" + os.environ["TASKGUARD_PREFIX"] + ":searched:" + shop + "}", f"{n} {time.time():.6f}")
    return n


def _report(user, n, seconds):
    """overlap="replace": "<start|lost|end> <n> <fence> <time>" entries, holding the lease meanwhile."""
    from taskguard import LeaseLost

    lease = current_lease()
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    entries = "{" + os.environ["TASKGUARD_PREFIX"] + ":reportlog:" + user + "}"
    r.rpush(entries, f"start {n} {lease.fencing_token} {time.time():.6f}")
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            lease.ensure_held()
            time.sleep(0.02)
    except LeaseLost:
        r.rpush(entries, f"lost {n} {lease.fencing_token} {time.time():.6f}")
        raise
    r.rpush(entries, f"end {n} {lease.fencing_token} {time.time():.6f}")
    return {"n": n, "fence": lease.fencing_token}


@guarded_job(ttl=1.5, key="report:{user}", overlap="replace")
def report(user, n, seconds=5.0):
    return _report(user, n, seconds)


@guarded_job(ttl=1.5, key="report:{user}", overlap="replace", replace_terminate=True)
def report_stopping(user, n, seconds=5.0):
    return _report(user, n, seconds)


@guarded_job(ttl=5, key="api:{n}", rate=(3, 1.0), rate_key="api")
def api_call(n):
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    r.rpush("{" + os.environ["TASKGUARD_PREFIX"] + ":calls}", f"{time.time():.6f} {n}")
    return n


def _server_now(r: redis.Redis) -> float:
    secs, micros = r.time()
    return secs + micros / 1e6


@guarded_job(ttl=5, key="llm:{n}", rate=(400, 1.0), rate_key="llm", cost=lambda tokens, **_: tokens, rate_burst=100)
def llm(n, tokens, actual=None):
    from taskguard import settle_cost

    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    r.rpush("{" + os.environ["TASKGUARD_PREFIX"] + ":llm}", f"{_server_now(r):.6f} {n} {tokens}")
    if actual is not None:
        settle_cost(actual)
    return n


@guarded_job(ttl=5, key="up:{n}", rate=(10, 1.0), rate_key="up", rate_burst=2)
def upstream(n, fail_on=None, pause=2.0):
    from taskguard import RateLimited

    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    log = "{" + os.environ["TASKGUARD_PREFIX"] + ":up}"
    r.rpush(log, f"{_server_now(r):.6f} {n}")
    if n == fail_on and r.set("{" + os.environ["TASKGUARD_PREFIX"] + ":429}", 1, nx=True, ex=600):
        r.rpush(log, f"{_server_now(r):.6f} 429")
        raise RateLimited(retry_after=pause)
    return n


@guarded_job(ttl=5, key="apib:{n}", rate="1/m", rate_key="apib", rate_max_wait=1)
def api_bounded(n):
    return n


@guarded_job(ttl=5, key="charge:{invoice_id}", once=True, fingerprint=("invoice_id", "amount"))
def charge(invoice_id, amount, fail=False):
    n = _attempt(f"charge:{invoice_id}")
    if fail:
        raise RuntimeError(f"declined {invoice_id}")
    return {"invoice": invoice_id, "amount": amount, "n": n, "fence": current_lease().fencing_token}


@guarded_job(ttl=5, key="shadow:{name}", enforce=False)
def shadowed(name):
    lease = current_lease()
    return {"leased": lease is not None}


@guarded_job(ttl=5, key="rep-retry:{u}", overlap="replace", replace_terminate=True)
def replaced_retrying(u, fail=True):
    """Fails (a Retry keeps its lease while it waits) unless ``fail`` is false."""
    if fail:
        raise RuntimeError("transient")
    return "ok"


@guarded_job(ttl=5, key="nest:{n}")
def nest(n, depth=0):
    """Calls itself once with the same key: the inner call runs under the outer's lease."""
    fence = current_lease().fencing_token
    if depth == 0:
        return [fence, *nest(n, depth=1)]
    return [fence]


@guarded_job(ttl=5, key="shadow-rated:{name}", rate="1/m", rate_key="shadow-rate:{name}", enforce=False)
def shadow_rated(name):
    return "ran"


@guarded_job(ttl=5, key="uq:{name}")
def unique_job(name, seconds=0.3):
    _log(f"unique:{name}")
    time.sleep(seconds)
    return name


@guarded_job(ttl=5, key="add:{x}:{y}")
def add(x, y, z=None):
    _log(f"add:{x}:{y}")
    return x + y


@guarded_job(ttl=5, key="down:{n}")
def down(n):
    """Calls itself directly (a new key each level) and another guarded job; logs, after the
    inner calls, which lease key the job's kept handle record names (the job's own)."""
    from rq import get_current_job

    from taskguard_rq import load_handle
    from taskguard_rq.config import locks_for

    _log(f"down:{n}:{current_lease().key}")
    inner = down(n - 1) if n else []
    total = add(n, 1)
    job = get_current_job()
    handle = load_handle(locks_for(None), job.id) if job is not None else None
    _log(f"down:{n}:handle:{handle['key'] if handle else None}")
    return [n] + inner + [total]


@guarded_job(ttl=3, key="lbr:{name}")
def lease_retried(name):
    """Enqueued with retry=Retry(...): RQ retries it while the lease store is down."""
    _log(f"lbr:{name}:{current_lease().fencing_token}")
    return name


@guarded_job(ttl=3, key="hold3")
def hold3(name, seconds=11.0):
    """Holds a ttl=3 lease for ``seconds`` (the maxmemory test), logging its start and end."""
    lease = current_lease()
    _log(f"hold3:{name}:start:{lease.fencing_token}")
    time.sleep(seconds)
    _log(f"hold3:{name}:end:{lease.fencing_token}")
    return {"fence": lease.fencing_token, "lost": lease.lost}


@guarded_job(ttl=3, key="hold3", wait=1.5, blocking_wait=True)
def hold3_wait(name):
    _log(f"hold3:{name}:start:{current_lease().fencing_token}")
    return name


@guarded_job(ttl=5, key="uo:{name}")
def unique_outcome(name, seconds=0.0, fail=False):
    """Logs ``outcome:NAME``, then fails when asked (for reused explicit job ids)."""
    _log(f"outcome:{name}")
    time.sleep(seconds)
    if fail:
        raise RuntimeError(f"{name} fails")
    return name


def _cron_entry(entry: str) -> None:
    from rq import get_current_job

    job = get_current_job()
    slot = (job.meta.get("taskguard_cron") or {}).get("slot", "-") if job is not None else "-"
    _log(f"cron|{entry}|{slot}|{job.id if job is not None else '-'}|{time.time():.3f}")


def cron_tick(entry: str) -> None:
    """A periodic job of the rq-cron tests (unguarded): logs ``cron|entry|slot|job id|time``."""
    _cron_entry(entry)


@guarded_job(ttl=5, key="cron:{entry}")
def cron_guarded(entry: str) -> dict:
    """A guarded periodic job of the rq-cron tests: logs as :func:`cron_tick` and returns its lease."""
    lease = current_lease()
    _cron_entry(entry)
    return {"key": lease.key, "ttl": lease.ttl, "fence": lease.fencing_token}


def _plan(tenant):
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return int(r.get("{" + os.environ["TASKGUARD_PREFIX"] + ":limit:" + tenant + "}") or 1)


@guarded_job(ttl=5, key="export:{tenant}", limit=lambda tenant, **_: _plan(tenant))
def export_tiered(tenant, seconds=0.5):
    lease = current_lease()
    _ledger("in", f"export:{tenant}", lease)
    time.sleep(seconds)
    _ledger("out", f"export:{tenant}", lease)
    return lease.slot


@guarded_job(ttl=2, key="ocron:{entry}")
def cron_overlap(entry: str, seconds: float = 5.0) -> str:
    """A guarded periodic job of the per-entry overlap tests: logs ``ocron|start|slot|fence|time|job
    id`` (fence ``-`` without a lease), then ``lost`` (its lease taken over) or ``end`` likewise."""
    from rq import get_current_job

    job = get_current_job()
    slot = (job.meta.get("taskguard_cron") or {}).get("slot", "-") if job is not None else "-"
    lease = current_lease()
    fence = "-" if lease is None else str(lease.fencing_token)

    def mark(what: str) -> None:
        _log(f"ocron|{what}|{slot}|{fence}|{time.time():.3f}|{job.id if job is not None else '-'}")

    mark("start")
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if lease is not None:
                lease.ensure_held()
            time.sleep(0.05)
    except Exception:
        mark("lost")
        raise
    mark("end")
    return fence


# a job with locks of its own (locks=): its worker needs no TASKGUARD_REDIS_URL
_OWN_LOCKS = RedisLocks(
    redis.Redis.from_url(os.environ.get("TG_OWN_LOCKS_URL", "redis://127.0.0.1:6379/0")),
    prefix=os.environ.get("TG_OWN_LOCKS_PREFIX", "tgtest-own-locks"),
)


@guarded_job(ttl=30, key="own:{name}", locks=_OWN_LOCKS)
def with_own_locks(name):
    return current_lease().fencing_token


@guarded_job(ttl=5, key="cache:{name}", debounce=1.0, debounce_max=2.5)
def refresh_cache(name, ttl=60, meta=None):
    """debounce= on a function whose parameters are named as RQ enqueue options."""
    return {"ttl": ttl, "meta": meta}


@guarded_job(ttl=5, key="digest:{user}", debounce=0.5, debounce_max=2.0)
def digest(user, n, seconds=0.0, fail_first=None):
    """debounce= with a body that takes ``seconds`` or, with ``fail_first``, fails its first
    attempt: ``"raise"`` (a failed job) or ``"retry"`` (returns RQ's ``Retry``). Logs ``"n"``
    per attempt that got past that."""
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    tag = "{" + os.environ["TASKGUARD_PREFIX"] + ":digested:" + user + "}"
    if fail_first is not None:
        attempts = r.incr(tag + ":attempts")
        r.expire(tag + ":attempts", 600)
        if attempts == 1:
            if fail_first == "retry":
                return Retry(max=1, interval=1)
            raise RuntimeError("the first attempt fails")
    r.pipeline().rpush(tag, str(n)).expire(tag, 600).execute()
    time.sleep(seconds)
    return n


def _digest_log(user, n):
    r = TimedRedis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    tag = "{" + os.environ["TASKGUARD_PREFIX"] + ":digested:" + user + "}"
    r.pipeline().rpush(tag, str(n)).expire(tag, 600).execute()


@guarded_job(ttl=5, key="dc:{user}", debounce=0.5, debounce_max=2.0, overlap="coalesce")
def digest_coalesced(user, n, seconds=0.0):
    """debounce= with overlap="coalesce": a window closing while the key is held pends."""
    _digest_log(user, n)
    time.sleep(seconds)
    return n


@guarded_job(ttl=5, key="dr:{user}", debounce=0.5, debounce_max=2.0, rate=(1, 4.0))
def digest_rated(user, n):
    """debounce= under a rate of one run per 4 s: a window closing inside it waits its turn."""
    _digest_log(user, n)
    return n


@guarded_job(ttl=5, key="progress:{name}")
def reports_progress(name, fail=False):
    """Saves a progress entry in its meta through another ``Job`` instance (as a web process or a
    helper would), then returns or fails."""
    from rq import get_current_job
    from rq.job import Job

    own = get_current_job()
    other = Job.fetch(own.id, connection=own.connection)
    other.meta["progress"] = 100
    other.save_meta()
    if fail:
        raise RuntimeError("fails after its progress")
    return "done"
