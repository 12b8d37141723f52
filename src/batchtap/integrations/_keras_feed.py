"""Host arithmetic of the TensorFlow capture's hand-over (imports no TensorFlow).

The rows themselves go to the Tap's pipeline as one block (``_tf_ring.TFCapture.flush`` ->
:meth:`batchtap.Tap.hand_over`); what is left here is the step time, measured on the host around
each call of the compiled function and spread over the steps that call ran.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["split_calls"]


def split_calls(durations: Sequence[tuple[float, int]], rows: int) -> np.ndarray:
    """Per-row step time from host clocks around compiled calls: each call's seconds spread evenly
    over the steps it ran (``steps_per_execution`` each; the last call takes what rows remain).

    Example:
        >>> split_calls([(0.2, 2), (0.3, 2)], 3).tolist()
        [0.1, 0.1, 0.3]
    """
    out = np.full(rows, np.nan)
    start = 0
    for index, (seconds, planned) in enumerate(durations):
        if start >= rows:
            break
        count = rows - start if index == len(durations) - 1 else min(planned, rows - start)
        if count > 0:
            out[start : start + count] = seconds / count
        start += count
    return out
