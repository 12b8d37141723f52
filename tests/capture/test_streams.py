"""The run's CUDA stream: a step on another stream is refused (the stream lookup is a stand-in on
this CPU machine; the real one runs in the GPU tests)."""

from __future__ import annotations

import pytest
import torch

import batchtap as bt
from batchtap.capture.streams import StreamCheck, stream_check_for

CUDA = torch.device("cuda", 0)


def test_a_step_on_another_stream_is_refused_with_the_fix() -> None:
    current = ["stream-a"]
    check = StreamCheck(CUDA, key=lambda device: current[0])
    check.check()
    current[0] = "stream-b"
    with pytest.raises(bt.InputError, match=r"another CUDA stream than the run's first step.*wait_stream"):
        check.check()
    current[0] = "stream-a"
    check.check()  # back on the run's stream: fine


def test_no_check_off_cuda_or_without_a_cuda_runtime() -> None:
    assert stream_check_for(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert stream_check_for(CUDA) is None  # FakeTensorMode on a CPU-only build: no streams exist
