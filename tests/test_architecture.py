"""The dependency direction of DESIGN.md, checked on the imports themselves."""

from __future__ import annotations

import ast
import re
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
    # host-only: sees records, never tensors (no torch), never the training state (not even lazily)
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
    # one line at the top of a script: patches torch's public hooks and drives a Tap through its public API
    "autolog": {"capture", "pipeline", "recovery", "store", "cli", "integrations", "demo"},
    # written the way a user's script is: `import batchtap as bt`, never the Tap's internals
    "demo": {"capture", "pipeline", "tap", "cli", "integrations"},
    # the browser view: reads stores (read-only) and serves them; nothing of training, no torch
    "ui": {"capture", "metrics", "pipeline", "rules", "recovery", "sinks", "cli", "integrations", "demo", "tap"},
}

# Packages that sit above the Tap (they drive one, or read what it stored); present or not.
_ABOVE_TAP = {"cli", "integrations", "demo", "ui", "autolog"}

# Top-level modules: the foundation every package may use imports no package (``_env`` redacts
# with store.url, the lowest package); the assembly modules (the Tap, its open run, its defaults)
# import the packages the Tap assembles, never what sits above the Tap.
_FOUNDATION = {
    "errors",
    "records",
    "hostreads",
    "devicereads",
    "_config",
    "_env",
    "_exit",
    "_names",
    "_optional",
    "_owner",
    "_userframes",
    "_validate",
    "_units",
    "_stale",
    "_lazy",
    "_fetches",
} & TOP_MODULES
_ASSEMBLY = {"tap", "_run", "_defaults", "_resume", "_run_metrics"}
TOP_FORBIDDEN = {
    **{name: (PACKAGES - {"store"} if name == "_env" else set(PACKAGES)) | _ASSEMBLY for name in _FOUNDATION},
    "_defaults": (_ABOVE_TAP & PACKAGES) | {"tap", "_run"},
    "_run": (_ABOVE_TAP & PACKAGES) | {"tap"},
    "_run_metrics": (_ABOVE_TAP & PACKAGES) | {"tap"},  # the Tap's run_metrics seam: reads its open run
    "_resume": (_ABOVE_TAP & PACKAGES) | {"tap", "_run"},
    "tap": _ABOVE_TAP & PACKAGES,
    # `python -m batchtap`: the command line and nothing else
    **({"__main__": set(PACKAGES - {"cli"}) | _ASSEMBLY} if "__main__" in TOP_MODULES else {}),
}

#: private attributes of objects batchtap does not own, read on purpose: name -> why
FOREIGN_PRIVATE = {
    "_scale": "torch.amp.GradScaler's scale tensor: reading it queues no device op (get_scale() syncs)",
}


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
        found = _imports(path) & FORBIDDEN[package]
        bad += [f"{where} imports batchtap.{name}" for name in sorted(found)]
    assert not bad, "\n".join(bad)


# pipeline/ split by job: subpackage -> the pipeline subpackages it must not import. The chain runs the
# same under either transport and in one process or many, so it imports neither; rank agreement is
# driven by the training thread and never by how messages travel.
PIPELINE_PARTS = {
    "chain": {"transport", "ranks"},
    "ranks": {"transport"},
    "transport": {"ranks"},
}


def test_every_pipeline_part_has_an_entry() -> None:
    parts = {p.name for p in (SRC / "pipeline").iterdir() if (p / "__init__.py").is_file()}
    loose = sorted(p.name for p in (SRC / "pipeline").glob("*.py") if p.name != "__init__.py")
    assert parts == set(PIPELINE_PARTS), f"pipeline subpackages {sorted(parts)} vs entries {sorted(PIPELINE_PARTS)}"
    assert not loose, f"modules loose in pipeline/ (put each in the part that does its job): {loose}"


@pytest.mark.parametrize("part", sorted(PIPELINE_PARTS))
def test_pipeline_parts_point_one_way(part: str) -> None:
    bad = []
    for path in sorted((SRC / "pipeline" / part).rglob("*.py")):
        for name in sorted(_imported(path)):
            pieces = name.split(".")
            if pieces[1] == "pipeline" and len(pieces) > 2 and pieces[2] in PIPELINE_PARTS[part]:
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, "\n".join(bad)


