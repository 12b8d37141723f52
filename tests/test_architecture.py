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
            continue  # SummaryWriter lives in torch.utils; it only gets host floats
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("torch") for a in node.names), path.name
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("torch"), path.name


def test_every_sync_point_is_labelled() -> None:
    """Every blocking wait or host read in the library carries a `# sync:` comment nearby."""
    suspicious = (".item()", ".synchronize()", ".wait_for(", "done.wait()")
    for path in SRC.rglob("*.py"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            code = line.split("#")[0]
            if any(s in code for s in suspicious) and ">>>" not in line and "``" not in line:
                window = "\n".join(lines[max(0, i - 4) : i + 1])
                if path.name in ("dispatch.py", "hostreads.py"):
                    continue  # sink workers wait on their own queues; hostreads documents reads
                assert "# sync:" in window, f"{path.relative_to(SRC)}:{i + 1}: {line.strip()}"
