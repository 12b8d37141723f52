"""debug_mode sets deterministic settings and restores the previous ones, also after an exception."""

from __future__ import annotations

import os

import pytest
import torch

from batchtap.recovery import debug_mode


def _settings():
    return (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_anomaly_enabled(),
        torch.is_anomaly_check_nan_enabled(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )


@pytest.fixture
def unusual_settings(monkeypatch):
    """Start from settings different from what debug_mode sets, so a restore is visible."""
    before = _settings()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = False
    torch.use_deterministic_algorithms(False)
    torch.set_anomaly_enabled(False, False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield _settings()
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[0], before[1]
    torch.use_deterministic_algorithms(before[2], warn_only=before[3])
    torch.set_anomaly_enabled(before[4], before[5])


def test_settings_inside_the_block(unusual_settings):
    with debug_mode(detect_anomaly=True, warn_only=True):
        assert _settings() == (False, True, True, True, True, True, ":4096:8")
    assert _settings() == unusual_settings


def test_settings_are_restored_after_an_exception(unusual_settings):
    with pytest.raises(ZeroDivisionError):
        with debug_mode(detect_anomaly=True):
            assert torch.is_anomaly_enabled()
            1 / 0
    assert _settings() == unusual_settings


def test_anomaly_detection_names_the_nan_backward(unusual_settings):
    x = torch.tensor([0.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="nan"), pytest.warns(UserWarning), debug_mode(detect_anomaly=True):
        torch.sqrt(x * 0 - 1).sum().backward()
    assert not torch.is_anomaly_enabled()


def test_an_existing_cublas_setting_is_kept(unusual_settings, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with debug_mode():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_without_deterministic_algorithms_only_cudnn_changes(unusual_settings):
    with debug_mode(deterministic_algorithms=False):
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic
