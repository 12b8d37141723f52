"""Shared pieces of the real-loop tests: reading what a ``ListSink`` got and the checks every loop
makes (one record per optimizer step, numbered from 0, no anomaly on a clean run)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import batchtap as bt
from batchtap.records import Event, Record

#: float32 rounding of a value the library computes itself (a weighted mean of float32 losses, a
#: float32 gradient norm): a few ulps of float32 (2**-23 ~ 1.2e-7) apart from the float64 reference.
F32_REL = 1e-5


def step_records(records: Sequence[Record]) -> list[Record]:
    """The per-step records (``tap.log()`` values come as sparse records of their own)."""
    return [r for r in records if not r.sparse]


def sparse_records(records: Sequence[Record]) -> list[Record]:
    return [r for r in records if r.sparse]


def events_of(events: Sequence[Event], kind: bt.EventKind) -> list[Event]:
    return [e for e in events if e.kind == kind]


def assert_one_record_per_step(records: Sequence[Record], steps: int) -> list[Record]:
    """Exactly one record per optimizer step, numbered 0..steps-1, in order; returns them."""
    rows = step_records(records)
    assert [r.step for r in rows] == list(range(steps)), [r.step for r in rows]
    return rows


def assert_clean(events: Sequence[Event]) -> None:
    """No anomaly (and no rule action or library warning) on a clean run."""
    bad = [e for e in events if e.kind in (bt.EventKind.ANOMALY, bt.EventKind.ACTION, bt.EventKind.WARNING)]
    assert not bad, [e.message for e in bad]


def assert_all_finite(records: Sequence[Record]) -> None:
    """No value of any record is NaN or infinite (a left-out value is absent, never NaN)."""
    for r in records:
        bad = {k: v for k, v in r.values.items() if not math.isfinite(v)}
        assert not bad, f"step {r.step}: {bad}"
