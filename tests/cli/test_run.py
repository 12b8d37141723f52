"""``batchtap run``: unmodified scripts recorded with autolog, every stored value equal to what the
script itself prints, the run's status and the script's exit status kept.

The five example scripts (examples/autolog/) run as their own processes (``python -m batchtap
run``; the DDP one under ``torchrun`` with two gloo ranks); the real-loop suite's char LM runs
in this process through the command's ``main``.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchtap.cli.main import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "autolog"
PRINTED = 5e-7  # the scripts print 6 decimals


def batchtap_run(db: Path, script: Path, *args: str, torchrun: int = 0) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "batchtap", "run", "--db", str(db), str(script), *args]
    if torchrun:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
            "-m", "batchtap", "run", "--db", str(db), str(script), *args,
        ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=db.parent)


def stored(db: Path) -> tuple[dict[str, object], dict[str, dict[int, float]]]:
    """The one run in ``db`` and its values per metric and step (the reduced rows in a process group)."""
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        runs = [dict(r) for r in conn.execute("SELECT * FROM runs")]
        assert len(runs) == 1, runs
        rank = conn.execute("SELECT MIN(rank) FROM metrics").fetchone()[0]
        values: dict[str, dict[int, float]] = {}
        for metric, step, value in conn.execute("SELECT metric, step, value FROM metrics WHERE rank = ?", (rank,)):
            values.setdefault(metric, {})[step] = value
        runs[0]["events"] = [dict(e) for e in conn.execute("SELECT kind, message FROM events")]
    return runs[0], values


def parsed(stdout: str, pattern: str) -> list[dict[str, float]]:
    rows = [{k: float(v) for k, v in m.groupdict().items()} for m in re.finditer(pattern, stdout)]
    assert rows, stdout
    return rows


def check(values: dict[str, dict[int, float]], printed: list[dict[str, float]], names: dict[str, str]) -> None:
    """Step i of the store against the i-th printed line; ``names``: stored name -> printed name."""
    assert sorted(values["loss"]) == list(range(len(printed)))
    for step, line in enumerate(printed):
        for stored_name, printed_name in names.items():
            scale = 100.0 if printed_name == "acc1" else 1.0
            assert values[stored_name][step] == pytest.approx(line[printed_name] / scale, abs=PRINTED, rel=1e-6), (
                step,
                stored_name,
            )


def test_mnist_example_steplr_per_epoch(tmp_path: Path) -> None:
    done = batchtap_run(tmp_path / "b.db", EXAMPLES / "mnist.py", "--epochs", "2", "--log-interval", "1")
    assert done.returncode == 0, done.stderr
    run, values = stored(tmp_path / "b.db")
    assert run["status"] == "finished"
    lines = parsed(done.stdout, r"Train Epoch: (?P<epoch>\d+) .*?Loss: (?P<loss>[\d.]+)\tAcc: (?P<acc>[\d.]+)")
    check(values, lines, {"loss": "loss", "accuracy": "acc"})
    for step, line in enumerate(lines):  # StepLR stepped per epoch, after the epoch's steps
        assert values["lr"][step] == pytest.approx(0.7 ** (line["epoch"] - 1), rel=1e-12)
    assert all(v >= 0 for v in values["data_time"].values())
    assert {r: None for r in (0, 1)}  # two epochs
    config = json.loads(run["config"])
    assert config["argv"][1:] == ["--epochs", "2", "--log-interval", "1"]


def test_char_gpt_example_accumulation_and_hand_set_lr(tmp_path: Path) -> None:
    done = batchtap_run(tmp_path / "b.db", EXAMPLES / "char_gpt.py", "--max_iters", "8")
    assert done.returncode == 0, done.stderr
    _, values = stored(tmp_path / "b.db")
    lines = parsed(done.stdout, r"iter \d+: loss (?P<loss>[\d.]+), lr (?P<lr>[\d.e+-]+), norm (?P<norm>[\d.]+)")
    check(values, lines, {"loss": "loss", "lr": "lr", "grad_norm": "norm"})
    assert all(0 <= v <= 1 for v in values["accuracy"].values())  # ignore_index=-1 taken from the loss call


def test_classifier_example_onecycle_per_step(tmp_path: Path) -> None:
    done = batchtap_run(tmp_path / "b.db", EXAMPLES / "classifier.py", "--epochs", "1", "--print-freq", "1")
    assert done.returncode == 0, done.stderr
    _, values = stored(tmp_path / "b.db")
    lines = parsed(done.stdout, r"lr: (?P<lr>[\d.]+) loss: (?P<loss>[\d.]+) acc1: (?P<acc1>[\d.]+)")
    check(values, lines, {"loss": "loss", "accuracy": "acc1"})
    for step, line in enumerate(lines):  # the lr the step used, though OneCycleLR moved before the row closed
        assert values["lr"][step] == pytest.approx(line["lr"], abs=5e-9)


def test_accelerate_example(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    done = batchtap_run(tmp_path / "b.db", EXAMPLES / "accelerate_train.py", "--epochs", "1")
    assert done.returncode == 0, done.stderr
    _, values = stored(tmp_path / "b.db")
    lines = parsed(done.stdout, r"step \d+: loss (?P<loss>[\d.]+) lr (?P<lr>[\d.]+)")
    assert len(lines) == 12  # 24 batches, accumulation 2: one record per optimizer step
    check(values, lines, {"loss": "loss"})
    for step, line in enumerate(lines):
        assert values["lr"][step] == pytest.approx(line["lr"], abs=5e-9)


def test_ddp_example_under_torchrun_two_gloo_ranks(tmp_path: Path) -> None:
    done = batchtap_run(tmp_path / "b.db", EXAMPLES / "ddp_train.py", "--epochs", "2", torchrun=2)
    assert done.returncode == 0, done.stderr[-3000:]
    run, values = stored(tmp_path / "b.db")
    assert run["world_size"] == 2 and run["status"] == "finished"
    lines = parsed(
        done.stdout,
        r"loss (?P<loss>[\d.]+) acc (?P<acc>[\d.]+) lr (?P<lr>[\d.]+) norm (?P<norm>[\d.]+)",
    )
    check(values, lines, {"loss": "loss", "accuracy": "acc", "lr": "lr", "grad_norm": "norm"})


@pytest.mark.parametrize(
    ("ending", "code", "status", "reason"),
    [
        ("raise RuntimeError('boom')", 1, "failed", "RuntimeError: boom"),
        ("sys.exit(3)", 3, "failed", "the script exited with status 3"),
        ("sys.exit(0)", 0, "finished", None),
    ],
    ids=["raises", "exit-3", "exit-0"],
)
def test_script_status_and_exit_code_kept(tmp_path: Path, ending: str, code: int, status: str, reason: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, torch, torch.nn.functional as F
            model = torch.nn.Linear(4, 3); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(7):
                loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
                opt.zero_grad(); loss.backward(); opt.step()
                print("loss", repr(loss.item()))
            {ending}
            """
        )
    )
    done = batchtap_run(tmp_path / "b.db", script, "--flag", "x")
    assert done.returncode == code, done.stderr
    run, values = stored(tmp_path / "b.db")
    assert run["status"] == status and run["stop_reason"] == reason
    printed = [float(v) for v in re.findall(r"loss (\S+)", done.stdout)]
    assert [values["loss"][s] for s in range(7)] == printed  # every captured step stored, exactly
    assert json.loads(run["config"])["argv"] == [str(script), "--flag", "x"]


