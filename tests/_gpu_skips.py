"""Pytest hooks that make skipped GPU tests loud (loaded by tests/conftest.py).

A GPU test is a test in a ``*_gpu.py`` file, or any test skipped for want of CUDA. On a machine
without CUDA they skip, and a run that passes must not look like it proved anything about CUDA:
the terminal summary ends with one line that says how many GPU tests did not run and how to run
them. Where a GPU is expected -- ``torch.cuda.is_available()`` is true, or
``BATCHTAP_REQUIRE_GPU=1`` is set (a GPU CI runner whose driver might be missing) -- a skipped GPU
test is turned into a failure instead.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

_SKIPPED: list[str] = []
_GPU_WORDS = ("cuda", "gpu")


def _gpu_expected() -> bool:
    if os.environ.get("BATCHTAP_REQUIRE_GPU") == "1":
        return True
    import torch

    return torch.cuda.is_available()


def _is_gpu_test(item: pytest.Item, reason: str) -> bool:
    return item.path.name.endswith("_gpu.py") or any(w in reason.lower() for w in _GPU_WORDS)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr or "")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if not _is_gpu_test(item, reason):
        return
    if _gpu_expected():
        report.outcome = "failed"
        report.longrepr = (
            f"GPU test skipped where a GPU is expected (torch.cuda.is_available() or BATCHTAP_REQUIRE_GPU=1): {reason}"
        )
    elif report.nodeid not in _SKIPPED:
        _SKIPPED.append(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _SKIPPED:
        return
    files = sorted({nodeid.split("::")[0] for nodeid in _SKIPPED})
    terminalreporter.write_sep(
        "!",
        f"GPU TESTS DID NOT RUN: {len(_SKIPPED)} skipped (no CUDA device) in {', '.join(files)}",
        red=True,
        bold=True,
    )
    terminalreporter.write_line(
        "Nothing about CUDA was tested here. On a GPU machine run: bash bench/gpu_check.sh "
        "(a skipped GPU test fails there, or anywhere with BATCHTAP_REQUIRE_GPU=1)",
        red=True,
    )
