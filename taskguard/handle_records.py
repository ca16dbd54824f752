"""A run's lease handle kept in the lease store by run id, and what settles it when the process
running the run is gone.

A framework whose executions carry no header of their own (RQ keeps one job id across retries and
saves a job's hash from more than one process: rq/worker) keeps the handle of a run in a record
beside the lease, under a key of its choosing (RQ: ``rq-job:<job id>``; the record named
``handle``). Two handles are kept there:

* the running execution's (``"running": True``), while its body runs: a supervisor that sees the
  process die (RQ's worker main process) settles the lease with :func:`settle_dead` at once,
  instead of leaving it to its TTL;
* a retry's (``"running": False``), kept by :func:`keep_for_retry` when the run ends in a way the
  framework will run again: the retry claims the same lease (same fencing token).

A handle holds the owner token: whoever can read this Redis can renew or release that lease.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import ConfigError, LeaseBackendError
from .handoff import handle_of, parse_handle, restore_handle
from .lease import HolderInfo
from .liveness import holder_is_dead
from .validate import MAX_SECONDS
from .values import RunState

if TYPE_CHECKING:  # pragma: no cover
    from .locks import Locks
    from .run import GuardedRun

__all__ = [
    "load",
    "save",
    "drop",
    "while_running",
    "keep_for_retry",
    "release_run",
    "release_when_dead",
    "DEATH_WAIT",
    "settle_dead",
    "Settled",
    "DeadRun",
]

log = logging.getLogger("taskguard")

_NAME = "handle"  # the record's name under its key


def load(locks: Locks, where: str) -> dict[str, Any] | None:
    """The handle kept under the record key ``where`` (with ``"running"``: ``bool``), or ``None``.
    A malformed record is logged and ignored. Raises LeaseBackendError."""
    return _parse(locks.get_record(where, _NAME), where)


def _parse(raw: str | None, where: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        return {**parse_handle(data), "running": data.get("running") is True}
    except (ValueError, ConfigError, AttributeError) as e:
        log.error("%s: ignoring its stored lease handle: %s", where, e)
        return None


def save(locks: Locks, where: str, handle: dict[str, Any], ttl: float) -> str:
    """Keep ``handle`` under ``where`` for ``ttl`` seconds; returns the record as stored (for
    :func:`drop`). Raises LeaseBackendError."""
    raw = json.dumps(handle)
    locks.put_record(where, _NAME, raw, ttl=ttl)
    return raw


def drop(locks: Locks, where: str, saved: str | None = None) -> None:
    """Forget the handle kept under ``where`` (only the one this execution ``saved``, when given:
    a later execution of the same run id may have stored its own). Raises LeaseBackendError."""
    locks.delete_record(where, _NAME, if_value=saved)


@contextmanager
def while_running(locks: Locks, where: str | None, run: GuardedRun, *, ttl: float) -> Iterator[None]:
    """While the body of ``run`` runs, keep its handle under ``where`` marked running (``ttl``
    seconds), for :func:`settle_dead`; afterwards drop it, unless the run was kept for a retry
    (whose handle replaced it). Nothing is kept without ``where`` (a direct call) or without a
    lease (shadow mode). A failed save hands the lease back before the body ran (nothing left
    locked) and raises; a failed drop is logged (the record's TTL bounds it)."""
    lease = run.lease
    if lease is None or where is None:
        yield
        return
    try:
        saved = save(
            locks, where, {**handle_of(lease), "running": True}, ttl=min(ttl, MAX_SECONDS)
        )  # (and its total's)
    except BaseException:
        run.hand_back()
        raise
    try:
        yield
    finally:
        if run.state != RunState.KEPT:
            try:
                drop(locks, where, saved)
            except LeaseBackendError as e:
                log.warning("%s: could not drop its stored lease handle: %s", where, e)


def keep_for_retry(locks: Locks, where: str, run: GuardedRun, retry_in: float | None) -> bool:
    """The execution of ``run`` ends without finishing its work for good. When the framework runs
    it again ``retry_in`` seconds from now, the lease is stretched over that and its TTL and its
    handle kept under ``where`` for the retry; with ``retry_in`` ``None`` the run failed (lease
    released). Returns ``True`` when kept (``False``: released, or lost meanwhile). Raises
    LeaseBackendError."""
    if retry_in is None:
        run.fail()
        return False
    stretch = min(retry_in + run.ttl, MAX_SECONDS)  # (a retry a framework books years ahead)
    handle = run.keep(stretch)
    if handle is None:  # lost meanwhile: the retry acquires afresh
        return False
    save(locks, where, handle, ttl=stretch)
    return True


def release_run(
    locks: Locks,
    run_id: str,
    keys: Iterable[str],
    *,
    dead_only: bool = False,
    execution: Mapping[str, Any] | None = None,
) -> bool:
    """Release, without an owner token, the leases run ``run_id`` holds on ``keys`` (its key and,
    under ``limit_total``, its place in the total) for a supervisor that knows the execution is
    over (:meth:`taskguard.Locks.release_run`). Each lease is released as the very lease seen held
    (its fencing token), never one a later execution took meanwhile.

    ``execution``: holder metadata items naming the execution (Celery's ``{"task_id": ...}``): the
    lease held by that execution whatever its run id (a beat slot's run is named by its slot,
    shared by every message of the slot), instead of any holder with run id ``run_id``.
    ``dead_only``: only a lease whose holder process is known dead on this host (never one of a
    live execution of the same run id, a retry). Returns ``True`` when the first key's lease (with
    ``dead_only``, any) was released. Raises ConfigError, LeaseBackendError."""

    released = []
    for key, info in _held(locks, run_id, keys, execution):
        if info is None or (dead_only and not holder_is_dead(info.holder)):
            released.append(False)
            continue
        released.append(locks.release_run(key, str(info.run_id), fencing_token=info.fencing_token))
    return any(released) if dead_only else bool(released and released[0])


def _held(
    locks: Locks, run_id: str, keys: Iterable[str], execution: Mapping[str, Any] | None
) -> list[tuple[str, HolderInfo | None]]:
    """Each key with the lease the run holds on it (named by ``execution``'s holder metadata items
    when given, else by its run id), ``None`` where it holds none."""

    def names(i: HolderInfo) -> bool:
        if execution is None:
            return i.run_id == run_id
        return all(i.holder.get(k) == v for k, v in execution.items())

    found = []
    for key in keys:
        info = next((i for i in locks.holders(key) if names(i) and i.run_id is not None), None)
        found.append((key, info))
    return found


#: How long :func:`release_when_dead` watches a signalled execution's process, seconds: longer
#: than any cleanup a cancelled body does; one that outlives it keeps its lease to its own
#: release at the body's end, or to its TTL.
DEATH_WAIT = 600.0
#: How often a watched process is looked at (seconds, doubling from the first to the last) and how
#: often the lease store is asked whether the execution still holds its leases.
_WATCH_PAUSES = (0.01, 0.25)
_WATCH_STORE_EVERY = 5.0


def release_when_dead(
    locks: Locks,
    run_id: str,
    keys: Iterable[str],
    *,
    execution: Mapping[str, Any],
    wait: float = DEATH_WAIT,
    on_release: Callable[[str], None] | None = None,
) -> bool:
    """Release the leases the execution named by ``execution`` (holder metadata items: its task
    id, host, PID namespace, pid) holds for run ``run_id`` on ``keys`` — for a supervisor that has
    just ended it from outside (a signal to its process) — but only once its process is dead: a
    process that survives the signal (one that handles it, like Celery's soft cancel, or ignores
    it) goes on running the body under its lease and releases it itself at the end. Dead now: the
    leases are released here, each the very lease seen held (its fencing token). Alive: a daemon
    thread watches the process (locally; the lease store every few seconds) for up to ``wait``
    seconds and releases once it is dead, unless the execution no longer holds them.
    ``on_release(key)`` is called after a release from that thread (a log line). Returns ``True``
    when the first key's lease was released here and now. Raises ConfigError, LeaseBackendError
    (reading the holders here); the thread logs its errors."""

    held = [(key, info) for key, info in _held(locks, run_id, keys, execution) if info is not None]
    if not held:
        return False
    if holder_is_dead(held[0][1].holder):
        return _release_seen(locks, held)[0]
    threading.Thread(
        target=_watch, args=(locks, held, wait, on_release), name="taskguard-release-when-dead", daemon=True
    ).start()
    return False


def _release_seen(locks: Locks, held: list[tuple[str, HolderInfo]]) -> list[bool]:
    return [locks.release_run(key, str(info.run_id), fencing_token=info.fencing_token) for key, info in held]


def _watch(
    locks: Locks, held: list[tuple[str, HolderInfo]], wait: float, on_release: Callable[[str], None] | None
) -> None:
    """:func:`release_when_dead`'s watcher thread."""
    key, first = held[0]
    start = time.monotonic()
    asked, pause = start, _WATCH_PAUSES[0]
    try:
        while time.monotonic() - start < wait:
            time.sleep(pause)
            pause = min(pause * 2, _WATCH_PAUSES[1])
            if holder_is_dead(first.holder):
                if _release_seen(locks, held)[0] and on_release is not None:
                    on_release(key)
                return
            if time.monotonic() - asked >= _WATCH_STORE_EVERY:
                asked = time.monotonic()
                if not any(i.fencing_token == first.fencing_token for i in locks.holders(key)):
                    return  # released by the execution itself (or expired): nothing left to do
        log.info(
            "lease %r: its holder (pid %s) outlived %.0fs after it was ended; its own release or its TTL settles it",
            key,
            first.holder.get("pid"),
            wait,
        )
    except (ConfigError, LeaseBackendError) as e:
        log.warning("lease %r: could not release it after its holder ended (its TTL bounds it): %s", key, e)


class Settled(str, enum.Enum):
    """How :func:`settle_dead` left a dead execution's lease."""

    KEPT = "kept"  #: stretched and kept for the framework's retry
    RELEASED = "released"
    HELD = "held"  #: held by a process of the run that may still live: left to it and its TTL
    NONE = "none"  #: the run held no lease


class DeadRun(NamedTuple):
    """What :func:`settle_dead` did: ``how``, the lease ``key``, ``seconds`` it was kept (``KEPT``),
    and the live ``holder``'s description (``HELD``: host, pid; never an owner token)."""

    how: Settled
    key: str | None = None
    seconds: float | None = None
    holder: dict[str, Any] | None = None
    unsaved: bool = False  #: released by run id: the execution died before saving its handle


def settle_dead(
    locks: Locks,
    where: str,
    run_id: str,
    *,
    ttl: float,
    retry_in: float | None,
    lease_keys: Callable[[], list[str]],
) -> DeadRun:
    """Settle the lease of run ``run_id`` whose executing process died (killed, stopped, its
    supervisor shut down): with ``retry_in`` (seconds until the framework runs it again) the lease
    is stretched over that plus ``ttl`` and its handle kept for the retry; otherwise released and
    the handle under ``where`` deleted.

    A handle marked running is settled only when the process holding that lease is known dead on
    this host: the process that just died is not always the holder (a supervisor killed while its
    child still runs the body; a later execution waiting for that one has no handle of its own).
    With no handle — the execution held no lease, or died in the one round trip between taking
    its lease and saving its handle — the leases the run id holds on ``lease_keys()`` (its key and
    its place in the total, computed only then) are released when their holder is known dead
    (:func:`release_run`). Raises ConfigError, LeaseBackendError."""
    raw = locks.get_record(where, _NAME)
    handle = _parse(raw, where)
    if handle is None:
        return _unsaved(locks, run_id, lease_keys)
    if handle.get("running"):
        fence = handle.get("fence")
        info = next((i for i in locks.holders(handle["key"]) if i.run_id == run_id and i.fencing_token == fence), None)
        if info is not None and not holder_is_dead(info.holder):
            return DeadRun(Settled.HELD, handle["key"], holder=dict(info.holder))
    lease = restore_handle(locks, handle, ttl=ttl)  # (with its place in the total, if any)
    lease.run_id = run_id
    total = lease.total
    if retry_in is not None:
        stretch = retry_in + ttl
        if lease.renew(stretch) and (total is None or total.renew(stretch)):
            save(locks, where, {**handle_of(lease), "running": False}, ttl=stretch)
            return DeadRun(Settled.KEPT, handle["key"], seconds=stretch)
    released = lease.release()
    if total is not None:
        total.release()
    drop(locks, where, raw)  # (only the handle read here: a later execution of the run id may have saved its own)
    if not released:  # the stored handle's lease is not the one this execution held (a retry's
        # process that claimed a kept lease, or took a fresh one, and died before saving its handle)
        return _unsaved(locks, run_id, lease_keys)
    return DeadRun(Settled.RELEASED, handle["key"])


def _unsaved(locks: Locks, run_id: str, lease_keys: Callable[[], list[str]]) -> DeadRun:
    keys = lease_keys()
    # the key's lease, and apart from it the place in the total (held alone for a moment by a run
    # that waited for a place: it takes the place, then its key)
    if not release_run(locks, run_id, keys, dead_only=True):
        return DeadRun(Settled.NONE)
    return DeadRun(Settled.RELEASED, keys[0], unsaved=True)
