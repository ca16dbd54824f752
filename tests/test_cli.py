"""The ``taskguard`` command line, as an operator runs it (a subprocess), on real Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import redis

from taskguard import RedisLocks

from .servers import RedisServer, free_port


def taskguard(*args, url=None, prefix=None, input=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGUARD_")}
    if url:
        env["TASKGUARD_REDIS_URL"] = url
    if prefix:
        env["TASKGUARD_PREFIX"] = prefix
    return subprocess.run(
        [sys.executable, "-m", "taskguard.cli", *args], env=env, capture_output=True, text=True, input=input, timeout=60
    )


def test_doctor_fails_on_a_redis_without_persistence_or_with_eviction():
    srv = RedisServer(extra=("--maxmemory-policy", "volatile-lru")).start()
    try:
        out = taskguard("doctor", url=srv.url)
        assert out.returncode == 1
        assert "FAIL maxmemory-policy: volatile-lru" in out.stdout
        assert "FAIL persistence" in out.stdout
        data = json.loads(taskguard("doctor", "--json", url=srv.url).stdout)
        assert data["ok"] is False
        assert {c["name"]: c["status"] for c in data["checks"]}["maxmemory-policy"] == "fail"
    finally:
        srv.close()


def test_doctor_passes_on_a_production_like_redis():
    srv = RedisServer(appendonly=True, extra=("--maxmemory-policy", "noeviction")).start()
    try:
        out = taskguard("doctor", url=srv.url)
        assert out.returncode == 0, out.stdout
        assert "doctor: all checks passed" in out.stdout
        assert "standalone" in out.stdout and "median PING round trip" in out.stdout
    finally:
        srv.close()


def test_doctor_unreachable_and_password_never_shown():
    url = f"redis://:Sup3rS3cret@127.0.0.1:{free_port()}/0"
    out = taskguard("doctor", url=url)
    assert out.returncode == 1
    assert "FAIL reachable" in out.stdout
    assert "Sup3rS3cret" not in out.stdout + out.stderr
    out = taskguard("doctor", "--json", url=url)
    assert "Sup3rS3cret" not in out.stdout and '"ok": false' in out.stdout


def test_doctor_without_url_says_what_to_set():
    out = taskguard("doctor")
    assert out.returncode == 2 and "TASKGUARD_REDIS_URL" in out.stderr


def test_leases_lists_holders_never_owner_tokens(redis_url, prefix):
    locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    a = locks.acquire("report:1", ttl=30, holder={"task": "reports.build", "task_id": "t-1"}).lease
    b = locks.acquire("sync:9", ttl=30).lease
    out = taskguard("leases", url=redis_url, prefix=prefix)
    assert out.returncode == 0
    assert "report:1" in out.stdout and "sync:9" in out.stdout and "task=reports.build" in out.stdout
    rows = json.loads(taskguard("leases", "report:*", "--json", url=redis_url, prefix=prefix).stdout)
    assert [r["key"] for r in rows] == ["report:1"]
    assert rows[0]["fencing_token"] == a.fencing_token and rows[0]["task_id"] == "t-1" and rows[0]["ttl"] > 25
    for token in (a.owner_token, b.owner_token):
        assert token not in out.stdout
    a.release(), b.release()
    assert "no leases held" in taskguard("leases", url=redis_url, prefix=prefix).stdout


def test_leases_shows_each_holder_of_a_limited_key_and_release_frees_them_all(redis_url, prefix):
    locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    held = [
        locks.acquire("export:acme", ttl=30, limit=3, holder={"task": "exports.run", "task_id": f"t-{i}"}).lease
        for i in range(3)
    ]
    rows = json.loads(taskguard("leases", "export:*", "--json", url=redis_url, prefix=prefix).stdout)
    assert [(r["key"], r["slot"], r["task_id"]) for r in rows] == [("export:acme", i, f"t-{i}") for i in range(3)]
    assert [r["fencing_token"] for r in rows] == [lease.fencing_token for lease in held]
    table = taskguard("leases", url=redis_url, prefix=prefix).stdout
    assert "SLOT" in table and table.count("export:acme") == 3
    assert all(lease.owner_token not in table for lease in held)
    done = taskguard("release", "export:acme", "--force", "--yes", url=redis_url, prefix=prefix)
    assert done.returncode == 0 and locks.holders("export:acme") == []
    assert all(lease.renew() is False for lease in held)


def test_release_force_with_confirmation(redis_url, prefix):
    locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    lease = locks.acquire("stuck", ttl=60).lease
    assert taskguard("release", "stuck", url=redis_url, prefix=prefix).returncode == 2  # --force is required
    declined = taskguard("release", "stuck", "--force", url=redis_url, prefix=prefix, input="n\n")
    assert declined.returncode == 1 and locks.holder("stuck") is not None
    done = taskguard("release", "stuck", "--force", url=redis_url, prefix=prefix, input="y\n")
    assert done.returncode == 0 and "released 'stuck'" in done.stdout
    assert locks.holder("stuck") is None
    assert lease.renew() is False and lease.lost  # the old holder finds out
    again = locks.acquire("stuck", ttl=5).lease
    assert again.fencing_token > lease.fencing_token
    out = json.loads(taskguard("release", "stuck", "--force", "--yes", "--json", url=redis_url, prefix=prefix).stdout)
    assert out == {"key": "stuck", "released": True, "fencing_token": again.fencing_token}
    assert taskguard("release", "stuck", "--force", "--yes", url=redis_url, prefix=prefix).returncode == 1


def test_leases_lists_only_held_leases_not_internal_records(redis_url, prefix):
    """After an RQ skip (its counter), a beat slot claim (a lease record) and a released lease,
    ``taskguard leases`` (and ``--json``) lists only the lease that is held."""
    from taskguard_rq.job import record_skip

    locks = RedisLocks(redis.Redis.from_url(redis_url), prefix=prefix)
    held = locks.acquire("held:1", ttl=30).lease
    record_skip(locks, "jobs.sync")
    leader = locks.acquire("beat-leader:app", ttl=30).lease
    leader.put_record("slot:tick", "1 claimed 1 b")
    leader.release()
    locks.put_record("defer-me", "defer:x", "n", ttl=30)
    rows = json.loads(taskguard("leases", "--json", url=redis_url, prefix=prefix).stdout)
    assert [r["key"] for r in rows] == ["held:1"]
    out = taskguard("leases", url=redis_url, prefix=prefix).stdout
    assert "held:1" in out and "rq-skips" not in out and "beat-leader" not in out and "defer" not in out
    held.release()


def test_cli_errors_name_the_option_given():
    """A bad ``--prefix`` or ``--url`` is blamed on that option (not on TASKGUARD_REDIS_URL); a
    missing URL says to pass ``--url`` or set the variable; ``doctor --json`` shows the URL
    without quotes and without its password."""
    out = taskguard("leases", "--prefix", "bad prefix!", "--url", "redis://127.0.0.1:6379/0")
    assert out.returncode == 2 and "--prefix" in out.stderr and "TASKGUARD_REDIS_URL" not in out.stderr
    out = taskguard("doctor", "--url", "redis//host")
    assert out.returncode == 2 and "--url must be a Redis URL" in out.stderr, out.stderr
    out = taskguard("leases", prefix="bad prefix!", url="redis://127.0.0.1:6379/0")
    assert out.returncode == 2 and "TASKGUARD_PREFIX" in out.stderr
    out = taskguard("doctor")
    assert out.returncode == 2 and "--url" in out.stderr and "TASKGUARD_REDIS_URL" in out.stderr
    assert "pass a client" not in out.stderr
    url = f"redis://:Sup3rS3cret@127.0.0.1:{free_port()}/0"
    doc = json.loads(taskguard("doctor", "--json", "--url", url).stdout)
    assert doc["url"] == f"redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]}", doc["url"]


def test_release_errors_are_clean_and_never_show_a_password():
    url = f"redis://:S3cretPW@127.0.0.1:{free_port()}/0"
    out = taskguard("release", "k", "--force", "--yes", "--url", url)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "S3cretPW" not in out.stdout + out.stderr
    assert "Redis failed" in out.stderr
    out = taskguard("release", "", "--force", "--yes", url="redis://127.0.0.1:6379/0")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "lease key" in out.stderr
    # an "@" the URL parser does not take for user info is still masked
    out = taskguard("doctor", "--json", "--url", f"redis://default:{free_port()}#s3cretPW@127.0.0.1:6379/0")
    assert "s3cretPW" not in out.stdout + out.stderr


def _taskguard_env(*args, **variables):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGUARD_")} | variables
    return subprocess.run(
        [sys.executable, "-m", "taskguard.cli", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_the_commands_read_the_settings_workers_read_and_name_the_variable_at_fault(redis_url, prefix):
    """The commands forced a 2 s socket timeout over TASKGUARD_SOCKET_TIMEOUT, so a
    TASKGUARD_REPLICA_TIMEOUT workers accept (1.5 s and more) made `doctor` and `leases` refuse to
    start, blaming TASKGUARD_REDIS_URL; an empty TASKGUARD_PREFIX was taken for an unset one (the
    default prefix listed, while from_env() refuses it)."""
    base = {"TASKGUARD_REDIS_URL": redis_url, "TASKGUARD_PREFIX": prefix}
    durable = base | {"TASKGUARD_REPLICAS": "1", "TASKGUARD_REPLICA_TIMEOUT": "4"}
    assert _taskguard_env("leases", **durable).returncode == 0
    doctor = _taskguard_env("doctor", "--json", **durable)
    assert doctor.returncode in (0, 1) and "replicas" in doctor.stdout, doctor.stderr
    tight = _taskguard_env("leases", **durable, TASKGUARD_SOCKET_TIMEOUT="3")
    assert (
        tight.returncode == 2
        and "TASKGUARD_SOCKET_TIMEOUT / TASKGUARD_REPLICA_TIMEOUT: replica_timeout" in tight.stderr
    )
    assert "TASKGUARD_REDIS_URL" not in tight.stderr
    empty = _taskguard_env("leases", **(base | {"TASKGUARD_PREFIX": ""}))
    assert empty.returncode == 2 and "TASKGUARD_PREFIX must be 1-64 characters" in empty.stderr
    no_url = _taskguard_env("leases", TASKGUARD_REDIS_URL="")
    assert no_url.returncode == 2 and "TASKGUARD_REDIS_URL is set but empty" in no_url.stderr
