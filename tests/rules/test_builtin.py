"""Built-in rules fire at the expected step on scripted sequences and never on clean ones."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtap.errors import ConfigError
from batchtap.rules import NonFinite, Plateau, Spike, StepTimeRegression, Threshold

from ._helpers import fire_steps

NAN, INF = math.nan, math.inf
# derandomize: the examples are fresh and varied, but the same on every run (seeded).
PROPERTY = settings(derandomize=True, deadline=None, max_examples=150)


def _noise(seed: int, n: int, *, center: float, amplitude: float) -> list[float]:
    rng = random.Random(seed)
    return [center + rng.uniform(-amplitude, amplitude) for _ in range(n)]


# ---- scripted sequences -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "values", "expected"),
    [
        pytest.param(NonFinite(), [0.9, 0.8, 0.7, NAN, 0.6], [3], id="nonfinite-nan"),
        pytest.param(NonFinite(), [0.9, INF, 0.7, -INF], [1, 3], id="nonfinite-inf-both-signs"),
        pytest.param(NonFinite(patience=2), [NAN, 1.0, NAN, NAN, NAN, NAN], [3, 5], id="nonfinite-patience"),
        pytest.param(NonFinite(warmup=2), [NAN, NAN, 0.5, NAN], [3], id="nonfinite-warmup"),
        pytest.param(
            Threshold("loss", below=0.5, patience=3),
            [0.6, 0.4, 0.4, 0.6, 0.4, 0.4, 0.4, 0.4],
            [6],
            id="threshold-below-patience",
        ),
        pytest.param(Threshold("loss", above=2.0), [1.0, 2.0, 2.5, 1.0, 3.0], [2, 4], id="threshold-above"),
        pytest.param(
            Threshold("loss", below=0.5, patience=3), [0.4, NAN, 0.4, 0.4], [3], id="threshold-nan-keeps-streak"
        ),
        pytest.param(
            Threshold("loss", below=0.2, above=0.8, patience=2), [0.5, 0.1, 0.9, 0.5, 0.9], [2], id="threshold-band"
        ),
        pytest.param(Spike(ratio=3.0, min_samples=5), [1.0] * 10 + [5.0] + [1.0] * 5, [10], id="spike-ratio"),
        pytest.param(
            Spike(ratio=3.0, min_samples=5, patience=2), [1.0] * 10 + [5.0, 5.0, 1.0], [11], id="spike-patience"
        ),
        pytest.param(
            Spike(ratio=2.0, min_samples=5, patience=3),
            [1.0] * 10 + [2.5] * 6,
            [12, 15],
            id="spike-does-not-raise-its-baseline",
        ),
        pytest.param(Spike(ratio=3.0, min_samples=5), [1.0] * 4 + [50.0], [], id="spike-waits-for-min-samples"),
        pytest.param(Spike(ratio=3.0, min_samples=3), [1.0] * 5 + [NAN, 5.0], [6], id="spike-ignores-nan"),
        pytest.param(
            Spike(ratio=4.0, min_samples=5, min_excess=1.0),
            [0.08] * 10 + [0.33, 0.08, 5.0],  # 0.33 is 4x a near-zero loss, not +1; 5.0 is both
            [12],
            id="spike-min-excess",
        ),
        pytest.param(
            Spike(zscore=3.0, window=10, min_samples=10, min_excess=0.5),
            [1.0, 1.01] * 10 + [1.2, 1.0, 1.6],  # 1.2 is many std above a flat history, not +0.5
            [22],
            id="spike-zscore-min-excess",
        ),
        pytest.param(
            Spike(zscore=6.0, window=20, min_samples=20),
            _noise(7, 40, center=2.0, amplitude=0.1) + [3.0],
            [40],
            id="spike-zscore",
        ),
        pytest.param(Plateau(window=5), [1.0] * 10, [9], id="plateau-flat"),
        pytest.param(Plateau(window=5), [10.0 - i for i in range(20)] + [-9.0] * 10, [28], id="plateau-after-progress"),
        pytest.param(
            Plateau("accuracy", window=3, mode="max", min_delta=0.05),
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.62, 0.63, 0.64, 0.64, 0.64],
            [10],
            id="plateau-max-min-delta",
        ),
        pytest.param(
            StepTimeRegression(factor=2.0, patience=3, min_samples=10),
            [0.1] * 20 + [0.5] * 10,
            [22],
            id="regression-once-then-relearns",
        ),
        pytest.param(
            StepTimeRegression("data_time", patience=1, min_samples=5, window=5),
            [0.01] * 5 + [0.01, 0.05, 0.01],
            [6],
            id="regression-data-time",
        ),
    ],
)
def test_rule_fires_at_expected_steps(rule, values, expected):
    assert fire_steps(rule, rule.metric, values) == expected


# ---- clean sequences never fire ------------------------------------------------------------------

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@PROPERTY
@given(st.lists(finite, max_size=200), st.integers(1, 5))
def test_nonfinite_never_fires_on_finite_values(values, patience):
    assert fire_steps(NonFinite(patience=patience), "loss", values) == []


@PROPERTY
@given(st.lists(finite, max_size=100), st.integers(0, 99))
def test_nonfinite_fires_exactly_at_the_first_nan(values, k):
    k = min(k, len(values))
    values = values[:k] + [NAN]
    assert fire_steps(NonFinite(), "loss", values) == [k]


@PROPERTY
@given(st.lists(st.floats(0.5, 1.0), max_size=200), st.integers(1, 10))
def test_threshold_never_fires_inside_bounds(values, patience):
    assert fire_steps(Threshold("accuracy", below=0.5, patience=patience), "accuracy", values) == []


@PROPERTY
@given(st.lists(st.floats(0.0, 1.0), max_size=200), st.integers(1, 6))
def test_threshold_matches_a_run_length_reference(values, patience):
    expected, streak = [], 0
    for step, v in enumerate(values):
        streak = streak + 1 if v < 0.3 else 0
        if streak == patience:
            expected.append(step)
            streak = 0
    assert fire_steps(Threshold("accuracy", below=0.3, patience=patience), "accuracy", values) == expected


@PROPERTY
@given(st.lists(st.floats(1.0, 2.9), max_size=300), st.integers(2, 60), st.integers(1, 4))
def test_spike_ratio_never_fires_below_ratio_times_the_floor(values, window, patience):
    # every value >= 1 keeps the EMA >= 1, so 3 x EMA >= 3 > any value
    rule = Spike(ratio=3.0, window=window, patience=patience, min_samples=1)
    assert fire_steps(rule, "loss", values) == []


@PROPERTY
@given(st.integers(0, 2**32 - 1), st.floats(0.01, 10.0), st.integers(30, 300))
def test_spike_zscore_never_fires_on_bounded_noise(seed, scale, n):
    values = _noise(seed, n, center=5.0 * scale, amplitude=scale)
    rule = Spike(zscore=6.0, window=50, min_samples=30)
    assert fire_steps(rule, "loss", values) == []


@PROPERTY
@given(st.integers(0, 2**32 - 1), st.floats(0.001, 1.0), st.integers(1, 20), st.integers(0, 200))
def test_plateau_never_fires_while_improving(seed, slope, window, n):
    # linear progress of `slope` per step: window means improve by slope * window; noise of at most
    # a quarter of that can take back at most half
    rng = random.Random(seed)
    amp = slope * window / 4
    values = [10.0 - slope * i + rng.uniform(-amp, amp) for i in range(n)]
    assert fire_steps(Plateau(window=window), "loss", values) == []


@PROPERTY
@given(st.lists(st.floats(0.1, 0.19), max_size=300), st.integers(1, 5))
def test_step_time_regression_never_fires_within_factor(values, patience):
    rule = StepTimeRegression(factor=2.0, patience=patience, min_samples=5, window=20)
    assert fire_steps(rule, "step_time", values) == []


def test_rules_skip_records_without_their_metric():
    assert fire_steps(NonFinite("loss"), "accuracy", [NAN, NAN]) == []


# ---- bad configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        pytest.param(lambda: Threshold("loss"), "below= or above=", id="threshold-no-bound"),
        pytest.param(lambda: Threshold("loss", below=0.5, patience=0), "patience", id="threshold-patience-0"),
        pytest.param(lambda: Threshold("loss", below=0.9, above=0.1), "below=0.9", id="threshold-inverted-band"),
        pytest.param(lambda: Threshold("loss", below=NAN), "finite", id="threshold-nan-bound"),
        pytest.param(lambda: NonFinite(patience=0), "patience", id="nonfinite-patience-0"),
        pytest.param(lambda: NonFinite(action="explode"), "unknown action 'explode'", id="unknown-action"),
        pytest.param(lambda: NonFinite(action=[]), "empty", id="no-action"),
        pytest.param(lambda: NonFinite(warmup=-1), "warmup", id="negative-warmup"),
        pytest.param(lambda: NonFinite(""), "metric", id="empty-metric"),
        pytest.param(lambda: Spike(ratio=2.0, zscore=3.0), "expected one", id="spike-both-modes"),
        pytest.param(lambda: Spike(ratio=0.5), "ratio must be > 1", id="spike-ratio-below-1"),
        pytest.param(lambda: Spike(zscore=0.0), "zscore must be > 0", id="spike-zscore-0"),
        pytest.param(lambda: Spike(patience=0), "patience", id="spike-patience-0"),
        pytest.param(lambda: Spike(window=1), "window", id="spike-window-1"),
        pytest.param(lambda: Spike(min_excess=-0.1), "min_excess must be >= 0", id="spike-negative-excess"),
        pytest.param(lambda: Plateau(window=0), "window", id="plateau-window-0"),
        pytest.param(lambda: Plateau(min_delta=-1.0), "min_delta", id="plateau-negative-delta"),
        pytest.param(lambda: Plateau(mode="up"), "mode", id="plateau-bad-mode"),
        pytest.param(lambda: StepTimeRegression(factor=1.0), "factor", id="regression-factor-1"),
        pytest.param(lambda: StepTimeRegression(patience=True), "patience", id="regression-bool-patience"),
        pytest.param(lambda: StepTimeRegression(window=5, min_samples=10), "min_samples", id="regression-window"),
    ],
)
def test_bad_configuration_fails_at_construction(make, needle):
    with pytest.raises(ConfigError, match="(?s).*" + __import__("re").escape(needle)):
        make()


def test_config_error_is_a_value_error_naming_the_fix():
    with pytest.raises(ValueError, match="Fix:"):
        Threshold("accuracy")
