"""The framework-free publish protocols both adapters go through: publish-time uniqueness
(:mod:`taskguard.unique`) and a debounce window's call (:func:`taskguard.debounce.publish_call`),
on Redis, Redis Cluster and MemoryLocks."""

from __future__ import annotations

import json
import threading
import time

import pytest

from taskguard import LeaseBackendError, debounce, unique
from taskguard.events import add_listener


class _Sent:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[object] = []
        self.fail = fail

    def __call__(self, arg: object) -> object:
        self.calls.append(arg)
        if self.fail:
            raise OSError("broker down")
        return ("sent", arg)


def test_unique_publish_marks_then_answers_with_the_queued_run_and_clears_on_start(any_locks):
    first = _Sent()
    got = unique.publish(any_locks, "uq:1", "run-1", ttl=30, task="t", shadow=False, send=first, existing=str)
    assert got == ("sent", True) and first.calls == [True]  # marked: the call carries its key
    second = _Sent()
    got = unique.publish(any_locks, "uq:1", "run-2", ttl=30, task="t", shadow=False, send=second, existing=str)
    assert got == "run-1" and second.calls == []  # nothing published: the queued run's handle
    unique.clear(any_locks, ("uq:1", "run-1", "t"), False)  # the run started
    third = _Sent()
    got = unique.publish(any_locks, "uq:1", "run-3", ttl=30, task="t", shadow=False, send=third, existing=str)
    assert got == ("sent", True)


def test_unique_publish_clears_a_mark_whose_run_the_framework_says_will_never_start(any_locks):
    """``over(run_id)`` (the framework's word: cancelled, deleted, failed while queued) clears
    that run's mark and publishes; a run still due keeps blocking; a running holder's lease is
    never touched, whatever ``over`` says."""
    pub = unique.publish
    assert pub(any_locks, "uq:o", "run-1", ttl=30, task="t", shadow=False, send=_Sent(), existing=str) == ("sent", True)
    asked: list[str] = []

    def still_due(run_id):
        asked.append(run_id)
        return False

    assert (
        pub(any_locks, "uq:o", "run-2", ttl=30, task="t", shadow=False, send=_Sent(), existing=str, over=still_due)
        == "run-1"
    )
    assert asked == ["run-1"]
    sent = _Sent()
    got = pub(any_locks, "uq:o", "run-3", ttl=30, task="t", shadow=False, send=sent, existing=str, over=lambda r: True)
    assert got == ("sent", True) and sent.calls == [True]
    assert pub(any_locks, "uq:o", "run-4", ttl=30, task="t", shadow=False, send=_Sent(), existing=str) == "run-3"
    # a run holding the lease (no mark of its own any more): over() cannot release it
    any_locks.clear_queued("uq:o", "run-3", "t")
    lease = any_locks.acquire("uq:o", ttl=30, holder={"task": "t", "task_id": "run-3"}, run_id="run-3").lease
    try:
        got = pub(
            any_locks, "uq:o", "run-5", ttl=30, task="t", shadow=False, send=_Sent(), existing=str, over=lambda r: True
        )
        assert got == "run-3" and any_locks.holder("uq:o").fencing_token == lease.fencing_token
    finally:
        lease.release()


def test_unique_publish_that_fails_leaves_no_mark(any_locks):
    with pytest.raises(OSError):
        unique.publish(any_locks, "uq:2", "run-1", ttl=30, task="t", shadow=False, send=_Sent(fail=True), existing=str)
    ok = _Sent()
    assert unique.publish(any_locks, "uq:2", "run-2", ttl=30, task="t", shadow=False, send=ok, existing=str) == (
        "sent",
        True,
    )


