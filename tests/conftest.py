"""Shared fixtures: the shared Redis (TASKGUARD_REDIS_URL, default 127.0.0.1:6379), a key prefix
per test, suite-owned redis-server processes and a 3-primary Redis Cluster."""

from __future__ import annotations

import os
import re
import uuid

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

from taskguard import MemoryLocks, RedisLocks

from .servers import RedisCluster, RedisServer

SHARED_URL = os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")


#: Keys the suite's Celery and RQ runs create outside the tests' prefixes, without a TTL (kombu's
#: bindings and unacked bookkeeping, RQ's registries of queues and workers): deleted at the end
#: when the suite created them (they did not exist when it started).
SHARED_BOOKKEEPING = (
    "_kombu.binding.*",
    "unacked*",
    "rq:queues",
    "rq:workers",
    "rq:workers:*",
    "rq:scheduler*",
    "rq:cron*",
    "rq:wip*",
    "rq:*:intermediate",
    "celery*",
)


#: The key prefixes handed out in this session (the ``prefix`` fixture): the session sweeps only
#: keys of its own, never the live keys of another session running on the same Redis at once.
_SESSION_PREFIXES: set[str] = set()


def _untimed(c, patterns):
    return {k for pattern in patterns for k in c.scan_iter(match=pattern, count=1000) if c.ttl(k) == -1}


#: The shared bookkeeping keys without a TTL found when the session started.
_BOOKKEEPING_BEFORE = pytest.StashKey[set]()

_PREFIX_IN_KEY = re.compile(rb"tgtest-[0-9a-f]{12}")


def _untimed_of_session(c):
    """Keys without a TTL that name one of this session's prefixes: one SCAN of the keyspace
    (a SCAN per prefix would read a large shared keyspace once per test)."""
    mine = {p.encode() for p in _SESSION_PREFIXES}
    keys = [k for k in c.scan_iter(match="*tgtest-*", count=5000) if mine & set(_PREFIX_IN_KEY.findall(k))]
    pipe = c.pipeline(transaction=False)
    for k in keys:
        pipe.ttl(k)
    return {k for k, ttl in zip(keys, pipe.execute(), strict=True) if ttl == -1}


