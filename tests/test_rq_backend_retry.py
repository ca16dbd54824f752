"""RQ: the lease store fails before the body runs. The lease is taken inside the job function,
so RQ sees a ``LeaseBackendError`` as the job's failure: a job enqueued with ``retry=Retry(...)``
is retried at RQ's intervals (counting against ``Retry.max``), never run unguarded; without a
``Retry`` it fails. Two suite-owned redis-servers: the queue's (RQ's registries, never shared
with parallel suites that clean up the shared Redis) and the leases' (stopped and started)."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from rq import Queue, Retry
from rq.job import JobStatus

import taskguard_rq

from . import rq_jobs
from .servers import RedisServer
from .test_rq import RQWorker, wait_done


@pytest.fixture
def stores(monkeypatch):
    """(queue, lease server, prefix): the queue on one private server, the leases (and the jobs'
    log) on another, named by TASKGUARD_REDIS_URL for the worker."""
    queue_server, lease_server = RedisServer().start(), RedisServer(appendonly=True).start()
    prefix = f"tgtest-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("TASKGUARD_REDIS_URL", lease_server.url)
    monkeypatch.setenv("TASKGUARD_PREFIX", prefix)
    monkeypatch.setenv("TASKGUARD_SOCKET_TIMEOUT", "0.5")
    monkeypatch.setenv("TASKGUARD_CONNECT_TIMEOUT", "0.5")
    monkeypatch.setattr(taskguard_rq.config, "_default", None)
    conn = redis.Redis(port=queue_server.port)
    yield Queue(f"q-{prefix}", connection=conn), lease_server, prefix, queue_server.url
    conn.close()
    queue_server.close()
    lease_server.close()


def _log(server, prefix):
    return [x.decode() for x in redis.Redis(port=server.port).lrange("{" + prefix + ":log}", 0, -1)]


def test_a_job_with_retry_is_retried_while_the_lease_store_is_down(stores):
    queue, lease_store, prefix, url = stores
    with RQWorker(queue, url=url) as worker:
        lease_store.stop()
        job = queue.enqueue(rq_jobs.lease_retried, "x", retry=Retry(max=5, interval=1))
        deadline = time.monotonic() + 30
        while (job.refresh() or job.retries_left) != 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # two executions failed on the lease store, two retries used
        assert job.retries_left == 3, worker.output()
        lease_store.start()
        assert wait_done(job, timeout=30) == JobStatus.FINISHED, worker.output()
    assert job.return_value() == "x"
    assert len(_log(lease_store, prefix)) == 1  # the body ran once, under its lease
    assert "LeaseBackendError" in worker.output()


def test_a_job_without_retry_fails_with_the_backend_error(stores):
    queue, lease_store, prefix, url = stores
    with RQWorker(queue, url=url) as worker:
        lease_store.stop()
        job = queue.enqueue(rq_jobs.lease_retried, "y")
        assert wait_done(job, timeout=30) == JobStatus.FAILED, worker.output()
    assert "LeaseBackendError" in (job.latest_result().exc_string or "")
    lease_store.start()
    assert not _log(lease_store, prefix)
