"""The dependency direction of DESIGN.md, checked on the imports themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "batchtap"
PACKAGES = frozenset(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())
TOP_MODULES = frozenset(p.stem for p in SRC.glob("*.py") if p.name != "__init__.py")

# package -> batchtap packages (and top-level modules) it must not import. Every package has an
# entry (test_every_package_has_an_entry), so a new one has to say where it stands.
FORBIDDEN = {
    # device side: knows metrics, nothing downstream of the ring
    "capture": {"pipeline", "rules", "recovery", "sinks", "store", "cli", "integrations", "demo", "tap"},
    # pure tensor functions and declarations: imports no other package
    "metrics": {"capture", "pipeline", "rules", "recovery", "sinks", "store", "cli", "integrations", "demo", "tap"},
    # host side beside training: reads blocks, decodes, reduces, judges, dispatches to sinks
    "pipeline": {"recovery", "cli", "integrations", "demo", "tap"},
    # host-only: sees records, never tensors (no torch), never the training state
    "rules": {"capture", "metrics", "pipeline", "recovery", "sinks", "store", "cli", "integrations", "demo", "tap"},
    # training-side tools the rules' decisions drive: may read rules and metrics, not the host side
    "recovery": {"capture", "pipeline", "sinks", "store", "cli", "integrations", "demo", "tap"},
    # host floats in, files/servers out
    "sinks": {"capture", "metrics", "pipeline", "rules", "recovery", "cli", "integrations", "demo", "tap"},
    # the schema and the readers: shared by the SQL sinks and the command line
    "store": {"capture", "metrics", "pipeline", "rules", "recovery", "sinks", "cli", "integrations", "demo", "tap"},
    # the command line reads stores, exports, audits (hooks Tap.step) and runs the demo
    "cli": {"capture", "metrics", "pipeline", "rules", "recovery", "integrations"},
    # frameworks drive a Tap through its public API
    "integrations": {"capture", "pipeline", "cli", "demo"},
    # written the way a user's script is: `import batchtap as bt`, never the Tap's internals
    "demo": {"capture", "pipeline", "tap", "cli", "integrations"},
}

# Public names kept where users import them from, loaded lazily (PEP 562) so that the import does
# not run at import time: `bt.rules.Rollback` and friends predate batchtap.recovery.
# test_the_rules_load_neither_recovery_nor_torch checks that importing the rules stays light.
REEXPORTS = {"rules/__init__.py": {"recovery"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    """Whether ``batchtap.a.b`` names a module or package under src/ (not a name inside one)."""
    base = SRC.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imported(path: Path) -> set[str]:
    """Every batchtap module or name the file imports, dotted: ``from batchtap.store import url``
    gives ``batchtap.store.url``; relative imports are resolved; ``importlib.import_module("...")``
    with a literal name counts too (a lazy import is still a dependency)."""
    own = _module_name(path).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return {name for name in found if name.startswith("batchtap.")}


def _imports(path: Path) -> set[str]:
    """The batchtap packages and top-level modules the file imports (``tap``, ``sinks``, ...)."""
    return {name.split(".")[1] for name in _imported(path)}


def test_every_package_has_an_entry() -> None:
    assert set(FORBIDDEN) == PACKAGES, (
        f"packages without an entry in FORBIDDEN: {sorted(PACKAGES - set(FORBIDDEN))}; "
        f"entries without a package: {sorted(set(FORBIDDEN) - PACKAGES)}. Say what the new package may not import."
    )
    for package, names in FORBIDDEN.items():
        assert package not in names and names <= PACKAGES | TOP_MODULES, (
            package,
            sorted(names - PACKAGES - TOP_MODULES),
        )


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package: str) -> None:
    bad = []
    for path in sorted((SRC / package).rglob("*.py")):
        where = str(path.relative_to(SRC))
        found = _imports(path) & FORBIDDEN[package] - REEXPORTS.get(where, set())
        bad += [f"{where} imports batchtap.{name}" for name in sorted(found)]
    assert not bad, "\n".join(bad)


def test_every_reexport_exemption_is_still_needed() -> None:
    for where, names in REEXPORTS.items():
        assert names <= _imports(SRC / where), f"{where} no longer imports {sorted(names)}: drop the exemption"


def _owner(target: str) -> str:
    """The package a private module or name belongs to: ``batchtap.store._x`` -> ``batchtap.store``;
    a private name in a module belongs to that module's package (``batchtap.capture.ring._f`` ->
    ``batchtap.capture``); nothing private -> ``""``."""
    parts = target.split(".")
    for i in range(1, len(parts)):
        if parts[i].startswith("_") and not parts[i].startswith("__"):
            prefix = ".".join(parts[:i])
            if _is_module(".".join(parts[: i + 1])) or (SRC.parent / Path(*parts[:i]) / "__init__.py").is_file():
                return prefix  # a private module, or a name defined in a package's __init__
            return prefix.rpartition(".")[0]  # a private name of a module: its package's
    return ""


def test_no_package_imports_another_packages_private_module() -> None:
    """``batchtap.<pkg>._mod`` (and ``_name``s of ``<pkg>``'s modules) are imported only from inside
    ``<pkg>``; batchtap's own top-level helpers (``batchtap._env`` ...) from anywhere in batchtap.
    What other packages need is a public module (``store/url.py``, ``pipeline/ranks.py``)."""
    bad = []
    for path in SRC.rglob("*.py"):
        importer = _module_name(path)
        for target in sorted(_imported(path)):
            owner = _owner(target)
            if owner and not (importer == owner or importer.startswith(owner + ".")):
                bad.append(f"{path.relative_to(SRC)} imports {target} (private to {owner})")
    assert not bad, "\n".join(bad)


def test_the_rules_load_neither_recovery_nor_torch() -> None:
    """The rules are host-only; their lazily re-exported recovery names load on first use."""
    import subprocess
    import sys

    code = (
        "import sys, batchtap.rules\n"
        "assert 'batchtap.recovery' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "import batchtap.recovery\n"
        "assert batchtap.rules.Rollback is batchtap.recovery.Rollback\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


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