def test_every_top_level_module_has_an_entry() -> None:
    assert set(TOP_FORBIDDEN) == TOP_MODULES, (
        f"top-level modules without an entry in TOP_FORBIDDEN: {sorted(TOP_MODULES - set(TOP_FORBIDDEN))}; "
        f"entries without a module: {sorted(set(TOP_FORBIDDEN) - TOP_MODULES)}. Say where the new module stands."
    )


@pytest.mark.parametrize("module", sorted(TOP_FORBIDDEN))
def test_top_level_modules_point_one_way(module: str) -> None:
    found = _imports(SRC / f"{module}.py") & TOP_FORBIDDEN[module]
    assert not found, f"{module}.py imports {sorted(found)}"


def _deepest_module(dotted: str) -> str | None:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if _is_module(".".join(parts[:i])):
            return ".".join(parts[:i])
    return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _module_graph() -> dict[str, set[str]]:
    """module -> the batchtap modules it imports: at the top, in functions (lazy) and under
    ``TYPE_CHECKING`` (type-only) alike."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        module = _module_name(path)
        graph[module] = {d for name in _imported(path) if (d := _deepest_module(name)) and d != module}
    return graph


def test_no_import_cycles_between_modules() -> None:
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles (lazy and type-only imports count; move what both need below both): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_import_cycles_between_packages() -> None:
    def unit(module: str) -> str:
        return module.split(".")[1] if module.count(".") else module

    graph: dict[str, set[str]] = {}
    for module, imported in _module_graph().items():
        graph.setdefault(unit(module), set()).update(unit(m) for m in imported if unit(m) != unit(module))
    cycles = _cycles(graph)
    assert not cycles, "packages that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def _unit(path: Path) -> str:
    """The package a file belongs to, or the top-level module it is."""
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else path.stem


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_attributes_defined(tree: ast.AST) -> set[str]:
    """Private names a file gives its own objects: methods and classes, ``self._x`` / ``cls._x``
    assignments, class and module attributes, ``__slots__`` entries."""
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            defined.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
            and _private(node.attr)
        ):
            defined.add(node.attr)
    bodies = [tree.body] + [c.body for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]  # type: ignore[attr-defined]
    for statement in (s for body in bodies for s in body):
        targets = (
            statement.targets
            if isinstance(statement, ast.Assign)
            else [statement.target]
            if isinstance(statement, ast.AnnAssign)
            else []
        )
        for target in targets:
            defined.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name) and _private(n.id))
            if isinstance(target, ast.Name) and target.id == "__slots__":
                defined.update(
                    c.value
                    for c in ast.walk(statement.value)  # type: ignore[arg-type]
                    if isinstance(c, ast.Constant) and isinstance(c.value, str) and _private(c.value)
                )
    return defined


def _foreign_roots(tree: ast.AST) -> set[str]:
    """Names the file binds by importing something outside batchtap (``torch``, ``np`` ...)."""
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update((a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("batchtap"))
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("batchtap"):
            roots.update(a.asname or a.name for a in node.names)
    return roots


def test_no_package_reads_another_packages_private_attributes() -> None:
    """``obj._name`` outside ``self``/``cls``/``super()`` names something private to the package that
    defines ``_name``: reading it from elsewhere (``tap._metrics`` from an integration) couples to
    internals the import rule cannot see. Private attributes of foreign objects (torch's) are listed
    in FOREIGN_PRIVATE with the reason."""
    trees = {path: ast.parse(path.read_text()) for path in SRC.rglob("*.py")}
    defined: dict[str, set[str]] = {}
    for path, tree in trees.items():
        defined.setdefault(_unit(path), set()).update(_private_attributes_defined(tree))
    bad = []
    for path, tree in trees.items():
        unit, foreign = _unit(path), _foreign_roots(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in FOREIGN_PRIVATE:
                continue
            if node.attr in ("_replace", "_asdict", "_fields", "_make"):  # the NamedTuple API
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "super":
                continue
            root = value
            while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in foreign:
                continue  # torch._C, sys._getframe ...
            if node.attr in defined.get(unit, ()):
                continue
            owners = sorted(u for u, names in defined.items() if node.attr in names)
            if owners:
                bad.append(
                    f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)} (private to {', '.join(owners)})"
                )
    assert not bad, "\n".join(bad)


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
    What other packages need is a public module (``store/url.py``, ``pipeline/ranks/group.py``)."""
    bad = []
    for path in SRC.rglob("*.py"):
        importer = _module_name(path)
        for target in sorted(_imported(path)):
            owner = _owner(target)
            if owner and not (importer == owner or importer.startswith(owner + ".")):
                bad.append(f"{path.relative_to(SRC)} imports {target} (private to {owner})")
    assert not bad, "\n".join(bad)


def test_the_rules_load_neither_recovery_nor_torch() -> None:
    """The rules are host-only; a name that moved to batchtap.recovery says where it went."""
    import subprocess
    import sys

    code = (
        "import sys, batchtap.rules\n"
        "assert 'batchtap.recovery' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "try:\n"
        "    batchtap.rules.Rollback\n"
        "except AttributeError as e:\n"
        "    assert 'batchtap.recovery' in str(e) and 'bt.Rollback' in str(e), e\n"
        "assert 'batchtap.recovery' not in sys.modules\n"
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
    # worker queues, the counter itself, and the decoder and its rows (numpy copies on the pipeline thread)
    exempt = {"dispatch.py", "hostreads.py", "decode.py", "rows.py"}
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


def test_the_pipeline_process_side_loads_no_torch() -> None:
    """What a pipeline process imports to decode, validate, judge and store a block (the chain,
    its own loop, the crossing, the segments, the decoders and the torch-free metric modules) loads
    no torch: what crosses is arrays and a column layout. Only a cross-rank reduction loads
    ``torch.distributed``, at its first exchange."""
    import subprocess
    import sys

    modules = sorted(
        _module_name(p)
        for p in [*(SRC / "pipeline" / "chain").glob("*.py"), *(SRC / "pipeline" / "transport").glob("*.py")]
        if p.stem not in ("link", "process", "thread", "make", "host")  # the training process's side
    ) + [
        "batchtap.metrics.decoding",
        "batchtap.metrics.decoders",
        "batchtap.metrics.sampling",
        "batchtap.metrics.timing",
        "batchtap.metrics",
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, f'importing {name} loaded torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


#: src files over the size limits today, with what splits them: the list may only shrink (a file
#: that fits again must leave it, a new one may not join)
OVER_SIZE: dict[str, str] = {}
OVER_METHODS: dict[str, str] = {}
_LINES = {"tap.py": 700}


def test_no_src_file_over_600_lines_and_no_class_over_25_methods() -> None:
    long, big = set(), set()
    for path in SRC.rglob("*.py"):
        where = str(path.relative_to(SRC))
        text = path.read_text()
        if len(text.splitlines()) > _LINES.get(where, 600):
            long.add(where)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > 25:
                    big.add(f"{where}:{node.name}")
    assert long == set(OVER_SIZE), (
        f"over 600 lines (tap.py 700), not listed: {sorted(long - set(OVER_SIZE))}; "
        f"listed but within the limit now (drop them from OVER_SIZE): {sorted(set(OVER_SIZE) - long)}"
    )
    assert big == set(OVER_METHODS), (
        f"classes over 25 methods, not listed: {sorted(big - set(OVER_METHODS))}; "
        f"listed but within the limit now (drop them from OVER_METHODS): {sorted(set(OVER_METHODS) - big)}"
    )


# ---------------------------------------------------------------------- docs/architecture.md's hop table

_DOC = SRC.parents[1] / "docs" / "architecture.md"


def _hops() -> list[tuple[int, list[list[tuple[str, list[str]]]], list[str], bool]]:
    """The "Follow one value" table: per hop its number, its "where" cell as ``→``-separated
    segments of (file, names), its "reached from" files, and whether a plain run reaches it."""
    text = _DOC.read_text()
    section = text[text.index("## Follow one value") :]
    section = section[: section.index("\n## ")]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    hops = []
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        segments = []
        for part in cells[1].split("→"):
            found: list[tuple[str, list[str]]] = []
            for token in re.findall(r"`([^`]+)`", part):
                if token.endswith(".py"):
                    found.append((token, []))
                elif found and re.fullmatch(r"[A-Za-z_][\w.]*", token):
                    found[-1][1].append(token)
            segments.append(found)
        reached = [t for t in re.findall(r"`([^`]+)`", cells[2]) if t.endswith(".py")]
        hops.append((int(cells[0]), [s for s in segments if s], reached, "process groups only" not in cells[1]))
    return hops


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    head, _, attr = name.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == head:
            if not attr:
                return True
            return isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.FunctionDef) and b.name == attr for b in node.body
            )
    return False


def _interfaces(path: Path, name: str, depth: int = 3) -> set[str]:
    """The modules declaring the base classes of ``name``'s class (``Loss`` -> ``metrics.decoders``,
    ``metrics.base``, ``metrics.decoding``): a caller reaches an implementation through them."""
    if depth == 0 or "." not in name:
        return set()
    tree = ast.parse(path.read_text())
    imported = {
        a.asname or a.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("batchtap")
        for a in node.names
    }
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name.split(".")[0]:
            for base in node.bases:
                module = imported.get(ast.unparse(base))
                if module:
                    found.add(module)
                    base_path = SRC.parent / Path(*module.split(".")).with_suffix(".py")
                    found |= _interfaces(base_path, f"{ast.unparse(base)}.x", depth - 1)
    return found


def _module_of(file: str) -> str:
    return "batchtap." + file.removesuffix(".py").replace("/", ".")


def test_the_hop_table_names_real_files_and_names_reached_through_imports() -> None:
    graph = _module_graph()
    hops = _hops()
    assert [n for n, *_ in hops] == list(range(1, len(hops) + 1)), "hops numbered 1..n in order"
    bad = []

    def reaches(caller: str, file: str, names: list[str]) -> bool:
        target = _module_of(file)
        via = {target}.union(*(_interfaces(SRC / file, n) for n in names if (SRC / file).is_file()))
        return caller == target or bool(graph.get(caller, set()) & via)

    where_files: list[set[str]] = []
    for number, segments, reached, _ in hops:
        files = {file for segment in segments for file, _ in segment}
        where_files.append(files)
        for segment in segments:
            for file, names in segment:
                if not (SRC / file).is_file():
                    bad.append(f"hop {number}: {file} does not exist")
                    continue
                bad += [f"hop {number}: {file} defines no {n}" for n in names if not _defines(SRC / file, n)]
        for before, after in zip(segments, segments[1:]):  # a → inside the cell: the first calls the next
            (file_a, _), (file_b, names_b) = before[-1], after[0]
            if not reaches(_module_of(file_a), file_b, names_b):
                bad.append(f"hop {number}: {file_a} → {file_b}, but {file_a} imports neither it nor its interface")
        if segments:
            file, names = segments[0][0]
            for caller in reached:
                if not reaches(_module_of(caller), file, names):
                    bad.append(f"hop {number}: reached from {caller}, which imports neither {file} nor its interface")
    for i, files in enumerate(where_files):  # no hop returns to a file the value already left
        for file in files:
            later = [j for j in range(i + 2, len(where_files)) if file in where_files[j]]
            if later and file not in where_files[i + 1]:
                bad.append(f"{file} is left after hop {i + 1} and returned to at hop {later[0] + 1}")
    assert not bad, "docs/architecture.md's hop table drifted from the code:\n" + "\n".join(bad)


def test_a_real_run_calls_every_name_the_hop_table_lists(tmp_path: Path) -> None:
    """The loss of real runs (thread pipeline, SQLite; a rule, then the short path) passes through
    every function the table names, but the reduction's (process groups only)."""
    import sys
    import threading

    import torch

    import batchtap as bt

    wanted = {
        (str(SRC / file), name)
        for _, segments, _, runs in _hops()
        if runs
        for segment in segments
        for file, names in segment
        for name in names
    }
    called: set[tuple[str, str]] = set()

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call":
            code = frame.f_code  # type: ignore[attr-defined]
            if code.co_filename.startswith(str(SRC)):
                called.add((code.co_filename, code.co_qualname))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        model = torch.nn.Linear(4, 3)
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        # with a rule (the rules stage; rule actions keep every step on the general path), then
        # without (the later steps of a repeated signature take the short path)
        for rules in ([bt.NonFinite()], []):
            tap = bt.Tap(sinks=[bt.sinks.SQLite(tmp_path / "hops.db")], rules=rules, flush_every=4)
            with tap.run(name="hops"):
                for _ in range(12):
                    out = model(x)
                    tap.step(loss=torch.nn.functional.cross_entropy(out, y), outputs=out, targets=y)
            tap.close()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    seen = {(f, q.split(".<locals>")[0]) for f, q in called}
    missing = sorted(f"{Path(f).relative_to(SRC)} {n}" for f, n in wanted - seen)
    assert not missing, f"docs/architecture.md's hop table names functions a real run never calls: {missing}"
