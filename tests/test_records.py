"""The record codec (``batchtap.records``): every message round-trips exactly, floats bit for bit."""

from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtap.records import (
    EpochStart,
    Event,
    EventKind,
    Message,
    Record,
    RunEnd,
    RunInfo,
    RunStart,
    RunStatus,
    Write,
    dumps,
    format_float,
    from_wire,
    loads,
    parse_float,
    to_wire,
)

# Every float, with the hard cases drawn often: signed zeros, subnormals, the extremes, non-finite.
_EDGES = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, -1.7976931348623157e308,
          math.inf, -math.inf, math.nan, 0.1, 1e16, 1e-7]  # fmt: skip
_floats = st.one_of(st.sampled_from(_EDGES), st.floats(allow_nan=True, allow_infinity=True, width=64))
# Names a record must keep whatever they are: its own keys, the escape prefix, text that looks like a float.
_names = st.one_of(
    st.sampled_from(
        [
            "type",
            "run_id",
            "step",
            "epoch",
            "batch",
            "rank",
            "wall_time",
            "sparse",
            "values",
            "metric:",
            "metric:step",
            "metric:metric:x",
            "nan",
            "inf",
            "loss/train ✓",
        ]
    ),  # fmt: skip
    st.text(min_size=1, max_size=12),
)
_text = st.one_of(st.sampled_from(["nan", "inf", "-inf", "1.5", ""]), st.text(max_size=20))
_ints = st.integers(min_value=-(2**40), max_value=2**40)

_records = st.builds(
    Record,
    run_id=_text,
    step=_ints,
    epoch=_ints,
    batch=_ints,
    rank=_ints,
    wall_time=_floats,
    values=st.dictionaries(_names, _floats, max_size=8),
    sparse=st.booleans(),
)
_events = st.builds(
    Event,
    run_id=_text,
    step=_ints,
    kind=st.sampled_from(list(EventKind)),
    message=_text,
    wall_time=_floats,
    metric=st.one_of(st.none(), _names),
    raw_value=st.one_of(st.none(), _floats),
    rank=_ints,
)
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), _text, st.floats(allow_nan=False, allow_infinity=False)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=8,
)
_runs = st.builds(
    RunInfo,
    id=_text,
    name=_text,
    config=st.dictionaries(_text, _json, max_size=4),
    started_at=_floats,
    status=st.sampled_from(list(RunStatus)),
    ended_at=st.one_of(st.none(), _floats),
    stop_reason=st.one_of(st.none(), _text),
    world_size=st.integers(min_value=1, max_value=1024),
    environment=st.dictionaries(_text, _json, max_size=4),
    metrics=st.lists(_names, max_size=5).map(tuple),
)
_messages = st.one_of(
    _records,
    _events,
    _runs.map(RunStart),
    _runs.map(RunEnd),
    st.builds(EpochStart, run_id=_text, epoch=_ints, total=st.one_of(st.none(), _ints)),
    st.builds(Write, records=st.lists(_records, max_size=3), events=st.lists(_events, max_size=3)),
)


def _bits(x: object) -> object:
    """A float as its 64 bits (every NaN as one: the codec keeps no NaN sign or payload); else as is."""
    if isinstance(x, float):
        return "nan" if math.isnan(x) else struct.pack("<d", x)
    return x


def _same_floats(a: object, b: object) -> bool:
    return type(a) is type(b) and _bits(a) == _bits(b)


def _assert_same_record(a: Record, b: Record) -> None:
    assert (a.run_id, a.step, a.epoch, a.batch, a.rank, a.sparse) == (
        b.run_id,
        b.step,
        b.epoch,
        b.batch,
        b.rank,
        b.sparse,
    )
    assert _same_floats(a.wall_time, b.wall_time)
    assert list(a.values) == list(b.values)  # names and their order
    assert all(_same_floats(a.values[k], b.values[k]) for k in a.values), (a.values, b.values)


def _assert_same_event(a: Event, b: Event) -> None:
    assert (a.run_id, a.step, a.kind, a.message, a.metric, a.rank) == (
        b.run_id,
        b.step,
        b.kind,
        b.message,
        b.metric,
        b.rank,
    )
    assert _same_floats(a.wall_time, b.wall_time)
    assert (a.raw_value is None and b.raw_value is None) or _same_floats(a.raw_value, b.raw_value)


def _assert_same_run(a: RunInfo, b: RunInfo) -> None:
    assert (a.id, a.name, a.config, a.status, a.stop_reason, a.world_size, a.environment, a.metrics) == (
        b.id, b.name, b.config, b.status, b.stop_reason, b.world_size, b.environment, b.metrics,
    )  # fmt: skip
    assert _same_floats(a.started_at, b.started_at)
    assert (a.ended_at is None and b.ended_at is None) or _same_floats(a.ended_at, b.ended_at)