@pytest.mark.parametrize("shadow", [False, True], ids=["enforced", "shadow"])
@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit, LeaseBackendError], ids=lambda e: e.__name__)
def test_a_mark_whose_answer_never_came_back_is_cleared(any_locks, monkeypatch, shadow, raised):
    """The mark's script ran on the server, but the client raised before it had the answer: a
    Redis timeout, or an exception that interrupts the wait itself (KeyboardInterrupt, SystemExit,
    gevent's Timeout is a BaseException too). Nothing was published, so the mark this call wrote
    is cleared: the next publish of the key is not suppressed for the mark's TTL (one hour by
    default). Before, only a LeaseBackendError cleared it, and never in shadow mode."""
    holder = any_locks.records if shadow else any_locks.backend
    name = "put" if shadow else "mark_queued"
    original = getattr(holder, name)

    def ran_then_raised(*a: object, **k: object) -> object:
        original(*a, **k)
        raise raised("timeout") if raised is not LeaseBackendError else raised("mark_queued", "uq:7", "timeout")

    monkeypatch.setattr(holder, name, ran_then_raised)
    sent = _Sent()
    if shadow and raised is LeaseBackendError:  # shadow mode publishes anyway, without a mark
        unique.publish(any_locks, "uq:7", "run-1", ttl=3600, task="t", shadow=shadow, send=sent, existing=str)
        assert sent.calls == [False]
    else:
        with pytest.raises(raised):
            unique.publish(any_locks, "uq:7", "run-1", ttl=3600, task="t", shadow=shadow, send=sent, existing=str)
        assert sent.calls == []
    monkeypatch.undo()
    assert any_locks.mark_queued("uq:7", "run-2", ttl=30, task="t", shadow=shadow) == (True, "run-2")


@pytest.mark.parametrize("shadow", [False, True], ids=["enforced", "shadow"])
def test_a_failed_mark_never_clears_an_earlier_publishs_mark_of_the_same_run_id(any_locks, monkeypatch, shadow):
    """run-X is published and marked; the same run id is published again (a task id given
    again): the mark's answer is "run-X is queued", but the client raises before it has it
    (enforced: the script ran; shadow mode: its read of the holders failed). The clean-up clears
    only a mark this call wrote, so run-X's mark stands and a third publish is still suppressed
    (shadow mode: reported as it would have been). (Before, the clean-up cleared run-X's mark,
    and a third publish was sent beside the queued run-X, or not reported.)"""
    first = _Sent()
    got = unique.publish(any_locks, "uq:8", "run-X", ttl=60, task="t", shadow=shadow, send=first, existing=str)
    assert got == ("sent", True)
    holder, name = (any_locks.backend, "holders") if shadow else (any_locks.backend, "mark_queued")
    original = getattr(holder, name)

    def ran_then_raised(*a: object, **k: object) -> object:
        original(*a, **k)
        raise KeyboardInterrupt("answer lost")

    monkeypatch.setattr(holder, name, ran_then_raised)
    with pytest.raises(KeyboardInterrupt):
        unique.publish(any_locks, "uq:8", "run-X", ttl=60, task="t", shadow=shadow, send=_Sent(), existing=str)
    monkeypatch.undo()
    third = _Sent()
    got = unique.publish(any_locks, "uq:8", "run-Y", ttl=60, task="t", shadow=shadow, send=third, existing=str)
    if shadow:  # published anyway, without a mark of its own: run-X's still stands
        assert third.calls == [False]
    else:
        assert got == "run-X" and third.calls == []
    assert any_locks.clear_queued("uq:8", "run-X", "t", shadow) is True  # (its run starts: the plain clear)


def test_unique_shadow_mode_always_publishes_and_reports_what_it_would_have_suppressed(any_locks):
    seen = []
    remove = add_listener(seen.append)
    try:
        sends = _Sent()
        for run in ("run-1", "run-2"):
            unique.publish(any_locks, "uq:3", run, ttl=30, task="t", shadow=True, send=sends, existing=str)
    finally:
        remove()
    assert sends.calls == [True, False]  # the second is published too, without a mark of its own
    assert [(e.status, e.shadow) for e in seen if e.kind == "publish" and e.key == "uq:3"] == [("suppressed", True)]


