"""Metric.row_writer: what a metric writes straight into its ring columns on the short step path
must be exactly what compute() gives, stacked as the general path stacks it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import batchtap as bt
import batchtap.metrics.accuracy as accuracy_module
from batchtap.metrics import Metric, StepInputs
from batchtap.metrics.base import settle_of
from tests.metrics._helpers import CountOps

CAPACITY = 4


@pytest.fixture(params=["counted at the flush", "counted at each step"])
def hits_counted(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The accuracy writer both ways: per-slot hit flags counted when the rows are flushed (the
    default), and one shared buffer counted at every step (targets too large for per-slot flags)."""
    if request.param == "counted at each step":
        monkeypatch.setattr(accuracy_module, "HITS_BUFFER_BYTES", 0)
    return str(request.param)


def _compute_row(metric: Metric, inputs: StepInputs) -> list[float]:
    with torch.no_grad():
        values = list(metric.compute(inputs))
    return torch.stack([v.float() for v in values]).tolist()


def _written_rows(metric: Metric, steps: list[StepInputs], stale: float = 7.0, block: int = 1) -> list[list[float]]:
    """Each step written by the metric's writer into slot ``step % CAPACITY`` of a ring whose
    rows first hold ``stale`` values (another writer's row: the first write of a slot is fresh),
    and read back ``block`` steps at a time, after the writer's ``settle`` (if any) of those slots,
    as the ring's flush does (``block`` divides ``CAPACITY``: a flush never wraps within a run)."""
    columns = torch.full((CAPACITY, metric.device_width), stale)
    write = metric.row_writer(steps[0], columns)
    settle = settle_of(write)
    rows = []
    with torch.no_grad(), CountOps() as counted:
        for first in range(0, len(steps), block):
            chunk = steps[first : first + block]
            for i, inputs in enumerate(chunk, first):
                write(inputs, i % CAPACITY, i < CAPACITY)
            if settle is not None:
                settle(first % CAPACITY, len(chunk))
            rows.extend(columns[i % CAPACITY].tolist() for i in range(first, first + len(chunk)))
    assert counted.host_reads == []
    return rows


def _accuracy_steps(
    shape: tuple[int, ...], classes: int, class_dim: int, pad: int | None, n: int = 11
) -> list[StepInputs]:
    gen = torch.Generator().manual_seed(sum(shape) + classes)
    steps = []
    for i in range(n):
        targets = torch.randint(0, classes, shape, generator=gen)
        if pad is not None:
            # padding that changes from step to step: none, some, all (no accuracy at that step)
            share = (0.0, 0.3, 1.0, 0.6)[i % 4]
            targets[torch.rand(shape, generator=gen) < share] = pad
        score_shape = (*shape, classes) if class_dim == -1 else (shape[0], classes, *shape[1:])
        outputs = torch.randn(score_shape, generator=gen)
        if i == 5:
            outputs[..., 0] = outputs[..., 0].clone()  # a copy: the writer must not rely on identity
        steps.append(StepInputs(None, outputs, targets, float(shape[0])))
    return steps


@pytest.mark.parametrize(
    ("shape", "classes", "class_dim"),
    [((32,), 10, -1), ((4, 9), 13, -1), ((3, 5, 2), 6, 1), ((6,), 2, -1)],
    ids=["NxC", "BxTxV", "NxCxd1xd2", "two-classes"],
)
@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("block", [1, 2, 4], ids=["flush-1", "flush-2", "flush-4"])
def test_accuracys_writer_writes_what_compute_gives(
    shape: tuple[int, ...], classes: int, class_dim: int, every: int, block: int, hits_counted: str
) -> None:
    steps = _accuracy_steps(shape, classes, class_dim, pad=-100, n=12)
    by_compute = bt.metrics.Accuracy(check_targets_every=every)
    expected = [_compute_row(by_compute, inputs) for inputs in steps]
    by_writer = bt.metrics.Accuracy(check_targets_every=every)
    write = by_writer.row_writer(steps[0], torch.zeros(CAPACITY, by_writer.device_width))
    assert (settle_of(write) is not None) == (hits_counted == "counted at the flush")
    assert _written_rows(by_writer, steps, block=block) == expected


