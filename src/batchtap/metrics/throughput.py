"""The throughput a trainer quotes: tokens per second, model FLOP/s and MFU, finalized on the host
from the step clocks and a FLOP count made once, with no device read."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from batchtap.errors import ConfigError
from batchtap.metrics._shared import step_device
from batchtap.metrics.base import Metric, StepInputs
from batchtap.metrics.domain import NONNEGATIVE, UNIT_INTERVAL, Output, Reduce
from batchtap.metrics.layer_decoders import MFU_CPU, MFU_KNOWN, MFU_UNKNOWN_GPU, PEAK_FLOPS, MFUDecoding

__all__ = ["MFU", "PEAK_FLOPS", "peak_flops_of"]

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


_MFU_KNOWN, _MFU_CPU, _MFU_UNKNOWN_GPU = MFU_KNOWN, MFU_CPU, MFU_UNKNOWN_GPU


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


class MFU(MFUDecoding, Metric):
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
        >>> from batchtap.metrics.decoding import StepTiming
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
        self.dtype_name = str(dtype or torch.float32)
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
