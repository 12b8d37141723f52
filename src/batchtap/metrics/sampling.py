"""System's host half, torch-free: the sampling thread (NVML and psutil) and the decoder that turns
a step's clock reading into the means and minima of the samples of its interval.

The pipeline decodes :class:`~batchtap.metrics.system.System` through :class:`SystemDecoding`
(numpy and the standard library only), so a pipeline process that samples and decodes System's
values never loads torch. Under ``pipeline="process"`` the decoder travels there and samples there
(NVML is per machine; psutil asks about the training process by its pid).
"""

from __future__ import annotations

import bisect
import collections
import importlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from batchtap.metrics.decoding import MetricDecoder, StepTiming

__all__ = ["GPU_FIELDS", "HOST_FIELDS", "Sampler", "SystemDecoding", "load_nvml"]

#: per GPU: (suffix, unit); utilisation also gets its minimum over the step (``_util_min``)
GPU_FIELDS = (("util", "%"), ("mem_used", "B"), ("mem_total", "B"), ("power", "W"), ("temp", "C"), ("sm_clock", "MHz"))
HOST_FIELDS = (("cpu_percent", "%"), ("process_rss", "B"), ("host_ram_used", "B"))
#: samples kept: 10 minutes at 10 Hz, far more than a pipeline is ever behind the steps
_KEEP = 6000


def load_nvml() -> tuple[Any | None, str | None]:
    """``(pynvml, None)`` initialised, or ``(None, why not)``."""
    try:
        import pynvml
    except ImportError:
        return None, "NVML bindings not installed (pip install 'batchtap[system]', package nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError and its many subclasses: no driver, no GPU
        return None, f"NVML could not start ({type(e).__name__}: {e}); no NVIDIA driver or GPU here"
    return pynvml, None


def _ask(read: Callable[..., Any], *args: Any) -> float:
    """``read(*args)`` as a float; NaN when it raises (NVML's NotSupported for power on some boards, a
    process gone), so one missing reading never costs the others."""
    try:
        return float(read(*args))
    except Exception:
        return math.nan


