"""`batchtap runs` and `show`, RUN resolution, store errors, exit codes and --help."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from batchtap.cli.main import main
from tests.cli.conftest import Runs, cli, cli_env

SUBCOMMANDS = ["demo", "runs", "show", "tail", "plot", "compare", "export", "tensorboard", "audit"]


def test_runs_lists_every_run_with_its_figures(runs: Runs) -> None:
    done = cli("runs", "--db", str(runs.db))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # at 80 columns (not a terminal) the start time is the column left out
    assert lines[0].split() == ["name", "id", "status", "steps", "metric", "last", "best", "duration", "anom"]
    assert max(len(line) for line in lines) <= 80
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {"cli-base", "cli-stop", "cli-clean"}
    base = rows["cli-base"]
    assert base[1] == runs.base[:8] and base[2] == "finished" and base[3] == "36" and base[4] == "loss"
    assert base[-1] == "2"  # the NaN loss: validation's anomaly and the rule's
    assert rows["cli-stop"][2] == "stopped" and rows["cli-clean"][-1] == "0"
    wide = cli("runs", "--db", str(runs.db), env=cli_env(COLUMNS="160"))
    assert wide.stdout.splitlines()[0].split()[-1] == "started"


def test_db_defaults_to_the_demo_store_in_the_working_directory_then_env(runs: Runs, tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    shutil.copy(runs.db, tmp_path / "runs" / "batchtap.db")
    done = cli("runs", cwd=tmp_path)
    assert done.returncode == 0 and "cli-base" in done.stdout, done.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert cli("runs", cwd=elsewhere, env=cli_env(BATCHTAP_DB=str(runs.db))).returncode == 0
    missing = cli("runs", cwd=elsewhere)
    assert missing.returncode == 1 and "runs/batchtap.db" in missing.stderr and "batchtap demo" in missing.stderr


def test_show_prints_config_environment_metrics_and_events(runs: Runs) -> None:
    done = cli("show", "cli-stop", "--db", str(runs.db))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"run cli-stop  (id {runs.stopped})" in out
    assert "status       stopped - " in out and "nonfinite(loss)" in out
    assert '"lr": 0.1' in out and "torch" in out and "host" in out
    metrics = {line.split()[0]: line.split() for line in out.split("\nmetrics\n")[1].splitlines()[1:8]}
    assert {"loss", "accuracy", "lr", "grad_norm"} <= set(metrics)
    assert metrics["lr"][1:4] == ["0.1", "0.1", "0.1"]  # last, min, max
    assert metrics["loss"][-1] == "1"  # one NaN
    assert "events: 2 anomalies, 2 actions, 0 warnings" in out
    assert any(line.split()[:2] == ["20", "action"] for line in out.splitlines())


@pytest.mark.parametrize("ref", ["id", "prefix", "name"])
def test_run_is_found_by_id_prefix_or_name(runs: Runs, ref: str, capsys: pytest.CaptureFixture[str]) -> None:
    given = {"id": runs.base, "prefix": runs.base[:6], "name": "cli-base"}[ref]
    assert main(["show", given, "--db", str(runs.db)]) == 0
    assert f"(id {runs.base})" in capsys.readouterr().out


def test_latest_run_of_a_name_wins(runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli import _train

    db = tmp_path / "two.db"
    _train.main(["--db", str(db), "--name", "twice", "--epochs", "1"])
    newer = _train.main(["--db", str(db), "--name", "twice", "--epochs", "1"])
    capsys.readouterr()
    assert main(["show", "twice", "--db", str(db)]) == 0
    assert f"(id {newer})" in capsys.readouterr().out


def test_unknown_run_exits_1_listing_the_closest_names(runs: Runs) -> None:
    done = cli("show", "cli-bsae", "--db", str(runs.db))
    assert done.returncode == 1
    assert "no run 'cli-bsae'" in done.stderr and "'cli-base'" in done.stderr and "batchtap runs" in done.stderr


def test_a_store_that_is_not_batchtaps_exits_1_saying_so(tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER)")
    done = cli("runs", "--db", str(other))
    assert done.returncode == 1 and "not a batchtap store" in done.stderr
    text = tmp_path / "notes.txt"
    text.write_text("hello " * 1000)
    done = cli("show", "x", "--db", str(text))
    assert done.returncode == 1 and "batchtap store" in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["runs", "--limit", "many"], id="bad-int"),
        pytest.param(["plot", "x", "--size", "12x"], id="bad-size"),
        pytest.param(["plot", "x", "--smooth", "1.5"], id="bad-smooth"),
        pytest.param(["export", "x"], id="missing-format"),
        pytest.param(["show"], id="missing-run"),
        pytest.param(["nosuch"], id="unknown-command"),
        pytest.param(["tail", "x", "--interval", "0"], id="bad-interval"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--db", str(runs.db)] if argv[0] not in ("nosuch",) else argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help_with_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out and f"batchtap {command}" in out


def test_top_level_help_lists_every_subcommand() -> None:
    done = cli("--help")
    assert done.returncode == 0
    for command in SUBCOMMANDS:
        assert f"    {command}" in done.stdout


def test_tag_sets_tags_and_a_note_that_show_and_the_reader_read(runs: Runs, tmp_path: Path) -> None:
    import batchtap.store

    db = tmp_path / "tagged.db"
    shutil.copy(runs.db, db)
    done = cli("tag", runs.base[:8], "--db", str(db), "--add", "baseline", "--add", "sweep", "--notes", "lr too high")
    assert done.returncode == 0, done.stderr
    assert cli("tag", "cli-base", "--db", str(db), "--remove", "sweep").returncode == 0
    with batchtap.store.open(db) as st:
        run = st.run(runs.base)
        assert run.tags == ("baseline",) and run.notes == "lr too high"
        assert st.run(runs.clean).tags == ()
    out = cli("show", "cli-base", "--db", str(db)).stdout
    assert "tags         baseline" in out and "notes        lr too high" in out
    printed = cli("tag", "cli-base", "--db", str(db)).stdout
    assert "baseline" in printed and "lr too high" in printed
    bad = cli("tag", "cli-base", "--db", str(db), "--add", " ")
    assert bad.returncode == 1 and "a tag must be" in bad.stderr


def test_runs_where_filters_with_the_browser_views_query_language(runs: Runs) -> None:
    done = cli("runs", "--db", str(runs.db), "--where", "status=stopped or name=cli-clean")
    assert done.returncode == 0, done.stderr
    names = sorted(line.split()[0] for line in done.stdout.splitlines()[1:])
    assert names == ["cli-clean", "cli-stop"]
    assert "no run matches" in cli("runs", "--db", str(runs.db), "--where", "steps>1000").stdout
    typo = cli("runs", "--db", str(runs.db), "--where", "lrr<0.1")
    assert typo.returncode == 1 and "no run has 'lrr'" in typo.stderr
    bad = cli("runs", "--db", str(runs.db), "--where", "lr<")
    assert bad.returncode == 2 and "expected a clause" in bad.stderr
