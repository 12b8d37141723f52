"""`batchtap audit SCRIPT`: host reads of device tensors by source line, per Tap.step, on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
    assert "ran 10 steps (Tap.step calls): 20 host reads of device tensors, 2.00 per step" in done.stdout
    for marker in ("PLANTED-ITEM", "PLANTED-IF"):
        n = _line_of(script, marker)
        row = next(line for line in done.stdout.splitlines() if line.startswith(f"train.py:{n} "))
        assert row.split()[1:4] == ["10", "1.00", "item/float/bool"], row
        assert marker in row  # the source text
    assert "2 source lines read device tensors" in done.stdout


def test_audit_of_a_clean_script_reports_zero(tmp_path: Path) -> None:
    script = _script(tmp_path, CLEAN)
    done = cli("audit", "--check", str(script), "6", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ran 6 steps (Tap.step calls): 0 host reads of device tensors" in done.stdout
    assert "nothing in this script makes the CPU wait" in done.stdout
    # the Tap's host-buffer views, made inside batchtap: counted apart, and not device reads
    assert re.search(r"\(\d+ reads inside batchtap itself not listed: none of a device tensor\)", done.stdout)
    assert not re.search(r"^train\.py:\d+", done.stdout, re.M)


PLAIN = """\
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
layer = torch.nn.Linear(5, 5)
x = torch.randn(5)
host = x.tolist()  # HOST-TOLIST
n = int(x.sum() > 0)  # HOST-INT
y = layer(x)
values = y.tolist()  # TOLIST
arr = y.detach().cpu().numpy()  # CPU
print(float(y.sum().detach()))  # FLOAT
xs = x.to(device)
pos = xs[xs > 0]  # MASK
again = x.tolist()  # HOST-AGAIN
"""


def _rows(stdout: str, name: str) -> dict[str, str]:
    return {line.split()[0]: line for line in stdout.splitlines() if line.startswith(f"{name}:")}


def test_only_reads_of_device_tensors_are_listed_each_with_its_op(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    done = cli("audit", "--check", str(script), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "4 host reads of device tensors (no Tap.step calls seen, so totals only)" in done.stdout
    rows = _rows(done.stdout, "plain.py")
    at = {
        m: f"plain.py:{_line_of(script, f'# {m}')}"
        for m in ("TOLIST", "CPU", "FLOAT", "MASK", "HOST-TOLIST", "HOST-INT", "HOST-AGAIN")
    }
    assert "Tensor.tolist" in rows[at["TOLIST"]] and "to(cpu)" in rows[at["CPU"]]
    assert "item/float/bool" in rows[at["FLOAT"]] and " - " in rows[at["FLOAT"]]  # no per-step figure
    assert "boolean-mask index" in rows[at["MASK"]]
    for host in ("HOST-TOLIST", "HOST-INT", "HOST-AGAIN"):  # x itself stays on the host after x.to(device)
        assert at[host] not in rows
    # the .numpy() of the host copy made by .cpu() is not a second sync
    assert "(4 more reads of tensors that stay on the host" in done.stdout

    listed = cli("audit", "--all", str(script), cwd=tmp_path)
    assert listed.returncode == 0
    head, _, host_table = listed.stdout.partition("host-only tensors (4 reads")
    assert host_table, listed.stdout
    host_rows = _rows(host_table, "plain.py")
    assert {at["HOST-TOLIST"], at["HOST-INT"], at["HOST-AGAIN"], at["CPU"]} == set(host_rows)
    assert "Tensor.numpy" in host_rows[at["CPU"]]


def test_a_script_that_crashes_at_import_reports_the_crash_first_and_exits_1(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("import torch\nimport no_such_module_xyz\n")
    done = cli("audit", "--check", str(script), cwd=tmp_path)
    assert done.returncode == 1
    assert "ModuleNotFoundError" in done.stderr  # the traceback
    report = done.stdout.strip().splitlines()
    assert (
        report[0]
        == "batchtap audit: "
        + str(script)
        + " CRASHED: ModuleNotFoundError: No module named 'no_such_module_xyz' at boom.py:2 (traceback above)"
    )
    assert "nothing in this script makes the CPU wait" not in done.stdout
    assert "no host reads of device tensors before it stopped" in done.stdout


def test_a_failing_script_still_gets_its_reads_after_the_crash_line(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text(
        "import torch\nw = torch.nn.Linear(2, 1)\nv = w(torch.ones(2)).sum().item()\n"
        "def fail():\n    raise RuntimeError('boom')\nfail()\n"
    )
    done = cli("audit", str(script), cwd=tmp_path)
    assert done.returncode == 1
    assert "RuntimeError: boom" in done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].endswith("CRASHED: RuntimeError: boom at boom.py:5 (traceback above)"), lines[0]
    assert lines[1] == "the counts below cover only what ran before the crash"
    assert "boom.py:3 " in done.stdout


def test_a_script_exiting_nonzero_says_so_and_exits_1(tmp_path: Path) -> None:
    script = tmp_path / "quit.py"
    script.write_text("import sys\nsys.exit(3)\n")
    done = cli("audit", str(script), cwd=tmp_path)
    assert done.returncode == 1
    assert (
        done.stdout.strip().splitlines()[0]
        == f"batchtap audit: {script} exited with status 3; the counts below cover what ran"
    )


LIBRARY = """\
def mean_value(t):
    return t.mean().item()  # LIB-READ
