"""RQ job functions for the adapter tests (imported by ``rq worker`` subprocesses too). Leases
come from ``taskguard.from_env()``: TASKGUARD_REDIS_URL and the test's own TASKGUARD_PREFIX."""

from __future__ import annotations

import os
import signal
import time

import redis

from rq import Retry

from taskguard_rq import current_lease, guarded_job


def _attempt(name: str) -> int:
    """How many times the job of ``name`` started so far, this start included."""
    r = redis.Redis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return int(r.incr("{" + os.environ["TASKGUARD_PREFIX"] + ":attempts:" + name + "}"))


def _log(entry: str) -> None:
    r = redis.Redis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    r.rpush("{" + os.environ["TASKGUARD_PREFIX"] + ":log}", entry)


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
    r = redis.Redis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    r.rpush("{" + os.environ["TASKGUARD_PREFIX"] + ":ledger:" + key + "}",
            f"{kind} {time.time():.6f} {os.getpid()} {lease.slot} {lease.fencing_token}")


@guarded_job(ttl=5, key="export:{tenant}", limit=2)
def export(tenant, seconds=0.5):
    lease = current_lease()
    _ledger("in", f"export:{tenant}", lease)
    time.sleep(seconds)
    _ledger("out", f"export:{tenant}", lease)
    return lease.slot


@guarded_job(ttl=5, key="api:{n}", rate=(3, 1.0), rate_key="api")
def api_call(n):
    r = redis.Redis.from_url(os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    r.rpush("{" + os.environ["TASKGUARD_PREFIX"] + ":calls}", f"{time.time():.6f} {n}")
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


@guarded_job(ttl=5, key="uq:{name}", unique=True, unique_ttl=1)
def unique_job(name, seconds=0.3):
    _log(f"unique:{name}")
    time.sleep(seconds)
    return name
