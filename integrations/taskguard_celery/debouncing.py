"""``debounce=`` for Celery: calls of a key within a quiet period make one run with the last
call's arguments, decided at publish (:mod:`taskguard.debounce`).

The first ``delay()`` / ``apply_async()`` of a window publishes one message, ``debounce`` seconds
ahead, with the ``taskguard_debounce`` header (a later call publishes it instead when the first
one died before publishing: :mod:`taskguard.debounce`); later calls publish nothing, update the window's
arguments and get its ``AsyncResult`` (a ``skip`` event with reason ``"debounced"`` each). When
the message arrives before the window's due time it is published again for the rest (still one
message per window) and this delivery ends with ``Ignore``; at the due time the window closes and
the body runs with the stored arguments of the latest call. A window whose run finds its key's
lease held is opened again and its message published for when the lease is due to be free
(:func:`busy`); a retry of the run (``self.retry()``, ``autoretry_for``) is a plain run of the
window's arguments."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from celery.exceptions import Ignore

from taskguard.debounce import Window, due as window_due, publish_call, refused
from taskguard.pipeline import Skip

from .headers import COALESCE_HEADER, DEBOUNCE_HEADER, PUBLISH_HEADER, RUN_HEADERS, without
from .identity import is_redelivery
from .serialization import decode, encode

__all__ = ["publish", "arrived", "busy", "is_closed", "is_window_message"]


def is_window_message(headers: Any) -> bool:
    return isinstance(headers, dict) and DEBOUNCE_HEADER in headers


def publish(
    task: Any, args: Any, kwargs: Any, task_id: str | None, options: dict, send: Callable[[str, dict], Any]
) -> Any:
    """A call of a debounced task: open the key's window (``send`` publishes its one message) or
    join the open one. Returns the window's ``AsyncResult``. Raises what rendering the key raises
    for these arguments, LeaseBackendError when Redis fails (nothing published)."""
    opts = task.taskguard_options
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    key = opts.key.render(args, kwargs)

    def send_window(w: Window) -> Any:
        headers = {**(options.get("headers") or {}), DEBOUNCE_HEADER: {"key": key}}
        o = {k: v for k, v in options.items() if k not in ("eta", "countdown")}
        return send(w.run_id, {**o, "headers": headers, "countdown": w.countdown})

    return publish_call(
        task.taskguard_locks,
        key,
        task_id or str(uuid.uuid4()),
        encode(task, {"args": list(args), "kwargs": kwargs}),
        debounce=opts.debounce,
        debounce_max=opts.debounce_max,
        task=task.name,
        send=send_window,
        joined=task.AsyncResult,
    )


_OWN = (*RUN_HEADERS, PUBLISH_HEADER, COALESCE_HEADER)


def arrived(task: Any, req: Any, key: str) -> tuple[tuple, dict, Any]:
    """The window's message arrived: the latest call's ``(args, kwargs)`` and the stored
    message (for :func:`busy`) when the window closes now — from here the request is a plain run
    of those arguments (:func:`_close`) — else it is published again for the rest of the window
    (or, a copy of a window that ran, dropped) and ``Ignore`` is raised."""
    # (a broker redelivery of a message whose execution died after closing it: its kept call)
    state, value = window_due(task.taskguard_locks, key, req.id, again=is_redelivery(req))
    if state == "run":
        call = decode(value)
        args, kwargs = tuple(call["args"]), dict(call["kwargs"])
        _close(req, key, args, kwargs)
        return args, kwargs, value
    if state == "wait":
        _come_back(task, req, key, value)
        raise Ignore(f"{task.name}[{req.id}]: debounce window of {key!r} open {value:.2f}s more")
    raise Ignore(f"{task.name}[{req.id}]: its debounce window ran already")


def is_closed(header: Any) -> bool:
    """A window header of a run whose window closed (:func:`_close`): a plain run."""
    return isinstance(header, dict) and bool(header.get("closed"))


def _close(req: Any, key: str, args: tuple, kwargs: dict) -> None:
    """The window closed: the request carries its arguments and a closed window header, so that
    whatever publishes it again — a retry, its rate turn, a back-off, its wake as a pending
    follow-up — is a plain run of them (never the window's message again, nor a new call)."""
    req.args, req.kwargs = list(args), dict(kwargs)
    closed = {"key": key, "closed": True}
    req.headers = {**(req.headers or {}), DEBOUNCE_HEADER: closed}
    if getattr(req, DEBOUNCE_HEADER, None) is not None:
        setattr(req, DEBOUNCE_HEADER, closed)


def busy(task: Any, req: Any, key: str, message: Any, decision: Any, bound: float) -> Any:
    """The window closed; a run refused because the key is busy is put back
    (:func:`taskguard.debounce.refused`): its message published again to look when the key may be
    free (at most ``bound`` seconds), then ``Ignore`` — or, a newer window open, a ``Skip`` with
    reason ``"debounced"`` to settle. Any other decision is returned as it is."""
    if not isinstance(decision, Skip):
        return decision
    debounce = task.taskguard_options.debounce or 0.0
    back = refused(task.taskguard_locks, key, req.id, message, decision.skipped, debounce=debounce, bound=bound)
    if isinstance(back, float):
        _come_back(task, req, key, back)
        raise Ignore(f"{task.name}[{req.id}]: lease of {key!r} held; debounce window put back for {back:.2f}s")
    return decision if back is None else Skip(back)


def _come_back(task: Any, req: Any, key: str, countdown: float) -> None:
    """Publish the window's message again (an open window header), ``countdown`` seconds ahead."""
    headers = {**without(req.headers, _OWN), DEBOUNCE_HEADER: {"key": key}}
    task.signature_from_request(req, countdown=countdown, retries=req.retries, headers=headers).apply_async()
