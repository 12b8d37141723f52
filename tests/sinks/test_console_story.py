"""The console tells what happened, not every event: one rollback is one line, an anomaly never
comes after the action that followed it, skipped steps are summed up per ``every`` steps, a
warning is said once, and no line runs on for hundreds of characters.

The first test runs the real demo with a loss spike (the spike rule rolls back) and reads its
console; the others feed the console the events the rules and the rollback write, in the order
and the flushes a lagging pipeline delivers them.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import batchtap.store
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus
from batchtap.sinks._story import HOLD_WRITES, MESSAGES_PER_LINE
from batchtap.sinks.console import Console
from tests.cli.conftest import cli_env

RUN = "abcdef0123456789"


def test_the_demo_s_rollback_is_one_line_and_every_event_is_counted(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "batchtap.cli.main", "demo", "--inject-spike-at", "50", "--epochs", "2"]
        + ["--out", str(tmp_path), "--print-every", "1000"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = (done.stdout + done.stderr).splitlines()
    told = [line for line in lines if line.startswith("batchtap ") and not line.startswith("batchtap demo")]
    stories = [line for line in told if line.startswith("batchtap rollback at step")]
    assert len(stories) == 1, told
    assert "divergence at step" in stories[0] and "restored the snapshot" in stories[0]
    undone = re.search(r"undone steps (\d+)\.\.(\d+)", stories[0])
    assert undone is not None
    after = told[told.index(stories[0]) + 1 :]
    assert not any(line.startswith(("batchtap anomaly", "batchtap action")) for line in after), after
    assert not any("ignored" in line or "skipped batches" in line for line in told), told
    assert all(len(line) < 300 for line in lines), max(lines, key=len)
    with batchtap.store.open(tmp_path / "batchtap.db") as st:
        (run,) = st.runs()
        anomalies = [e for e in st.events(run.id) if e.kind.value == "anomaly"]
    end = next(line for line in lines if line.startswith("batchtap: run 'demo' finished"))
    assert f"anomalies: {len(anomalies)};" in end and "rollbacks: 1" in end
    assert f"batchtap show {run.id[:8]}" in end  # where the details are


def _console(every: int = 100) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    console = Console(every=every, stream=out, live=False, guard_stdout=False)
    console.start_run(RunInfo(RUN, "story", {}, started_at=0.0))
    return console, out


def _anomaly(step: int, message: str, metric: str = "loss") -> Event:
    return Event(RUN, step, EventKind.ANOMALY, message, float(step), metric, float("nan"))


def _action(step: int, message: str) -> Event:
    return Event(RUN, step, EventKind.ACTION, message, float(step))


def _records(first: int, last: int) -> list[Record]:
    return [Record(RUN, s, 1, s - 45, 0, float(s), {"loss": 2.0}) for s in range(first, last + 1)]


def _told(out: io.StringIO) -> list[str]:
    return [line for line in out.getvalue().splitlines()[1:] if not line.startswith("epoch ")]


SPIKE = "spike(loss): loss 77354 > 4 x EMA 1.982 -> rollback"
ROLLBACK = (
    "rollback 1: divergence at step 51 (loss 77354 > 4 x EMA 1.982 at step 51); restored the snapshot of step 40"
    " at step 54, undone steps 41..54, lr x0.5, skipping the next 3 batches"
)


def test_a_rollback_its_anomalies_and_what_it_ignored_are_one_line_across_flushes() -> None:
    console, out = _console()
    console.write(_records(50, 51), [_anomaly(51, SPIKE)])  # the spike: held for its rollback's line
    assert _told(out) == []
    console.write(
        _records(52, 53),
        [
            _anomaly(52, "spike(loss): loss 2.04e+08 > 4 x EMA 1.982 -> rollback"),
            _anomaly(53, "grad_norm=inf", "grad_norm"),
        ],
    )
    console.write(_records(54, 55), [_action(54, ROLLBACK)])
    late = [_anomaly(54, "spike(loss): loss 3e+09 > 4 x EMA 1.982 -> rollback")]  # the abandoned trajectory's
    ignored = [
        _action(56, f"ignored spike(loss) at step {s}: a rollback abandoned that trajectory") for s in range(52, 55)
    ]
    console.write(
        _records(56, 60), [*late, *ignored, _action(58, "rollback 1: skipped batches (epoch:batch) 1:9, 1:10")]
    )
    console.end_run(RunInfo(RUN, "story", {}, started_at=0.0, status=RunStatus.FINISHED))
    told = _told(out)
    # the step is named once, at the start of the line
    assert (
        told[0] == f"batchtap rollback at step 54: {ROLLBACK.removeprefix('rollback 1: ').replace(' at step 54', '')}"
    )
    assert len(told) == 2 and told[1].startswith("batchtap: run 'story' finished")
    assert "anomalies: 4;" in told[1] and "rollbacks: 1" in told[1]  # every anomaly counted
    assert f"`batchtap show {RUN[:8]}` lists every event" in told[1]


def test_an_anomaly_that_arrives_after_its_action_is_counted_not_printed() -> None:
    console, out = _console()
    console.write(
        _records(38, 40), [_anomaly(40, "nonfinite(loss): loss is nan -> stop"), _action(40, "stop requested")]
    )
    console.write(_records(41, 41), [_anomaly(40, "grad_norm=nan is not a number", "grad_norm")])  # a late one
    console.write(_records(42, 42), [_anomaly(42, "loss=nan is not a number")])  # after the action: printed
    told = _told(out)
    assert told == [
        "batchtap anomaly at step 40: nonfinite(loss): loss is nan -> stop",
        "batchtap action at step 40: stop requested",
        "batchtap anomaly at step 42: loss=nan is not a number",
    ]
    console.end_run(RunInfo(RUN, "story", {}, started_at=0.0, status=RunStatus.STOPPED))
    assert "anomalies: 3" in _told(out)[-1]


def test_a_rollback_anomaly_whose_rollback_never_comes_is_printed_after_a_bounded_wait() -> None:
    console, out = _console()
    console.write(_records(10, 10), [_anomaly(10, SPIKE)])
    for i in range(HOLD_WRITES - 1):
        console.write(_records(11 + i, 11 + i))
        assert _told(out) == []
    console.write(_records(20, 20))
    assert _told(out) == [f"batchtap anomaly at step 10: {SPIKE}"]
    console, out = _console()
    console.write(_records(10, 10), [_anomaly(10, SPIKE)])
    console.end_run(RunInfo(RUN, "story", {}, started_at=0.0, status=RunStatus.FAILED))
    assert _told(out)[0] == f"batchtap anomaly at step 10: {SPIKE}"  # never lost at the end


def test_skipped_steps_are_one_line_per_every_steps() -> None:
    console, out = _console(every=5)
    skip = "the AMP GradScaler skipped the optimizer step (inf/NaN gradients)"
    events = [Event(RUN, s, EventKind.SKIP, f"step {s}: {skip}", float(s)) for s in (1, 2, 3, 7, 12)]
    console.write(_records(0, 9), events)
    assert _told(out) == [
        f"batchtap skip: 3 steps skipped in 0..4 ({skip})",
        f"batchtap skip: 1 step skipped in 5..9 ({skip})",
    ]  # 10..14 is not over yet
    console.end_run(RunInfo(RUN, "story", {}, started_at=0.0, status=RunStatus.FINISHED))
    assert _told(out)[2] == f"batchtap skip: 1 step skipped in 10..14 ({skip})"
    assert "skipped steps: 5" in _told(out)[-1]


def test_a_warning_is_said_once_and_a_long_step_is_cut_to_a_count() -> None:
    console, out = _console()
    note = "the loss looks accumulated over 4 micro-batches: each value is the sum as the gradients saw it"
    console.write(_records(0, 3), [Event(RUN, s, EventKind.WARNING, f"step {s}: {note}", 0.0) for s in (0, 3)])
    console.write(_records(4, 6), [Event(RUN, 6, EventKind.WARNING, note, 0.0)])
    poisoned = [_anomaly(5, f"m{i}=nan is not a number (expected a finite value)", f"m{i}") for i in range(30)]
    console.write(_records(7, 7), poisoned)
    told = _told(out)
    assert told[0] == f"batchtap warning at step 0: {note}" and sum(note in line for line in told) == 1
    assert told[1].startswith("batchtap anomaly at step 5: m0=nan") and told[1].endswith(
        f"; and {30 - MESSAGES_PER_LINE} more"
    )
    assert len(told[1]) < 300
