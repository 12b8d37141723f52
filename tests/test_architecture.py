"""The dependency direction of DESIGN.md, checked on the imports themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "batchtap"

# package -> batchtap packages it must not import
FORBIDDEN = {
    "capture": {"pipeline", "rules", "sinks", "store", "cli", "integrations", "tap"},
    "metrics": {"pipeline", "rules", "sinks", "store", "cli", "integrations", "tap", "capture"},
    "sinks": {"capture", "tap", "rules", "cli"},
    "store": {"capture", "tap", "rules", "cli", "metrics"},
    "rules": {"capture", "sinks", "store", "cli"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("batchtap."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("batchtap."))
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package: str) -> None:
    for path in (SRC / package).rglob("*.py"):
        bad = _imports(path) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(SRC)} imports batchtap.{sorted(bad)}"


def test_sinks_never_touch_torch() -> None:
    for path in (SRC / "sinks").glob("*.py"):
        if path.name == "tensorboard.py":
            continue  # its FileWriter lives in torch.utils; it only gets host floats
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("torch") for a in node.names), path.name
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("torch"), path.name


def test_every_sync_point_is_labelled() -> None:
    """Every call that can make the host wait (for the device or the pipeline) carries a `# sync:`
    comment on it or on one of the four lines above."""
    waiting_calls = {"item", "synchronize", "tolist", "cpu", "wait_for", "drain", "flush"}
    # worker queues, the counter itself, and the decoder (numpy copies on the pipeline thread)
    exempt = {"dispatch.py", "hostreads.py", "harvest.py", "decode.py"}
    for path in SRC.rglob("*.py"):
        if path.name in exempt or "sinks" in path.parts or "store" in path.parts:
            continue  # sinks and the store flush files and connections, never the device
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            if name not in waiting_calls:
                continue
            if name == "flush" and "tap" not in ast.unparse(node.func.value):
                continue  # file/stream flushes
            window = "\n".join(lines[max(0, node.lineno - 5) : node.lineno])
            assert "# sync:" in window, f"{path.relative_to(SRC)}:{node.lineno}: {lines[node.lineno - 1].strip()}"


def test_the_command_line_starts_without_importing_torch() -> None:
    """`batchtap runs/show/tail/...` only read a store; torch (seconds to import) loads only for
    the subcommands that train or trace (demo, audit), and for `bt.Tap` and friends on first use."""
    import subprocess
    import sys

    code = (
        "import sys, batchtap, batchtap.cli.main\n"
        "assert 'torch' not in sys.modules, 'importing the CLI imported torch'\n"
        "import batchtap as bt\n"
        "assert bt.Tap.__name__ == 'Tap' and bt.metrics.Loss and bt.sinks.SQLite and bt.NonFinite\n"
        "assert 'torch' in sys.modules and 'Tap' in dir(bt)\n"
        "try:\n"
        "    bt.NoSuchThing\n"
        "except AttributeError as e:\n"
        "    assert 'NoSuchThing' in str(e)\n"
        "else:\n"
        "    raise AssertionError('bt.NoSuchThing did not raise')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