def _assert_same(a: Message, b: Message) -> None:
    assert type(a) is type(b)
    if isinstance(a, Record):
        _assert_same_record(a, b)  # type: ignore[arg-type]
    elif isinstance(a, Event):
        _assert_same_event(a, b)  # type: ignore[arg-type]
    elif isinstance(a, (RunStart, RunEnd)):
        _assert_same_run(a.run, b.run)  # type: ignore[union-attr]
    elif isinstance(a, Write):
        assert len(a.records) == len(b.records) and len(a.events) == len(b.events)  # type: ignore[union-attr]
        for x, y in zip(a.records, b.records):  # type: ignore[union-attr]
            _assert_same_record(x, y)
        for e, f in zip(a.events, b.events):  # type: ignore[union-attr]
            _assert_same_event(e, f)
    else:
        assert a == b


@settings(max_examples=400, deadline=None, derandomize=True)
@given(msg=_messages)
def test_every_message_round_trips_exactly_through_one_strict_json_line(msg: Message) -> None:
    line = dumps(msg)
    assert "\n" not in line
    # strict JSON (no NaN/Infinity tokens), and the dict form is the line's object
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}")) == json.loads(
        json.dumps(to_wire(msg))
    )
    _assert_same(loads(line), msg)
    _assert_same(loads((line + "\n").encode("utf-8")), msg)  # as read from a file, bytes and newline
    _assert_same(from_wire(to_wire(msg)), msg)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(x=_floats)
def test_format_float_is_the_json_rule_as_text(x: float) -> None:
    text = format_float(x)
    assert _same_floats(parse_float(text), x)
    wired = to_wire(Record("r", 0, 0, 0, 0, x, {"v": x}))
    assert wired["v"] == wired["wall_time"]
    assert (wired["v"] == text) if not math.isfinite(x) else (json.dumps(wired["v"]) == text)


def test_text_that_looks_like_a_float_stays_text_outside_float_fields() -> None:
    run = RunInfo("nan", "inf", {"lr": "nan", "x": "-inf"}, 1.0, stop_reason="nan", metrics=("nan",))
    back = loads(dumps(RunEnd(run)))
    assert isinstance(back, RunEnd) and back.run == run
    ev = loads(dumps(Event("nan", 1, EventKind.WARNING, "inf", 2.0, metric="-inf")))
    assert isinstance(ev, Event) and (ev.run_id, ev.message, ev.metric, ev.raw_value) == ("nan", "inf", "-inf", None)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param('{"type":"record","run_id":"r","step":0,"epoch":0,"batch":0,"rank":0,"wall_time":0.0,"loss":"1.5"}',
                     r"'nan', 'inf', '-inf' in a float field, got '1.5'", id="number-as-text"),
        pytest.param('{"type":"record","run_id":"r","step":0,"epoch":0,"batch":0,"rank":0,"wall_time":"NaN"}',
                     r"got 'NaN'", id="other-nan-spelling"),
        pytest.param('{"type":"record","run_id":"r","step":0,"epoch":0,"batch":0,"rank":0,"wall_time":0,"x":true}',
                     r"got True", id="bool-value"),
        pytest.param('{"type":"event","run_id":"r","step":0}', r"'event' object lacks the key 'kind'", id="missing-key"),
        pytest.param('{"type":"bogus"}', r"\"type\" of record, event, .*got 'bogus'", id="unknown-type"),
        pytest.param('{"v":1,"op":"write"}', r"got none", id="no-type"),
        pytest.param('[1, 2]', r"expected a JSON object", id="not-an-object"),
        pytest.param('{"type":"write","records":3,"events":[]}', r"'write' object is malformed", id="write-not-a-list"),
    ],
)  # fmt: skip
def test_lines_that_are_not_codec_objects_are_refused_by_name(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        loads(line)


def test_only_messages_are_encoded() -> None:
    with pytest.raises(TypeError, match=r"writes Record, Event, .* got RunInfo"):
        to_wire(RunInfo("r", "n", {}, 0.0))  # type: ignore[arg-type]


def test_to_dict_is_the_codec_form_without_its_type() -> None:
    r = Record("r", 3, 0, -1, 0, 1.5, {"val": math.nan, "step": 2.0}, sparse=True)
    e = Event("r", 3, EventKind.ANOMALY, "loss is inf", 1.5, metric="loss", raw_value=-math.inf)
    assert r.to_dict() == {k: v for k, v in to_wire(r).items() if k != "type"}
    assert r.to_dict() == {"run_id": "r", "step": 3, "epoch": 0, "batch": -1, "rank": 0, "wall_time": 1.5, "sparse": True,
                           "val": "nan", "metric:step": 2.0}  # fmt: skip
    assert e.to_dict() == {k: v for k, v in to_wire(e).items() if k != "type"}
    assert e.to_dict()["raw_value"] == "-inf"
