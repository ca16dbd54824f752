"""The listener API, and owner tokens kept out of every repr, log line, event and error."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import secrets
import time

import pytest

import taskguard
from taskguard import LeaseLost, RedisLocks, add_listener
from taskguard.locks import new_owner_token


def test_listener_reports_every_operation_kind(client, prefix):
    local, everywhere = [], []
    remove = add_listener(everywhere.append)
    try:
        locks = RedisLocks(client, prefix=prefix, renew_fraction=0.25, listeners=[local.append])
        lease = locks.acquire("ev", ttl=0.4, renew=True, holder={"task": "t"}).lease
        time.sleep(0.3)  # at least one heartbeat renewal
        locks.with_lease("ev", lambda lease: None, ttl=1)  # skipped: held
        assert lease.renew(1)
        assert lease.release()
        gone = locks.acquire("ev2", ttl=1).lease
        client.delete("{" + prefix + ":ev2}")
        assert gone.release() is False  # found lost
    finally:
        remove()
    seen = {(e.kind, e.status) for e in local}
    assert {
        ("acquire", "acquired"),
        ("renew", "renewed"),
        ("acquire", "held"),
        ("skip", "held"),
        ("release", "released"),
        ("release", "not_owner"),
    } <= seen
    assert any(e.kind == "lost" for e in local)
    for e in local:
        assert e.key in ("ev", "ev2")
        assert e.duration >= 0 and abs(e.at - time.time()) < 30
    acquired = next(e for e in local if e.kind == "acquire" and e.status == "acquired")
    assert acquired.fencing_token == lease.fencing_token and acquired.ttl == 0.4
    assert acquired.holder["task"] == "t"
    assert [(e.kind, e.status, e.key) for e in everywhere if e.key in ("ev", "ev2")] == [
        (e.kind, e.status, e.key) for e in local
    ]


def test_a_failing_listener_never_breaks_an_operation(client, prefix, caplog):
    def broken(event):
        raise RuntimeError("listener bug")

    locks = RedisLocks(client, prefix=prefix, listeners=[broken])
    lease = locks.acquire("robust", ttl=5).lease
    assert lease.release()
    assert "listener" in caplog.text


def test_owner_tokens_are_random_and_from_secrets(monkeypatch):
    tokens = {new_owner_token() for _ in range(1000)}
    assert len(tokens) == 1000 and min(len(t) for t in tokens) >= 20
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: "from-secrets")
    assert new_owner_token() == "from-secrets"


def test_owner_token_never_in_repr_logs_events_or_errors(client, prefix, caplog):
    caplog.set_level(logging.DEBUG, logger="taskguard")
    events = []
    locks = RedisLocks(client, prefix=prefix, renew_fraction=0.25, listeners=[events.append])
    acq = locks.acquire("secret", ttl=0.4, renew=True, holder={"task": "t"})
    lease = acq.lease
    token = lease.owner_token
    texts = [repr(lease), str(lease), repr(acq), repr(locks), repr(locks.holder("secret"))]
    time.sleep(0.3)
    now_ms = int(client.time()[0]) * 1000
    client.hset("{" + prefix + ":secret}", mapping={"o": "thief", "x": now_ms + 6000})  # the heartbeat finds it lost
    time.sleep(0.4)
    assert lease.lost
    with pytest.raises(LeaseLost) as err:
        lease.ensure_held(verify=True)
    texts += [str(err.value), repr(err.value), str(pickle.loads(pickle.dumps(err.value)).args)]
    skipped = locks.with_lease("secret", lambda lease: None, ttl=1)
    texts += [repr(skipped), str(skipped.to_dict())]
    for e in events:
        texts.append(repr(e))
        texts.append(repr(dataclasses.asdict(e)))
    texts.append(caplog.text)
    assert len(events) >= 4
    for text in texts:
        assert token not in text
    # the restored handle (built from a persisted token) hides it too
    restored = locks.restore("secret", token, ttl=1)
    assert token not in repr(restored)
    assert taskguard.__name__  # module import kept for clarity
