"""Issue 38 item 4 (secrets in argv): ``batchtap run script.py --webhook <Slack URL> --db <PostgreSQL
URL with a password>`` stores and shows the run's argv and its parsed arguments with the webhook's
token and the password redacted, whichever way the option is spelled.

A real ``batchtap run`` into SQLite; the store is read back with sqlite3 (every byte of every file
beside it too), ``batchtap show`` and ``batchtap runs``.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from tests.faults._procs import cli

TOKEN = "T0SECRET/B0SECRET/XyzSeCrEtToKeN"
PASSWORD = "pWsEcReT42"

SCRIPT = """
import argparse, torch, torch.nn.functional as F
parser = argparse.ArgumentParser()
parser.add_argument("--webhook")
parser.add_argument("--alerts")
parser.add_argument("--db")
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
for _ in range(4):
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("script done", flush=True)
"""


def test_batchtap_run_never_stores_or_shows_a_webhook_token_or_a_password_from_argv(tmp_path: Path) -> None:
    script = tmp_path / "train_secret.py"
    script.write_text(SCRIPT)
    db = tmp_path / "bt.db"
    slack = f"https://hooks.slack.com/services/{TOKEN}"
    discord = f"https://discord.com/api/webhooks/123456/{TOKEN}"
    dsn = f"postgresql://trainer:{PASSWORD}@db.example:5432/runs"
    done = cli(
        "run",
        "--db",
        str(db),
        str(script),
        "--webhook",
        slack,
        f"--alerts={discord}",
        "--db",
        dsn,
        "--lr",
        "0.05",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "script done" in done.stdout
    for secret in (TOKEN, "XyzSeCrEtToKeN", PASSWORD):
        assert secret not in done.stdout + done.stderr

    with sqlite3.connect(db) as conn:
        config_text, environment_text = conn.execute("SELECT config, environment FROM runs").fetchone()
    conn.close()
    config, environment = json.loads(config_text), json.loads(environment_text)
    # the argv is kept (a reader can still see which options were given), minus the secrets
    for argv in (config["argv"], environment["argv"]):
        assert argv[0].endswith("train_secret.py") and argv[-2:] == ["--lr", "0.05"]
        assert argv[1] == "--webhook" and argv[2].startswith("https://hooks.slack.com/")
        assert argv[3].startswith("--alerts=https://discord.com/")
        assert argv[4] == "--db" and argv[5].startswith("postgresql://trainer:") and "@db.example:5432/runs" in argv[5]
    # the parsed arguments are config keys, redacted the same way
    assert config["lr"] == 0.05
    assert config["webhook"].startswith("https://hooks.slack.com/")
    assert config["alerts"].startswith("https://discord.com/")
    assert config["db"].startswith("postgresql://trainer:") and config["db"].endswith("@db.example:5432/runs")
    for text in (config_text, environment_text):
        assert TOKEN not in text and "XyzSeCrEtToKeN" not in text and PASSWORD not in text
    # nowhere in the store's files, in any form (journal and WAL included)
    for path in tmp_path.iterdir():
        if path.name.startswith("bt.db"):
            data = path.read_bytes()
            assert b"XyzSeCrEtToKeN" not in data and PASSWORD.encode() not in data, path

    shown = cli("show", "train_secret", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    assert "hooks.slack.com" in shown.stdout and "@db.example:5432/runs" in shown.stdout  # the config is shown
    listed = cli("runs", "--db", str(db))
    assert listed.returncode == 0, listed.stderr
    for out in (shown.stdout + shown.stderr, listed.stdout + listed.stderr):
        assert "XyzSeCrEtToKeN" not in out and PASSWORD not in out
