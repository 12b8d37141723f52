"""The short accumulation path (``Metric.micro_writer``, ``capture/accumulate.py``) held to the
general path it replaces: the metrics' settled columns against the sums of their ``compute()``, and
whole runs with the short path against the same runs without it, every stored value and event.

The reference run turns the short path off by giving the built-in loss no micro writer (the path
needs one from every metric), so both runs see the same inputs through the same Tap.
"""

from __future__ import annotations

import math

import pytest
import torch

import batchtap as bt
from batchtap.capture.accumulate import SHORT_CAPACITY, MicroBatches
from batchtap.hostreads import HostReadCounter
from batchtap.metrics import Accuracy, Loss, StepInputs
from batchtap.metrics.accuracy import HITS_BUFFER_BYTES
from tests.conftest import ListSink

# (outputs shape, targets shape): [N, C]; [B, T, V] (classes last); [N, C, d] (classes at dim 1)
LAYOUTS = [((6, 5), (6,)), ((3, 7, 11), (3, 7)), ((4, 5, 9), (4, 9))]


def _micro(shape: tuple[int, ...], targets: tuple[int, ...], seed: int, *, ignore: int = -100) -> StepInputs:
    g = torch.Generator().manual_seed(seed)
    outputs = torch.randn(shape, generator=g)
    classes = shape[-1] if len(targets) == len(shape) - 1 and targets[1:] == shape[1:-1] else shape[1]
    y = torch.randint(0, classes, targets, generator=g)
    y[torch.rand(targets, generator=g) < 0.3] = ignore
    loss = torch.rand((), generator=g).to(torch.bfloat16) * 3  # a bf16 loss, as under autocast
    return StepInputs(loss, outputs, y, float(targets[0]))


@pytest.mark.parametrize(("outputs", "targets"), LAYOUTS)
@pytest.mark.parametrize("count", [1, 3, SHORT_CAPACITY])
def test_settled_columns_equal_the_sums_of_compute(outputs: tuple, targets: tuple, count: int) -> None:
    metrics = [Loss(), Accuracy()]
    micro = [_micro(outputs, targets, seed) for seed in range(count)]
    general = MicroBatches(metrics, torch.device("cpu"))
    for inputs in micro:
        general.add([v for m in metrics for v in m.compute(inputs)], samples=inputs.batch_size, tokens=None)
    writers = [m.micro_writer(micro[0], SHORT_CAPACITY) for m in metrics]
    assert all(w is not None for w in writers)
    for i, inputs in enumerate(micro):
        for w in writers:
            w.write(inputs, i)  # type: ignore[union-attr]
    settled = torch.stack([v.float() for w in writers for v in w.settle(count)])  # type: ignore[union-attr]
    summed = general.result() * torch.tensor([general.weight] + [1.0] * 8)  # undo the mean's division
    assert settled[0].item() == pytest.approx(summed[0].item(), rel=1e-6)  # sum of loss * samples
    assert torch.equal(settled[1:], summed[1:]), (settled, summed)  # counts and target range: exact


def test_a_step_of_ignored_targets_only_settles_like_compute() -> None:
    inputs = _micro((4, 5), (4,), 0)
    assert inputs.targets is not None
    inputs.targets.fill_(-100)
    acc = Accuracy()
    writer = acc.micro_writer(inputs, 4)
    assert writer is not None
    writer.write(inputs, 0)
    writer.write(inputs, 1)
    expected = [2 * v for v in acc.compute(inputs)[:3]] + list(acc.compute(inputs)[3:])
    assert [float(v) for v in writer.settle(2)] == [float(v) for v in expected]


def test_settings_the_writer_does_not_cover_take_compute() -> None:
    example = _micro((4, 5), (4,), 0)
    assert Accuracy(topk=(1, 3)).micro_writer(example, 8) is None
    assert Accuracy(ignore_index=None).micro_writer(example, 8) is None
    assert Accuracy(ignore_index=0).micro_writer(example, 8) is None  # an ignored value that is a class
    one_hot = StepInputs(None, example.outputs, torch.nn.functional.one_hot(torch.arange(4), 5), 4.0)
    assert Accuracy().micro_writer(one_hot, 8) is None


