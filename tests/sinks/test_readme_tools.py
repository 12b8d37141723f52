"""The README's "Into the tools you already use" snippets run as written (each in a fresh folder,
after the shared ``train`` loop), and what they print is what they claim."""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def snippet(name: str) -> str:
    """The python block after ``<!-- readme-test: NAME -->`` in the README."""
    found = re.search(rf"<!-- readme-test: {re.escape(name)} -->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert found, f"README has no snippet marked {name!r}"
    return found.group(1)


@contextlib.contextmanager
def in_dir(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def run(name: str, tmp_path: Path) -> tuple[dict[str, Any], str]:
    ns: dict[str, Any] = {"__name__": f"readme_{name}"}
    out = io.StringIO()
    with in_dir(tmp_path), contextlib.redirect_stdout(out):
        exec(compile(snippet("loop"), "README:loop", "exec"), ns)  # noqa: S102 - the README's own code
        exec(compile(snippet(name), f"README:{name}", "exec"), ns)  # noqa: S102
    return ns, out.getvalue()


def test_mlflow_snippet(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    ns, printed = run("mlflow", tmp_path)
    assert printed.startswith("FINISHED {'lr': '0.1'} ")
    client = ns["MlflowClient"]("sqlite:///" + str(tmp_path / "mlflow.db"))
    mid = ns["sink"].mlflow_run_id(ns["run"].id)
    assert [m.step for m in client.get_metric_history(mid, "loss")] == list(range(30))
    assert [m.step for m in client.get_metric_history(mid, "val_loss")] == [9, 19, 29]


def test_wandb_snippet(tmp_path: Path) -> None:
    wandb = pytest.importorskip("wandb")
    ns, printed = run("wandb", tmp_path)
    wandb.teardown()  # waits until the service wrote the file
    (path,) = ns["sink"].files[ns["run"].id]
    assert path in printed and Path(path).is_relative_to(tmp_path / "runs" / "wandb")
    from tests.sinks._wandb_file import read_run

    rows = read_run(path).history
    assert sorted(r["batchtap/step"] for r in rows if "train/loss" in r) == list(range(30))


def test_prometheus_snippet(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    ns, printed = run("prometheus", tmp_path)
    assert 'batchtap_value{metric="loss",rank="0",run="prom-demo"' in printed
    assert 'batchtap_steps_per_second{run="prom-demo"' in printed


def test_pandas_snippet(tmp_path: Path) -> None:
    pytest.importorskip("pandas")
    ns, printed = run("pandas", tmp_path)
    df = ns["df"]
    assert list(df.index) == list(range(30)) and df.index.name == "step"
    assert df["val_loss"].notna().sum() == 3 and "loss" in printed and "val_loss" in printed
    assert (tmp_path / "runs" / "demo.db").exists()
