"""``System``: GPU utilisation, memory, power, temperature and SM clock (NVML), and the training
process's CPU and memory with the host's RAM (psutil), per step.

A background thread samples every ``interval`` seconds (default 10 Hz) and keeps the samples with
their ``time.monotonic()``. The training thread does nothing but read that clock once per step
(:meth:`System.read_host`: no CUDA call, no NVML call, no lock). On the pipeline side each step
gets the mean (and for utilisation also the minimum) of the samples taken during its interval
— from the previous step's clock reading to its own — or, for a step shorter than the sampling
period, the sample whose period encloses it (the latest one taken before the step ended). The
sampling thread and that decoding live in :mod:`batchtap.metrics.sampling`, which needs no torch.

NVML comes from NVIDIA's bindings, ``nvidia-ml-py`` (module ``pynvml``), psutil from ``psutil``:
``pip install 'batchtap[system]'``. Without NVML (a CPU machine, no driver, the package missing)
the GPU values are left out and one warning event of the run says why; without psutil the
process and host values are.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from batchtap.metrics.base import Metric, StepInputs
from batchtap.metrics.domain import NONNEGATIVE, Output, Reduce
from batchtap.metrics.sampling import GPU_FIELDS, HOST_FIELDS, SystemDecoding
from batchtap.metrics.sampling import load_nvml as _load_nvml

__all__ = ["System", "nvml_available"]

_NVML_STATE: tuple[Any | None, str | None] | None = None


def nvml_available() -> bool:
    """Whether NVML starts here and sees at least one GPU (asked once per process): the default
    metrics include :class:`System` only then."""
    global _NVML_STATE
    if _NVML_STATE is None:
        _NVML_STATE = _load_nvml()
    nvml = _NVML_STATE[0]
    if nvml is None:
        return False
    try:
        return int(nvml.nvmlDeviceGetCount()) > 0
    except Exception:
        return False


class System(SystemDecoding, Metric):
    """GPU and host metrics per step, sampled off the training thread (see the module's text).

    Values (per NVML device ``i``): ``gpu{i}_util`` and ``gpu{i}_util_min`` (%),
    ``gpu{i}_mem_used`` and ``gpu{i}_mem_total`` (bytes), ``gpu{i}_power`` (W), ``gpu{i}_temp``
    (°C), ``gpu{i}_sm_clock`` (MHz); for the training process ``cpu_percent`` (% of one core,
    so above 100 with several threads busy) and ``process_rss`` (bytes); for the host
    ``host_ram_used`` (bytes). Each is the mean over the step's interval, ``*_util_min`` the
    lowest sample in it: a short dip of the GPU shows there even when the mean hides it.

    On by default where NVML sees a GPU (:func:`nvml_available`); add ``bt.metrics.System()``
    yourself for the host values on a CPU machine.

    Args:
        interval: seconds between samples (default 0.1: 10 Hz).
        devices: NVML device indices to sample (default: all). NVML numbers devices by PCI bus,
            which is CUDA's order only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
        gpu: sample the GPUs (NVML).
        host: sample the process and the host (psutil).
        nvml: an NVML module to use instead of ``pynvml`` (already initialised), e.g. in tests.
        clock: the clock samples and steps are stamped with (default ``time.monotonic``).
        background: sample on a thread of its own (False: only when ``sampler.sample()`` is called,
            e.g. by a test at chosen times).

    Example:
        >>> m = System(gpu=False)
        >>> [o.name for o in m.outputs()]
        ['cpu_percent', 'process_rss', 'host_ram_used']
    """

    host_width = 1

    def __init__(
        self,
        *,
        interval: float = 0.1,
        devices: Sequence[int] | None = None,
        gpu: bool = True,
        host: bool = True,
        nvml: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
    ) -> None:
        from batchtap.errors import ConfigError

        if not (isinstance(interval, (int, float)) and interval > 0):
            raise ConfigError(f"System interval must be > 0 seconds, got {interval!r}")
        self.interval = float(interval)
        self.clock = clock
        self.background = background
        self.why_no_gpu = None
        if gpu and nvml is None:
            nvml, self.why_no_gpu = _load_nvml()
        elif not gpu:
            nvml, self.why_no_gpu = None, None
        count = int(nvml.nvmlDeviceGetCount()) if nvml is not None else 0
        self.devices = list(range(count)) if devices is None else list(devices)
        if nvml is not None and not self.devices:
            nvml, self.why_no_gpu = None, "NVML sees no GPU"
        for d in self.devices if nvml is not None else ():
            if not 0 <= d < count:
                raise ConfigError(f"System devices must be NVML indices in [0, {count}), got {d}")
        psutil: Any = None
        self.why_no_host: str | None = None
        if host:
            try:
                psutil = importlib.import_module("psutil")
            except ImportError:
                self.why_no_host = "psutil not installed (pip install 'batchtap[system]')"
        self._gpu_devices = self.devices if nvml is not None else []
        self._pid = os.getpid()  # the training process: sampled from wherever the metric runs
        self._nvml, self._psutil = nvml, psutil
        self._names = [f"gpu{d}_{f}" for d in self._gpu_devices for f, _ in GPU_FIELDS]
        self._names += [f for f, _ in HOST_FIELDS] if psutil is not None else []
        self._prev = None
        self._sampler = self._start()

    def outputs(self) -> tuple[Output, ...]:
        out = []
        for d in self._gpu_devices:
            for field, unit in GPU_FIELDS:
                out.append(Output(f"gpu{d}_{field}", NONNEGATIVE, Reduce.MEAN, unit=unit))
                if field == "util":
                    out.append(Output(f"gpu{d}_util_min", NONNEGATIVE, Reduce.MIN, unit=unit))
        if self._psutil is not None:
            out += [Output(name, NONNEGATIVE, Reduce.MEAN, unit=unit) for name, unit in HOST_FIELDS]
        return tuple(out)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        """The step's end on the sampling clock: the one thing the training thread does."""
        return (self.clock(),)
