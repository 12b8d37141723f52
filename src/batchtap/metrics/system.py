"""``System``: GPU utilisation, memory, power, temperature and SM clock (NVML), and the training
process's CPU and memory with the host's RAM (psutil), per step.

A background thread samples every ``interval`` seconds (default 10 Hz) and keeps the samples with
their ``time.monotonic()``. The training thread does nothing but read that clock once per step
(:meth:`System.read_host`: no CUDA call, no NVML call, no lock). On the pipeline side each step
gets the mean (and for utilisation also the minimum) of the samples taken during its interval
— from the previous step's clock reading to its own — or, for a step shorter than the sampling
period, the sample whose period encloses it (the latest one taken before the step ended).

NVML comes from NVIDIA's bindings, ``nvidia-ml-py`` (module ``pynvml``), psutil from ``psutil``:
``pip install 'batchtap[system]'``. Without NVML (a CPU machine, no driver, the package missing)
the GPU values are left out and one warning event of the run says why; without psutil the
process and host values are.
"""

from __future__ import annotations

import bisect
import collections
import importlib
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from batchtap.metrics.base import Metric, StepInputs, StepTiming
from batchtap.metrics.domain import NONNEGATIVE, Output, Reduce

__all__ = ["System", "nvml_available"]

#: per GPU: (suffix, unit); utilisation also gets its minimum over the step (``_util_min``)
_GPU_FIELDS = (("util", "%"), ("mem_used", "B"), ("mem_total", "B"), ("power", "W"), ("temp", "C"), ("sm_clock", "MHz"))
_HOST_FIELDS = (("cpu_percent", "%"), ("process_rss", "B"), ("host_ram_used", "B"))
#: samples kept: 10 minutes at 10 Hz, far more than a pipeline is ever behind the steps
_KEEP = 6000


def _load_nvml() -> tuple[Any | None, str | None]:
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


class _Sampler:
    """The thread that samples; runs while a :class:`System` that uses it is alive."""

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
        self.users: weakref.WeakSet[System] = weakref.WeakSet()
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
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="batchtap-system", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        deadline = time.monotonic()
        while self.users:  # every System using it was collected: the thread ends
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


def _ask(read: Callable[..., Any], *args: Any) -> float:
    """``read(*args)`` as a float; NaN when it raises (NVML's NotSupported for power on some boards, a
    process gone), so one missing reading never costs the others."""
    try:
        return float(read(*args))
    except Exception:
        return math.nan


class System(Metric):
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
        self.why_no_gpu: str | None = None
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
        self._names = [f"gpu{d}_{f}" for d in self._gpu_devices for f, _ in _GPU_FIELDS]
        self._names += [f for f, _ in _HOST_FIELDS] if psutil is not None else []
        self._prev: float | None = None
        self._sampler = self._start()

    def _start(self) -> _Sampler:
        sampler = _Sampler(self._nvml, self._gpu_devices, self._psutil, self._pid, self.interval, self.clock)
        sampler.users.add(self)
        if self.background:
            sampler.start()
        return sampler

    @property
    def sampler(self) -> _Sampler:
        """The sampling thread's state (its samples; :meth:`_Sampler.sample` takes one now)."""
        return self._sampler

    def __getstate__(self) -> dict[str, Any]:
        # Under pipeline="process" the metric is finalized in the pipeline process: it samples
        # there (NVML is per machine, psutil asks about the training process by its pid).
        state = self.__dict__.copy()
        state["_sampler"] = None
        state["_nvml"] = self._nvml is not None  # a module does not pickle: load it again there
        state["_psutil"] = self._psutil is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._nvml = _load_nvml()[0] if state["_nvml"] else None
        self._psutil = importlib.import_module("psutil") if state["_psutil"] else None
        self._sampler = self._start()

    def outputs(self) -> tuple[Output, ...]:
        out = []
        for d in self._gpu_devices:
            for field, unit in _GPU_FIELDS:
                out.append(Output(f"gpu{d}_{field}", NONNEGATIVE, Reduce.MEAN, unit=unit))
                if field == "util":
                    out.append(Output(f"gpu{d}_util_min", NONNEGATIVE, Reduce.MIN, unit=unit))
        if self._psutil is not None:
            out += [Output(name, NONNEGATIVE, Reduce.MEAN, unit=unit) for name, unit in _HOST_FIELDS]
        return tuple(out)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        """The step's end on the sampling clock: the one thing the training thread does."""
        return (self.clock(),)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        end = raw[0]
        samples = self._sampler.window(self._prev, end)
        self._prev = end
        if not samples:
            return (None,) * len(self.outputs())
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
