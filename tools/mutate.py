"""A small mutation run over batchtap's critical modules: plant one-line bugs, see which tests notice.

Usage::

    .venv/bin/python tools/mutate.py                      # every module in MODULES, sampled (--fraction)
    .venv/bin/python tools/mutate.py --only pipeline/chain/reduce.py --fraction 1   # every mutant of one module
    .venv/bin/python tools/mutate.py --ids mutants.txt    # re-run the mutants listed (one id a line)
    .venv/bin/python tools/mutate.py --no-pinned --seed 38 --fraction 0.06 --only ui/app.py   # a fresh sample only

Why a script of our own: mutmut 3 rewrites the package into a trampoline tree and cannot follow the
distributed tests, which start fresh interpreters on the checkout; cosmic-ray needs a session
database and a config per module. This script does the one thing we need and nothing else:

1. copies ``src/`` and ``tests/`` into a scratch tree (the checkout is never modified, so engineers
   can keep working in it while a run goes on), with bytecode writing off so a mutant is never
   served from a stale ``.pyc``;
2. lists mutation sites with :mod:`ast` — comparison operators, arithmetic and boolean operators,
   ``not``, numeric and boolean constants, ``min``/``max``, ``torch.minimum``/``torch.maximum``,
   ``torch.float32`` narrowed to ``float16``, and whole statements that are calls
   (a call deleted: "the worker never closes the sink") — in function bodies only, never in
   docstrings or message strings;
3. for each mutant (a fixed-seed sample of ``--fraction`` of each module's sites, plus every site in
   the functions :data:`PINNED` names), writes the mutated
   module (``ast.unparse`` of the changed tree) into the scratch tree and runs that module's tests
   (``TESTS`` below, then the module's own doctests) with ``PYTHONPATH`` pointing at the scratch ``src``; a failing or timed-out run
   kills the mutant, a passing run is a survivor;
4. prints a table and writes ``mutants.json`` (every mutant, its diff line and its fate) to ``--out``.

A mutant id is ``module:index`` in the order the sites are listed (stable for an unchanged module).
It is run on demand (``make mutate``), not in CI: the full list takes hours on two cores.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "src/batchtap"

#: module (relative to src/batchtap) -> the tests that own it. Kept small: each mutant runs them all.
_DIST = "tests/pipeline/test_distributed.py::"
TESTS: dict[str, list[str]] = {
    "capture/clock.py": ["tests/capture", "tests/pipeline/test_harvest.py"],
    "capture/flush.py": ["tests/capture", "tests/pipeline/test_harvest.py"],
    "capture/ring.py": [
        "tests/capture",
        "tests/pipeline/test_harvest.py",
        "tests/test_tap.py",
        "tests/test_launches.py",
    ],
    "capture/guard.py": ["tests/capture", "tests/test_tap.py"],
    "capture/accumulate.py": ["tests/test_accumulate.py", "tests/faults/test_three_mutants.py"],
    "metrics/accuracy.py": ["tests/metrics", "tests/test_properties.py", "tests/test_bad_input.py"],
    "metrics/gradients.py": ["tests/metrics", "tests/test_properties.py", "tests/test_bad_input.py"],
    "metrics/scalars.py": ["tests/metrics", "tests/test_properties.py", "tests/test_bad_input.py"],
    "metrics/timing.py": ["tests/metrics", "tests/test_properties.py", "tests/test_bad_input.py"],
    "metrics/functional.py": ["tests/metrics", "tests/test_properties.py"],
    "metrics/domain.py": ["tests/metrics", "tests/test_bad_input.py"],
    "pipeline/chain/decode.py": [
        "tests/pipeline/test_decode.py",
        "tests/metrics/test_domains.py",
        "tests/test_bad_input.py",
        "tests/test_tap.py",
        "tests/metrics/test_builtin.py",
    ],
    # the fast arithmetic first (-x stops there); the real gloo runs only for what survives it
    "pipeline/chain/reduce.py": [
        "tests/pipeline/test_reduce.py",
        "tests/pipeline/test_reduce_packing.py",
        _DIST + "test_every_reduction_kind_over_real_ranks",
        _DIST + "test_reduced_loss_and_accuracy_equal_the_union_reference",
        _DIST + "test_straggler_fields_name_the_slow_rank",
    ],
    "pipeline/chain/dispatch.py": ["tests/pipeline/test_dispatch.py", "tests/faults/test_three_mutants.py"],
    "sinks/resilient.py": ["tests/sinks/test_resilient.py"],
    "sinks/spool.py": [
        "tests/sinks/test_mutants_spool.py",
        "tests/sinks/test_resilient.py",
        "tests/cli/test_replay.py",
    ],
    "rules/engine.py": ["tests/rules/test_engine.py", "tests/test_tap_rules.py"],
    "store/schema.py": ["tests/store/test_schema.py", "tests/sinks/test_sqlite.py"],
    # issue 38: the files an independent mutation run found weakest
    # the new test files first: -x stops at the first failure, and they take seconds
    "autolog/_graph.py": [
        "tests/autolog/test_mutants_graph.py",
        "tests/autolog/test_loop_shapes.py",
        "tests/autolog/test_steps.py",
        "tests/autolog/test_realloops.py",
    ],
    "autolog/_losses.py": [
        "tests/autolog/test_mutants_graph.py",
        "tests/autolog/test_loop_shapes.py",
        "tests/autolog/test_steps.py",
        "tests/autolog/test_realloops.py",
    ],
    "autolog/_steps.py": [
        "tests/autolog/test_loop_shapes.py",
        "tests/autolog/test_steps.py",
        "tests/autolog/test_step_definition.py",
        "tests/autolog/test_realloops.py",
    ],
    "autolog/_rows.py": [
        "tests/autolog/test_mutants_rows.py",
        "tests/autolog/test_loop_shapes.py",
        "tests/autolog/test_steps.py",
        "tests/autolog/test_realloops.py",
    ],
    "autolog/_session.py": [
        "tests/autolog/test_mutants_session.py",
        "tests/autolog/test_mutants_rows.py",
        "tests/autolog/test_lifecycle.py",
        "tests/test_lifecycle.py",
        "tests/autolog/test_steps.py",
    ],
    "ui/decimate.py": ["tests/ui/test_mutants_decimate.py", "tests/ui/test_decimate.py", "tests/ui/test_server.py"],
    "ui/auth.py": ["tests/ui/test_security.py", "tests/ui/test_server.py"],
    "ui/app.py": ["tests/ui/test_security.py", "tests/ui/test_server.py"],
    "integrations/_tf_ring.py": ["tests/integrations/test_tf_ring_mutants.py", "tests/integrations/test_keras.py"],
    "metrics/sampling.py": ["tests/metrics/test_system.py", "tests/rules/test_gpu_starved.py"],
    "rules/builtin.py": ["tests/rules", "tests/faults/test_edges_mutants.py"],
    "sinks/webhook.py": ["tests/sinks/test_mutants_webhook.py", "tests/sinks/test_webhook.py"],
    "_stale.py": [
        "tests/faults/test_mutants_stale.py",
        "tests/faults/test_edges_mutants.py",
        "tests/faults/test_group_kill.py",
    ],
}

#: the modules the issue names (issue 16): the default run
MODULES = [
    "capture/clock.py",
    "capture/flush.py",
    "capture/ring.py",
    "capture/guard.py",
    "capture/accumulate.py",
    "metrics/accuracy.py",
    "metrics/gradients.py",
    "metrics/scalars.py",
    "metrics/timing.py",
    "metrics/functional.py",
    "metrics/domain.py",
    "pipeline/chain/decode.py",
    "pipeline/chain/reduce.py",
    "pipeline/chain/dispatch.py",
    "sinks/resilient.py",
    "sinks/spool.py",
    "rules/engine.py",
    "store/schema.py",
    # issue 38
    "autolog/_graph.py",
    "autolog/_losses.py",
    "autolog/_steps.py",
    "autolog/_rows.py",
    "autolog/_session.py",
    "ui/decimate.py",
    "ui/auth.py",
    "ui/app.py",
    "integrations/_tf_ring.py",
    "metrics/sampling.py",
    "sinks/webhook.py",
    "_stale.py",
]

#: functions whose every mutation site is always run, whatever the sample (issue 29: an
#: independent mutation run found a surviving one-line bug in each; the tests that kill them are
#: tests/faults/test_three_mutants.py and tests/metrics/test_accuracy_every_step.py)
PINNED: dict[str, tuple[str, ...]] = {
    "capture/accumulate.py": ("_combine",),
    "metrics/accuracy.py": ("_fused_top1",),
    "pipeline/chain/dispatch.py": ("_drop_oldest",),
    # issue 38: the survivors of the second independent run (tests/metrics/test_system.py,
    # tests/faults/test_edges_mutants.py, tests/sinks/test_webhook.py)
    "metrics/sampling.py": ("finalize", "window"),
    "sinks/webhook.py": ("_send", "_post_once"),
    "_stale.py": ("segment_abandoned", "_group_alive"),
}

#: attribute swaps: torch's elementwise min/max, and a count's dtype narrowed (float32 -> float16)
_ATTR_SWAP: dict[str, str] = {"minimum": "maximum", "maximum": "minimum", "float32": "float16"}

_CMP_SWAP: dict[type, type] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BIN_SWAP: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
}


@dataclasses.dataclass
class Mutant:
    id: str
    module: str
    line: int
    kind: str
    before: str
    after: str
    status: str = "pending"  # killed | survived | timeout | error
    seconds: float = 0.0


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _in_functions(tree: ast.AST) -> Iterator[ast.AST]:
    """Nodes inside function bodies (module-level tables and class attributes are left alone)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:
                yield from ast.walk(stmt)