def test_missing_script_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "--db", str(tmp_path / "b.db"), str(tmp_path / "nope.py")]) == 1
    assert "no script" in capsys.readouterr().err


def test_realloop_char_lm_in_process(tmp_path: Path) -> None:
    """The real-loop suite's char LM (unmodified) through the command's main(), in this process."""
    out = tmp_path / "expected.json"
    script = tmp_path / "char_lm.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, sys
            sys.path.insert(0, {str(ROOT)!r})
            from tests.autolog._helpers import Reads
            from tests.autolog.test_realloops import char_lm_loop
            json.dump(char_lm_loop(Reads()), open(sys.argv[1], "w"))
            """
        )
    )
    assert cli_main(["run", "--db", str(tmp_path / "b.db"), "--flush-every", "3", str(script), str(out)]) == 0
    run, values = stored(tmp_path / "b.db")
    assert run["status"] == "finished"
    expected = json.loads(out.read_text())
    for step, ref in enumerate(expected):
        assert values["loss"][step] == pytest.approx(ref["loss"], rel=1e-5)
        assert values["accuracy"][step] == pytest.approx(ref["accuracy"], rel=1e-12)
        assert values["lr"][step] == ref["lr"]
        assert values["grad_norm"][step] == pytest.approx(ref["grad_norm"], rel=1e-7)
    import batchtap.autolog as autolog_package

    assert autolog_package.active_session() is None  # ended, every patch undone


SWEEP_SCRIPT = """
import argparse, torch, torch.nn.functional as F
p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--api-key", default="")
sub = argparse.ArgumentParser(add_help=False)
sub.add_argument("--inner", default="not-the-command-line")
sub.parse_args(["--inner", "x"])  # an explicit list: not the script's command line
args = p.parse_args()
model = torch.nn.Linear(4, 3); opt = torch.optim.SGD(model.parameters(), lr=args.lr)
for epoch in range(args.epochs):
    for i in range(3):
        loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
        opt.zero_grad(); loss.backward(); opt.step()
print("lr", args.lr, "epochs", args.epochs)
"""


def test_the_scripts_parsed_arguments_are_its_config(tmp_path: Path) -> None:
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_SCRIPT)
    db = tmp_path / "b.db"
    command = [sys.executable, "-m", "batchtap", "run", "--db", str(db), "--tag", "sweep", "--tag", "lr"]
    command += ["--notes", "first try", str(script), "--lr", "0.01", "--epochs", "2", "--api-key", "s3cret"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "lr 0.01 epochs 2" in done.stdout  # the script saw its own arguments, unchanged
    run, values = stored(db)
    config = json.loads(run["config"])
    assert config["lr"] == 0.01 and config["epochs"] == 2 and "inner" not in config
    assert config["api_key"] == "***"  # a parsed secret is masked like any config secret
    assert len(values["loss"]) == 6
    import batchtap.store

    with batchtap.store.open(db) as st:
        (row,) = st.runs()
        assert row.tags == ("sweep", "lr") and row.notes == "first try"