def test_accuracys_flush_count_takes_five_ops_for_a_block_and_two_a_step(hits_counted: str) -> None:
    steps = _accuracy_steps((4, 9), 13, -1, pad=-100, n=CAPACITY)
    metric = bt.metrics.Accuracy(check_targets_every=1000)
    columns = torch.zeros(CAPACITY, metric.device_width)
    write = metric.row_writer(steps[0], columns)
    with torch.no_grad():
        write(steps[0], 0, True)  # the first: range check and constant columns
        with CountOps() as per_step:
            for slot, inputs in enumerate(steps[1:], 1):
                write(inputs, slot, False)
        settle = settle_of(write)
        with CountOps() as at_flush:
            if settle is not None:
                settle(0, CAPACITY)
    kernels = lambda ops: [op for op in ops if not any(v in op for v in ("slice", "select", "view", "alias"))]  # noqa: E731
    # counted at the flush: argmax and sub a step; eq, sum, where, amin, amax (the range of
    # every step's targets) for the block. At each step: argmax, eq, mm, add, aminmax.
    at_flush_counted = hits_counted == "counted at the flush"
    counts = (len(kernels(per_step.ops)), len(kernels(at_flush.ops)))
    expected = ((CAPACITY - 1) * 2, 5) if at_flush_counted else ((CAPACITY - 1) * 5, 0)
    assert counts == expected, (per_step.ops, at_flush.ops)


def test_accuracys_writer_takes_int32_targets_and_a_sampled_range_that_shows_a_bad_index(hits_counted: str) -> None:
    steps = _accuracy_steps((16,), 5, -1, pad=-100, n=6)
    for inputs in steps:
        inputs.targets = inputs.targets.int()  # type: ignore[union-attr]
    steps[3].targets[2] = 9  # type: ignore[index]  # out of range: shown by the range columns
    by_compute = bt.metrics.Accuracy(check_targets_every=1)
    expected = [_compute_row(by_compute, inputs) for inputs in steps]
    metric = bt.metrics.Accuracy(check_targets_every=1)
    rows = _written_rows(metric, steps)
    assert rows == expected
    assert "outside [0, 5)" in (metric.input_error(rows[3] + [5.0, 0.0]) or "")


@pytest.mark.parametrize(
    "settings",
    [{"topk": (1, 3)}, {"ignore_index": 0}, {"ignore_index": None}],
    ids=["top-k", "ignored-value-is-a-class", "no-ignore-index"],
)
def test_other_accuracy_settings_take_the_default_writer_and_agree_too(settings: dict[str, Any]) -> None:
    steps = _accuracy_steps((4, 7), 5, -1, pad=0 if settings.get("ignore_index") == 0 else None)
    by_compute = bt.metrics.Accuracy(**settings)
    expected = [_compute_row(by_compute, inputs) for inputs in steps]
    assert _written_rows(bt.metrics.Accuracy(**settings), steps) == expected


def test_the_loss_writer_casts_to_float32_as_the_stack_does() -> None:
    steps = [StepInputs(torch.tensor(v, dtype=torch.bfloat16), None, None, 1.0) for v in (0.1, 2.5, float("nan"))]
    expected = [_compute_row(bt.metrics.Loss(), inputs) for inputs in steps]
    rows = _written_rows(bt.metrics.Loss(), steps)
    assert str(rows) == str(expected)  # NaN included


def test_the_default_writer_fills_one_column_and_stacks_several() -> None:
    one = bt.metrics.Custom("double", lambda loss: loss * 2, requires=("loss",))
    steps = [StepInputs(torch.tensor(v), None, None, 1.0) for v in (0.5, 1.5, 3.0, 4.0, 5.0)]
    assert _written_rows(one, steps) == [_compute_row(one, s) for s in steps]

    class Pair(Metric):
        device_width = 2
        requires = frozenset({"loss"})

        def outputs(self) -> tuple[bt.metrics.Output, ...]:
            return (bt.metrics.Output("a", bt.metrics.ANY_FINITE), bt.metrics.Output("b", bt.metrics.ANY_FINITE))

        def compute(self, inputs: StepInputs) -> tuple[torch.Tensor, ...]:
            assert inputs.loss is not None
            return inputs.loss, inputs.loss + 1

    pair = Pair()
    assert _written_rows(pair, steps) == [_compute_row(pair, s) for s in steps]
