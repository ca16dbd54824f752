"""A limit per key and a total (``limit=2, limit_total=10``): a run needs a place in both, takes
its key's slot first and the total's second, gives back what it took when the other is full
(never holding one while waiting for the other), renews, keeps for a retry and releases both —
on Redis (standalone and Cluster, where the two keys live in different hash slots) and
MemoryLocks alike; and the options, validated at declaration."""

from __future__ import annotations

import threading
import time

import pytest
from redis.crc import key_slot

from taskguard import ConfigError, LeaseLost, is_skipped
from taskguard.handoff import parse_handle, release_handle
from taskguard.policy import GuardOptions, check_option_names
from taskguard.run import GuardedRun, RunRequest


def _total_key(locks, key: str) -> str:
    """A total key whose hash slot differs from ``key``'s (so that, on Cluster, the two caps
    are two slots, usually on two nodes)."""
    prefix = locks.prefix
    return next(
        t
        for t in (f"exports{i}" for i in range(100))
        if key_slot(("{" + f"{prefix}:{t}" + "}").encode()) != key_slot(("{" + f"{prefix}:{key}" + "}").encode())
    )


def _run(locks, key, total, *, limit=2, cap=3, ttl=5.0, run_id=None, **kw):
    return GuardedRun(locks, RunRequest(key, ttl, limit=limit, total=(total, cap), run_id=run_id, task="export", **kw))


def test_a_run_needs_a_place_in_both_and_gives_back_what_it_took(any_locks):
    total = _total_key(any_locks, "export:t2")
    runs = [_run(any_locks, f"export:{t}", total) for t in ("t1", "t1", "t1", "t2", "t2")]
    began = [r.begin() for r in runs]
    assert began == [True, True, False, True, False]
    assert runs[2].reason == "limit"  # its own key is full: the total is not asked
    assert runs[4].reason == "limit_total" and 0 < runs[4].holder_ttl <= 5
    # the refused t2 run gave its key's slot back at once: only the first t2 run holds export:t2
    assert [h.slot for h in any_locks.holders("export:t2")] == [0]
    assert len(any_locks.holders(total)) == 3
    skipped = runs[4].skip(report=False)
    assert skipped.reason == "limit_total" and skipped.key == total
    assert "every place in the total" in skipped.describe()
    # self.lease is the key's lease; its place in the total is lease.total, with its own fence
    lease = runs[0].lease
    assert lease.key == "export:t1" and lease.total.key == total
    assert isinstance(lease.total.fencing_token, int) and lease.total.slot in (0, 1, 2)
    lease.ensure_held(verify=True)
    runs[3].finish("done")  # both of its holds are released
    assert any_locks.holders("export:t2") == [] and len(any_locks.holders(total)) == 2
    late = _run(any_locks, "export:t2", total)
    assert late.begin() and late.lease.total.slot == runs[3].lease.total.slot
    assert late.lease.total.fencing_token > runs[3].lease.total.fencing_token
    for r in (runs[0], runs[1], late):
        r.finish()
    assert any_locks.holders(total) == [] and any_locks.holders("export:t1") == []


def test_the_two_keys_live_in_different_cluster_slots(any_locks):
    total = _total_key(any_locks, "export:t1")
    prefix = any_locks.prefix
    assert key_slot(f"{{{prefix}:{total}}}".encode()) != key_slot(f"{{{prefix}:export:t1}}".encode())
    run = _run(any_locks, "export:t1", total)
    assert run.begin()
    run.finish()


def test_the_heartbeat_renews_both_and_losing_the_total_is_losing_the_lease(any_locks):
    total = _total_key(any_locks, "export:t1")
    run = _run(any_locks, "export:t1", total, ttl=0.6, renew=True)
    assert run.begin()
    time.sleep(1.5)  # past two TTLs: only renewals keep them
    assert len(any_locks.holders("export:t1")) == 1 and len(any_locks.holders(total)) == 1
    run.lease.ensure_held(verify=True)
    run.finish()
    run = _run(any_locks, "export:t1", total, ttl=5.0)
    assert run.begin()
    any_locks.force_release(total)  # its place in the total is gone (an operator, an expiry)
    with pytest.raises(LeaseLost):
        run.lease.ensure_held(verify=True)
    with pytest.raises(LeaseLost, match="total"):
        run.finish()
    assert any_locks.holders("export:t1") == []  # the key's lease was released all the same


