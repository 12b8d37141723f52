"""Read a cell's SQLite store back and hold every stored value to the loop's ``.item()`` truth."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CLOCKED", "COUNTS", "Outcome", "check", "stored"]

#: values measured by a clock, for which a loop has no ``.item()`` truth: each with the range it must
#: lie in wherever stored (in a process group: the slowest rank's index and max/min of the ranks' step times)
CLOCKED: dict[str, tuple[float, float]] = {
    "step_time": (0.0, math.inf),
    "data_time": (0.0, math.inf),
    "throughput": (0.0, math.inf),
    "slowest_rank": (0.0, 1.0),
    "step_time_spread": (1.0, math.inf),
}
#: float32 rounding of a value the library combines itself (a weighted mean, a float32 norm)
REL = 1e-5
#: what a step's throughput can count, carried in each truth step beside the metrics (not stored values):
#: ``samples`` the rows of the batches the loader handed out (sequences for a sequence model), ``tokens``
#: the step's kept targets (what a token-normalised loss divides by), ``input_tokens`` the elements of the
#: HF Trainer's ``input_ids`` (HF cells only); summed over ranks in a process group
COUNTS = ("samples", "tokens", "input_tokens")


@dataclass
class Outcome:
    """What a front-end's run of a scenario gives the check.

    Attributes:
        steps: per optimizer step, ``{"epoch", "batch", <metric>: truth...}`` (the ``.item()`` values).
        reads: host reads per step (after the first) where the front-end counted them, else None.
        db: the SQLite store the run wrote to.
        counted: what this cell's stored ``throughput`` counts per second (one of :data:`COUNTS`):
            wherever a step stores both, throughput x step_time must equal that count of the step
            (the registry sets it from the scenario and the front-end).
        data_time: True when this front-end must store the loader's wait on every step.
        step_time: True when it must store a step time on every step after the first.
        notes: what the cell's run said on the way (for a failure's message).
    """

    steps: list[dict[str, float]]
    reads: list[int] | None
    db: Path
    data_time: bool = False
    step_time: bool = False
    counted: str = "samples"
    notes: list[str] = field(default_factory=list)


def stored(db: Path) -> tuple[dict[str, Any], dict[int, dict[str, tuple[int, int, float | None]]], list[dict]]:
    """The one run in ``db``: the run row, ``{step: {metric: (epoch, batch, value)}}`` of the rows
    of the lowest rank (the reduced rows in a process group), and its events."""
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        runs = [dict(r) for r in conn.execute("SELECT * FROM runs")]
        assert len(runs) == 1, f"expected one run in {db}, got {len(runs)}"
        rank = conn.execute("SELECT MIN(rank) FROM metrics").fetchone()[0]
        rows: dict[int, dict[str, tuple[int, int, float | None]]] = {}
        query = "SELECT metric, step, epoch, batch, value FROM metrics WHERE rank = ?"
        for metric, step, epoch, batch, value in conn.execute(query, (rank,)):
            rows.setdefault(step, {})[metric] = (epoch, batch, value)
        events = [dict(e) for e in conn.execute("SELECT step, kind, metric, message FROM events ORDER BY step")]
    return runs[0], rows, events


def check(outcome: Outcome) -> None:
    """Every stored value of every step equals its truth (or, for a clocked value, is a duration);
    every truth is stored; each row's (epoch, batch) is the loop's; no host read was added."""
    run, rows, events = stored(outcome.db)
    problems: list[str] = []
    if run["status"] != "finished":
        problems.append(f"run stored as {run['status']!r} ({run['stop_reason']}), expected 'finished'")
    anomalies = [e for e in events if e["kind"] == "anomaly"]
    if anomalies:
        problems.append(f"anomaly events on a clean run: {[e['message'] for e in anomalies][:3]}")
    truth = outcome.steps
    if sorted(rows) != list(range(len(truth))):
        problems.append(f"stored steps {sorted(rows)}, expected 0..{len(truth) - 1}")
    for step, expected in enumerate(truth):
        got = rows.get(step, {})
        problems += _check_step(step, expected, got, data_time=outcome.data_time, step_time=outcome.step_time)
        problems += _check_throughput(step, expected, got, outcome.counted)
    if outcome.reads is not None and any(outcome.reads):
        problems.append(f"host reads per step (after the first): {outcome.reads}, expected 0")
    if problems:
        said = [f"{e['kind']}@{e['step']}: {e['message'][:200]}" for e in events if e["kind"] != "anomaly"]
        raise AssertionError("\n".join([*problems[:12], f"({len(problems)} problems)", *said[:6], *outcome.notes]))


def _check_step(
    step: int,
    expected: Mapping[str, float],
    got: Mapping[str, tuple[int, int, float | None]],
    *,
    data_time: bool,
    step_time: bool,
) -> list[str]:
    problems = []
    where = (int(expected["epoch"]), int(expected["batch"]))
    for metric, (epoch, batch, value) in got.items():
        if (epoch, batch) != where:
            problems.append(f"step {step} {metric}: stored at (epoch, batch) {(epoch, batch)}, expected {where}")
        if metric in expected:
            want = expected[metric]
            if value is None or not math.isclose(value, want, rel_tol=REL, abs_tol=1e-9):
                problems.append(f"step {step} {metric}: stored {value!r}, truth {want!r}")
        elif metric in CLOCKED:
            low, high = CLOCKED[metric]
            if value is None or not (math.isfinite(value) and low <= value <= high):
                problems.append(f"step {step} {metric}: stored {value!r}, expected a finite value in [{low}, {high}]")
        else:
            problems.append(f"step {step} {metric}: stored {value!r}, but the loop has no such value")
    for metric in expected:
        if metric not in ("epoch", "batch", *COUNTS) and metric not in got:
            problems.append(f"step {step} {metric}: not stored (truth {expected[metric]!r})")
    if data_time and "data_time" not in got:
        problems.append(f"step {step}: no data_time stored")
    if step_time and step > 0 and "step_time" not in got:  # the first step may have no start to time from
        problems.append(f"step {step}: no step_time stored")
    return problems


def _check_throughput(
    step: int, expected: Mapping[str, float], got: Mapping[str, tuple[int, int, float | None]], counted: str
) -> list[str]:
    """Throughput x step_time is the step's count (``counted``) wherever both are stored. A process
    group's global row sums the ranks' throughputs and keeps the slowest rank's step time, so there the
    product lies between the ranks' summed count and that times ``step_time_spread`` (slowest / fastest)."""
    if "throughput" not in got or "step_time" not in got:
        return []
    if counted not in expected:
        return [f"step {step} throughput: stored, but the truth has no {counted!r} count to hold it to"]
    throughput, step_time = got["throughput"][2], got["step_time"][2]
    if throughput is None or step_time is None:
        return []  # a missing value is reported by _check_step
    count, product = expected[counted], throughput * step_time
    spread = got["step_time_spread"][2] if "step_time_spread" in got else None
    high = count * (spread if spread is not None else 1.0)
    if count * (1 - REL) <= product <= high * (1 + REL):
        return []
    within = f" (up to x{spread:.4g}, the ranks' step_time_spread)" if spread is not None else ""
    return [
        f"step {step} throughput: stored {throughput!r}/s x step_time {step_time!r} s = {product:.6g}, expected the "
        f"step's {counted} {count:g}{within}"
    ]


def combine_ranks(per_rank: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """The global truth of a process group's step from each rank's: loss and accuracy the mean over
    ranks (the loops give every rank the same number of samples), the rest the same on every rank."""
    steps = []
    for rows in zip(*(r["steps"] for r in per_rank)):
        first = dict(rows[0])
        for name in ("loss", "accuracy"):
            first[name] = sum(r[name] for r in rows) / len(rows)
        for name in COUNTS:  # global throughput sums the ranks'
            if name in first:
                first[name] = sum(r[name] for r in rows)
        for name in ("lr", "grad_norm"):
            if name in first:
                values = [r[name] for r in rows]
                assert all(math.isclose(v, values[0], rel_tol=REL) for v in values), (name, values)
        steps.append(first)
    return steps
