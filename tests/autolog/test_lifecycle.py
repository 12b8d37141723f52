"""autolog's life cycle: every patch undone by ``autolog(enabled=False)`` and at process exit, the
run's status from how the script ended, and an error of autolog's own never reaching the loop."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import batchtap as bt
from tests.autolog._helpers import autologged
from tests.conftest import ListSink
from tests.realloops._loops import events_of


def _patched_objects() -> dict[str, object]:
    import torch.nn.utils.clip_grad as clip_module
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    return {
        "backward": torch.autograd.backward,
        "cross_entropy": F.cross_entropy,
        "nll_loss": F.nll_loss,
        "clip": torch.nn.utils.clip_grad_norm_,
        "clip_module": clip_module.clip_grad_norm_,
        "scaler.step": torch.amp.GradScaler.step,
        "optimizer.__init__": torch.optim.Optimizer.__init__,
        "DataLoader.__iter__": DataLoader.__iter__,
        "destroy_process_group": torch.distributed.destroy_process_group,
        "pre hooks": len(_global_optimizer_pre_hooks),
        "post hooks": len(_global_optimizer_post_hooks),
    }


def test_enabled_false_undoes_every_patch(sink: ListSink) -> None:
    before = _patched_objects()
    with autologged(sink):
        during = _patched_objects()
        assert all(during[k] is not before[k] for k in before if not k.endswith("hooks"))
        # autolog listens through batchtap's one pair of optimizer step hooks: registered now,
        # unless a metric of an earlier Tap in this process still listens (then already there)
        assert max(before["pre hooks"], 1) <= during["pre hooks"] <= before["pre hooks"] + 1
    assert _patched_objects() == before
    assert bt.autolog(enabled=False) is None  # twice: nothing left to undo


def test_an_error_of_autologs_own_never_reaches_the_loop(sink: ListSink) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with autologged(sink) as tap:
        tap.step = None  # type: ignore[method-assign]  # autolog's next hand-over to the Tap fails
        for _ in range(3):
            loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()  # training goes on
    messages = [e.message for e in events_of(sink.events, bt.EventKind.WARNING)]
    assert sum("stopped recording" in m for m in messages) == 1, messages  # said once


def test_compiled_model_loss_function_inside_compile(sink: ListSink) -> None:
    """Inside torch.compile the loss wrappers run only while tracing: the loss still comes from the
    graph (the compiled module's output), accuracy is left out and said so, nothing crashes."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend="eager")
    def compute_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    losses = []
    with autologged(sink):
        for _ in range(4):
            loss = compute_loss(torch.randn(8, 4), torch.randint(0, 3, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    rows = [r for r in sink.records if not r.sparse]
    assert [r.values["loss"] for r in rows] == losses


SCRIPT = """
import sys, torch, torch.nn.functional as F
import batchtap as bt
bt.autolog(name="in-script")
model = torch.nn.Linear(4, 3); opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(5):
    loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
    opt.zero_grad(); loss.backward(); opt.step()
    print("loss", repr(loss.item()))
{ending}
"""


def _run_script(tmp_path: Path, ending: str) -> tuple[subprocess.CompletedProcess[str], tuple[str, str | None, int]]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(ending=ending)))
    db = tmp_path / "b.db"
    env = {**__import__("os").environ, "BATCHTAP_DB": str(db)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    with sqlite3.connect(db) as conn:
        status, reason = conn.execute("SELECT status, stop_reason FROM runs").fetchone()
        steps = conn.execute("SELECT COUNT(*) FROM metrics WHERE metric = 'loss'").fetchone()[0]
    return done, (status, reason, steps)


def test_script_with_autolog_line_finished_at_exit(tmp_path: Path) -> None:
    done, (status, reason, steps) = _run_script(tmp_path, "")
    assert done.returncode == 0, done.stderr
    assert (status, reason, steps) == ("finished", None, 5)


def test_script_with_autolog_line_that_raises_is_failed(tmp_path: Path) -> None:
    done, (status, reason, steps) = _run_script(tmp_path, "raise ValueError('diverged')")
    assert done.returncode == 1 and "ValueError: diverged" in done.stderr
    assert (status, reason, steps) == ("failed", "ValueError: diverged", 5)  # every captured step stored