def test_a_retry_restores_both_holds_from_its_handle(any_locks):
    total = _total_key(any_locks, "export:t1")
    first = _run(any_locks, "export:t1", total, run_id="job-1", cap=2)
    assert first.begin()
    fences = (first.lease.fencing_token, first.lease.total.fencing_token)
    handle = first.keep(10.0)
    assert parse_handle(handle)["total"]["key"] == total  # one handle, the total's nested
    assert len(any_locks.holders("export:t1")) == 1 and len(any_locks.holders(total)) == 1  # kept
    retry = _run(any_locks, "export:t1", total, run_id="job-1", cap=2)
    assert retry.begin(handle=handle)
    assert (retry.lease.fencing_token, retry.lease.total.fencing_token) == fences  # claimed: same fences
    assert len(any_locks.holders(total)) == 1
    retry.finish()
    assert any_locks.holders("export:t1") == [] and any_locks.holders(total) == []


def test_a_retry_whose_place_in_the_total_went_meanwhile_gives_its_key_back(any_locks):
    total = _total_key(any_locks, "export:t1")
    first = _run(any_locks, "export:t1", total, run_id="job-1", cap=1, limit=1, ttl=0.3)
    assert first.begin()
    handle = first.keep(0.3)
    time.sleep(0.4)  # both kept holds expire; another tenant's run takes the only place in the total
    other = _run(any_locks, "export:t9", total, cap=1, limit=1)
    assert other.begin()
    retry = _run(any_locks, "export:t1", total, run_id="job-1", cap=1, limit=1)
    assert not retry.begin(handle=handle)
    assert retry.reason == "limit_total"
    assert any_locks.holders("export:t1") == []  # nothing held by the refused retry
    other.finish()
    again = _run(any_locks, "export:t1", total, run_id="job-1", cap=1, limit=1)
    assert again.begin(handle=handle)  # expired handle: both acquired afresh
    again.finish()


def test_release_handle_and_release_kept_release_both(any_locks):
    total = _total_key(any_locks, "export:t1")
    run = _run(any_locks, "export:t1", total, run_id="job-1")
    assert run.begin()
    handle = run.keep(10.0)
    assert release_handle(any_locks, handle) is True
    assert any_locks.holders("export:t1") == [] and any_locks.holders(total) == []
    run = _run(any_locks, "export:t1", total, run_id="job-2")
    assert run.begin()
    run.release_kept(run.keep(10.0))
    assert any_locks.holders("export:t1") == [] and any_locks.holders(total) == []


def test_waiting_for_the_total_holds_no_slot_of_the_key(any_locks):
    """With ``wait``, a run finding the total full gives its key's slot back and waits for the
    total holding nothing (no hold-and-wait); a release of the total wakes it and it takes both."""
    total = _total_key(any_locks, "export:t2")
    holder = _run(any_locks, "export:t1", total, cap=1)
    assert holder.begin()
    waiter = _run(any_locks, "export:t2", total, cap=1, wait=5.0)
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(waiter.begin()))
    t.start()
    time.sleep(0.4)
    assert t.is_alive() and any_locks.holders("export:t2") == []  # waiting, holding nothing
    started = time.monotonic()
    holder.finish()
    t.join(5)
    assert out == [True] and time.monotonic() - started < 2
    assert waiter.lease.key == "export:t2" and waiter.lease.total.key == total
    waiter.finish()
    timed = _run(any_locks, "export:t3", total, cap=1, wait=0.3)
    blocker = _run(any_locks, "export:t1", total, cap=1)
    assert blocker.begin()
    assert not timed.begin() and timed.reason == "wait_timeout"
    assert any_locks.holders("export:t3") == []
    blocker.finish()


def test_shadow_mode_reports_limit_total_and_takes_nothing(any_locks):
    events = []
    remove = any_locks.add_listener(lambda e: events.append(e))
    try:
        total = _total_key(any_locks, "export:t2")
        holder = _run(any_locks, "export:t1", total, cap=1)
        assert holder.begin()
        shadow = _run(any_locks, "export:t2", total, cap=1, enforce=False)
        assert shadow.begin()  # the body runs anyway
        assert shadow.lease is None and shadow.reason == "limit_total"
        assert any_locks.holders("export:t2") == []  # its key's slot was given back
        shadow.finish()
        holder.finish()
    finally:
        remove()
    skips = [e for e in events if getattr(e, "kind", None) == "skip"]
    assert [(e.status, e.key, e.shadow) for e in skips] == [("limit_total", total, True)], skips


def test_a_with_run_skip_of_limit_total_is_a_skipped_value(any_locks):
    total = _total_key(any_locks, "export:t2")
    holder = _run(any_locks, "export:t1", total, cap=1)
    assert holder.begin()
    value = _run(any_locks, "export:t2", total, cap=1).call(lambda lease: "ran")
    assert is_skipped(value) and value.reason == "limit_total"
    holder.finish()


