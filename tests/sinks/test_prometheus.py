"""``bt.sinks.Prometheus``: its HTTP endpoint scraped (and parsed with prometheus-client's own
parser) from another thread while a real training run goes on."""

from __future__ import annotations

import math
import socket
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap.errors import ConfigError, SinkError
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus
from batchtap.rules import NonFinite
from tests.conftest import ListSink

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from batchtap.sinks.prometheus import Prometheus  # noqa: E402

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of the endpoint, keyed by (name, labels)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def get(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    hits = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


class Scraper(threading.Thread):
    """Scrapes once each time it is asked, from its own thread, as Prometheus would."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.ask = threading.Event()
        self.done = threading.Event()
        self.stop = False
        self.last: Samples = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            self.ask.wait()
            self.ask.clear()
            if self.stop:
                return
            try:
                self.last = scrape(self.url)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc
            self.done.set()

    def now(self) -> Samples:
        self.done.clear()
        self.ask.set()
        assert self.done.wait(30), "the scraper thread did not answer"
        assert self.error is None, self.error
        return self.last

    def close(self) -> None:
        self.stop = True
        self.ask.set()
        self.join(10)


def test_scraped_while_training_runs(tmp_path: Path) -> None:
    sink = Prometheus(port=0, addr="127.0.0.1")
    seen = ListSink()
    scraper = Scraper(sink.url)
    scraper.start()
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rules = [NonFinite("loss", action="stop")]
    try:
        with bt.Tap(sinks=[sink, seen], optimizer=opt, model=model, flush_every=3, rules=rules, nan_guard=False) as tap:
            with tap.run("prom-run") as info:
                for step in range(24):
                    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
                    out = model(x)
                    loss = torch.nn.functional.cross_entropy(out, y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    tap.step(loss=loss * math.nan if step == 16 else loss, outputs=out, targets=y)
                    if step % 8 == 7:
                        tap.log({"val_loss": loss.detach() / 2})
                        tap.flush()  # sync: test checkpoint, every value reached the sinks
                        got = scraper.now()
                        last = [r for r in seen.records if not r.sparse][-1]
                        assert last.step == step
                        run = {"run": "prom-run", "run_id": info.id}
                        assert get(got, "batchtap_step", **run) == step
                        assert get(got, "batchtap_epoch", **run) == last.epoch
                        for name, v in last.values.items():
                            g = get(got, "batchtap_value", metric=name, rank="0", **run)
                            assert (math.isnan(g) and math.isnan(v)) or g == v, name
                        logged = [r for r in seen.records if r.sparse][-1]
                        assert get(got, "batchtap_logged_value", metric="val_loss", **run) == logged.values["val_loss"]
                        assert get(got, "batchtap_logged_step", metric="val_loss", **run) == step
                        assert get(got, "batchtap_run_status", batchtap_run_status="running", **run) == 1.0
                        steps = [r for r in seen.records if not r.sparse]
                        # the window starts at the latest step at least rate_window before the last
                        # (or at the first step, when the run is younger than that)
                        before = [r for r in steps[:-1] if r.wall_time <= steps[-1].wall_time - sink.rate_window]
                        window = [before[-1] if before else steps[0], steps[-1]]
                        span = window[1].wall_time - window[0].wall_time
                        rate = get(got, "batchtap_steps_per_second", **run)
                        if span > 0:  # the speed of the recorded steps, from their own wall times
                            assert rate == pytest.approx((steps[-1].step - window[0].step) / span, rel=1e-9)
                    if step == 16:
                        tap.flush()  # sync: test checkpoint, the rule saw the NaN: the next step stops
                    if tap.should_stop:
                        break
            tap.flush()  # sync: test checkpoint, the sinks handled the run's end
            final = scraper.now()
        run = {"run": "prom-run", "run_id": info.id}
        assert get(final, "batchtap_run_status", batchtap_run_status="stopped", **run) == 1.0
        assert get(final, "batchtap_run_status", batchtap_run_status="running", **run) == 0.0
        assert get(final, "batchtap_step", **run) == [r for r in seen.records if not r.sparse][-1].step == 17
        # the NaN at step 16: the loss domain's anomaly and the rule's, then the rule's stop action
        anomalies = [e for e in seen.events if e.kind is EventKind.ANOMALY]
        actions = [e for e in seen.events if e.kind is EventKind.ACTION]
        assert len(anomalies) >= 1 and len(actions) >= 1
        assert get(final, "batchtap_events_total", kind="anomaly", metric="loss", **run) == len(anomalies)
        assert sum(
            v for (n, ls), v in final.items() if n == "batchtap_events_total" and ("kind", "action") in ls
        ) == len(actions)
    finally:
        scraper.close()
    with pytest.raises(OSError):
        scrape(sink.url)  # closed with the Tap: nothing listens there any more


def test_speed_and_ranks_from_record_wall_times() -> None:
    sink = Prometheus(port=0, addr="127.0.0.1", rate_window=2.0)
    try:
        sink.start_run(RunInfo("r1", "speed", {}, started_at=100.0))
        # 10 steps/s for 3 s, then 20 steps/s: the 2-s window sees only the new speed
        recs = [Record("r1", s, 0, s, -1, 100.0 + s * 0.1, {"loss": 1.0}) for s in range(30)]
        recs += [Record("r1", 30 + s, 0, 30 + s, -1, 103.0 + s * 0.05, {"loss": 1.0}) for s in range(1, 61)]
        sink.write(recs[:30])
        assert get(scrape(sink.url), "batchtap_steps_per_second", run="speed") == pytest.approx(10.0)
        sink.write(recs[30:])
        got = scrape(sink.url)
        assert get(got, "batchtap_steps_per_second", run="speed") == pytest.approx(20.0)
        assert get(got, "batchtap_value", metric="loss", rank="all", run="speed") == 1.0
        assert get(got, "batchtap_run_start_time_seconds", run="speed") == 100.0
        sink.write([], [Event("r1", 5, EventKind.SKIP, "scaler skipped", 1.0)] * 3)
        sink.end_run(RunInfo("r1", "speed", {}, started_at=100.0, status=RunStatus.STOPPED, ended_at=110.0))
        got = scrape(sink.url)
        assert get(got, "batchtap_events_total", kind="skip", run="speed") == 3.0
        assert get(got, "batchtap_run_status", batchtap_run_status="stopped", run="speed") == 1.0
    finally:
        sink.close()


def test_a_port_in_use_names_it_and_the_fix() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SinkError, match=rf"cannot listen on 127.0.0.1:{port}: .*fix: pass another port="):
            Prometheus(port=port, addr="127.0.0.1")
    with pytest.raises(ConfigError, match="rate_window must be > 0 seconds, got 0"):
        Prometheus(port=0, rate_window=0)
