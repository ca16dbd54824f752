"""Cases of the queued mark cleared by the acquisition (``Locks.acquire(queued_mark=...)``, the
ACQUIRE script's optional task and run id, ``pipeline.decide`` passing it for a run published
with ``unique=True``), on Redis (standalone and Cluster) and MemoryLocks.

A run is queued from its publish until it starts: while it waits inside the worker for what its
guard needs, nothing else of the key may be published."""

from __future__ import annotations

import threading

import pytest

from taskguard.memory_locks import MemoryLocks
from taskguard.pipeline import Run, decide
from taskguard.policy import GuardOptions

from .test_pipeline import Hooks, ex


def export(tenant):
    return tenant


@pytest.mark.parametrize(
    "run_id",
    [
        "a b",
        "a 1 b",
        "run 123 ~abc",
        "x 5 ~ab",
        "50%",
        "%d+",
        "a-b.c",
        "(.*)",
        "^$",
        " lead",
        "tail ",
        "two\nlines",
        "ünï-cödé",
        "1234567890",
    ],
)
@pytest.mark.parametrize("task", ["t", "t.%-x", "t q", "t#1", "q:x", "tâsk"])
def test_odd_run_ids_and_task_names_are_cleared_by_their_acquisition_only(any_locks, run_id, task):
    locks = any_locks
    assert locks.mark_queued("k", run_id, ttl=60, task=task) == (True, run_id)
    # another run's acquisition (an id that is a prefix or a pattern of this one) leaves it
    for other in (run_id + "x", run_id.strip() or "y", "%", "."):
        if other == run_id:
            continue
        acq = locks.acquire("k", ttl=10, run_id=other, queued_mark=(task, other))
        assert acq.acquired
        assert acq.lease.release()
        assert locks.mark_queued("k", "probe", ttl=60, task=task) == (False, run_id), other
    acq = locks.acquire("k", ttl=10, run_id=run_id, queued_mark=(task, run_id))
    assert acq.acquired
    assert acq.lease.release()
    assert locks.mark_queued("k", "after", ttl=60, task=task) == (True, "after")


def test_a_mark_written_by_an_older_version_is_cleared_by_the_acquisition(locks):
    """Marks from before the nonce ("<run id> <expiry ms>"), left in Redis across an upgrade."""
    lk = locks.backend.lease_key("k")
    for run_id in ("old-1", "old 2", "old 3 ~x"):
        locks.client.hset(lk, "q:t", f"{run_id} 99999999999999")
        assert locks.mark_queued("k", "new", ttl=60, task="t") == (False, run_id)
        acq = locks.acquire("k", ttl=10, run_id=run_id, queued_mark=("t", run_id))
        assert acq.acquired and acq.lease.release()
        assert locks.client.hget(lk, "q:t") is None, run_id
    locks.client.delete(lk)


def test_memory_and_redis_clear_the_same_marks(locks):
    """The same sequence on MemoryLocks and Redis answers alike (an expired mark naming the run,
    another task's mark, a re-acquisition by the holder's own token)."""
    mem = MemoryLocks()
    out = []
    for lk in (locks, mem):
        seq = []
        seq.append(lk.mark_queued("k", "r1", ttl=60, task="t"))
        seq.append(lk.mark_queued("k", "r1", ttl=60, task="u"))
        a = lk.acquire("k", ttl=10, run_id="r1", queued_mark=("t", "r1"))
        seq.append(a.acquired)
        seq.append(lk.mark_queued("k", "r2", ttl=60, task="t"))  # running: r1 holds it
        seq.append(lk.mark_queued("k", "r2", ttl=60, task="u"))  # u's mark untouched: queued r1
        seq.append(a.lease.release())
        seq.append(lk.clear_queued("k", "r1", "u"))
        out.append(seq)
    assert out[0] == out[1]


def _opts(**kw):
    kw.setdefault("key", "export:{tenant}")
    return GuardOptions.build(export, name="t.export", **kw)


def test_a_unique_run_waiting_for_a_place_in_the_total_is_still_queued(any_locks):
    """``limit_total`` with ``wait``: the run takes its key's slot, finds the total full, gives the
    slot back and waits for a place. It has not started: until it does, a publish of the same
    task and key must find it queued. So the key's slot taken before the total's carries no mark;
    the key's acquisition once a place is held does (had the first, given-back acquisition
    deleted the mark, the publish would go out and the key get a second run queued behind)."""
    locks = any_locks
    o = _opts(limit_total=1, limit_total_key="exports", wait=30.0, blocking_wait=True, ttl=30.0)
    key = o.key.render(("acme",), {})
    blocker = locks.acquire("exports", ttl=30, limit=1)  # the total is full
    assert blocker.acquired
    assert locks.mark_queued(key, "id-1", ttl=60, task="t.export") == (True, "id-1")
    gave_back = threading.Event()

    def listener(e):
        if e.kind == "release" and e.key == key:
            gave_back.set()  # the run took its key's slot and gave it back: it now waits

    remove = locks.add_listener(listener)
    h = Hooks()
    h.mark = (key, "id-1", "t.export")
    decided: list = []
    t = threading.Thread(target=lambda: decided.append(decide(o, key, ("acme",), {}, ex(task="t.export"), h, locks)))
    t.start()
    try:
        assert gave_back.wait(20), "the run never took its key's slot"
        assert not decided  # still waiting for the total: it has not started
        # a second publish of the key while the first run is still queued (waiting in the worker)
        assert locks.mark_queued(key, "id-2", ttl=60, task="t.export") == (False, "id-1")
    finally:
        remove()
        blocker.lease.release()
        t.join(30)
    d = decided[0]
    assert isinstance(d, Run)
    d.run.finish(None)
    locks.clear_queued(key, "id-2", "t.export")


