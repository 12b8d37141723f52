"""The conformance matrix (see ``registry.py``): one test, one parameter per (front-end, scenario)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.compare import check
from tests.conformance.registry import FrontEnd, Scenario, cells, counted


@pytest.mark.parametrize(("scenario", "frontend"), list(cells()))
def test_cell(scenario: Scenario, frontend: FrontEnd, tmp_path: Path) -> None:
    outcome = frontend.run(scenario.name, tmp_path)
    outcome.counted = counted(scenario, frontend)
    check(outcome)
