"""Shared fixtures: a sink that keeps what it gets, seeded randomness, small models."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence

import pytest
import torch

from batchtap.records import Event, Record, RunInfo
from batchtap.sinks.base import Sink
from tests._gpu_skips import pytest_runtest_makereport, pytest_terminal_summary  # noqa: F401 (pytest hooks)


class ListSink(Sink):
    """Keeps every record, event and run it receives (thread-safe; read after tap.flush()/run end)."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.events: list[Event] = []
        self.started: list[RunInfo] = []
        self.ended: list[RunInfo] = []
        self.writes = 0
        self.closed = False
        self._lock = threading.Lock()

    def start_run(self, run: RunInfo) -> None:
        self.started.append(run)

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        with self._lock:
            self.records.extend(records)
            self.events.extend(events)
            self.writes += 1

    def end_run(self, run: RunInfo) -> None:
        self.ended.append(run)

    def close(self) -> None:
        self.closed = True

    def values(self, name: str) -> list[float]:
        return [r.values[name] for r in self.records if name in r.values]


#: What the suite needs besides torch; `make test` installs all of it (the extras in pyproject.toml).
OPTIONAL_TEST_DEPENDENCIES = (
    "psycopg", "tensorboard", "matplotlib", "sklearn", "mypy", "hypothesis", "lightning", "transformers",
    "accelerate", "jsonargparse", "pandas", "pyarrow", "mlflow", "sqlalchemy", "alembic", "wandb",
    "prometheus_client", "starlette", "uvicorn", "bokeh", "playwright",
    "keras", "tensorflow", "psutil", "pynvml", "hydra",
)  # fmt: skip


def pytest_sessionstart(session: pytest.Session) -> None:
    """In CI a missing optional package would turn its tests into skips that look like passes: fail."""
    if os.environ.get("CI") != "true":
        return
    missing = [m for m in OPTIONAL_TEST_DEPENDENCIES if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(
            f"CI=true but test dependencies are missing: {', '.join(missing)}; their tests would only "
            "skip. Install them with: pip install -e '.[dev]' (make test does)"
        )


@pytest.fixture
def sink() -> ListSink:
    return ListSink()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _default_store(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Tap without ``sinks=`` stores to $BATCHTAP_DB: a fresh file per test, never the checkout."""
    monkeypatch.setenv("BATCHTAP_DB", str(tmp_path_factory.mktemp("store") / "batchtap.db"))


def classifier(features: int = 8, classes: int = 5) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)