def test_unique_clear_never_raises_on_a_backend_error(any_locks, monkeypatch):
    def down(*a: object, **k: object) -> bool:
        raise LeaseBackendError("clear_queued", "uq:4", "connection refused")

    monkeypatch.setattr(any_locks, "clear_queued", down)
    unique.clear(any_locks, ("uq:4", "run-1", "t"), False)  # logged, not raised
    unique.clear(any_locks, None, False)  # no mark: nothing to do


def test_debounce_publish_call_publishes_one_message_per_window_and_reports_each_join(any_locks):
    seen = []
    remove = add_listener(seen.append)
    try:
        sends = _Sent()
        handles = [
            debounce.publish_call(
                any_locks,
                "db:1",
                f"run-{i}",
                {"n": i},
                debounce=5,
                debounce_max=20,
                task="t",
                send=sends,
                joined=str,
            )
            for i in range(3)
        ]
    finally:
        remove()
    assert len(sends.calls) == 1 and sends.calls[0].run_id == "run-0" and sends.calls[0].fresh
    assert handles[1:] == ["run-0", "run-0"]  # the joining calls get the window's run
    assert [e.status for e in seen if e.kind == "skip" and e.key == "db:1"] == ["debounced", "debounced"]
    state, message = debounce.due(any_locks, "db:1", "run-0")
    assert state == "wait" and 0 < message <= 5


def _debounced(locks, key, run_id, n, send, over=None):
    return debounce.publish_call(
        locks, key, run_id, {"n": n}, debounce=5, debounce_max=20, task="t", send=send, joined=str, over=over
    )


def test_debounce_a_window_whose_message_will_never_run_is_reopened_by_the_next_call(any_locks):
    """A window whose message is cancelled, deleted or revoked swallowed every call joining it
    until its record ran out (``debounce_max`` + 10 min). When the framework says so (``over``),
    the joining call reopens it under its own run id and publishes; the window runs that call's
    arguments; a live window is joined as before, and ``over`` is never asked of the call's own
    fresh window."""
    asked: list[str] = []

    def dead(run_id):
        asked.append(run_id)
        return run_id == "run-0"

    first = _Sent()
    assert _debounced(any_locks, "db:o", "run-0", 0, first, over=dead) == ("sent", first.calls[0])
    assert asked == []  # the opener never asks
    second = _Sent()
    _debounced(any_locks, "db:o", "run-1", 1, second, over=dead)
    assert asked == ["run-0"] and len(second.calls) == 1
    assert second.calls[0].run_id == "run-1" and second.calls[0].fresh and second.calls[0].countdown == 5
    third = _Sent()
    assert _debounced(any_locks, "db:o", "run-2", 2, third, over=dead) == "run-1" and third.calls == []
    assert asked == ["run-0", "run-1"]
    window = json.loads(any_locks.get_record("db:o", debounce.RECORD))
    assert (window["id"], window["msg"]) == ("run-1", {"n": 2})  # the latest call's arguments run


def test_debounce_of_calls_finding_one_dead_window_one_reopens_it_and_the_others_join(any_locks):
    _debounced(any_locks, "db:c", "run-0", 0, _Sent())
    sends = _Sent()
    got: list[object] = []
    barrier = threading.Barrier(6)

    def call(i):
        barrier.wait()
        got.append(_debounced(any_locks, "db:c", f"run-{i + 1}", i + 1, sends, over=lambda r: r == "run-0"))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(sends.calls) == 1  # one new window, one message
    new = sends.calls[0].run_id
    assert new != "run-0" and sorted(g if isinstance(g, str) else new for g in got) == [new] * 6


def test_debounce_a_window_whose_message_took_its_record_meanwhile_is_never_reopened(any_locks):
    """A window's message takes the record before its body runs: once it has, the window ran
    with the joining call's arguments, whatever its state says by the time ``over`` is asked
    (finished, failed in its body). Reopening then would run that call twice."""
    _debounced(any_locks, "db:r", "run-0", 0, _Sent())

    def ran_meanwhile(run_id):
        assert debounce.drop(any_locks, "db:r", run_id)  # (as its message taking the record does)
        return True

    sends = _Sent()
    assert _debounced(any_locks, "db:r", "run-1", 1, sends, over=ran_meanwhile) == "run-0" and sends.calls == []


