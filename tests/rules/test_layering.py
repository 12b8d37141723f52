"""rules/ sees host records only: it imports nothing from the device side, the pipeline, sinks or the Tap."""

from __future__ import annotations

import ast
from pathlib import Path

import batchtap.rules

FORBIDDEN = (
    "batchtap.capture",
    "batchtap.pipeline",
    "batchtap.sinks",
    "batchtap.tap",
    "batchtap.store",
    "batchtap.cli",
)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_rules_do_not_import_upstream_or_sibling_layers():
    root = Path(batchtap.rules.__file__).parent
    bad = {
        f"{path.name}: {name}"
        for path in root.rglob("*.py")
        for name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    }
    assert not bad


def test_public_names_are_exported():
    for name in batchtap.rules.__all__:
        assert hasattr(batchtap.rules, name), name
    assert len(set(batchtap.rules.__all__)) == len(batchtap.rules.__all__)
