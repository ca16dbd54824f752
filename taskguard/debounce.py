"""``debounce=``: calls of a key within a quiet period make one run, with the last call's
arguments, decided when the call is published.

One record per key (``debounce``, beside the lease) holds the window: the run id of its one
message, when the window opened and when it is due, whether its message was published, and the
latest call's arguments (as the adapter serialises them). The first call of a window publishes one
message, delayed by ``debounce`` seconds, then marks the window published (:func:`published`);
every later call only updates the record — its due time moves to ``debounce`` seconds after it,
never past ``debounce_max`` seconds after the window opened — and gets the same run id (one broker
message per window, not one per call). The message, when it arrives, asks
:func:`due`: not yet (``"wait"``: it is published again for the rest), or the window closes
(``"run"``: the record is taken atomically; the body runs with the stored arguments). Calls after
that open a new window. Times come from the Redis server's clock.

**Publishing is claimed.** The call that opens a window claims its publishing for
:data:`PUBLISH_CLAIM` seconds (server clock, in the record). A call joining a window whose message
is not marked published yet does not return its handle before it is: while the claim lasts it
waits (polling, a few milliseconds apart at first) for the window to be marked published; once the
claim has run out — the publisher died between writing the record and publishing (SIGKILLed, its
connection cut), or is slower than the claim — it takes the claim over in one conditional write
and publishes the window's message itself (same run id; :attr:`Window.publish`). So every call
that got the window's handle has its window published, the last call's arguments run, and a burst
of calls during one slow publish makes one message, not one per call. A publisher slower than the
claim makes a second message of the same run id: the first to arrive at the due time takes the
record (atomically), the other finds it gone — one run, never two at once. A call that dies before
its record write changed nothing; one that dies after it has its arguments in the window (and the
window still runs once). A send that succeeded is never reported as failed: should marking the
window published fail then, it is logged (a later call may publish the window again after the
claim: one run).

**A window whose run finds the key's lease held** (the previous window's run still going) is
not skipped: :func:`put_back` opens it again for its message to come back when the lease is due
to be free, so a burst's last call is never lost.

**A window whose message will never run** — cancelled, deleted, revoked, rejected by a worker that
does not know its task — would swallow every call joining it until its record expires
(``debounce_max`` + :data:`GRACE`). Where the framework can tell from the handle a joining call
fetches anyway (RQ: the window's job, over or gone), :func:`publish_call` asks ``over`` and the
call reopens the window under its own run id instead (one conditional write: of calls finding the
same dead window one reopens, the others join it); where the framework announces it (Celery:
``task_revoked``, ``task_unknown``), :func:`drop` deletes the record that names it.

This module imports no task framework.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import LeaseBackendError
from .skipped import Skipped
from .values import Reason

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks

__all__ = [
    "RECORD",
    "Window",
    "publish_call",
    "publish",
    "published",
    "due",
    "put_back",
    "ended",
    "closing",
    "CLOSED",
    "refused",
    "BUSY",
    "drop",
    "GRACE",
    "PUBLISH_CLAIM",
]

log = logging.getLogger("taskguard")

T = TypeVar("T")

#: The lease record holding a key's open window (JSON).
RECORD = "debounce"
#: Seconds a window's record outlives ``debounce_max`` (a message delayed by a busy worker).
GRACE = 600.0
#: The record keeping a closed window's call while the execution that closed it runs
#: (``debounce-closed:<run id>``; :func:`due`, :func:`ended`), and how long it stays should that
#: execution die: a day, for a redelivery or a requeue to find it.
CLOSED, CLOSED_TTL = "debounce-closed:", 86400.0
#: Seconds a call's claim to publish a window's message lasts: calls joining the window meanwhile
#: wait for it to be published; after it, one of them publishes instead (its publisher is taken
#: for dead). Longer than a broker publish with its retries normally takes.
PUBLISH_CLAIM = 5.0
_ROUNDS = 100
#: Polls of a joining call waiting for a claimed window to be published: first and longest gap (s).
_POLL_FIRST, _POLL_MAX = 0.005, 0.1


@dataclasses.dataclass(frozen=True)
class Window:
    """What :func:`publish` decided: ``run_id`` (the window's run), ``fresh`` (this call opened
    it), ``countdown`` (seconds until the window is due) and ``publish``: this call publishes the
    window's message, ``countdown`` seconds ahead, then calls :func:`published` (with ``ttl``, the
    seconds the record is kept) — it opened the window, or joined one whose publisher's claim ran
    out before it was marked published; else it publishes nothing. ``pending``: the window is
    not marked published yet and its publisher's claim lasts ``claim_left`` seconds more
    (:func:`publish_call` waits for it). ``claim``: the claim this call wrote (server time it
    ends), when it is the one to publish."""

    run_id: str
    fresh: bool
    countdown: float
    publish: bool = False
    ttl: float = GRACE
    pending: bool = False
    claim_left: float = 0.0
    claim: float = 0.0


def _dumps(rec: dict[str, Any]) -> str:
    return json.dumps(rec, separators=(",", ":"))


def publish_call(
    locks: Locks,
    key: str,
    run_id: str,
    message: Any,
    *,
    debounce: float,
    debounce_max: float,
    task: str,
    send: Callable[[Window], T],
    joined: Callable[[str], T],
    over: Callable[[str], bool] | None = None,
) -> T:
    """A call of ``task`` (its arguments as ``message``, a JSON value): open the key's window,
    named ``run_id``, or join the open one. ``send(window)`` publishes the window's one message
    (run id ``window.run_id``, ``window.countdown`` seconds ahead) when this call is the one to
    (:attr:`Window.publish`), after which the window is marked published; else ``joined(run_id)``
    is the handle returned for the open window. ``over(run_id)``, asked before joining a
    published window: ``True`` when the framework knows its message will never run; this call
    then reopens the window under ``run_id``. A call joining a window is reported as a skip
    (reason ``"debounced"``). Returns what ``send`` or ``joined`` returns. Raises
    LeaseBackendError when Redis fails (nothing published), and what ``send`` raises."""
    w = publish(locks, key, run_id, message, debounce=debounce, debounce_max=debounce_max)
    for _ in range(_ROUNDS):
        if w.pending:
            w = _await_published(locks, key, w)
        if w.publish or over is None or not over(w.run_id):
            break
        reopened = _reopen(locks, key, w.run_id, run_id, message, debounce=debounce, debounce_max=debounce_max)
        if reopened is None:  # its record was taken meanwhile: the window ran (this call's arguments too)
            break
        log.info("%s: the debounce window %s of %r will never run: reopened", task, w.run_id, key)
        w = reopened
    if not w.fresh:
        locks.report_skip(Skipped(key=key, reason=Reason.DEBOUNCED, task=task))
        log.debug("%s: call joined the debounce window %s of %r", task, w.run_id, key)
    if not w.publish:
        return joined(w.run_id)
    if not w.fresh:  # its publisher's claim ran out: it died before publishing, or is that slow
        log.warning("%s: the debounce window %s of %r was not published in time; publishing it", task, w.run_id, key)
    claimed = time.monotonic()
    try:
        result = send(w)
    except BaseException:
        _drop_claim(locks, key, w.run_id, w.claim, ttl=max(w.ttl - (time.monotonic() - claimed), 1.0))
        raise
    try:
        published(locks, key, w.run_id, ttl=w.ttl)
    except LeaseBackendError as e:  # the message is out: the call succeeded
        log.warning("%s: could not mark the debounce window %s of %r published: %s", task, w.run_id, key, e)
    return result


def publish(locks: Locks, key: str, run_id: str, message: Any, *, debounce: float, debounce_max: float) -> Window:
    """Add a call (its arguments as ``message``, a JSON value) to the key's open window, or open
    one named ``run_id``. Raises LeaseBackendError."""
    for _ in range(_ROUNDS):
        raw = locks.get_record(key, RECORD)
        now = locks.server_time()
        rec = json.loads(raw) if raw is not None else None
        if rec is None:
            opened = _open(locks, key, run_id, message, now, None, debounce=debounce, debounce_max=debounce_max)
            if opened is not None:
                return opened
            continue
        rec["due"] = min(now + debounce, rec["first"] + debounce_max)
        rec["msg"] = message
        left = max(rec["first"] + debounce_max + GRACE - now, 1.0)
        # a window recorded by an earlier release has no "pub": it was published; one without a
        # "claim" (an earlier release's publisher) counts as unclaimed
        unpublished = rec.get("pub", 1) == 0
        claim_left = float(rec.get("claim", now)) - now if unpublished else 0.0
        take = unpublished and claim_left <= 0
        if take:
            rec["claim"] = now + PUBLISH_CLAIM
        if locks.put_record(key, RECORD, _dumps(rec), ttl=left, if_value=raw):
            countdown = max(rec["due"] - now, 0.0)
            pending = unpublished and not take
            claim = float(rec["claim"]) if take else 0.0
            return Window(str(rec["id"]), False, countdown, take, left, pending, max(claim_left, 0.0), claim)
    raise LeaseBackendError("debounce", key, "could not record the call: too much contention")


def _open(
    locks: Locks,
    key: str,
    run_id: str,
    message: Any,
    now: float,
    raw: str | None,
    *,
    debounce: float,
    debounce_max: float,
) -> Window | None:
    """Write a new window named ``run_id``, claimed for publishing by this call, over the record
    ``raw`` (``None``: where there is none); ``None`` when the record changed meanwhile."""
    new = {"id": run_id, "first": now, "due": now + debounce, "msg": message, "pub": 0, "claim": now + PUBLISH_CLAIM}
    ttl = debounce_max + GRACE
    written = (
        locks.put_record(key, RECORD, _dumps(new), ttl=ttl, if_absent=True)
        if raw is None
        else locks.put_record(key, RECORD, _dumps(new), ttl=ttl, if_value=raw)
    )
    return Window(run_id, True, debounce, publish=True, ttl=ttl, claim=new["claim"]) if written else None


def _reopen(
    locks: Locks, key: str, dead: str, run_id: str, message: Any, *, debounce: float, debounce_max: float
) -> Window | None:
    """The framework says the window ``dead``'s message will never run: replace the window with
    one named ``run_id`` (this call publishes it) while the record still names ``dead`` — a
    message that took its record has run, whatever its state says now (a window's message takes
    the record, atomically, before its body runs: :func:`due`). When another call replaced it
    first, add this call to that window, as :func:`publish` does. ``None``: the record is gone
    (the window ran, with this call's arguments)."""
    for _ in range(_ROUNDS):
        raw = locks.get_record(key, RECORD)
        rec = json.loads(raw) if raw is not None else None
        if rec is None:
            return None
        if rec.get("id") != dead:
            return publish(locks, key, run_id, message, debounce=debounce, debounce_max=debounce_max)
        now = locks.server_time()
        opened = _open(locks, key, run_id, message, now, raw, debounce=debounce, debounce_max=debounce_max)
        if opened is not None:
            return opened
    raise LeaseBackendError("debounce", key, "could not reopen the window: too much contention")


#: The skip reasons that mean the key is busy now: a window's run skipped for one of them is put
#: back (:func:`put_back`), never ended.
BUSY = frozenset({Reason.HELD, Reason.LIMIT, Reason.LIMIT_TOTAL, Reason.WAIT_TIMEOUT, Reason.UNREPLICATED})


def refused(
    locks: Locks, key: str, run_id: str, message: Any, skipped: Skipped, *, debounce: float, bound: float
) -> float | Skipped | None:
    """The window ``run_id`` closed (its stored call ``message``) and its run was refused,
    ``skipped``. Because the key is busy (:data:`BUSY`), the window is put back (:func:`put_back`)
    and this returns the seconds after which its message comes back to look again — the holder's
    time left, but at most ``debounce`` (a holder that renews its lease may end long before its
    TTL would) and ``bound`` (the adapter's longest deferral), at least 1 s — or, a newer window
    being open (its calls win), the ``Skipped`` (reason ``"debounced"``) this run ends with.
    ``None``: refused for another reason, settled as usual. Raises LeaseBackendError."""
    if skipped.reason not in BUSY:
        return None
    countdown = max(1.0, min(skipped.holder_ttl or debounce, debounce, bound))
    if put_back(locks, key, run_id, message, countdown=countdown):
        return countdown
    return Skipped(key=key, reason=Reason.DEBOUNCED, task=skipped.task)


def put_back(locks: Locks, key: str, run_id: str, message: Any, *, countdown: float) -> bool:
    """The window ``run_id`` closed (its message took the record: :func:`due`) but its run
    cannot start now — the key's lease is held, e.g. by the previous window's run, still going:
    open it again, published, under the same run id with its arguments (``message``), due in
    ``countdown`` seconds, for its message to come back then (calls meanwhile join it and their
    arguments win, as in any window). ``False``: a newer window of the key is open — its calls
    came later, so their arguments run and this window ends (``Skipped("debounced")``). Raises
    LeaseBackendError."""
    now = locks.server_time()
    rec = {"id": run_id, "first": now, "due": now + countdown, "msg": message, "pub": 1}
    return locks.put_record(key, RECORD, _dumps(rec), ttl=countdown + GRACE, if_absent=True)


def drop(locks: Locks, key: str, run_id: str) -> bool:
    """The window ``run_id``'s message will never run (revoked, rejected): delete the key's
    record if it still names that window, so that the next call opens a new one. Returns ``True``
    when deleted. Raises LeaseBackendError."""
    for _ in range(_ROUNDS):
        raw = locks.get_record(key, RECORD)
        rec = json.loads(raw) if raw is not None else None
        if rec is None or rec.get("id") != run_id:
            return False
        if locks.delete_record(key, RECORD, if_value=raw):
            return True
    raise LeaseBackendError("debounce", key, "could not drop the window: too much contention")


def _drop_claim(locks: Locks, key: str, run_id: str, claim: float, *, ttl: float) -> None:
    """This call's publish of the window ``run_id`` failed: give its claim (``claim``, as it
    wrote it) up, so that the next call joining the window publishes at once instead of waiting
    the claim out; a claim another call took over meanwhile is left alone. Never raises (a failure
    is logged: the claim then runs out by itself)."""
    try:
        for _ in range(_ROUNDS):  # (calls joining meanwhile change the record: read it again)
            raw = locks.get_record(key, RECORD)
            rec = json.loads(raw) if raw is not None else None
            if rec is None or rec.get("id") != run_id or rec.get("pub", 1) != 0 or rec.get("claim") != claim:
                return
            rec["claim"] = 0
            if locks.put_record(key, RECORD, _dumps(rec), ttl=ttl, if_value=raw):
                return
    except Exception as e:
        log.warning("could not give up the publishing claim of the debounce window %s of %r: %s", run_id, key, e)


def _await_published(locks: Locks, key: str, w: Window) -> Window:
    """``w`` joined a window whose publisher's claim still lasts: wait until the window is marked
    published (or has gone: it was published, and taken by its message), or take its claim over
    once it has run out (then this call publishes). Raises LeaseBackendError."""
    gap = _POLL_FIRST
    start = time.monotonic()
    # (the server's clock decides when a claim has run out; this local bound only stops a wait
    # that other joiners' take-overs would prolong: past it, this call publishes too — one run)
    deadline = start + w.claim_left + 2 * PUBLISH_CLAIM
    while True:
        time.sleep(min(gap, max(w.claim_left, 0.0) + 0.001))
        gap = min(gap * 2, _POLL_MAX)
        raw = locks.get_record(key, RECORD)
        rec = json.loads(raw) if raw is not None else None
        if rec is None or rec.get("id") != w.run_id or rec.get("pub", 1) != 0:
            return dataclasses.replace(w, pending=False)
        now = locks.server_time()
        claim_left = float(rec.get("claim", now)) - now
        if claim_left > 0 and time.monotonic() < deadline:
            w = dataclasses.replace(w, claim_left=claim_left)
            continue
        rec["claim"] = now + PUBLISH_CLAIM
        left = max(w.ttl - (time.monotonic() - start), 1.0)  # the record's time left, as it was
        if locks.put_record(key, RECORD, _dumps(rec), ttl=left, if_value=raw):
            countdown = max(rec["due"] - now, 0.0)
            return dataclasses.replace(
                w, publish=True, pending=False, countdown=countdown, ttl=left, claim=rec["claim"]
            )


def published(locks: Locks, key: str, run_id: str, *, ttl: float) -> None:
    """The window ``run_id``'s message was published: mark it so (while the record still names
    it), so that later calls do not publish it again; the record is kept ``ttl`` seconds more
    (:attr:`Window.ttl`). Raises LeaseBackendError (the window then stays unmarked: at worst a
    later call publishes a second message of the same run id, which runs once)."""
    for _ in range(_ROUNDS):
        raw = locks.get_record(key, RECORD)
        rec = json.loads(raw) if raw is not None else None
        if rec is None or rec.get("id") != run_id or rec.get("pub", 1) != 0:
            return
        rec["pub"] = 1
        if locks.put_record(key, RECORD, _dumps(rec), ttl=ttl, if_value=raw):
            return
    raise LeaseBackendError("debounce", key, "could not mark the window published: too much contention")


def due(locks: Locks, key: str, run_id: str, *, again: bool = False) -> tuple[str, Any]:
    """The window's message ``run_id`` arrived: ``("wait", seconds)`` (come back then),
    ``("run", message)`` (the window is closed and taken: run with the latest call's arguments)
    or ``("gone", None)`` (no open window names it: a copy of a run that ran already).

    Closing the window keeps its call (the record :data:`CLOSED` ``+ run_id``) until the run's
    execution ends (:func:`ended`): with ``again`` — this is the same delivery or job once more,
    its execution having died (a broker redelivery after a SIGKILLed worker process, an RQ job
    requeued or retried after its work-horse was killed) — a closed window's kept call is
    ``("run", message)`` again. Raises LeaseBackendError."""
    for _ in range(_ROUNDS):
        raw = locks.get_record(key, RECORD)
        rec = json.loads(raw) if raw is not None else None
        if rec is None or rec.get("id") != run_id:
            kept = locks.get_record(key, CLOSED + run_id) if again else None
            return ("run", json.loads(kept)) if kept is not None else ("gone", None)
        left = rec["due"] - locks.server_time()
        if left > 0.02:
            return "wait", left
        locks.put_record(key, CLOSED + run_id, _dumps(rec["msg"]), ttl=CLOSED_TTL)
        if locks.delete_record(key, RECORD, if_value=raw):
            return "run", rec["msg"]
    raise LeaseBackendError("debounce", key, "could not close the window: too much contention")


@contextlib.contextmanager
def closing(locks: Locks, key: str, run_id: str | None, closed: bool) -> Iterator[None]:
    """Around the execution of ``run_id`` (``closed``: it closed its window): when it ends, in
    whatever way, its kept call goes (:func:`ended`). A process killed meanwhile leaves it."""
    try:
        yield
    finally:
        if closed and run_id is not None:
            ended(locks, key, run_id)


def ended(locks: Locks, key: str, run_id: str) -> None:
    """The execution that closed the window ``run_id`` ended (ran, failed, was put back, pends,
    waits its rate turn as a plain run): its kept call goes (:func:`due`). Never raises (a
    failure is logged: the record's TTL bounds it)."""
    try:
        locks.delete_record(key, CLOSED + run_id)
    except Exception as e:
        log.warning("could not delete the closed debounce window %s of %r (its TTL bounds it): %s", run_id, key, e)