def test_debounce_a_window_whose_run_finds_its_key_busy_is_put_back_unless_a_newer_one_is_open(any_locks):
    from taskguard.skipped import Skipped

    def refused(skipped, run_id="run-0", n=0):
        return debounce.refused(any_locks, "db:p", run_id, {"n": n}, skipped, debounce=5, bound=30)

    assert refused(Skipped(key="db:p", reason="once")) is None  # not busy: settled as usual
    assert any_locks.get_record("db:p", debounce.RECORD) is None
    assert refused(Skipped(key="db:p", reason="held", holder_ttl=3.5)) == 3.5  # the holder's time left
    joined = _Sent()
    assert _debounced(any_locks, "db:p", "run-1", 1, joined) == "run-0" and joined.calls == []  # calls join it
    window = json.loads(any_locks.get_record("db:p", debounce.RECORD))
    assert (window["id"], window["msg"], window["pub"]) == ("run-0", {"n": 1}, 1)
    newer = refused(Skipped(key="db:p", reason="limit", task="t"), run_id="run-9", n=9)  # a newer window is open
    assert (newer.key, newer.reason, newer.task) == ("db:p", "debounced", "t")
    any_locks.delete_record("db:p", debounce.RECORD)
    assert refused(Skipped(key="db:p", reason="held", holder_ttl=0.2)) == 1.0  # at least 1 s
    any_locks.delete_record("db:p", debounce.RECORD)
    assert refused(Skipped(key="db:p", reason="wait_timeout")) == 5  # no holder's time known: debounce
    any_locks.delete_record("db:p", debounce.RECORD)
    # a holder renewing a long lease may end any moment: the window looks again every `debounce`
    assert refused(Skipped(key="db:p", reason="held", holder_ttl=3600)) == 5


def test_debounce_a_closed_windows_call_is_kept_for_a_redelivery_until_its_execution_ends(any_locks):
    _debounced(any_locks, "db:k", "run-0", 0, _Sent())
    _debounced(any_locks, "db:k", "run-1", 1, _Sent())  # joins: the window's call is now {"n": 1}
    window = json.loads(any_locks.get_record("db:k", debounce.RECORD))
    any_locks.put_record("db:k", debounce.RECORD, json.dumps({**window, "due": 0}), ttl=60)
    assert debounce.due(any_locks, "db:k", "run-0") == ("run", {"n": 1})
    assert debounce.due(any_locks, "db:k", "run-0") == ("gone", None)  # another copy: not the same delivery
    assert debounce.due(any_locks, "db:k", "run-0", again=True) == ("run", {"n": 1})  # its execution died
    with pytest.raises(RuntimeError), debounce.closing(any_locks, "db:k", "run-0", True):
        raise RuntimeError("the body failed")  # an execution that ends, in whatever way
    assert debounce.due(any_locks, "db:k", "run-0", again=True) == ("gone", None)


def test_debounce_drop_deletes_only_the_window_it_names(any_locks):
    """(bullmq#3232: a removed job deleted the deduplication key a newer job held.)"""
    _debounced(any_locks, "db:d", "run-0", 0, _Sent())
    assert debounce.drop(any_locks, "db:d", "run-9") is False
    assert _debounced(any_locks, "db:d", "run-1", 1, _Sent()) == "run-0"  # still open
    assert debounce.drop(any_locks, "db:d", "run-0") is True
    sends = _Sent()
    _debounced(any_locks, "db:d", "run-2", 2, sends)
    assert sends.calls[0].run_id == "run-2" and sends.calls[0].fresh  # a new window
    assert debounce.drop(any_locks, "db:none", "run-0") is False


