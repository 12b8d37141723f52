"""The host side of the per-layer metrics and MFU (:mod:`~batchtap.metrics.layers`,
:mod:`~batchtap.metrics.histograms`, :mod:`~batchtap.metrics.throughput`): numpy only, so a pipeline
process decodes them without loading torch. Each metric derives from its decoding class here and
the pipeline gets a twin holding the attributes named in ``decode_state``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from batchtap.metrics.decoding import BlockTiming, MetricDecoder, StepTiming

__all__ = ["LayersDecoding", "HistogramsDecoding", "MFUDecoding", "PEAK_FLOPS", "CAPTURED", "NOT_CAPTURED"]

#: a per-layer metric's first host column: whether this row carries a capture
NOT_CAPTURED, CAPTURED = 0.0, 1.0

#: dense peak FLOP/s per GPU (no structured sparsity) from NVIDIA's data sheets, by a name fragment
#: of ``torch.cuda.get_device_name()`` (first match wins: the specific names come first) and the
#: dtype the matrix products run in ("tf32": float32 with TF32 matmuls allowed)
PEAK_FLOPS: Mapping[str, Mapping[str, float]] = {
    "H100 PCIe": {"fp8": 1513e12, "bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100 NVL": {"fp8": 1671e12, "bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "GH200": {"fp8": 1979e12, "bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H200": {"fp8": 1979e12, "bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100": {"fp8": 1979e12, "bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},  # SXM
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"fp8": 733e12, "bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "L4": {"fp8": 242e12, "bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}

# MFU's last host column: why mfu is absent
MFU_KNOWN, MFU_CPU, MFU_UNKNOWN_GPU = 0.0, 1.0, 2.0


class LayersDecoding(MetricDecoder):
    """Layers' columns: ``3 x layers`` device values, then the captured marker and, per layer,
    whether it had a gradient. A row that did not capture gives nothing; a layer without a gradient
    no ``grad_norm``."""

    decode_state: ClassVar[tuple[str, ...]] = ("device_width", "names")
    device_width: int
    names: tuple[str, ...]

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        width = len(self.names)
        captured = raw[:, self.device_width] == CAPTURED
        present = np.repeat(captured[:, None], self.device_width, axis=1)
        present[:, :width] &= raw[:, self.device_width + 1 :] == 1.0
        return raw[:, : self.device_width].copy(), present


class HistogramsDecoding(MetricDecoder):
    """Histograms' columns: per kind and layer ``bins + 2`` device values (min, max, counts), then
    the captured marker and, per layer, whether it had a gradient."""

    decode_state: ClassVar[tuple[str, ...]] = ("device_width", "names", "bins")
    device_width: int
    names: tuple[str, ...]
    bins: int

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        per, width = self.bins + 2, len(self.names)
        captured = raw[:, self.device_width] == CAPTURED
        have = raw[:, self.device_width + 1 :] == 1.0
        weight = np.repeat(captured[:, None], width * per, axis=1)
        grad = np.repeat(captured[:, None] & have, per, axis=1)
        return raw[:, : self.device_width].copy(), np.concatenate([weight, grad], axis=1)


class MFUDecoding(MetricDecoder):
    """MFU's host columns (FLOPs per step, peak, tokens from the targets' shape, why mfu is absent)
    and the step time become tokens/s, FLOP/s and mfu; mfu absent says why, once."""

    decode_state: ClassVar[tuple[str, ...]] = ("dtype_name",)
    dtype_name: str

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        flops, peak, shape_tokens, _ = raw
        seconds = timing.step_time
        if not (math.isfinite(seconds) and seconds > 0):
            return (None, None, None)
        tokens = timing.tokens if math.isfinite(timing.tokens) else shape_tokens
        per_second = flops / seconds if math.isfinite(flops) else None
        mfu = per_second / peak if per_second is not None and math.isfinite(peak) else None
        return (tokens / seconds if math.isfinite(tokens) else None, per_second, mfu)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        seconds = timing.step_time
        tokens = np.where(np.isfinite(timing.tokens), timing.tokens, raw[:, 2])
        with np.errstate(invalid="ignore", divide="ignore"):
            timed = np.isfinite(seconds) & (seconds > 0)
            per_second = raw[:, 0] / seconds
            values = np.stack([tokens / seconds, per_second, per_second / raw[:, 1]], axis=1)
        present = np.stack(
            [timed & np.isfinite(tokens), timed & np.isfinite(raw[:, 0]), timed & np.isfinite(raw[:, 0] * raw[:, 1])],
            axis=1,
        )
        return values, present

    def warning_suspects(self, raw: np.ndarray) -> np.ndarray:
        """The rows whose :meth:`warning` may say something: those where mfu is absent for a reason."""
        return np.asarray(raw[:, 3] != MFU_KNOWN)

    def warning(self, raw: Sequence[float]) -> str | None:
        why = raw[3]
        if why == MFU_CPU:
            return (
                "mfu: left out on the CPU (batchtap knows no peak FLOP/s of CPUs); flops_per_second is "
                "recorded; pass bt.metrics.MFU(peak_flops=...) to get mfu"
            )
        if why == MFU_UNKNOWN_GPU:
            return (
                f"mfu: left out: no peak FLOP/s known for this GPU in {self.dtype_name} "
                f"(known: {', '.join(PEAK_FLOPS)}); pass bt.metrics.MFU(peak_flops=..., dtype=...)"
            )
        return None