# -- the options ---------------------------------------------------------------------------------


def _export(tenant, seconds=0.0):
    return tenant


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"key": "export:{tenant}", "limit": 2, "limit_total": 0}, "limit_total must be an int from 1 to 100"),
        ({"key": "export:{tenant}", "limit": 2, "limit_total": 101}, "limit_total must be an int from 1 to 100"),
        ({"key": "export:{tenant}", "limit": 5, "limit_total": 3}, r"limit \(5\) exceeds limit_total \(3\)"),
        ({"limit": 2, "limit_total": 10}, "limit_total needs key="),
        ({"key": "export:{tenant}", "limit_total_key": "exports"}, "limit_total_key needs limit_total="),
        ({"key": "x:{tenant}", "limit_total": 3, "limit_total_key": "x:{tenant}"}, "must differ from key"),
        ({"key": "x:{tenant}", "limit_total": 3, "limit_total_key": "all:{nope}"}, "nope"),
        ({"key": "x:{tenant}", "limit_total": 3, "overlap": "coalesce"}, "cannot be combined with limit_total"),
        ({"key": "x:{tenant}", "limit_total": 3, "overlap": "replace"}, "cannot be combined with limit_total"),
    ],
)
def test_bad_total_options_fail_at_declaration(opts, match):
    with pytest.raises(ConfigError, match=match):
        GuardOptions.build(_export, name="t.export", **opts)


def test_a_misspelt_total_option_says_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'limit_total'"):
        check_option_names("t.export", ["limit_totl"])
    with pytest.raises(ConfigError, match="did you mean 'limit_total_key'"):
        check_option_names("t.export", ["limit_total_keys"])


def test_the_total_key_defaults_to_the_task_name_and_renders_per_call():
    opts = GuardOptions.build(_export, name="t.export", key="export:{tenant}", limit=2, limit_total=10)
    assert opts.total_of(("acme",), {}) == ("t.export", 10)
    per_region = GuardOptions.build(
        _export, name="t.export", key="export:{tenant}", limit=2, limit_total=10, limit_total_key="all:{seconds}"
    )
    assert per_region.total_of(("acme",), {"seconds": 1}) == ("all:1", 10)
    assert GuardOptions.build(_export, name="t.export", key="export:{tenant}").total_of(("a",), {}) is None
    same = GuardOptions.build(
        _export,
        name="t.export",
        key="export:{tenant}",
        limit_total=3,
        limit_total_key=lambda tenant, **_: f"export:{tenant}",
    )
    with pytest.raises(ConfigError, match="the lease key itself"):
        same.total_of(("x",), {})  # (renders "export:x" for both)


def _hold_and_die(url, prefix, total, cap):
    import os
    import socket

    from taskguard import RedisLocks

    locks = RedisLocks.from_url(url, prefix=prefix)
    holder = {"pid": os.getpid(), "host": socket.gethostname()}
    run = GuardedRun(locks, RunRequest("export:t1", 20.0, limit=2, total=(total, cap), run_id="R1", holder=holder))
    assert run.begin()
    os.kill(os.getpid(), 9)  # SIGKILL while holding both


@pytest.mark.parametrize("cap", [1, 5])
def test_a_copy_of_a_run_whose_holder_was_killed_releases_both_holds_and_runs(redis_url, prefix, cap):
    """A redelivered copy of run R1 finds R1's holder dead (its pid gone, same host): it releases
    R1's lease *and* R1's place in the total, and runs at once — also when the total has room
    for both (before, only the key was released, and the copy answered "running" for the total's
    whole TTL, the dead run's place in the total held)."""
    import multiprocessing

    from taskguard import RedisLocks

    locks = RedisLocks.from_url(redis_url, prefix=prefix)
    total = _total_key(locks, "export:t1")
    child = multiprocessing.get_context("fork").Process(target=_hold_and_die, args=(redis_url, prefix, total, cap))
    child.start()
    child.join(30)
    assert child.exitcode == -9
    assert [h.run_id for h in locks.holders(total)] == ["R1"]
    started = time.monotonic()
    copy = _run(locks, "export:t1", total, cap=cap, ttl=20.0, run_id="R1")
    assert copy.begin(), copy.reason
    assert time.monotonic() - started < 2.0  # not after the dead holds' 20 s TTL
    assert [h.run_id for h in locks.holders(total)] == ["R1"]  # its own place now, one only
    copy.finish()
    assert locks.holders(total) == [] and locks.holders("export:t1") == []
