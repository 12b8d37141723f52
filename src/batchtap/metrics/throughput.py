"""The throughput a trainer quotes: tokens per second, model FLOP/s and MFU, finalized on the host
from the step clocks and a FLOP count made once, with no device read."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from batchtap.errors import ConfigError
from batchtap.metrics._shared import step_device
from batchtap.metrics.base import BlockTiming, Metric, StepInputs, StepTiming
from batchtap.metrics.domain import NONNEGATIVE, UNIT_INTERVAL, Output, Reduce

__all__ = ["MFU", "PEAK_FLOPS", "peak_flops_of"]

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

_DTYPE_KEYS = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    getattr(torch, "float8_e4m3fn", None): "fp8",
    getattr(torch, "float8_e5m2", None): "fp8",
}


def _missing_formulas() -> dict[Any, Any]:
    """FLOP formulas FlopCounterMode lacks: the CPU's fused attention (forward and backward) counts
    as the other attention kernels do, or a transformer's attention would be missing on the CPU."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    known = flop_counter.flop_registry

    def forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(flop_counter.sdpa_flop_count(query, key, value))

    def backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
        return int(flop_counter.sdpa_backward_flop_count(grad, query, key, value))

    formulas: dict[Any, Any] = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", forward),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", backward),
    ):
        op = getattr(aten, name, None)
        if op is not None and op not in known:
            formulas[op] = formula
    return formulas


# MFU's host columns: why mfu is absent
_MFU_KNOWN, _MFU_CPU, _MFU_UNKNOWN_GPU = 0.0, 1.0, 2.0


def peak_flops_of(device_name: str, dtype: torch.dtype, *, tf32: bool = False) -> float | None:
    """The dense peak FLOP/s of a GPU named ``device_name`` for matrix products in ``dtype``
    (float32 counts as TF32 when ``tf32``), or None when the table does not know it.

    Example:
        >>> peak_flops_of("NVIDIA H100 80GB HBM3", torch.bfloat16), peak_flops_of("NVIDIA H200", torch.bfloat16)
        (989400000000000.0, 989400000000000.0)
        >>> peak_flops_of("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True), peak_flops_of("Intel CPU", torch.float32)
        (156000000000000.0, None)
    """
    key = _DTYPE_KEYS.get(dtype)
    if key is None:
        return None
    if key == "fp32" and tf32:
        key = "tf32"
    for fragment, peaks in PEAK_FLOPS.items():
        if fragment in device_name:
            return peaks.get(key)
    return None