def _sites(tree: ast.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, path) of every mutation site; the path addresses the node by child indices."""
    docs = _docstring_nodes(tree)
    paths: dict[int, tuple[int, ...]] = {}

    def index(node: ast.AST, path: tuple[int, ...]) -> None:
        paths[id(node)] = path
        for i, child in enumerate(ast.iter_child_nodes(node)):
            index(child, (*path, i))

    index(tree, ())
    seen: set[int] = set()
    out: list[tuple[str, tuple[int, ...]]] = []
    for node in _in_functions(tree):
        if id(node) in seen:
            continue
        seen.add(id(node))
        p = paths[id(node)]
        if isinstance(node, ast.Compare):
            for k, op in enumerate(node.ops):
                if type(op) in _CMP_SWAP:
                    out.append((f"cmp{k}", p))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BIN_SWAP:
            if not (isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)):  # "%" formatting
                out.append(("binop", p))
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BIN_SWAP:
            out.append(("augop", p))
        elif isinstance(node, ast.BoolOp):
            out.append(("boolop", p))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append(("not", p))
        elif isinstance(node, ast.Constant) and id(node) not in docs:
            if isinstance(node.value, bool):
                out.append(("bool", p))
            elif isinstance(node.value, (int, float)):
                out.append(("number", p))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            out.append(("minmax", p))
        elif isinstance(node, ast.Attribute) and node.attr in _ATTR_SWAP and isinstance(node.value, ast.Name):
            if node.value.id == "torch":
                out.append(("attr", p))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            out.append(("delcall", p))
    return out


def _node_at(tree: ast.AST, path: tuple[int, ...]) -> tuple[ast.AST, ast.AST | None]:
    node, parent = tree, None
    for i in path:
        parent, node = node, list(ast.iter_child_nodes(node))[i]
    return node, parent


def _apply(tree: ast.Module, kind: str, path: tuple[int, ...]) -> ast.Module:
    tree = copy.deepcopy(tree)
    node, parent = _node_at(tree, path)
    if kind.startswith("cmp"):
        assert isinstance(node, ast.Compare)
        k = int(kind[3:])
        node.ops[k] = _CMP_SWAP[type(node.ops[k])]()
    elif kind in ("binop", "augop"):
        assert isinstance(node, (ast.BinOp, ast.AugAssign))
        node.op = _BIN_SWAP[type(node.op)]()
    elif kind == "boolop":
        assert isinstance(node, ast.BoolOp)
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "not":
        assert isinstance(node, ast.UnaryOp) and parent is not None
        _replace(parent, node, node.operand)
    elif kind == "bool":
        assert isinstance(node, ast.Constant)
        node.value = not node.value
    elif kind == "number":
        assert isinstance(node, ast.Constant)
        v = node.value
        node.value = (1 if v == 0 else 0) if isinstance(v, int) else (1.0 if v == 0 else v * 2)
    elif kind == "attr":
        assert isinstance(node, ast.Attribute)
        node.attr = _ATTR_SWAP[node.attr]
    elif kind == "minmax":
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        node.func.id = "max" if node.func.id == "min" else "min"
    elif kind == "delcall":
        assert parent is not None
        _replace(parent, node, ast.Pass())
    return ast.fix_missing_locations(tree)


def _replace(parent: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for field, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, field, new)
            return
        if isinstance(value, list):
            for i, item in enumerate(value):
                if item is old:
                    value[i] = new
                    return
    raise AssertionError("node not found under its parent")


def _line_of(tree: ast.Module, path: tuple[int, ...]) -> tuple[int, str]:
    node, _ = _node_at(tree, path)
    line = getattr(node, "lineno", 0)
    return line, ast.unparse(node).splitlines()[0][:100]


def _pinned_lines(tree: ast.Module, module: str) -> set[int]:
    """The lines of the functions :data:`PINNED` names in ``module``."""
    names = PINNED.get(module, ())
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def list_mutants(module: str) -> list[tuple[Mutant, ast.Module]]:
    source = (ROOT / PKG / module).read_text()
    tree = ast.parse(source)
    out = []
    for i, (kind, path) in enumerate(_sites(tree)):
        line, before = _line_of(tree, path)
        mutated = _apply(tree, kind, path)
        _, after = _line_of(mutated, path) if kind != "delcall" else (line, "pass")
        out.append((Mutant(f"{module}:{i}", module, line, kind, before, after), mutated))
    return out


def _scratch() -> Path:
    work = Path(tempfile.mkdtemp(prefix="batchtap-mutate-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for part in ("src", "tests"):
        shutil.copytree(ROOT / part, work / part, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        if (ROOT / f).exists():
            shutil.copy(ROOT / f, work / f)
    return work


def _run_tests(work: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    env = dict(os.environ, PYTHONPATH=f"{work / 'src'}{os.pathsep}{work}", PYTHONDONTWRITEBYTECODE="1")
    # the project's addopts stay (--doctest-modules): a module's own doctests are among its tests
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "--no-header", *tests]
    started = time.monotonic()
    # its own session, so a timeout ends the test run with every process it started (gloo ranks)
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout", time.monotonic() - started
    # 1: a test failed; 2: collection failed (the mutant broke an import) -- both catch the mutant.
    # 3-5 (internal error, usage error, nothing collected) say the run itself is wrong: not a kill.
    code = proc.returncode
    status = {0: "survived", 1: "killed", 2: "killed"}.get(code, "error")
    return status, time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", help="module under src/batchtap (repeatable)")
    ap.add_argument("--fraction", type=float, default=0.05, help="share of each module's sites sampled; 1 = all")
    ap.add_argument("--min-per-module", type=int, default=2, help="sample at least this many per module")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument(
        "--no-pinned", action="store_true", help="sample only: leave out the PINNED functions' sites (a fresh estimate)"
    )
    ap.add_argument("--ids", type=Path, help="file of mutant ids to run (others skipped)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant before it counts killed")
    ap.add_argument("--out", type=Path, default=ROOT / "mutants.json")
    ap.add_argument("--list", action="store_true", help="list the sites and exit")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the scratch tree is removed whichever way the run ends
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("mutate: terminated"))

    modules = args.only or MODULES
    wanted = set(args.ids.read_text().split()) if args.ids else None
    work = _scratch()
    env_check = subprocess.run(
        [sys.executable, "-c", "import batchtap; print(batchtap.__file__)"],
        env=dict(os.environ, PYTHONPATH=str(work / "src")),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not env_check.startswith(str(work)):
        sys.exit(f"mutate: the scratch tree is not the one imported ({env_check}); refusing to run")
    results: list[Mutant] = []
    rng = random.Random(args.seed)
    try:
        for module in modules:
            listed = list_mutants(module)
            total = len(listed)
            if wanted is not None:
                listed = [m for m in listed if m[0].id in wanted]
            elif args.fraction < 1:
                pinned = _pinned_lines(ast.parse((ROOT / PKG / module).read_text()), module)
                always = [] if args.no_pinned else [m for m in listed if m[0].line in pinned]
                rest = [m for m in listed if args.no_pinned or m[0].line not in pinned]
                k = min(len(rest), max(args.min_per_module, round(args.fraction * total)))
                listed = sorted(always + rng.sample(rest, k), key=lambda m: int(m[0].id.split(":")[1]))
            print(f"== {module}: {total} sites, running {len(listed)}", flush=True)
            if args.list:
                for m, _ in listed:
                    print(f"  {m.id:32} line {m.line:4} {m.kind:8} {m.before!r} -> {m.after!r}")
                continue
            target = work / PKG / module
            original = target.read_text()
            tests = [t for t in TESTS[module] if (ROOT / t.split("::")[0]).exists()] + [f"{PKG}/{module}"]
            try:
                for mutant, tree in listed:
                    target.write_text(ast.unparse(tree) + "\n")
                    mutant.status, mutant.seconds = _run_tests(work, tests, args.timeout)
                    results.append(mutant)
                    print(
                        f"  {mutant.status:8} {mutant.id:32} line {mutant.line:4} {mutant.kind:8} "
                        f"{mutant.before!r} -> {mutant.after!r} ({mutant.seconds:.0f} s)",
                        flush=True,
                    )
            finally:
                target.write_text(original)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.list:
        return
    killed = sum(m.status in ("killed", "timeout") for m in results)
    survived = sum(m.status == "survived" for m in results)
    errors = len(results) - killed - survived
    print(
        f"\nmutants run: {len(results)}, killed: {killed}, survived: {survived}, run errors: {errors}"
        + (f", score {100 * killed / (killed + survived):.1f} %" if killed + survived else "")
    )
    args.out.write_text(json.dumps([dataclasses.asdict(m) for m in results], indent=1))


if __name__ == "__main__":
    main()
