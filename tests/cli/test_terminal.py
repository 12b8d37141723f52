"""The commands on a real 80-column pseudo-terminal: every line fits, words are not cut, help shows
no reST markup; `tail` before the run exists names --wait; a taken port for `batchtap ui` is a
clear error naming a free port."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus
from batchtap.sinks.sqlite import SQLite
from tests.cli.conftest import Runs, cli, cli_env

COLUMNS = 80
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LONG_NAME = "sweep-lr0.001-wd0.05-warmup2000-cosine-bs256-seed17"
LONG_MESSAGE = (
    "spike: loss=3.5e+31 is 12000000 times the median of the last 50 steps (2.9e+24 over the "
    "threshold); the rule's action rollback restored the snapshot of step 40 and halved the learning "
    "rate; the abandoned trajectory's values stay stored and are left out of every summary"
)


def on_terminal(*args: str, columns: int = COLUMNS, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``batchtap ARGS`` with stdout and stderr on a pseudo-terminal of ``columns`` columns."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    environ = {k: v for k, v in (env or cli_env()).items() if k not in ("COLUMNS", "LINES")}
    environ["TERM"] = "xterm"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchtap.cli.main", *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=environ,
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            raise AssertionError("no output for 120 s")
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    code = proc.wait(timeout=120)
    os.close(master)
    text = _ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r\n", "\n")
    return code, text


def assert_fits(text: str, columns: int = COLUMNS) -> None:
    long = [line for line in text.splitlines() if len(line.rstrip("\r")) > columns]
    assert not long, f"{len(long)} lines over {columns} columns, e.g. {long[0]!r}"


@pytest.fixture(scope="module")
def wide_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with a long name, long config values, many metrics and a long event message."""
    db = tmp_path_factory.mktemp("wide") / "wide.db"
    sink = SQLite(db)
    names = ("loss", "accuracy", "lr", "grad_norm", "step_time", "throughput", "memory_allocated")
    config = {"optimizer": {"name": "AdamW", "betas": [0.9, 0.999]}, "note": "x " * 80, "lr": 0.001}
    sink.start_run(RunInfo("w1de" * 8, LONG_NAME, config, started_at=1.7e9, metrics=names))
    sink.write(
        [
            Record(
                "w1de" * 8,
                step=s,
                epoch=0,
                batch=s,
                rank=0,
                wall_time=1.7e9 + s,
                values={n: 1.0 / (s + 1) + i for i, n in enumerate(names)},
            )
            for s in range(30)
        ],
        [Event("w1de" * 8, 12, EventKind.ANOMALY, LONG_MESSAGE, 1.7e9 + 12, "loss", 3.5e31)],
    )
    sink.end_run(
        RunInfo("w1de" * 8, LONG_NAME, config, started_at=1.7e9, status=RunStatus.FINISHED, ended_at=1.7e9 + 40)
    )
    sink.close()
    return db


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["runs"], id="runs"),
        pytest.param(["show", LONG_NAME], id="show"),
        pytest.param(["tail", LONG_NAME], id="tail-live"),
        pytest.param(["tail", LONG_NAME, "--plain"], id="tail-plain"),
    ],
)
def test_store_commands_fit_80_columns(wide_db: Path, argv: list[str]) -> None:
    code, text = on_terminal(*argv, "--db", str(wide_db))
    assert code == 0, text
    assert_fits(text)
    if argv[0] == "show":
        flat = " ".join(text.split())
        assert LONG_MESSAGE in flat, "the event message is cut or split inside a word"
    if argv[0] == "runs":
        assert LONG_NAME[:10] in text and "w1dew1de" in text and "finished" in text
    if argv[0] == "tail":
        assert "finished at step 29" in " ".join(w for w in text.split() if w != "#")


def test_compare_fits_80_columns(wide_db: Path, runs: Runs, tmp_path: Path) -> None:
    code, text = on_terminal("compare", "cli-base", "cli-clean", "--db", str(runs.db), "-o", str(tmp_path / "c.png"))
    assert code == 0, text
    assert_fits(text)


SUBCOMMANDS = ["", "demo", "runs", "show", "tail", "plot", "compare", "export", "tensorboard", "audit", "run"]
SUBCOMMANDS += ["ui", "replay", "tag"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_help_fits_80_columns_without_rest_markup(command: str) -> None:
    code, text = on_terminal(*([command] if command else []), "--help")
    assert code == 0, text
    assert_fits(text)
    for markup in ("``", ":func:`", ":mod:`", ":class:`", ":meth:`"):
        assert markup not in text, f"reST {markup!r} in {command or 'batchtap'} --help"


def test_tail_of_a_run_not_there_yet_names_wait(runs: Runs) -> None:
    done = cli("tail", "tomorrows-run", "--db", str(runs.db))
    assert done.returncode == 1
    assert "no run 'tomorrows-run'" in done.stderr and "batchtap tail tomorrows-run --wait 60" in done.stderr
    code, text = on_terminal("tail", "tomorrows-run", "--db", str(runs.db))
    assert code == 1 and "--wait 60" in text
    assert_fits(text)


def test_a_taken_port_is_a_clear_error_with_a_free_port_named(runs: Runs) -> None:
    pytest.importorskip("uvicorn")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("ui", "--db", str(runs.db), "--port", str(port), timeout=60)
    assert done.returncode == 1, done.stderr
    said = done.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in said and "Traceback" not in said
    free = int(re.search(r"batchtap ui --port (\d+) \(free now\)", said).group(1))  # type: ignore[union-attr]
    assert free > port