class MFU(Metric):
    """``tokens_per_second``, ``flops_per_second`` and ``mfu`` (model FLOPs utilisation) per step.

    * ``tokens_per_second``: the step's tokens (``tap.step(tokens=...)``, else the element count
      of integer targets of two or more dimensions, ``[B, T]`` token ids) over its step time; left
      out for other inputs.
    * ``flops_per_second``: the model's FLOPs per optimizer step over the step time. The FLOPs are
      ``flops_per_step`` when given, else counted once by ``torch.utils.flop_counter.FlopCounterMode``
      over the run's first whole step (from the first ``tap.step`` to the second: forward,
      backward and optimizer step; on the host, from shapes, no device read); left out until known.
      Per rank: summed over ranks like throughput.
    * ``mfu``: ``flops_per_second`` over the device's peak (``peak_flops``, else :data:`PEAK_FLOPS`
      by the GPU's name and ``dtype``). On the CPU, or a GPU the table does not know, it is left
      out and the run gets one warning saying why.

    Args:
        flops_per_step: the model's FLOPs of one optimizer step on this rank (e.g. ``6 * params *
            tokens`` for a transformer); None: counted at the run's first step.
        peak_flops: the device's peak FLOP/s; None: from the table.
        dtype: the dtype the model's matrix products run in (``torch.bfloat16`` under bf16
            autocast); None: ``torch.float32`` (TF32 when ``torch.backends.cuda.matmul.allow_tf32``).

    Example:
        >>> metric = MFU(flops_per_step=2e12, peak_flops=1e14)
        >>> inputs = StepInputs(None, None, torch.zeros(4, 256, dtype=torch.long), 4.0)
        >>> raw = list(metric.read_host(inputs))
        >>> metric.finalize(raw, StepTiming(samples=4.0, step_time=0.5, data_time=math.nan))
        (2048.0, 4000000000000.0, 0.04)
    """

    host_width = 4  # flops per step, peak, tokens from the targets' shape, why mfu is absent

    def __init__(
        self,
        *,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        for label, value in (("flops_per_step", flops_per_step), ("peak_flops", peak_flops)):
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"MFU {label} must be a positive finite number or None, got {value!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ConfigError(f"MFU dtype must be a torch.dtype, got {dtype!r}; fix: e.g. dtype=torch.bfloat16")
        self.flops_per_step: float | None = None if flops_per_step is None else float(flops_per_step)
        self.peak_flops: float | None = None if peak_flops is None else float(peak_flops)
        self.dtype = dtype
        self._counter: Any = None  # the open FlopCounterMode between the first two rows
        self._rows = 0
        self._peak: tuple[float, float] | None = None  # (peak or NaN, why absent), found at the first row
        self._device_name = ""

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_counter"] = None
        return state

    def outputs(self) -> tuple[Output, ...]:
        return (
            Output("tokens_per_second", NONNEGATIVE, Reduce.SUM),
            Output("flops_per_second", NONNEGATIVE, Reduce.SUM),
            Output("mfu", UNIT_INTERVAL, Reduce.MEAN),
        )

    @property
    def per_micro_batch(self) -> bool:
        return False

    def _find_peak(self, device: torch.device) -> tuple[float, float]:
        if self.peak_flops is not None:
            return self.peak_flops, _MFU_KNOWN
        if device.type != "cuda":
            return math.nan, _MFU_CPU
        self._device_name = torch.cuda.get_device_name(device)  # the driver's name: a host call, no sync
        dtype = self.dtype or torch.float32
        peak = peak_flops_of(self._device_name, dtype, tf32=bool(torch.backends.cuda.matmul.allow_tf32))
        return (math.nan, _MFU_UNKNOWN_GPU) if peak is None else (peak, _MFU_KNOWN)

    def _count(self) -> None:
        """The FLOP count between the first two rows: opened at the first, read at the second."""
        if self.flops_per_step is not None:
            return
        if self._counter is None and self._rows == 1:
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False, custom_mapping=_missing_formulas())
            self._counter.__enter__()
        elif self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
            self.flops_per_step = float(counter.get_total_flops())

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        self._rows += 1
        if self._peak is None:
            self._peak = self._find_peak(step_device(inputs))
        self._count()
        targets = inputs.targets
        tokens = math.nan
        if isinstance(targets, torch.Tensor) and targets.dim() >= 2 and not targets.is_floating_point():
            tokens = float(targets.numel())  # token ids [B, T]: metadata only
        flops = math.nan if self.flops_per_step is None else self.flops_per_step
        return (flops, self._peak[0], tokens, self._peak[1])

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
        return np.asarray(raw[:, 3] != _MFU_KNOWN)

    def warning(self, raw: Sequence[float]) -> str | None:
        why = raw[3]
        if why == _MFU_CPU:
            return (
                "mfu: left out on the CPU (batchtap knows no peak FLOP/s of CPUs); flops_per_second is "
                "recorded; pass bt.metrics.MFU(peak_flops=...) to get mfu"
            )
        if why == _MFU_UNKNOWN_GPU:
            dtype = self.dtype or torch.float32
            return (
                f"mfu: left out: no peak FLOP/s known for {self._device_name or 'this GPU'} in {dtype} "
                f"(known: {', '.join(PEAK_FLOPS)}); pass bt.metrics.MFU(peak_flops=..., dtype=...)"
            )
        return None
