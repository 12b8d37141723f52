"""One default store, found again by every entry point: a ``Tap`` without ``sinks=``, ``bt.autolog()``
and ``batchtap run`` write where ``batchtap runs`` / ``show`` and the browser view read, from the same
working directory and environment: ``$BATCHTAP_DB``, else ``runs/batchtap.db`` in the working
directory (docs/storage.md, "Which store", says why there is no per-user fallback). Real SQLite,
a real ``batchtap run`` subprocess, the real UI server asked over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap._resume import sql_stores
from batchtap.autolog import autolog  # not bt.autolog: that would shadow the submodule others import
from batchtap.cli.main import main as cli_main

SCRIPT = """
    import torch
    import torch.nn.functional as F
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.parametrize("env", ["unset", "BATCHTAP_DB"])
def test_every_entry_point_writes_and_reads_the_same_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: str
) -> None:
    work = tmp_path / "project"
    work.mkdir()
    monkeypatch.chdir(work)
    if env == "unset":
        monkeypatch.delenv("BATCHTAP_DB", raising=False)
        expected = work / "runs" / "batchtap.db"
    else:
        expected = tmp_path / "elsewhere" / "all.db"
        monkeypatch.setenv("BATCHTAP_DB", str(expected))

    with bt.Tap(metrics=[bt.metrics.Loss()]) as tap, tap.run(name="by-tap"):  # no sinks=
        tap.step(loss=torch.tensor(1.0))
    assert [Path(where).resolve() for _, where, _ in sql_stores(tap.sinks)] == [expected.resolve()]

    auto = autolog(name="by-autolog")
    try:
        assert auto is not None
        assert [Path(where).resolve() for _, where, _ in sql_stores(auto.sinks)] == [expected.resolve()]
    finally:
        autolog(enabled=False)

    (work / "train.py").write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, "-m", "batchtap", "run", "--name", "by-batchtap-run", "train.py"],
        cwd=work,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr

    names = {"by-tap", "by-autolog", "by-batchtap-run"}
    assert expected.is_file()
    capsys.readouterr()
    assert cli_main(["runs", "--all"]) == 0  # no --db: the default store
    listed = capsys.readouterr().out
    assert all(name in listed for name in names), listed
    assert cli_main(["show", "by-batchtap-run"]) == 0

    pytest.importorskip("uvicorn")
    with bt.ui.start() as server:  # no db: the default store
        base = server.url.split("?")[0].rstrip("/")
        with urllib.request.urlopen(f"{base}/api/runs", timeout=60) as answer:
            body = json.loads(answer.read())
    rows = body["runs"] if isinstance(body, dict) else body
    assert {r["name"] for r in rows} == names, rows