"""
USER = """\
import sys
import torch
sys.path.insert(0, sys.argv[1])
import helperlib
layer = torch.nn.Linear(3, 3)
for _ in range(4):
    print(helperlib.mean_value(layer(torch.randn(2, 3))))  # CALL
"""


def test_reads_inside_code_outside_the_script_folder_go_to_the_calling_line_unless_it_is_a_source(
    tmp_path: Path,
) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helperlib.py").write_text(LIBRARY)
    app = tmp_path / "app"
    app.mkdir()
    script = app / "train.py"
    script.write_text(USER)
    call = f"train.py:{_line_of(script, 'CALL')}"

    done = cli("audit", str(script), str(lib), cwd=app)
    assert done.returncode == 0, done.stderr
    rows = _rows(done.stdout, "train.py")
    assert rows[call].split()[1] == "4", rows
    following = done.stdout.split(rows[call], 1)[1].splitlines()[1]
    assert "via " in following and "helperlib.py:2 (mean_value): 4" in following

    mine = cli("audit", "--source", str(lib), str(script), str(lib), cwd=app)
    assert mine.returncode == 0, mine.stderr
    assert call not in _rows(mine.stdout, "train.py")
    row = next(line for line in mine.stdout.splitlines() if "helperlib.py:2 " in line)
    assert row.split()[1] == "4" and "LIB-READ" in row

    bad = cli("audit", "--source", str(tmp_path / "nope"), str(script), cwd=app)
    assert bad.returncode == 1 and "is not a folder" in bad.stderr


def test_audit_of_a_missing_script_exits_1(tmp_path: Path) -> None:
    done = cli("audit", "nope.py", cwd=tmp_path)
    assert done.returncode == 1 and "no script 'nope.py'" in done.stderr


LOOPS = Path(__file__).parent / "audit_loops"


@pytest.mark.parametrize(
    "name, min_host_only",
    [
        pytest.param("nanogpt_planted.py", 500, id="nanogpt-memmap-adamw"),
        pytest.param("hf_planted.py", 100, id="hf-no-trainer-gpt2"),
        pytest.param("lightning_planted.py", 50, id="lightning-trainer"),
    ],
)
def test_planted_loops_every_real_sync_found_by_line_and_most_reads_real(
    tmp_path: Path, name: str, min_host_only: int
) -> None:
    """Each ``# SYNC`` line of the loop syncs on a GPU: all must be listed, and >= 90 % of the
    reads listed must be on them; the host-only reads (memmap indexing, AdamW step counters,
    DataLoader seeds) are counted apart."""
    script = LOOPS / name
    real = {i for i, line in enumerate(script.read_text().splitlines(), 1) if "# SYNC" in line}
    done = cli("audit", "--top", "500", str(script), str(tmp_path), cwd=LOOPS, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    listed = {}
    for line in done.stdout.splitlines():
        m = re.match(r"^(\S+):(\d+)\s+(\d+)\s", line)
        if m:
            assert m.group(1) == name, line  # every read attributed to the user's own file
            listed[int(m.group(2))] = listed.get(int(m.group(2)), 0) + int(m.group(3))
    assert real <= set(listed), f"missed real syncs on lines {sorted(real - set(listed))}"
    total = sum(listed.values())
    on_real = sum(n for lineno, n in listed.items() if lineno in real)
    assert on_real / total >= 0.9, f"{on_real}/{total} reported reads on real sync lines: {listed}"
    host_only = re.search(r"\((\d+) more reads of tensors that stay on the host", done.stdout)
    assert host_only and int(host_only.group(1)) >= min_host_only, done.stdout[-2000:]
