"""Notes (``info`` events): a choice or assumption batchtap made is stored with kind ``info`` and
printed once by the console, never as a warning; a degradation stays a ``warning``. Real SQLite
store, the real console sink, ``batchtap show`` read back."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchtap as bt
import batchtap.store
from batchtap.autolog import autolog  # not bt.autolog: that would shadow the submodule others import
from batchtap.cli.main import main as cli_main

ACCUMULATION = "gradient-accumulation micro-batches"


def _accumulating_loop(db: Path, console: io.StringIO) -> None:
    """Three micro-batches per step, each loss divided by the count: autolog's accumulation note."""
    torch.manual_seed(0)
    tap = autolog(
        name="accum-note", sinks=[bt.sinks.SQLite(db), bt.sinks.Console(stream=console, live=False)], flush_every=2
    )
    assert tap is not None
    try:
        model = nn.Linear(6, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(6):
            for _ in range(3):
                x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
                (F.cross_entropy(model(x), y) / 3).backward()
            opt.step()
            opt.zero_grad()
    finally:
        autolog(enabled=False)


def test_the_accumulation_note_is_info_printed_once_never_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    console = io.StringIO()
    with caplog.at_level(logging.DEBUG, logger="batchtap"):
        _accumulating_loop(db, console)
    printed = console.getvalue()
    assert printed.count(ACCUMULATION) == 1, printed  # once on the console
    assert "batchtap info at step" in printed and "batchtap warning" not in printed, printed
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING and ACCUMULATION in r.getMessage()]
    assert not loud, loud  # not logged as a warning (the log would print it a second time)

    with batchtap.store.open(db) as store:
        (run,) = store.runs()
        events = store.events(run.id)
    notes = [e for e in events if e.kind is bt.EventKind.INFO]
    assert len(notes) == 1 and ACCUMULATION in notes[0].message, events
    assert not [e for e in events if e.kind is bt.EventKind.WARNING], events

    capsys.readouterr()
    assert cli_main(["show", run.id[:8], "--db", str(db)]) == 0
    shown = capsys.readouterr().out
    assert "0 warnings, 1 notes" in shown, shown
    assert "info" in shown and "gradient-accumulation" in shown, shown


def test_a_degradation_stays_a_warning_and_a_note_is_info(tmp_path: Path) -> None:
    """``Tap.warn`` (what autolog and the integrations call): a warning by default, ``info=True`` a note."""
    db = tmp_path / "runs.db"
    with bt.Tap(None, [bt.sinks.SQLite(db)]) as tap, tap.run(name="kinds"):
        tap.warn("could not record the loss")
        tap.warn("took the classes to be last", info=True)
        tap.step(loss=torch.tensor(1.0))
    with batchtap.store.open(db) as store:
        (run,) = store.runs()
        kinds = {e.message: e.kind for e in store.events(run.id)}
    assert kinds == {
        "could not record the loss": bt.EventKind.WARNING,
        "took the classes to be last": bt.EventKind.INFO,
    }
