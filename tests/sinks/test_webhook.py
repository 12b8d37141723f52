"""bt.sinks.Webhook against a real local HTTP server (http.server in a thread): each chosen event
delivered once, in a Slack-compatible body; retries after a 5xx; a dead endpoint neither blocks
nor fails training; the URL's secret never stored, printed or put in an event."""

from __future__ import annotations

import json
import pickle
import socket
import sqlite3
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap.records import RunInfo, RunStatus
from batchtap.sinks import Webhook
from tests.conftest import ListSink

SECRET = "T0SECRET/B0SECRET/XXXXtokenXXXX"


class Endpoint:
    """A local webhook endpoint: keeps every JSON body; answers ``fail_first`` posts with 503."""

    def __init__(self, fail_first: int = 0) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.fail_first = fail_first
        self.posts = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers["Content-Length"])
                body = self.rfile.read(length)
                endpoint.posts += 1
                if endpoint.posts <= endpoint.fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                endpoint.bodies.append(json.loads(body))
                endpoint.paths.append(self.path)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/{SECRET}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Endpoint:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    with Endpoint() as e:
        yield e


def _train(tap: bt.Tap, steps: int, nan_at: int | None = None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        tap.step(loss=loss * float("nan") if i == nan_at else loss, outputs=out, targets=y)
        if tap.should_stop:
            break


def test_each_chosen_event_is_delivered_once_as_a_slack_compatible_body(endpoint: Endpoint, tmp_path: Path) -> None:
    hook = Webhook(endpoint.url, events=("anomaly", "action", "stopped"))
    db = tmp_path / "runs.db"
    with bt.Tap(sinks=[hook, bt.sinks.SQLite(db)], flush_every=4) as tap, tap.run("alerts"):
        _train(tap, 30, nan_at=9)
    assert endpoint.paths and set(endpoint.paths) == {f"/services/{SECRET}"}
    texts = [b["text"] for b in endpoint.bodies]
    events = [e for b in endpoint.bodies for e in b["batchtap"].get("events", [])]
    keys = [(e["kind"], e["step"], e["metric"], e["message"]) for e in events]
    assert len(keys) == len(set(keys))  # once per event
    stored = sqlite3.connect(db).execute("SELECT kind, step FROM events WHERE kind IN ('anomaly', 'action')").fetchall()
    assert sorted((k, s) for k, s, _, _ in keys) == sorted(stored)  # every chosen event, none twice
    assert any(e["kind"] == "anomaly" and e["metric"] == "loss" and e["step"] == 9 for e in events)
    assert any("batchtap run 'alerts' anomaly at step 9: loss=nan" in t for t in texts)
    assert texts[-1].startswith("batchtap: run 'alerts' (") and " stopped (" in texts[-1]
    assert endpoint.bodies[-1]["batchtap"]["status"] == "stopped"
    assert hook.delivered == len(endpoint.bodies) and hook.dropped == 0


def test_a_failed_post_is_retried_and_delivered_once() -> None:
    with Endpoint(fail_first=2) as endpoint:
        hook = Webhook(endpoint.url, events=("finished",), retries=2, backoff=0.01)
        run = RunInfo("r1", "retry", {}, 0.0)
        hook.start_run(run)
        hook.end_run(RunInfo("r1", "retry", {}, 0.0, status=RunStatus.FINISHED))
    assert endpoint.posts == 3 and len(endpoint.bodies) == 1
    assert endpoint.bodies[0]["text"] == "batchtap: run 'retry' (r1) finished"
    assert hook.take_events() == []


def _dead_url() -> tuple[socket.socket, str]:
    """A port that takes connections and never answers (a hung server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return listener, f"http://user:pw@127.0.0.1:{listener.getsockname()[1]}/hook/{SECRET}?token={SECRET}"


def test_a_dead_endpoint_neither_blocks_nor_fails_training_and_never_shows_the_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listener, url = _dead_url()
    try:
        hook = Webhook(url, events=("anomaly", "finished"), timeout=0.2, retries=1, backoff=0.01, cooldown=3600)
        sink = ListSink()
        db = tmp_path / "runs.db"
        tap = bt.Tap(
            [bt.metrics.Loss()], sinks=[hook, sink, bt.sinks.SQLite(db), bt.sinks.Console(every=1)], flush_every=2
        )
        with tap, tap.run("dead"):
            for i in range(20):
                tap.step(loss=torch.tensor(-1.0 if i % 3 == 0 else 0.5))  # a negative loss: an anomaly
                if i == 10:
                    tap.flush()  # the sinks took steps 0..10: the webhook's report goes out with the next block
    finally:
        listener.close()
    assert sink.ended[-1].status is RunStatus.FINISHED  # training went on to the end
    assert len([r for r in sink.records if not r.sparse]) == 20
    warnings = [e for e in sink.events if "webhook" in e.message]
    assert len(warnings) == 1 and "http://127.0.0.1:" in warnings[0].message  # then quiet for the cooldown
    assert hook.dropped >= 1 and hook.delivered == 0
    shown = capsys.readouterr()
    stored = "\n".join(str(row) for row in sqlite3.connect(db).execute("SELECT * FROM events").fetchall())
    for text in (shown.out, shown.err, stored, repr(hook), *(e.message for e in sink.events)):
        assert SECRET not in text and "pw" not in text.replace("pwd", "")


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(bt.ConfigError, match=r"url must be an http:// or https:// URL, got ftp://h/…"):
        Webhook(f"ftp://h/{SECRET}")
    with pytest.raises(bt.ConfigError, match=r"events must be among anomaly, action, .* got \['nan'\]"):
        Webhook("https://h/x", events=["nan"])
    with pytest.raises(bt.ConfigError, match=r"timeout must be a number of seconds > 0, got 0"):
        Webhook("https://h/x", timeout=0)


def test_it_travels_to_the_pipeline_process_and_posts_from_there(endpoint: Endpoint) -> None:
    """Under pipeline='process' the pickled copy delivers (test_pickle.py lists it as checked here)."""
    hook = Webhook(endpoint.url, events=("finished",))
    assert pickle.loads(pickle.dumps(hook)).shown_url == f"http://127.0.0.1:{endpoint.server.server_address[1]}/…"
    with bt.Tap([bt.metrics.Loss()], sinks=[hook], pipeline="process") as tap, tap.run("remote"):
        for _ in range(3):
            tap.step(loss=torch.tensor(0.5))
    assert [b["batchtap"]["status"] for b in endpoint.bodies] == ["finished"]