def test_capacity_shrinks_to_keep_counts_exact_and_buffers_bounded() -> None:
    targets = 2**21  # 8 micro-batches would be 2**24 targets: float32 counts stay exact at most that
    example = StepInputs(None, torch.empty((targets, 2)), torch.zeros(targets, dtype=torch.int64), float(targets))
    writer = Accuracy().micro_writer(example, SHORT_CAPACITY)
    assert writer is not None
    assert writer.capacity == min(SHORT_CAPACITY, 2**24 // targets, HITS_BUFFER_BYTES // (16 * targets))
    huge = 2**23 + 1  # not even two fit: every micro-batch is computed
    assert (
        Accuracy().micro_writer(StepInputs(None, torch.empty((huge, 2)), torch.zeros(huge, dtype=torch.int64), 1.0), 8)
        is None
    )


# ------------------------------------------------------------------ whole runs: short path vs general path


def _run(
    steps: list[list[StepInputs]], monkeypatch: pytest.MonkeyPatch, *, short: bool, autocast: bool = False
) -> ListSink:
    """Each step's micro-batches through tap.accumulate, then tap.step; the short path on or off."""
    sink = ListSink()
    with monkeypatch.context() as patch:
        if not short:
            patch.setattr(Loss, "micro_writer", lambda self, example, capacity: None)
        with bt.Tap([Loss(), Accuracy()], [sink], flush_every=3) as tap, tap.run():
            for micro in steps:
                for inputs in micro:
                    tap.accumulate(loss=inputs.loss, outputs=inputs.outputs, targets=inputs.targets)
                if autocast:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        tap.step()
                else:
                    tap.step()
    return sink


def _same_records(short: ListSink, general: ListSink) -> None:
    assert [r.step for r in short.records] == [r.step for r in general.records]
    for a, b in zip(short.records, general.records):
        assert a.values.keys() == b.values.keys(), a.step
        assert a.values["loss"] == pytest.approx(b.values["loss"], rel=1e-6), a.step
        assert a.values.get("accuracy") == b.values.get("accuracy"), a.step  # counts: exact
    assert [(e.step, e.kind, e.metric) for e in short.events] == [(e.step, e.kind, e.metric) for e in general.events]


def _steps(counts: list[int], shape: tuple = (3, 7, 11), targets: tuple = (3, 7)) -> list[list[StepInputs]]:
    seeds = iter(range(10_000))
    return [[_micro(shape, targets, next(seeds)) for _ in range(n)] for n in counts]


def test_runs_store_the_same_with_and_without_the_short_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 a step; one step past the writers' capacity (folded twice); an epoch's short last step
    steps = _steps([4, 4, 4, SHORT_CAPACITY + 3, 4, 1, 4])
    short, general = _run(steps, monkeypatch, short=True), _run(steps, monkeypatch, short=False)
    assert len(short.records) == len(steps)
    _same_records(short, general)


def test_micro_batches_of_another_shape_mid_step_join_the_same_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _steps([4, 4, 4])
    odd = _micro((2, 7, 11), (2, 7), 999)  # another signature: the general path, between short ones
    steps[2].insert(2, odd)
    steps.append([odd, *_steps([3])[0]])
    _same_records(_run(steps, monkeypatch, short=True), _run(steps, monkeypatch, short=False))


def test_a_step_closed_under_autocast_settles_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _steps([4, 4, 4, 4])
    short = _run(steps, monkeypatch, short=True, autocast=True)
    _same_records(short, _run(steps, monkeypatch, short=False))


def test_exact_weighted_loss_when_same_shaped_micro_batches_declare_other_sizes(sink: ListSink) -> None:
    """batch_size= (e.g. sequences kept after packing) weights the loss, on the short path too."""
    steps = _steps([4, 4, 4])
    sizes = [5, 3, 8, 1]
    with bt.Tap([Loss(), Accuracy()], [sink], flush_every=2) as tap, tap.run():
        for micro in steps:
            for inputs, size in zip(micro, sizes):
                tap.accumulate(loss=inputs.loss, outputs=inputs.outputs, targets=inputs.targets, batch_size=size)
            tap.step()
    for record, micro in zip(sink.records, steps):
        truth = sum(float(i.loss) * n for i, n in zip(micro, sizes)) / sum(sizes)  # type: ignore[arg-type]
        assert record.values["loss"] == pytest.approx(truth, rel=1e-6)


def test_a_nan_loss_on_the_short_path_stops_training_at_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _steps([4, 4, 4, 4, 4])
    steps[3][2].loss = torch.tensor(math.nan)  # a short-path micro-batch (the third of its step)
    seen = []
    for short in (True, False):
        sink = ListSink()
        with monkeypatch.context() as patch:
            if not short:
                patch.setattr(Loss, "micro_writer", lambda self, example, capacity: None)
            with bt.Tap([Loss(), Accuracy()], [sink], flush_every=10) as tap, tap.run():
                for step, micro in enumerate(steps):
                    for inputs in micro:
                        tap.accumulate(loss=inputs.loss, outputs=inputs.outputs, targets=inputs.targets)
                    tap.step()
                    if tap.should_stop:
                        break
        assert step == 3, short
        seen.append([(e.step, e.kind, e.metric) for e in sink.events])
    assert seen[0] == seen[1]
    assert seen[0] and {step for step, _, _ in seen[0]} == {3}, seen[0]


def test_out_of_range_targets_on_the_short_path_are_caught_as_on_the_general_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps = _steps([4, 4, 4])
    assert steps[1][3].targets is not None
    steps[1][3].targets[0, 0] = 11  # 11 classes: index 11 is out of range
    outcomes = []
    for short in (True, False):
        with pytest.raises(bt.InputError) as raised:
            _run(steps + _steps([4, 4, 4]), monkeypatch, short=short)
        outcomes.append(str(raised.value))
    assert outcomes[0] == outcomes[1]
    assert "11" in outcomes[0]


def test_no_host_read_on_the_short_path(sink: ListSink) -> None:
    steps = _steps([4] * 12)
    with bt.Tap([Loss(), Accuracy()], [sink], flush_every=50, capacity=100) as tap, tap.run():
        for i, micro in enumerate(steps):
            with HostReadCounter() as reads:
                for inputs in micro:
                    tap.accumulate(loss=inputs.loss, outputs=inputs.outputs, targets=inputs.targets)
                tap.step()
            if i >= 2:  # the run's first steps make the ring and the writers
                assert reads.count == 0, (i, reads.reads)
    assert len(sink.records) == 12