class Sampler:
    """The thread that samples; runs while a System (or its decoder) that uses it is alive."""

    def __init__(
        self,
        nvml: Any | None,
        devices: Sequence[int],
        psutil: Any | None,
        pid: int,
        interval: float,
        clock: Callable[[], float],
    ) -> None:
        self.nvml, self.psutil, self.interval, self.clock = nvml, psutil, interval, clock
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in devices] if nvml is not None else []
        self.process = psutil.Process(pid) if psutil is not None else None
        if self.process is not None:
            self.process.cpu_percent(None)  # the first call starts psutil's CPU interval
        #: (time, values) in time order; values in the order of System.outputs(), minima excluded
        self.samples: collections.deque[tuple[float, tuple[float, ...]]] = collections.deque(maxlen=_KEEP)
        self.taken = threading.Condition()
        self.users: weakref.WeakSet[Any] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def read(self) -> tuple[float, ...]:
        """One sample of every field (NaN for a field this device does not report)."""
        out: list[float] = []
        nvml: Any = self.nvml
        for h in self.handles:
            out.append(_ask(lambda d: nvml.nvmlDeviceGetUtilizationRates(d).gpu, h))
            out.append(_ask(lambda d: nvml.nvmlDeviceGetMemoryInfo(d).used, h))
            out.append(_ask(lambda d: nvml.nvmlDeviceGetMemoryInfo(d).total, h))
            out.append(_ask(nvml.nvmlDeviceGetPowerUsage, h) / 1000.0)  # mW
            out.append(_ask(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU))
            out.append(_ask(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM))
        process: Any = self.process
        if process is not None:
            psutil: Any = self.psutil
            out.append(_ask(lambda: process.cpu_percent(None)))
            out.append(_ask(lambda: process.memory_info().rss))
            out.append(_ask(lambda: psutil.virtual_memory().used))
        return tuple(out)

    def sample(self) -> None:
        """Take one sample now (the thread's tick; tests call it to sample at chosen times)."""
        values = self.read()
        t = self.clock()  # after the reads: a sample is about the period that ends here
        with self.taken:
            self.samples.append((t, values))
            self.taken.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` samples were kept (tests synchronise on it instead of sleeping)."""
        with self.taken:
            # sync: waits for the sampling thread, never for the device; tests call it, training never does
            return self.taken.wait_for(lambda: len(self.samples) >= count, timeout)

    def start(self) -> None:
        """Start the sampling thread (again, if it ended)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="batchtap-system", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        deadline = time.monotonic()
        while self.users:  # every user was collected: the thread ends
            try:
                self.sample()
            except Exception:  # a sampling failure must never reach training: skip the tick
                pass
            deadline += self.interval
            time.sleep(max(0.0, deadline - time.monotonic()))

    def window(self, start: float | None, end: float) -> list[tuple[float, ...]]:
        """The samples of the interval ``(start, end]``, else the one enclosing it (the last
        taken at or before ``end``); empty when none was taken yet."""
        with self.taken:
            samples = list(self.samples)
        times = [t for t, _ in samples]
        hi = bisect.bisect_right(times, end)
        lo = bisect.bisect_right(times, start) if start is not None else hi
        if hi > lo:
            return [v for _, v in samples[lo:hi]]
        return [samples[hi - 1][1]] if hi else []


class SystemDecoding(MetricDecoder):
    """System's values of a step from its one host column (the step's end on the sampling clock):
    the mean of each field over the samples of the step's interval, and utilisation's minimum."""

    decode_state: ClassVar[tuple[str, ...]] = (
        "why_no_gpu",
        "interval",
        "clock",
        "background",
        "_gpu_devices",
        "_pid",
        "_nvml",
        "_psutil",
        "_names",
        "_prev",
        "_sampler",
    )
    why_no_gpu: str | None
    interval: float
    clock: Callable[[], float]
    background: bool
    _gpu_devices: list[int]
    _pid: int
    _nvml: Any
    _psutil: Any
    _names: list[str]
    _prev: float | None
    _sampler: Sampler

    def _start(self) -> Sampler:
        sampler = Sampler(self._nvml, self._gpu_devices, self._psutil, self._pid, self.interval, self.clock)
        sampler.users.add(self)
        if self.background:
            sampler.start()
        return sampler

    @property
    def sampler(self) -> Sampler:
        """The sampling thread's state (its samples; :meth:`Sampler.sample` takes one now)."""
        return self._sampler

    def __getstate__(self) -> dict[str, Any]:
        # Under pipeline="process" the decoder samples in the pipeline process: NVML and psutil
        # are loaded again there, and a thread of its own started.
        state = self.__dict__.copy()
        state["_sampler"] = None
        state["_nvml"] = self._nvml is not None  # a module does not pickle: load it again there
        state["_psutil"] = self._psutil is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._nvml = load_nvml()[0] if state["_nvml"] else None
        self._psutil = importlib.import_module("psutil") if state["_psutil"] else None
        self._sampler = self._start()

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        end = raw[0]
        samples = self._sampler.window(self._prev, end)
        self._prev = end
        if not samples:
            return (None,) * (len(self._names) + len(self._gpu_devices))  # each GPU's util_min too
        out: list[float | None] = []
        for j, name in enumerate(self._names):
            column = [s[j] for s in samples if not math.isnan(s[j])]
            mean = math.fsum(column) / len(column) if column else None
            out.append(mean)
            if name.endswith("_util"):
                out.append(min(column) if column else None)
        return out

    def warning(self, raw: Sequence[float]) -> str | None:
        if self.why_no_gpu is None:
            return None
        return f"GPU metrics left out: {self.why_no_gpu}; CPU and memory of the process and host are recorded"
