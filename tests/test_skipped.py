"""``Skipped``: the explicit, falsy value of a run that did not happen, and its tagged-dict form
that survives serializers knowing no custom types (JSON, msgpack)."""

from __future__ import annotations

import dataclasses
import json
import pickle

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from taskguard import MemoryLocks, Skipped, is_skipped
from taskguard.skipped import SKIP_REASONS, TAG

FIELDS = ("key", "reason", "task", "holder_ttl", "at")


def sample(**over) -> Skipped:
    values = dict(key="nightly-report", reason="held", task="reports.nightly", holder_ttl=12.5, at=1_700_000_000.25)
    values.update(over)
    return Skipped(**values)


def test_fields_are_exactly_these_and_none_can_hold_an_owner_token():
    """No owner token by construction: the dataclass has no field for one (a new field must be
    added here deliberately)."""
    names = tuple(f.name for f in dataclasses.fields(Skipped))
    assert names == FIELDS
    assert not any("owner" in n or "token" in n or "secret" in n for n in names)
    assert set(sample().to_dict()) == set(FIELDS) | {TAG}


def test_is_frozen():
    s = sample()
    for name in FIELDS:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(s, name, "changed")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.owner_token = "sneaked-in"  # no new attributes either
    with pytest.raises(dataclasses.FrozenInstanceError):
        del s.key
    assert s == sample()


@pytest.mark.parametrize(
    "s",
    [
        sample(),
        sample(task=None, holder_ttl=None),
        sample(reason="wait_timeout"),
        sample(holder_ttl=0.0),
        sample(key=""),
    ],
)
def test_is_falsy(s):
    assert bool(s) is False
    assert not s
    assert (s or "fallback") == "fallback"


def test_defaults_and_at_is_now():
    import time

    before = time.time()
    s = Skipped(key="k", reason="held")
    after = time.time()
    assert s.task is None and s.holder_ttl is None
    assert before <= s.at <= after


def test_dict_round_trip():
    s = sample()
    d = s.to_dict()
    assert d[TAG] == 1
    assert {k: d[k] for k in FIELDS} == dataclasses.asdict(s)
    back = Skipped.from_dict(d)
    assert back == s and type(back) is Skipped
    # unknown keys (e.g. from a newer version) are ignored, the tag is required
    assert Skipped.from_dict({**d, "future_field": 1}) == s


def test_from_dict_rejects_what_is_not_a_tagged_dict():
    d = sample().to_dict()
    for bad in (
        {k: v for k, v in d.items() if k != TAG},
        {**d, TAG: 0},
        {**d, TAG: "1"},
        {TAG: 1, "key": "k"},
        {TAG: 1, "reason": "held"},
        {},
        [("key", "k")],
    ):
        with pytest.raises(ValueError):
            Skipped.from_dict(bad)


def test_json_round_trip_of_the_dict_is_recognised():
    s = sample()
    wire = json.dumps(s.to_dict())
    got = json.loads(wire)
    assert is_skipped(got)
    assert Skipped.from_dict(got) == s
    # also when nested in a larger result, as a result backend would store it
    envelope = json.loads(json.dumps({"status": "SUCCESS", "result": s.to_dict()}))
    assert is_skipped(envelope["result"]) and not is_skipped(envelope)


def test_msgpack_round_trip_of_the_dict_is_recognised():
    s = sample()
    got = msgpack.unpackb(msgpack.packb(s.to_dict()), raw=False)
    assert is_skipped(got)
    assert Skipped.from_dict(got) == s
    none_fields = sample(task=None, holder_ttl=None)
    got = msgpack.unpackb(msgpack.packb(none_fields.to_dict()), raw=False)
    assert is_skipped(got) and Skipped.from_dict(got) == none_fields


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickle_round_trip(protocol):
    s = sample()
    back = pickle.loads(pickle.dumps(s, protocol=protocol))
    assert back == s and type(back) is Skipped and not back and is_skipped(back)


@pytest.mark.parametrize(
    "value",
    [
        None,
        0,
        False,
        "",
        "held",
        [],
        (),
        {},
        set(),
        b"",
        1.5,
        object(),
        {"key": "k", "reason": "held"},  # the fields without the tag
        {"key": "k", "reason": "held", TAG: 0},
        {"key": "k", "reason": "held", TAG: "1"},
        {TAG: 1},
        {TAG: 1, "key": "k"},
        {TAG: 1, "reason": "held"},
        [TAG, "key", "reason"],
        json.dumps(sample().to_dict()),  # the serialized text itself is not a value
        dataclasses.asdict(sample()),
        Exception("held"),
    ],
)
def test_is_skipped_rejects_ordinary_values(value):
    assert is_skipped(value) is False


def test_is_skipped_accepts_the_value_and_its_dict():
    s = sample()
    assert is_skipped(s) is True
    assert is_skipped(s.to_dict()) is True
    assert is_skipped({TAG: 1, "key": "k", "reason": "anything new"}) is True


def test_describe_is_one_readable_line():
    assert sample().describe() == "reports.nightly: skipped, lease 'nightly-report' held (holder has 12.5s left)"
    assert sample(task=None, holder_ttl=None, reason="wait_timeout").describe() == (
        "skipped, lease 'nightly-report' wait_timeout"
    )
    assert "\n" not in sample(key="multi").describe()


def test_with_lease_returns_a_skipped_when_the_lease_is_held():
    locks = MemoryLocks()
    holder = locks.acquire("busy", ttl=30).lease
    ran = []
    result = locks.with_lease("busy", lambda lease: ran.append(1), ttl=30, task="app.job")
    assert ran == []
    assert isinstance(result, Skipped) and is_skipped(result) and not result
    assert (result.key, result.reason, result.task) == ("busy", "held", "app.job")
    assert 0 < result.holder_ttl <= 30
    assert holder.owner_token not in repr(result) and holder.owner_token not in json.dumps(result.to_dict())
    holder.release()


def test_reasons_the_core_uses_are_listed():
    assert {"held", "wait_timeout", "retry_exhausted"} <= set(SKIP_REASONS)


# -- property: any plain values survive every round trip ---------------------------------------------

skips = st.builds(
    Skipped,
    key=st.text(),
    reason=st.one_of(st.sampled_from(SKIP_REASONS), st.text()),
    task=st.none() | st.text(),
    holder_ttl=st.none() | st.floats(min_value=0, max_value=1e9, allow_nan=False),
    at=st.floats(min_value=0, max_value=4e9, allow_nan=False),
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(skips)
def test_property_round_trips(s):
    assert not s
    for back in (
        Skipped.from_dict(s.to_dict()),
        Skipped.from_dict(json.loads(json.dumps(s.to_dict()))),
        Skipped.from_dict(msgpack.unpackb(msgpack.packb(s.to_dict()), raw=False)),
        pickle.loads(pickle.dumps(s)),
    ):
        assert back == s
        assert is_skipped(back) and is_skipped(back.to_dict())
    assert is_skipped(json.loads(json.dumps(s.to_dict())))
