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
    # one for the anomalies' post, then quiet for the cooldown, except for the run's end: always tried
    assert len(warnings) == 2 and all("http://127.0.0.1:" in w.message for w in warnings)
    assert "1 event(s) not delivered" in warnings[-1].message
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


class Scripted:
    """A local endpoint answering each POST from a script of (status, Location) — then 200 — and
    keeping what each request carried: method, path, body, Authorization."""

    def __init__(self, script: list[tuple[int, str | None]]) -> None:
        self.script = list(script)
        self.seen: list[tuple[str, str, bytes, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                outer.seen.append((self.command, self.path, self.rfile.read(length), self.headers["Authorization"]))
                status, location = outer.script.pop(0) if outer.script else (200, None)
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET = _answer  # noqa: N815 (http.server's names)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _end(hook: Webhook, status: RunStatus = RunStatus.FINISHED) -> None:
    hook.start_run(RunInfo("r1", "hooked", {}, 0.0))
    hook.end_run(RunInfo("r1", "hooked", {}, 0.0, status=status))


@pytest.mark.parametrize("code", [500, 502, 503, 429])
def test_a_server_error_is_retried_until_delivered(code: int) -> None:
    ep = Scripted([(code, None), (code, None)])
    try:
        hook = Webhook(ep.base + f"/hook/{SECRET}", events=("finished",), retries=2, backoff=0.001)
        _end(hook)
    finally:
        ep.close()
    assert [m for m, *_ in ep.seen] == ["POST"] * 3
    assert hook.delivered == 1 and hook.dropped == 0 and hook.take_events() == []


@pytest.mark.parametrize("code", [400, 403, 404])
def test_a_client_error_is_not_retried(code: int) -> None:
    ep = Scripted([(code, None)])
    try:
        hook = Webhook(ep.base + "/hook", events=("finished",), retries=3, backoff=0.001)
        _end(hook)
    finally:
        ep.close()
    assert len(ep.seen) == 1 and hook.delivered == 0 and hook.dropped == 1
    assert f"HTTP {code}" in hook.take_events()[0].message


@pytest.mark.parametrize("code", [307, 308])
def test_a_307_or_308_redirect_is_followed_with_the_same_post(code: int) -> None:
    ep = Scripted([(code, "/moved/here")])
    try:
        hook = Webhook(ep.base + f"/hook/{SECRET}", events=("finished",), retries=0)
        _end(hook)
    finally:
        ep.close()
    assert [(m, p) for m, p, _, _ in ep.seen] == [("POST", f"/hook/{SECRET}"), ("POST", "/moved/here")]
    assert ep.seen[0][2] == ep.seen[1][2] and json.loads(ep.seen[1][2])["batchtap"]["status"] == "finished"
    assert hook.delivered == 1 and hook.take_events() == []


@pytest.mark.parametrize("code", [301, 302, 303])
def test_a_301_302_or_303_redirect_is_refused_clearly_and_never_counted_delivered(
    code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    ep = Scripted([(code, f"/moved/{SECRET}")])
    try:
        hook = Webhook(ep.base + "/hook", events=("finished",), retries=2, backoff=0.001)
        _end(hook)
    finally:
        ep.close()
    assert [m for m, *_ in ep.seen] == ["POST"]  # no GET without a body, no retry
    assert hook.delivered == 0 and hook.dropped == 1
    (warning,) = hook.take_events()
    assert f"HTTP {code} redirect to {ep.base}/… refused" in warning.message and SECRET not in warning.message
    err = capsys.readouterr().err
    assert "did not take the run's 'finished' alert" in err and SECRET not in err


def test_redirect_loops_end() -> None:
    ep = Scripted([(307, "/a")] * 10)
    try:
        hook = Webhook(ep.base + "/hook", events=("finished",), retries=0)
        _end(hook)
    finally:
        ep.close()
    assert len(ep.seen) == 6 and hook.delivered == 0 and "more than 5 redirects" in hook.take_events()[0].message


def test_credentials_in_the_url_are_sent_as_basic_auth_never_as_part_of_the_host_name() -> None:
    ep = Scripted([])
    try:
        url = ep.base.replace("http://", "http://alice:p%40ss@") + f"/hook/{SECRET}"
        hook = Webhook(url, events=("finished",), retries=0, timeout=5)
        _end(hook)
    finally:
        ep.close()
    # before: urllib took 'alice:p%40ss@127.0.0.1' for the host, asked the resolver for it, and never delivered
    assert hook.delivered == 1 and len(ep.seen) == 1
    assert ep.seen[0][3] == "Basic " + __import__("base64").b64encode(b"alice:p@ss").decode()
    assert "alice" not in repr(hook) and "p%40ss" not in repr(hook)


def test_the_runs_end_alert_is_tried_even_in_a_cooldown_and_its_failure_is_said(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ep = Scripted([(500, None), (500, None)])
    try:
        hook = Webhook(ep.base + "/hook", events=("anomaly", "stopped"), retries=0, cooldown=3600)
        hook.start_run(RunInfo("r1", "hooked", {}, 0.0))
        from batchtap.records import Event, EventKind

        hook.write([], [Event("r1", 3, EventKind.ANOMALY, "loss=nan", 0.0, "loss", float("nan"))])
        assert len(ep.seen) == 1 and hook.dropped == 1  # now in its cooldown
        hook.end_run(RunInfo("r1", "hooked", {}, 0.0, status=RunStatus.STOPPED, stop_reason="nan"))
        assert len(ep.seen) == 2  # the stopped alert was tried anyway (and failed: 500)
        hook.end_run(RunInfo("r1", "hooked", {}, 0.0, status=RunStatus.STOPPED))
    finally:
        ep.close()
    assert len(ep.seen) == 3 and hook.delivered == 1  # and a later one delivered inside the cooldown
    assert "did not take the run's 'stopped' alert (HTTP 500)" in capsys.readouterr().err


def test_the_end_alerts_failure_is_stored_by_the_other_sinks(tmp_path: Path) -> None:
    ep = Scripted([(500, None)] * 3)
    try:
        hook = Webhook(ep.base + f"/hook/{SECRET}", events=("finished",), retries=0)
        db = tmp_path / "runs.db"
        with bt.Tap([bt.metrics.Loss()], sinks=[hook, bt.sinks.SQLite(db)]) as tap, tap.run("end-fails"):
            tap.step(loss=torch.tensor(0.5))
    finally:
        ep.close()
    stored = sqlite3.connect(db).execute("SELECT kind, message FROM events WHERE message LIKE '%webhook%'").fetchall()
    assert len(stored) == 1 and stored[0][0] == "warning" and "HTTP 500" in stored[0][1]
    assert SECRET not in stored[0][1]


def test_a_slack_token_is_redacted_in_the_stored_config_and_argv(tmp_path: Path) -> None:
    from batchtap._env import scrub_argv

    slack = f"https://hooks.slack.com/services/{SECRET}"
    db = tmp_path / "runs.db"
    with bt.Tap([bt.metrics.Loss()], sinks=[bt.sinks.SQLite(db)]) as tap, tap.run("cfg", config={"alerts": slack}):
        tap.step(loss=torch.tensor(0.5))
    stored = "\n".join(str(r) for r in sqlite3.connect(db).execute("SELECT * FROM runs").fetchall())
    assert SECRET not in stored and "hooks.slack.com" in stored
    assert SECRET not in " ".join(scrub_argv(["train.py", "--alerts", slack, f"--hook={slack}"]))


def test_retries_back_off_doubling_from_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pauses between tries, read from a stand-in for time.sleep (no real waiting)."""
    import batchtap.sinks.webhook as webhook_module

    pauses: list[float] = []
    monkeypatch.setattr(webhook_module.time, "sleep", pauses.append)
    ep = Scripted([(503, None)] * 4)
    try:
        hook = Webhook(ep.base + "/hook", events=("finished",), retries=3, backoff=0.25)
        _end(hook)
    finally:
        ep.close()
    assert len(ep.seen) == 4 and hook.delivered == 0
    assert pauses == [0.25, 0.5, 1.0]  # none before the first try, then doubling


def test_a_redirect_keeps_the_credentials_on_their_host_and_drops_them_on_another() -> None:
    ep = Scripted([(307, "/same-host"), (308, None)])
    port = ep.server.server_address[1]
    ep.script[1] = (308, f"http://localhost:{port}/other-host")  # another host name: no credentials there
    try:
        hook = Webhook(f"http://alice:pw@127.0.0.1:{port}/hook", events=("finished",), retries=0)
        _end(hook)
    finally:
        ep.close()
    assert [p for _, p, _, _ in ep.seen] == ["/hook", "/same-host", "/other-host"] and hook.delivered == 1
    auth = [a for *_, a in ep.seen]
    assert auth[0] == auth[1] is not None and auth[0].startswith("Basic ") and auth[2] is None


def test_a_refused_redirect_names_where_it_pointed_without_its_path() -> None:
    ep = Scripted([])
    port = ep.server.server_address[1]
    ep.script.append((302, f"http://localhost:{port}/moved/{SECRET}"))
    try:
        hook = Webhook(f"http://127.0.0.1:{port}/hook", events=("finished",), retries=0)
        _end(hook)
    finally:
        ep.close()
    (warning,) = hook.take_events()
    assert f"HTTP 302 redirect to http://localhost:{port}/… refused" in warning.message
    assert SECRET not in warning.message
