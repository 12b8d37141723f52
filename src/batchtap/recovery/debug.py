"""A context for chasing a divergence: deterministic kernels, optional autograd anomaly detection.

Everything it changes is process-global, so it restores the previous values on exit, also when the
block raises. Autograd anomaly detection slows every backward considerably; use it for a short
reproduction, not for a whole run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["debug_mode"]

# cuBLAS needs a fixed workspace for deterministic results (CUDA >= 10.2); torch raises on the first
# non-deterministic matmul without it when deterministic algorithms are on.
_CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"


@contextlib.contextmanager
def debug_mode(
    *,
    detect_anomaly: bool = False,
    check_nan: bool = True,
    deterministic_algorithms: bool = True,
    warn_only: bool = False,
) -> Iterator[None]:
    """Run a block with ``cudnn.benchmark=False``, ``cudnn.deterministic=True`` and friends.

    Args:
        detect_anomaly: turn on autograd anomaly detection (names the forward op behind a NaN grad).
        check_nan: with ``detect_anomaly``, also raise when a backward produces NaN.
        deterministic_algorithms: ``torch.use_deterministic_algorithms(True)`` inside the block.
        warn_only: with it, warn instead of raising on an op that has no deterministic kernel.

    Also sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` if unset (cuBLAS reads it when its handle is made, so
    enter the context before the first CUDA matmul for it to count).

    Example:
        >>> before = torch.backends.cudnn.benchmark
        >>> with debug_mode():
        ...     torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled()
        (True, True)
        >>> torch.backends.cudnn.benchmark == before
        True
    """
    saved_benchmark = torch.backends.cudnn.benchmark
    saved_cudnn_det = torch.backends.cudnn.deterministic
    saved_algos = torch.are_deterministic_algorithms_enabled()
    saved_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    saved_anomaly = torch.is_anomaly_enabled()
    saved_check_nan = torch.is_anomaly_check_nan_enabled()
    saved_env = os.environ.get(_CUBLAS_ENV)
    try:
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        if deterministic_algorithms:
            if saved_env is None:
                os.environ[_CUBLAS_ENV] = ":4096:8"
            torch.use_deterministic_algorithms(True, warn_only=warn_only)
        if detect_anomaly:
            torch.set_anomaly_enabled(True, check_nan)
        yield
    finally:
        torch.backends.cudnn.benchmark = saved_benchmark
        torch.backends.cudnn.deterministic = saved_cudnn_det
        torch.use_deterministic_algorithms(saved_algos, warn_only=saved_warn_only)
        torch.set_anomaly_enabled(saved_anomaly, saved_check_nan)
        if saved_env is None:
            os.environ.pop(_CUBLAS_ENV, None)
        else:
            os.environ[_CUBLAS_ENV] = saved_env