def test_debounce_a_window_whose_opener_died_before_publishing_is_published_by_the_next_call(any_locks):
    died = _Sent(fail=True)
    with pytest.raises(OSError):  # the opener's publish never happened: the window stays unmarked
        debounce.publish_call(
            any_locks, "db:2", "run-0", {"n": 0}, debounce=5, debounce_max=20, task="t", send=died, joined=str
        )
    sends = _Sent()
    debounce.publish_call(
        any_locks, "db:2", "run-1", {"n": 1}, debounce=5, debounce_max=20, task="t", send=sends, joined=str
    )
    assert len(sends.calls) == 1 and sends.calls[0].run_id == "run-0" and not sends.calls[0].fresh
    later = _Sent()  # now marked published: a third call publishes nothing
    assert (
        debounce.publish_call(
            any_locks, "db:2", "run-2", {"n": 2}, debounce=5, debounce_max=20, task="t", send=later, joined=str
        )
        == "run-0"
    )
    assert later.calls == []


class _SlowSent(_Sent):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def __call__(self, arg: object) -> object:
        time.sleep(self.seconds)
        return super().__call__(arg)


def _call(locks, key, n, send):
    return debounce.publish_call(
        locks, key, f"run-{n}", {"n": n}, debounce=5, debounce_max=20, task="t", send=send, joined=str
    )


def test_debounce_calls_joining_while_the_window_is_being_published_make_no_second_message(any_locks):
    """The opener's publish takes 0.3 s (a slow broker); 30 calls join meanwhile. Before, each of
    them saw the window unpublished and published it again (10 messages in the reported case);
    now they wait for it to be marked published: one message, every call returns the window's
    run id, none before the message was sent."""
    sends = _SlowSent(0.3)
    opener = threading.Thread(target=_call, args=(any_locks, "db:5", 0, sends))
    opener.start()
    deadline = time.monotonic() + 5
    while any_locks.get_record("db:5", debounce.RECORD) is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    results: list[tuple[object, float]] = []

    def join(n: int) -> None:
        got = _call(any_locks, "db:5", n, sends)
        results.append((got, time.monotonic()))

    joiners = [threading.Thread(target=join, args=(n,)) for n in range(1, 31)]
    for t in joiners:
        t.start()
    for t in [opener, *joiners]:
        t.join(10)
    assert len(sends.calls) == 1 and sends.calls[0].run_id == "run-0"
    assert sorted({got for got, _ in results}) == ["run-0"] and len(results) == 30
    state, message = debounce.due(any_locks, "db:5", "run-0")
    assert state == "wait"


