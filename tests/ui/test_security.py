"""The browser view as a service an attacker can reach: Host names, tokens, query numbers, and
user-controlled names rendered as text. Each case is an attack a probe made on loopback.

The server is the real one (uvicorn in a thread over a store made by real training runs); the
browser cases drive Debian's chromium through Playwright, as tests/ui/test_browser.py does.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("bokeh")

import batchtap.ui  # noqa: E402
from batchtap.errors import ConfigError  # noqa: E402
from batchtap.records import Record, RunInfo, RunStatus  # noqa: E402
from batchtap.sinks.sqlite import SQLite  # noqa: E402
from batchtap.ui.auth import allowed_hosts, check_token, is_loopback  # noqa: E402
from tests.ui.conftest import Runs  # noqa: E402
from tests.ui.test_server import get  # noqa: E402


# -- Host names: DNS rebinding ------------------------------------------------------------------
@pytest.mark.parametrize(
    "host",
    [
        pytest.param("127.0.0.1.evil.example", id="loopback-prefix"),
        pytest.param("127.0.0.1.nip.io:8080", id="nip-io"),
        pytest.param("127.evil.example", id="127-dot-name"),
        pytest.param("localhost.evil.example", id="localhost-prefix"),
        pytest.param("evil.example", id="foreign"),
        pytest.param("127.0.0.2", id="other-loopback-address-not-bound"),
        pytest.param("", id="empty"),
    ],
)
def test_a_host_name_not_on_the_exact_list_is_refused(server: Any, host: str) -> None:
    status, body, _ = get(server.base + "/api/runs", {"Host": host})
    assert status == 403 and b"answers only to the Host names" in body


@pytest.mark.parametrize("host", ["127.0.0.1", "LOCALHOST", "localhost:8080", "[::1]:1234", "127.0.0.1:1"])
def test_loopback_host_names_are_answered_with_any_port(server: Any, host: str) -> None:
    assert get(server.base + "/api/runs", {"Host": host})[0] == 200


def test_the_refusal_holds_on_every_route(server: Any, runs: Runs) -> None:
    for path in ("/", f"/run/{runs.anomalies}", f"/api/runs/{runs.anomalies}/live", "/static/app.js"):
        assert get(server.base + path, {"Host": "127.0.0.1.nip.io"})[0] == 403, path


def test_a_server_bound_to_another_loopback_address_answers_that_name_too(runs: Runs) -> None:
    with batchtap.ui.start(runs.db, host="127.0.0.2") as srv:
        assert get(srv.base + "/api/runs")[0] == 200  # Host: 127.0.0.2:<port>
        assert get(srv.base + "/api/runs", {"Host": "localhost"})[0] == 200
        assert get(srv.base + "/api/runs", {"Host": "127.0.0.2.evil.example"})[0] == 403


def test_is_loopback_and_the_allowed_names_match_nothing_by_prefix() -> None:
    assert not is_loopback("127.0.0.1.nip.io") and not is_loopback("127.x") and is_loopback("127.1.2.3")
    assert allowed_hosts("127.0.0.1") == {"127.0.0.1", "localhost", "[::1]"}
    assert allowed_hosts("::1") == {"127.0.0.1", "localhost", "[::1]"}
    assert allowed_hosts("0.0.0.0") is None  # every interface: the token guards it


# -- tokens -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("token", "why"),
    [
        pytest.param("", "must not be empty", id="empty"),
        pytest.param("tökén", "printable ASCII", id="non-latin-1"),
        pytest.param("été", "printable ASCII", id="latin-1-not-ascii"),
        pytest.param("a b", "printable ASCII", id="space"),
        pytest.param("a;b", "printable ASCII", id="cookie-separator"),
        pytest.param("a\nb", "printable ASCII", id="newline"),
    ],
)
def test_an_unusable_token_is_refused_before_serving(runs: Runs, token: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        batchtap.ui.start(runs.db, host="0.0.0.0", token=token)
    with pytest.raises(ConfigError, match=why):
        check_token(token)


def test_an_empty_cookie_or_bearer_is_refused(runs: Runs) -> None:
    with batchtap.ui.start(runs.db, host="0.0.0.0", token="tok-en_1.2~3") as srv:
        local = srv.base.replace("0.0.0.0", "127.0.0.1")
        assert get(local + "/api/runs", {"Cookie": "batchtap_ui_token="})[0] == 401
        assert get(local + "/api/runs", {"Authorization": "Bearer "})[0] == 401
        assert get(local + "/api/runs?token=")[0] == 401
        status, _, headers = get(srv.url.replace("0.0.0.0", "127.0.0.1"))  # the printed link works
        assert status == 200 and "set-cookie" in {k.lower() for k in headers}


def test_a_token_is_generated_when_absent_off_loopback(runs: Runs) -> None:
    with batchtap.ui.start(runs.db, host="0.0.0.0") as srv:
        assert srv.token is not None and len(srv.token) >= 32 and check_token(srv.token) == srv.token


def test_any_host_name_is_answered_only_with_the_token_on_every_interface(runs: Runs) -> None:
    with batchtap.ui.start(runs.db, host="0.0.0.0") as srv:
        local = srv.base.replace("0.0.0.0", "127.0.0.1")
        assert get(local + "/api/runs", {"Host": "my-box.lan"})[0] == 401
        assert get(local + f"/api/runs?token={srv.token}", {"Host": "my-box.lan"})[0] == 200


# -- numbers in the query -----------------------------------------------------------------------
BAD_NUMBERS = ["inf", "-inf", "Infinity", "1e30", "-1e30", "nan", "NaN", "1.5", "9223372036854775808", "0x10"]


@pytest.mark.parametrize("raw", BAD_NUMBERS)
@pytest.mark.parametrize("param", ["start", "end", "rank", "width"])
def test_a_number_out_of_range_in_a_series_query_is_a_400(server: Any, runs: Runs, param: str, raw: str) -> None:
    status, body, _ = get(f"{server.base}/api/runs/{runs.anomalies}/series?metric=loss&{param}={raw}")
    assert status == 400 and repr(param) in body["error"], body


@pytest.mark.parametrize("raw", BAD_NUMBERS)
def test_a_number_out_of_range_in_the_live_and_ranks_queries_is_a_400(server: Any, runs: Runs, raw: str) -> None:
    for path in (f"live?after={raw}", f"live?events={raw}", f"ranks?width={raw}"):
        status, body, _ = get(f"{server.base}/api/runs/{runs.anomalies}/{path}")
        assert status == 400 and "must be an integer" in body["error"], (path, body)


def test_whole_numbers_written_as_floats_still_work(server: Any, runs: Runs) -> None:
    status, body, _ = get(f"{server.base}/api/runs/{runs.anomalies}/series?metric=loss&start=1e1&end=20.0&width=1e3")
    assert status == 200 and body["step"][0] == 10 and body["step"][-1] == 20


def test_live_after_a_huge_step_is_refused_and_a_big_valid_one_streams(server: Any, runs: Runs) -> None:
    assert get(f"{server.base}/api/runs/{runs.anomalies}/live?after=1e30")[0] == 400
    with urllib.request.urlopen(f"{server.base}/api/runs/{runs.anomalies}/live?after=4611686018427387904") as r:
        text = r.read().decode()
    assert "event: end" in text  # a finished run: nothing after that step, then the end


# -- user strings as text in a real browser -----------------------------------------------------
HOSTILE_METRIC = '<img src=x onerror="window.__ran.push(1)"><svg onload="window.__ran.push(2)"></svg><a href=/x>a</a>'


@pytest.fixture
def hostile_metric_db(tmp_path: Path) -> tuple[Path, str]:
    db = tmp_path / "hostile.db"
    sink = SQLite(db)
    run_id = "hostile01"
    sink.start_run(RunInfo(run_id, "h", {}, started_at=1000.0, metrics=(HOSTILE_METRIC,)))
    sink.write(
        [
            Record(run_id, step=s, epoch=0, batch=s, rank=0, wall_time=1000.0 + s, values={HOSTILE_METRIC: 1.0 + s})
            for s in range(50)
        ]
    )
    sink.end_run(RunInfo(run_id, "h", {}, started_at=1000.0, status=RunStatus.FINISHED, ended_at=1050.0))
    sink.close()
    return db, run_id


_TOOLTIPS = """() => {
    const tips = [];
    const walk = (root) => {
        for (const el of root.querySelectorAll('*')) {
            if (!el.shadowRoot) continue;
            if (String(el.className).includes('Tooltip')) {
                const content = el.shadowRoot.querySelector('.bk-tooltip-content');
                if (content) tips.push({
                    text: content.textContent,
                    tags: [...content.querySelectorAll('img, svg, a, style, script, iframe')].map(e => e.tagName),
                });
            }
            walk(el.shadowRoot);
        }
    };
    walk(document);
    return tips;
}"""


def test_a_metric_name_made_of_html_is_text_in_the_charts_hover_tooltip(
    page: Any, hostile_metric_db: tuple[Path, str]
) -> None:
    db, run_id = hostile_metric_db
    page.add_init_script("window.__ran = [];")
    with batchtap.ui.start(db) as srv:
        page.goto(f"{srv.base}/run/{run_id}")
        page.wait_for_selector("body[data-ready='1']")
        box = page.locator(".bk-GridPlot, .bk-Figure").first.bounding_box()
        assert box is not None
        shown: list[dict[str, Any]] = []
        # sweep the pointer across the first chart until its line's tooltip opens
        for i in range(1, 80):
            page.mouse.move(box["x"] + box["width"] * i / 80, box["y"] + 120)
            shown = [t for t in page.evaluate(_TOOLTIPS) if "metric" in t["text"]]
            if shown:
                break
        assert shown, "no hover tooltip opened on the chart"
        assert HOSTILE_METRIC in shown[0]["text"] and shown[0]["tags"] == [], shown
        assert page.evaluate("() => window.__ran") == []
        assert not any(u.endswith("/x") for u in page.requests)  # no <img src=x>, no <a href=/x> followed


def test_the_cli_refuses_an_unusable_token_as_a_user_error(runs: Runs) -> None:
    import subprocess
    import sys

    from tests.cli.conftest import cli_env

    done = subprocess.run(
        [sys.executable, "-m", "batchtap.cli.main", "ui", "--db", str(runs.db), "--port", "0", "--token", "tök en"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and "printable ASCII" in done.stderr and "Traceback" not in done.stderr