#: The modules that take longest (a minute and more each on 2 cores, measured with
#: ``--durations``), longest first: they start first, so that the parallel workers
#: (pytest-xdist, whole modules each) do not end on one of them while the others idle.
LONGEST_FIRST = (
    "test_celery_beat.py",
    "test_celery_failures.py",
    "test_rq_cron.py",
    "test_run_identity.py",
    "test_faults.py",
    "test_clock_steps.py",
    "test_celery_limits.py",
    "test_package.py",
    "test_celery_guard.py",
    "test_examples.py",
    "test_rq.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    """The shared bookkeeping keys without a TTL that exist before the suite runs (read once, by
    the process that runs the session: pytest itself, or pytest-xdist's controller)."""
    if _is_xdist_worker(session.config):
        return
    c = redis.Redis.from_url(SHARED_URL, socket_connect_timeout=2)
    try:
        session.config.stash[_BOOKKEEPING_BEFORE] = _untimed(c, SHARED_BOOKKEEPING)
    except redis.RedisError:
        pass  # the redis_url fixture reports it
    finally:
        c.close()


def pytest_sessionfinish(session, exitstatus):
    """After every test (under pytest-xdist: after every worker has finished, so that no worker's
    live bookkeeping is taken from under it): the shared bookkeeping keys without a TTL that the
    suite created are deleted, and the suite's members leave the registries that existed before."""
    if _is_xdist_worker(session.config) or _BOOKKEEPING_BEFORE not in session.config.stash:
        return
    before = session.config.stash[_BOOKKEEPING_BEFORE]
    c = redis.Redis.from_url(SHARED_URL, socket_connect_timeout=2)
    try:
        ours = _untimed(c, SHARED_BOOKKEEPING) - before
        for key in ("rq:queues", "rq:workers"):  # sets that existed before: drop the suite's members
            if key in before:
                members = [m for m in c.smembers(key) if b"tgtest-" in m or b"q-tg" in m]
                if members:
                    c.srem(key, *members)
        if ours:
            c.delete(*ours)
    except redis.RedisError:
        pass  # the suite's own failures say why
    finally:
        c.close()


@pytest.fixture(scope="session", autouse=True)
def no_untimed_keys_left_behind():
    """After the session: no key without a TTL that the suite made stays in the shared Redis.
    Here the tests' own keys (their prefixes, queues and workers all contain the test's prefix),
    of this session's prefixes only — under pytest-xdist each worker sweeps the prefixes it
    handed out, and another worker's or another session's live keys (queues, logs, jobs) are left
    alone; the shared bookkeeping keys are swept by :func:`pytest_sessionfinish`."""
    yield
    c = redis.Redis.from_url(SHARED_URL, socket_connect_timeout=2)
    try:
        ours = _untimed_of_session(c)
        if ours:
            c.delete(*ours)
    except redis.RedisError:
        pass  # the redis_url fixture reports it
    finally:
        c.close()


@pytest.fixture(scope="session")
def redis_url() -> str:
    c = redis.Redis.from_url(SHARED_URL, socket_connect_timeout=2)
    try:
        c.ping()
    except redis.RedisError as e:
        pytest.fail(
            f"Redis at TASKGUARD_REDIS_URL / 127.0.0.1:6379 is not answering ({e}); "
            "start one or run the suite through ./run test",
            pytrace=False,
        )
    finally:
        c.close()
    return SHARED_URL


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def prefix(redis_url):
    """A key prefix unique to the test; its keys are deleted afterwards."""
    p = f"tgtest-{uuid.uuid4().hex[:12]}"
    _SESSION_PREFIXES.add(p)
    yield p
    c = redis.Redis.from_url(redis_url)
    keys = [k for pattern in ("{" + p + ":*", f"*{p}*") for k in c.scan_iter(match=pattern, count=1000)]
    if keys:  # leases, markers, the test's queues and their kombu bindings
        c.delete(*set(keys))
    c.close()


@pytest.fixture(scope="session")
def cluster():
    """A real 3-primary Redis Cluster of redis-server processes on free loopback ports."""
    cl = RedisCluster().start()
    yield cl
    cl.close()


@pytest.fixture(params=["standalone", "cluster"])
def backend(request, redis_url, prefix):
    """(kind, client) for the shared standalone Redis and for the suite's Redis Cluster."""
    if request.param == "standalone":
        c = redis.Redis.from_url(redis_url)
    else:
        cl = request.getfixturevalue("cluster")
        c = ClusterClient(host="127.0.0.1", port=cl.ports[0])
    yield request.param, c
    c.close()


@pytest.fixture(params=["standalone", "cluster", "memory"])
def any_locks(request, redis_url, prefix):
    """The same API on three backends: RedisLocks on the shared Redis and on the suite's Redis
    Cluster, and MemoryLocks; the test's own prefix."""
    # (each test's leases are released at its end: a lease left held would be renewed by the
    # process's heartbeat for the rest of the session, and past the suite's Redis Cluster)
    if request.param == "memory":
        mem = MemoryLocks(prefix=prefix)
        yield mem
        mem.close(timeout=2)
        return
    if request.param == "standalone":
        client = redis.Redis.from_url(redis_url)
    else:
        client = ClusterClient(host="127.0.0.1", port=request.getfixturevalue("cluster").ports[0])
    lk = RedisLocks(client, prefix=prefix)
    yield lk
    lk.close(timeout=2)
    client.close()


@pytest.fixture
def locks(backend, prefix):
    """A RedisLocks on each backend, with the test's own prefix."""
    kind, c = backend
    lk = RedisLocks(c, prefix=prefix)
    yield lk
    lk.close(timeout=2)


@pytest.fixture
def redis_server():
    """A suite-owned redis-server with persistence (appendonly, fsync always) on a free port."""
    srv = RedisServer(appendonly=True).start()
    yield srv
    srv.close()


@pytest.fixture
def rq_env(redis_url, prefix, monkeypatch):
    """Leases under the test's prefix (here and in worker processes), and the test's own queue."""
    # RQ imported here: only the RQ tests (test_rq*.py and a few others) use this fixture
    from rq import Queue
    from rq.job import Job

    import taskguard_rq.config

    monkeypatch.setenv("TASKGUARD_REDIS_URL", redis_url)
    monkeypatch.setenv("TASKGUARD_PREFIX", prefix)
    monkeypatch.setattr(taskguard_rq.config, "_default", None)
    conn = redis.Redis.from_url(redis_url)
    queue = Queue(f"q-{prefix}", connection=conn)
    yield queue
    # the jobs RQ keeps in its registries (finished, failed, ...) and their results have no TTL
    # of their own for a long while (failure_ttl: a year): they go with the test
    registries = (
        queue.finished_job_registry,
        queue.failed_job_registry,
        queue.started_job_registry,
        queue.deferred_job_registry,
        queue.scheduled_job_registry,
        queue.canceled_job_registry,
    )
    for registry in registries:
        for job_id in registry.get_job_ids():
            try:
                Job.fetch(job_id, connection=conn).delete()
            except Exception:  # already gone
                conn.delete(f"rq:job:{job_id}", f"rq:results:{job_id}")
    queue.delete(delete_jobs=True)
    for key in conn.scan_iter(match="{" + prefix + ":*"):
        conn.delete(key)
