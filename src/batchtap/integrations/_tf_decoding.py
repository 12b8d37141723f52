"""How a TensorFlow ring's columns decode: numpy only, no torch, no TensorFlow.

A pipeline process (``bt.Tap(pipeline="process")``) decodes a run's blocks with each metric's
:meth:`~batchtap.metrics.Metric.decoder`: a metric whose host hooks live in a torch-free
:class:`~batchtap.metrics.decoding.MetricDecoder` class of their own is decoded there by a twin
of that class, so that process never imports the metric's module (``_tf_metrics.py`` imports
batchtap's torch metrics to say which of a Tap's metrics TensorFlow stands in for). These are
those classes for the metrics of ``_tf_metrics.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchtap.metrics.decoding import BlockTiming, MetricDecoder, StepTiming

__all__ = ["TFAccuracyDecoding", "TFValueDecoding"]


class TFAccuracyDecoding(MetricDecoder):
    """Hits and counted targets (two columns) to the step's top-1 accuracy, weighted by the counted
    targets across ranks; absent where nothing was counted.

    Example:
        >>> import numpy as np
        >>> values, present = TFAccuracyDecoding().finalize_block(np.array([[3.0, 4.0], [0.0, 0.0]]), None)
        >>> float(values[0, 0]), bool(present[1, 0])
        (0.75, False)
    """

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        hits, kept = raw[0], raw[1]
        return (hits / kept if kept > 0 else None,)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming | None) -> tuple[np.ndarray, np.ndarray]:
        kept = raw[:, 1:2]
        present = kept > 0
        with np.errstate(invalid="ignore", divide="ignore"):
            values = np.where(present, raw[:, 0:1] / np.where(present, kept, 1.0), np.nan)
        return values, present

    def weight(self, raw: Sequence[float]) -> float | None:
        return raw[1]

    def weight_block(self, raw: np.ndarray) -> np.ndarray | None:
        return raw[:, 1].astype(np.float64)


class TFValueDecoding(MetricDecoder):
    """A value and its presence flag (two columns): absent where the flag is 0, never by NaN (a
    NaN the step produced stays a NaN, and is reported).

    Example:
        >>> import numpy as np
        >>> values, present = TFValueDecoding().finalize_block(np.array([[np.nan, 1.0], [0.0, 0.0]]), None)
        >>> bool(np.isnan(values[0, 0])), present[:, 0].tolist()
        (True, [True, False])
    """

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        return (raw[0] if raw[1] > 0 else None,)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming | None) -> tuple[np.ndarray, np.ndarray]:
        return raw[:, 0:1].copy(), raw[:, 1:2] > 0