def test_debounce_a_publisher_that_died_mid_publish_is_taken_over_once_its_claim_runs_out(any_locks, monkeypatch):
    """The opener wrote the window and died before publishing or giving its claim up (SIGKILL:
    here, its record written by ``publish`` alone). Calls joining within the claim wait; once it
    runs out, one of them publishes the window's message (its run id), and the others get it."""
    monkeypatch.setattr(debounce, "PUBLISH_CLAIM", 1.0)
    w = debounce.publish(any_locks, "db:6", "run-0", {"n": 0}, debounce=5, debounce_max=20)
    assert w.publish and w.fresh  # ... and the opener dies here
    sends = _Sent()
    started = time.monotonic()
    threads = [threading.Thread(target=_call, args=(any_locks, "db:6", n, sends)) for n in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    waited = time.monotonic() - started
    assert len(sends.calls) == 1 and sends.calls[0].run_id == "run-0" and not sends.calls[0].fresh
    assert 0.8 < waited < 5.0
    assert debounce.due(any_locks, "db:6", "run-0")[0] == "wait"


def test_debounce_a_sent_message_is_never_reported_as_failed(any_locks, monkeypatch):
    """Marking the window published fails after its message was sent: the call returns the sent
    message's handle (logged, not raised: the message is out)."""

    def down(*a: object, **k: object) -> None:
        raise LeaseBackendError("debounce", "db:7", "connection reset")

    monkeypatch.setattr(debounce, "published", down)
    sends = _Sent()
    assert _call(any_locks, "db:7", 0, sends)[0] == "sent" and len(sends.calls) == 1


def test_debounce_a_failed_send_gives_up_only_its_own_claim(any_locks, monkeypatch):
    """The opener's send hangs past its claim (2 s); a joining call takes the claim over and
    publishes; then the opener's send fails. The opener gives up only the claim it wrote, so a
    third call arriving during the second one's publish waits for it: one message from the
    joiners. (Before, the opener reset whatever claim the record held, and the third call
    published too.) The steps are ordered by events, not by timing."""
    monkeypatch.setattr(debounce, "PUBLISH_CLAIM", 2.0)
    joiner_sending, opener_failed, third_started = threading.Event(), threading.Event(), threading.Event()
    sends: list[str] = []

    def opener_send(w: object) -> object:
        sends.append("opener")
        joiner_sending.wait(10)  # hangs until the joiner took its claim over and publishes
        raise OSError("broker down")

    def joiner_send(w: object) -> object:
        sends.append("joiner")
        joiner_sending.set()
        third_started.wait(10)
        time.sleep(0.5)  # still publishing while the third call looks at the window
        return ("sent", "joiner")

    def third_send(w: object) -> object:
        sends.append("third")
        return ("sent", "third")

    def opener() -> None:
        try:
            _call(any_locks, "db:8", 0, opener_send)
        except OSError:
            opener_failed.set()

    threads = [threading.Thread(target=opener)]
    threads[0].start()
    deadline = time.monotonic() + 5
    while any_locks.get_record("db:8", debounce.RECORD) is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    threads.append(threading.Thread(target=_call, args=(any_locks, "db:8", 1, joiner_send)))
    threads[1].start()
    assert opener_failed.wait(15)
    threads.append(threading.Thread(target=_call, args=(any_locks, "db:8", 2, third_send)))
    threads[2].start()
    third_started.set()
    for t in threads:
        t.join(15)
    assert sends == ["opener", "joiner"], sends


def test_debounce_a_failed_send_gives_its_claim_up_even_when_a_call_joins_meanwhile(any_locks, monkeypatch):
    """A call joins the window between the failed opener's read of the record and its write that
    gives the claim up (a burst): the give-up reads the record again and writes, so the next
    call publishes at once instead of waiting out the dead claim (5 s). (Before, one
    compare-and-set that lost to the joiner left the claim in place.)"""
    original = any_locks.get_record
    joined: list[object] = []

    def failing_send(w: object) -> object:
        def get_then_join(*a: object, **k: object) -> object:
            raw = original(*a, **k)
            if not joined:  # the give-up's first read: a call joins right after it
                monkeypatch.setattr(any_locks, "get_record", original)
                joined.append(debounce.publish(any_locks, "db:9", "run-J0", {"n": "j0"}, debounce=30, debounce_max=60))
            return raw

        monkeypatch.setattr(any_locks, "get_record", get_then_join)
        raise OSError("broker down")

    with pytest.raises(OSError):
        _call(any_locks, "db:9", 0, failing_send)
    monkeypatch.undo()
    assert joined and joined[0].pending  # it joined while the failed opener's claim stood
    sends = _Sent()
    started = time.monotonic()
    _call(any_locks, "db:9", 1, sends)
    assert len(sends.calls) == 1 and sends.calls[0].run_id == "run-0" and time.monotonic() - started < 2.0


def test_clearing_a_mark_by_the_nonce_that_wrote_it_on_every_backend(any_locks):
    """``Backend.clear_queued(written_by=)``: the nonce of the mark's writer clears it, another
    nonce does not, and an empty one means any writer (the run-start clear) on every backend."""
    backend = any_locks.backend
    assert backend.mark_queued("uq:10", "r-1", 30, "t", "n0nce0001").marked
    assert backend.clear_queued("uq:10", "r-1", "t", written_by="n0nce0002") is False
    assert backend.clear_queued("uq:10", "r-1", "t", written_by="n0nce0001") is True
    assert backend.mark_queued("uq:10", "r-2", 30, "t", "n0nce0003").marked
    assert backend.clear_queued("uq:10", "r-2", "t", written_by="") is True
