"""README.md, docs/cli.md and the ``--help`` texts checked against the code: commands the docs
show parse, the defaults a help text names are the parser's and the code's, the README's printed
output has the shape of a real run's, and the install sets the README describes are pyproject's."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from batchtap.cli import compare, plot
from batchtap.cli.main import build_parser
from batchtap.cli.main import main as cli

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CLI_MD = (REPO / "docs" / "cli.md").read_text()


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


# -- docs/cli.md and --help ---------------------------------------------------------------------
def _documented_commands() -> list[list[str]]:
    """Every ``batchtap SUBCOMMAND ...`` line of the docs' code blocks (not printed output)."""
    names = set(_subparsers(build_parser()))
    out = []
    for block in _code_blocks(CLI_MD) + _code_blocks(README):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            words = line.split()
            if len(words) > 1 and words[0] in ("batchtap", ".venv/bin/batchtap") and words[1] in names:
                out.append(shlex.split(line)[1:])
    assert len(out) >= 10
    return out


@pytest.mark.parametrize("argv", _documented_commands(), ids=" ".join)
def test_every_command_the_docs_show_parses(argv: list[str]) -> None:
    parser = build_parser()
    sub = _subparsers(parser)[argv[0]]
    if argv[0] == "audit":  # the script's own arguments follow it
        argv = argv[:2]
    sub.parse_args(argv[1:])  # an unknown option or a bad value exits 2 here


#: help texts that describe their default in words: (subcommand, option) -> the parser's default
DESCRIBED = {("demo", "device"): "auto"}


def _same(said: str, default: object) -> bool:
    if isinstance(default, tuple) and all(isinstance(v, int) for v in default):
        return said == "x".join(map(str, default))
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return float(said) == float(default)
        except ValueError:
            return False
    return said.rstrip("/") == str(default).rstrip("/")


def test_every_default_a_help_text_names_is_the_parser_s() -> None:
    checked, wrong = 0, []
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            said = re.search(r"\(default:? ([^(),;]+)\)", action.help or "")
            if not said or action.default in (None, argparse.SUPPRESS):
                continue
            checked += 1
            if DESCRIBED.get((name, action.dest)) == action.default:
                continue
            if not _same(said.group(1).strip(), action.default):
                wrong.append((name, action.dest, said.group(1), action.default))
    assert checked >= 10 and not wrong


def test_plot_and_compare_help_name_the_defaults_their_code_uses() -> None:
    subs = _subparsers(build_parser())
    for sub, metrics, output in (
        (subs["plot"], plot.DEFAULT_METRICS, "<run name>.png"),
        (subs["compare"], compare.DEFAULT_METRICS, compare.DEFAULT_OUTPUT),
    ):
        helps = {a.dest: a.help for a in sub._actions}
        assert f"default {', '.join(metrics)})" in helps["metrics"]
        assert helps["output"] == f"PNG to write (default: {output})"
    assert compare.DEFAULT_METRICS == ("loss",) and compare.DEFAULT_OUTPUT == "compare.png"


def test_usage_errors_exit_2_as_docs_cli_md_says(tmp_path: Path) -> None:
    assert "**2** a usage error" in CLI_MD
    with pytest.raises(SystemExit) as exited:
        cli(["export", "any", "--format", "parquet", "--db", str(tmp_path / "none.db")])
    assert exited.value.code == 2


# -- install sets --------------------------------------------------------------------------------
def test_the_demo_installs_the_core_and_scikit_learn_only_as_the_readme_says() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!\[ ]", d)[0] for d in project["dependencies"]]
    assert names == ["torch", "numpy", "tqdm"]  # the core: README's first lines name these
    assert project["optional-dependencies"]["demo"] == ["scikit-learn>=1.2"]  # keep the demo light
    assert "make demo    # .venv + the core (torch, numpy, tqdm) + the demo's scikit-learn" in README
    makefile = (REPO / "Makefile").read_text()
    assert "pip install -q -e '.[demo]'" in makefile and "pip install -q -e '.[dev]'" in makefile
    assert "| `make demo` | `pip install -e '.[demo]'` |" in README
    assert "| `make test` | `pip install -e '.[dev]'` |" in README


# -- README's printed output, from real runs ------------------------------------------------------
_NUMBER = r"-?\d+(?:\.\d+)?(?:e[+-]\d+)?"


def _template(line: str) -> re.Pattern[str]:
    """A README output line as a pattern: its numbers may differ, its words and units may not."""
    parts = re.split(_NUMBER, line)
    return re.compile(_NUMBER.join(re.escape(p) for p in parts))


def _printed_blocks() -> list[list[str]]:
    blocks = [b for b in _code_blocks(README) if b.startswith(("epoch ", "batchtap anomaly"))]
    assert len(blocks) == 2
    return [[line for line in b.splitlines() if line and line != "..."] for b in blocks]


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    out = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for name, extra in (("ok", ["--epochs", "2"]), ("nan", ["--inject-nan-at", "57"])):
        done = subprocess.run(
            [sys.executable, "-m", "batchtap.cli.main", "demo", "--out", str(out / name), *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        runs[name] = (done.stdout + done.stderr, out / name / "batchtap.db")
    return runs


def test_the_readme_s_printed_output_is_what_the_demo_prints(demo_runs: dict[str, tuple[str, Path]]) -> None:
    for block, run in zip(_printed_blocks(), ("ok", "nan")):
        printed = demo_runs[run][0].splitlines()
        for line in block:
            pattern = _template(line)
            assert any(pattern.fullmatch(p) for p in printed), (line, printed[-8:])


def test_tail_prints_the_units_the_console_prints(demo_runs: dict[str, tuple[str, Path]]) -> None:
    printed, db = demo_runs["ok"]
    console = next(line for line in printed.splitlines() if line.startswith("epoch 1 batch 20:"))
    tail = subprocess.run(
        [sys.executable, "-m", "batchtap.cli.main", "tail", "demo", "--plain", "--db", str(db), "-n", "200"],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert tail.returncode == 0, tail.stderr
    (step,) = sqlite3.connect(db).execute("SELECT MIN(step) FROM metrics WHERE epoch = 1 AND batch = 20").fetchone()
    line = next(line for line in tail.stdout.splitlines() if line.startswith(f"step={step} "))
    for label, name in (("acc", "accuracy"), ("step", "step_time"), ("loss", "loss"), ("tput", "throughput")):
        shown = re.search(rf"\b{label}=(\S+)", console).group(1)
        assert f" {name}={shown}" in line, (console, line)  # the same value, the same text
