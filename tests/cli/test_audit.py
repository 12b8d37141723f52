"""`batchtap audit SCRIPT`: host reads by source line, per Tap.step, on the CPU."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from tests.cli.conftest import cli

LOOP = """\
import sys
import torch
import batchtap as bt

torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
tap = bt.Tap(sinks=[], flush_every=4)
steps = int(sys.argv[1])
total = torch.zeros(())
with tap, tap.run(name="audit"):
    for i in range(steps):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        tap.step(loss, outputs=out, targets=y)
{body}
print("trained", steps)
"""

DIRTY = """\
        total += loss.item()  # PLANTED-ITEM
        if loss > 0:  # PLANTED-IF
            total += 1
"""
CLEAN = """\
        total += loss.detach()
"""


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(LOOP.format(body=body))
    return path


def _line_of(path: Path, marker: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


def test_audit_reports_the_planted_item_and_if_with_their_lines(tmp_path: Path) -> None:
    script = _script(tmp_path, DIRTY)
    done = cli("audit", str(script), "10", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "trained 10" in done.stdout  # the script ran, with its argv
    assert "ran 10 steps (Tap.step calls): 20 host reads, 2.00 per step" in done.stdout
    for marker in ("PLANTED-ITEM", "PLANTED-IF"):
        n = _line_of(script, marker)
        row = next(line for line in done.stdout.splitlines() if line.startswith(f"train.py:{n} "))
        assert row.split()[1:4] == ["10", "1.00", "item/float/bool"], row
        assert marker in row  # the source text
    assert "2 source lines read tensor values" in done.stdout


def test_audit_of_a_clean_script_reports_zero(tmp_path: Path) -> None:
    script = _script(tmp_path, CLEAN)
    done = cli("audit", "--check", str(script), "6", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ran 6 steps (Tap.step calls): 0 host reads" in done.stdout
    assert "no host reads" in done.stdout
    assert not re.search(r"^train\.py:\d+", done.stdout, re.M)


def test_audit_check_fails_on_reads_and_other_ops_are_named(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""\
        import torch
        x = torch.randn(5)
        values = x.tolist()  # TOLIST
        arr = x.numpy()  # NUMPY
        print(float(x.sum()))  # FLOAT
    """))
    done = cli("audit", "--check", str(script), cwd=tmp_path)
    assert done.returncode == 1
    assert "3 host reads (no Tap.step calls seen, so totals only)" in done.stdout
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("plain.py:")}
    assert "Tensor.tolist" in rows["plain.py:3"] and "Tensor.numpy" in rows["plain.py:4"]
    assert "item/float/bool" in rows["plain.py:5"] and " - " in rows["plain.py:5"]  # no per-step figure


def test_a_failing_script_still_gets_its_report_and_exit_1(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("import torch\nv = torch.ones(2).sum().item()\nraise RuntimeError('boom')\n")
    done = cli("audit", str(script), cwd=tmp_path)
    assert done.returncode == 1
    assert "RuntimeError: boom" in done.stderr
    assert "boom.py:2" in done.stdout


def test_audit_of_a_missing_script_exits_1(tmp_path: Path) -> None:
    done = cli("audit", "nope.py", cwd=tmp_path)
    assert done.returncode == 1 and "no script 'nope.py'" in done.stderr
