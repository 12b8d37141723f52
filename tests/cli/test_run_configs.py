"""``batchtap run``: the run's config columns come from the script's own config, stored as soon as
the script has it: argparse arguments (stored at parse time, so a killed run shows them), a Hydra
app's resolved config (overrides on the command line) and an OmegaConf config merged with
``OmegaConf.from_cli()``, flattened to dotted keys. Real scripts in subprocesses, SQLite read back."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchtap.cli._configs import flatten

TRAIN = """
    import torch
    import torch.nn.functional as F

    def train(lr, steps):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(steps):
            loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
"""


def _run(tmp_path: Path, source: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]]]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN) + textwrap.dedent(source))
    # relative, as a user types it: the script may change its working directory (Hydra's chdir)
    command = [sys.executable, "-m", "batchtap", "run", "--db", "runs.db", "train.py", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    with sqlite3.connect(tmp_path / "runs.db") as conn:
        configs = [json.loads(row[0]) for row in conn.execute("SELECT config FROM runs")]
    return done, configs


def test_argparse_arguments_are_stored_when_parsed_so_a_killed_run_shows_them(tmp_path: Path) -> None:
    """SIGKILL after a few steps: the run never ends, so only the write made at parse time holds them."""
    done, configs = _run(
        tmp_path,
        """
        import argparse, os, signal
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, default=0.1)
        parser.add_argument("--epochs", type=int, default=1)
        args = parser.parse_args()
        train(args.lr, 3)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
        "--lr",
        "0.01",
        "--epochs",
        "2",
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    (config,) = configs
    assert config["lr"] == 0.01 and config["epochs"] == 2, config


@pytest.mark.parametrize("version_base", ["None", "'1.1'"], ids=["hydra-1.3", "chdir"])
def test_a_hydra_apps_resolved_config_with_overrides(tmp_path: Path, version_base: str) -> None:
    """The task SIGKILLs itself: the config is in the run's row from the start of the task.
    ``version_base='1.1'``: Hydra moves into outputs/<date>/<time> before the task runs; the run's
    store (given as a relative path) is still the one in the folder it was started from."""
    pytest.importorskip("hydra")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(
        "epochs: 1\noptimizer:\n  name: sgd\n  lr: 0.1\n  betas: [0.9, 0.99]\nsteps: ${epochs}\n"
    )
    done, configs = _run(
        tmp_path,
        f"""
        VERSION_BASE = {version_base}
        """
        + """
        import os, signal
        import hydra

        @hydra.main(version_base=VERSION_BASE, config_path="conf", config_name="config")
        def main(cfg):
            train(cfg.optimizer.lr, cfg.epochs * 2)
            os.kill(os.getpid(), signal.SIGKILL)  # no end of run: only the write made at once holds the config

        if __name__ == "__main__":
            main()
        """,
        "optimizer.lr=0.01",
        "epochs=2",
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    (config,) = configs
    assert config["optimizer.lr"] == 0.01 and config["epochs"] == 2, config
    assert config["steps"] == 2  # the interpolation resolved
    assert config["optimizer.betas"] == [0.9, 0.99] and config["optimizer.name"] == "sgd"
    assert "overrides" not in config and "hydra_help" not in config  # Hydra's own argparse is not the config
    assert config["argv"][1:] == ["optimizer.lr=0.01", "epochs=2"]


def test_an_omegaconf_config_merged_with_the_command_line(tmp_path: Path) -> None:
    pytest.importorskip("omegaconf")
    done, configs = _run(
        tmp_path,
        """
        from omegaconf import OmegaConf

        base = OmegaConf.create({"model": {"width": 32, "depth": 2}, "lr": 0.1, "tag": "x"})
        other = OmegaConf.merge(OmegaConf.create({"unrelated": 1}), {"b": 2})  # not the command line's
        cfg = OmegaConf.merge(base, OmegaConf.from_cli())
        train(cfg.lr, 2)
        """,
        "lr=0.01",
        "model.depth=4",
    )
    assert done.returncode == 0, done.stderr
    (config,) = configs
    assert config["lr"] == 0.01 and config["model.depth"] == 4 and config["model.width"] == 32, config
    assert "unrelated" not in config and "b" not in config


def test_flatten_makes_dotted_keys() -> None:
    assert flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": {}, "f": None}) == {
        "a.b.c": 1,
        "a.d": [1, 2],
        "e": {},
        "f": None,
    }