def test_an_acquisition_re_sent_by_the_client_clears_the_mark_and_answers_acquired(prefix):
    """ACQUIRE with the queued mark sent during a 1.6 s stall with a 1 s socket timeout: redis-py
    re-sends it; the first send took the lease and deleted the mark, the re-send finds its own
    token. The caller is told it acquired and no mark is left."""
    from .servers import RedisServer
    from .test_resend import flaky_locks, no_mark, stalled, warm

    srv = RedisServer().start()
    locks = flaky_locks(srv, prefix)
    try:
        warm(locks)
        assert locks.mark_queued("k", "run 1 %d", ttl=3600, task="t.x") == (True, "run 1 %d")
        with stalled(srv, 1.6):
            acq = locks.acquire("k", ttl=30, run_id="run 1 %d", queued_mark=("t.x", "run 1 %d"))
        assert acq.acquired
        assert no_mark(locks.client.hget(locks.backend.lease_key("k"), "q:t.x"))
        assert acq.lease.release()
        assert locks.mark_queued("k", "run-2", ttl=3600, task="t.x") == (True, "run-2")
    finally:
        locks.close()
        srv.close()


def _pipeline_opts(**kw):
    from .test_pipeline import opts

    return opts(**kw)


def _marked(locks, run_id="id-1"):
    assert locks.mark_queued("inv:7", run_id, ttl=60, task="t.charge") == (True, run_id)
    h = Hooks()
    h.mark = ("inv:7", run_id, "t.charge")
    return h


def _still_queued(locks, run_id="id-1"):
    return locks.mark_queued("inv:7", "probe", ttl=60, task="t.charge") == (False, run_id)


def test_pipeline_variants_with_a_queued_mark(any_locks):
    """What held: the mark's fate per decision with ``queued_mark`` passed (the Hooks clear is a
    recorder, so a mark that survives here is one only the acquisition could have cleared)."""
    from taskguard.pipeline import Pend, Stored

    from .test_pipeline import go

    locks = any_locks
    # shadow mode: the acquisition touches no enforced mark; the adapter's clear is asked for
    h = _marked(locks)
    d = go(locks, _pipeline_opts(enforce=False), h)
    assert isinstance(d, Run) and not d.run.unmarked and h.calls[0] == ("clear_mark",)
    assert _still_queued(locks)  # (only the recorder was asked: the enforced mark is untouched)
    d.run.finish(None)
    assert locks.clear_queued("inv:7", "id-1", "t.charge")
    # a beat slot: the lease names the slot, the mark the task id; the acquisition clears the mark
    h = _marked(locks, "task-id-9")
    d = go(locks, _pipeline_opts(), h, run_id="task-id-9", slot=("slot:e:1", 60.0))
    assert isinstance(d, Run) and d.run.unmarked and h.calls == []
    assert locks.holders("inv:7")[0].run_id == "slot:e:1"
    assert not _still_queued(locks, "task-id-9")
    locks.clear_queued("inv:7", "probe", "t.charge")
    d.run.finish(None)
    # coalesce behind a holder: pended, cleared by the adapter, the acquisition refused left it
    held = locks.acquire("inv:7", ttl=5, run_id="other").lease
    h = _marked(locks)
    d = go(locks, _pipeline_opts(overlap="coalesce"), h)
    assert isinstance(d, Pend) and ("clear_mark",) in h.calls and _still_queued(locks)
    held.release()
    locks.clear_queued("inv:7", "id-1", "t.charge")
    # once, completed: the acquisition is never tried (stored value); the adapter clears
    o = _pipeline_opts(once=True)
    first = go(locks, o, Hooks(), run_id="id-0")
    first.run.finish("v")
    locks.clear_queued("inv:7", "probe", "t.charge")
    h = _marked(locks)
    d = go(locks, o, h)
    assert isinstance(d, Stored) and h.calls == [("clear_mark",)] and _still_queued(locks)
    locks.clear_queued("inv:7", "id-1", "t.charge")
    # replace: the run that takes over clears its mark with its acquisition
    victim = go(locks, _pipeline_opts(overlap="replace"), Hooks(), run_id="id-v")
    assert isinstance(victim, Run)
    h = _marked(locks, "id-r")
    h.replaced = lambda holder: h.calls.append(("replaced", holder.run_id))
    d = go(locks, _pipeline_opts(overlap="replace"), h, run_id="id-r")
    assert isinstance(d, Run) and d.run.unmarked and not _still_queued(locks, "id-r")
    assert ("replaced", "id-v") in h.calls and ("clear_mark",) not in h.calls
    d.run.finish(None)
    locks.clear_queued("inv:7", "probe", "t.charge")
