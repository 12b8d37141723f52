"""Accuracy on the layouts real loops pass (classifier, dense prediction, causal LM with padding),
against the masked reference F.cross_entropy's ignore_index implies."""

from __future__ import annotations

import math

import pytest
import torch

import batchtap as bt
from batchtap.metrics import StepInputs
from batchtap.metrics import functional as F
from tests.metrics._helpers import CountOps, accumulated, raw, step

# name -> (outputs shape, class dim, targets shape)
LAYOUTS = {
    "N,C": ((32, 7), 1, (32,)),
    "N,C,H,W": ((4, 6, 5, 3), 1, (4, 5, 3)),
    "B,T,V": ((3, 11, 13), -1, (3, 11)),
    "B,T,V-square": ((2, 9, 9), -1, (2, 9)),  # T == V: classes last, as documented
}


def _inputs(layout: str, seed: int, *, ignore_fraction: float = 0.3, dtype: torch.dtype = torch.float32):
    shape, class_dim, target_shape = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    outputs = (torch.randn(shape, generator=g) * 2).to(dtype)
    targets = torch.randint(0, shape[class_dim], target_shape, generator=g)
    targets[torch.rand(target_shape, generator=g) < ignore_fraction] = -100
    return outputs, targets, class_dim


def _reference(outputs, targets, class_dim, k, ignore_index=-100):
    """Top-k accuracy over the kept targets, computed the ordinary way (host, float64)."""
    scores = outputs.float().movedim(class_dim, -1).reshape(-1, outputs.shape[class_dim])
    flat = targets.reshape(-1)
    keep = flat != ignore_index if ignore_index is not None else torch.ones_like(flat, dtype=torch.bool)
    top = scores.topk(k, dim=1).indices
    hit = (top == flat[:, None]).any(1)
    return hit[keep].double().sum().item() / keep.sum().item()


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("topk", [(1,), (1, 3)], ids=["top1", "top1+3"])
@pytest.mark.parametrize("seed", [0, 1])
def test_accuracy_over_kept_targets_matches_reference(layout, topk, seed) -> None:
    outputs, targets, class_dim = _inputs(layout, seed)
    metric = bt.metrics.Accuracy(topk=topk)
    inputs = StepInputs(None, outputs, targets, float(outputs.shape[0]))
    metric.check(inputs)
    got = step(metric, inputs)
    assert got == pytest.approx([_reference(outputs, targets, class_dim, k) for k in topk], abs=1e-12)
    assert metric.input_error(raw(metric, inputs)) is None  # -100 is ignored, not out of range


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_sequence_logits(dtype) -> None:
    outputs, targets, class_dim = _inputs("B,T,V", 3, dtype=dtype)
    got = step(bt.metrics.Accuracy(), StepInputs(None, outputs, targets, 3.0))
    assert got == pytest.approx([_reference(outputs, targets, class_dim, 1)], abs=1e-12)


def test_ignore_index_none_counts_every_target_and_other_ignore_values() -> None:
    outputs, targets, class_dim = _inputs("B,T,V", 4, ignore_fraction=0.0)
    inputs = StepInputs(None, outputs, targets, 3.0)
    assert step(bt.metrics.Accuracy(ignore_index=None), inputs) == pytest.approx(
        [_reference(outputs, targets, class_dim, 1, ignore_index=None)], abs=1e-12
    )
    padded = targets.clone()
    padded[:, -4:] = 0  # pad token id 0
    assert step(bt.metrics.Accuracy(ignore_index=0), StepInputs(None, outputs, padded, 3.0)) == pytest.approx(
        [_reference(outputs, padded, class_dim, 1, ignore_index=0)], abs=1e-12
    )


def test_every_target_ignored_gives_no_accuracy_and_no_error() -> None:
    outputs = torch.randn(2, 5, 4)
    targets = torch.full((2, 5), -100)
    metric = bt.metrics.Accuracy(topk=(1, 2))
    inputs = StepInputs(None, outputs, targets, 2.0)
    assert step(metric, inputs) == [None, None]
    assert metric.input_error(raw(metric, inputs)) is None


@pytest.mark.parametrize(
    ("bad", "ignore_index", "smallest", "largest"),
    [
        pytest.param(7, -100, 0, 7, id="target-equal-to-C"),
        pytest.param(-1, -100, -1, 6, id="target-minus-1"),
        pytest.param(-100, None, -100, 6, id="minus-100-without-ignore_index"),
        pytest.param(-100, 3, -100, 6, id="minus-100-with-another-ignore_index"),
    ],
)
def test_each_target_boundary_alone_is_an_input_error(bad, ignore_index, smallest, largest) -> None:
    g = torch.Generator().manual_seed(5)
    outputs = torch.randn(40, 7, generator=g)
    targets = torch.randint(0, 7, (40,), generator=g)
    targets[0], targets[1] = 0, 6  # the valid extremes are there too: only `bad` is out of range
    targets[3] = bad
    metric = bt.metrics.Accuracy(ignore_index=ignore_index)
    message = metric.input_error(raw(metric, StepInputs(None, outputs, targets, 40.0)))
    assert message is not None
    assert f"outside [0, 7) (smallest {smallest}, largest {largest}) for outputs with 7 classes" in message
    left_out = f" (targets equal to {ignore_index} left out)"
    assert message.count(left_out if ignore_index is not None else "left out") == (ignore_index is not None)


def test_valid_extremes_and_ignored_targets_are_no_error() -> None:
    outputs = torch.randn(6, 7)
    targets = torch.tensor([0, 6, -100, 3, -100, 6])
    metric = bt.metrics.Accuracy()
    assert metric.input_error(raw(metric, StepInputs(None, outputs, targets, 6.0))) is None


def test_float_targets_message_names_both_fixes() -> None:
    metric = bt.metrics.Accuracy()
    with pytest.raises(bt.InputError) as info:
        metric.check(StepInputs(None, torch.randn(4, 3), torch.rand(4, 3), 4.0))
    assert str(info.value) == (
        "Accuracy needs integer class indices as targets, got float32 targets: for regression leave Accuracy "
        "out (the default metrics leave it out by themselves for floating-point targets); for one-hot or soft "
        "labels pass targets.argmax(-1) (integer one-hot targets of the outputs' shape are taken as their argmax)"
    )


@pytest.mark.parametrize(
    ("outputs", "targets", "message"),
    [
        pytest.param(
            (2, 5, 7),
            (2, 6),
            r"fit neither layout .* \[2, 5\] \(classes last, .*\[2, 7\] \(classes at dim 1",
            id="3d-neither",
        ),
        pytest.param(
            (8, 4), (8, 2), r"targets must have shape \[8\] for outputs of shape \[8, 4\], got \[8, 2\]", id="2d"
        ),
        pytest.param((8, 4), (6,), r"outputs and targets disagree on batch size: 8 vs 6", id="batch"),
    ],
)
def test_shape_mismatch_names_the_accepted_layouts(outputs, targets, message) -> None:
    inputs = StepInputs(None, torch.randn(outputs), torch.zeros(targets, dtype=torch.long), 2.0)
    with pytest.raises(bt.InputError, match=message):
        bt.metrics.Accuracy().check(inputs)


def test_topk_larger_than_classes_in_the_class_dim() -> None:
    inputs = StepInputs(None, torch.randn(2, 9, 4), torch.zeros(2, 9, dtype=torch.long), 2.0)  # V = 4
    with pytest.raises(bt.InputError, match=r"needs at least 5 classes, outputs have 4"):
        bt.metrics.Accuracy(topk=(1, 5)).check(inputs)


@pytest.mark.parametrize(
    ("outputs", "targets", "expected"),
    [
        pytest.param(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]), True, id="int-targets"),
        pytest.param(torch.randn(2, 5, 3), torch.randint(0, 3, (2, 5), dtype=torch.int32), True, id="lm-int32"),
        pytest.param(torch.randn(4, 1), torch.randn(4, 1), False, id="regression"),
        pytest.param(torch.randn(4, 3), torch.rand(4, 3), False, id="soft-labels"),
        pytest.param(torch.randn(4), torch.tensor([0, 1, 1, 0]), False, id="1d-outputs"),
        pytest.param(torch.randn(4, 2), torch.tensor([True, False, True, True]), False, id="bool-targets"),
        pytest.param(torch.randint(0, 3, (4, 3)), torch.tensor([0, 1, 2, 0]), False, id="int-outputs"),
        pytest.param(torch.randn(4, 3), None, False, id="no-targets"),
    ],
)
def test_applies_only_to_float_scores_with_integer_targets(outputs, targets, expected) -> None:
    assert bt.metrics.Accuracy().applies(StepInputs(torch.tensor(1.0), outputs, targets, 4.0)) is expected


def test_micro_batches_combine_to_accuracy_over_every_kept_target() -> None:
    metric = bt.metrics.Accuracy(topk=(1, 3))
    micro = [_inputs("B,T,V", seed, ignore_fraction=f) for seed, f in ((10, 0.1), (11, 0.6), (12, 1.0), (13, 0.0))]
    raws = accumulated(metric, [StepInputs(None, o, t, float(o.shape[0])) for o, t, _ in micro])
    outputs = torch.cat([o for o, _, _ in micro])
    targets = torch.cat([t for _, t, _ in micro])
    assert metric.finalize(raws, None) == pytest.approx(  # type: ignore[arg-type]
        [_reference(outputs, targets, -1, k) for k in (1, 3)], abs=1e-12
    )
    assert metric.input_error(raws) is None


def test_micro_batch_with_a_bad_target_is_an_error_of_the_step() -> None:
    metric = bt.metrics.Accuracy(check_targets_every=1)
    good = StepInputs(None, torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3)), 2.0)
    bad_targets = torch.randint(0, 5, (2, 3))
    bad_targets[1, 1] = 5
    raws = accumulated(metric, [good, StepInputs(None, torch.randn(2, 3, 5), bad_targets, 2.0), good])
    assert "outside [0, 5)" in (metric.input_error(raws) or "")


def test_combine_declaration() -> None:
    C = bt.metrics.Combine
    # correct per k, ignored, positions: low parts, then high parts; then the target range
    assert bt.metrics.Accuracy().combine() == (C.SUM,) * 6 + (C.MIN, C.MAX)
    assert bt.metrics.Accuracy(topk=(1, 5)).combine() == (C.SUM,) * 8 + (C.MIN, C.MAX)
    assert bt.metrics.Accuracy().per_micro_batch


def test_counts_stay_exact_past_2_pow_24_targets() -> None:
    # 2**24 + 6 positions, one ignored: 2**24 + 5 kept, 2**24 + 3 correct; neither fits float32
    n = 2**24 + 6
    targets = torch.ones(n, dtype=torch.long)
    targets[-1] = -100
    outputs = torch.zeros(n, 2, dtype=torch.float16)
    outputs[:, 1] = 1.0
    outputs[:2, 0] = 2.0  # two wrong predictions
    metric = bt.metrics.Accuracy()
    inputs = StepInputs(None, outputs, targets, float(n))
    columns = raw(metric, inputs)
    assert columns[0] + columns[3] * 2**24 == 2**24 + 3  # correct: low part + high part
    assert columns[1] + columns[4] * 2**24 == 1  # ignored
    assert columns[2] + columns[5] * 2**24 == 2**24 + 6  # positions: kept = positions - ignored
    assert metric.finalize(columns, None) == [(2**24 + 3) / (2**24 + 5)]  # type: ignore[arg-type]
    assert float(torch.tensor(2**24 + 3, dtype=torch.float32)) != 2**24 + 3  # why the split is needed
    del outputs
    # every target counts (uint8 cannot hold -100): the kept count is the host-known size
    small = torch.ones(n, dtype=torch.uint8)
    logits = torch.zeros(n, 2, dtype=torch.float16)
    logits[:, 1] = 1.0
    logits[:1, 0] = 2.0
    assert step(metric, StepInputs(None, logits, small, float(n))) == [(n - 1) / n]


@pytest.mark.parametrize(
    "count", [0, 5, 2**24 - 1, 2**24, 2**24 + 1, 3 * 2**24 + 12345, 2**40 + 7], ids=lambda c: f"count={c}"
)
def test_split_count_parts_are_exact_in_float32(count) -> None:
    low, high = F.split_count(torch.tensor(count))
    low32, high32 = low.float(), high.float()
    assert int(low32) == int(low) and int(high32) == int(high)
    assert int(high32) * 2**24 + int(low32) == count


def test_common_path_is_a_handful_of_device_ops() -> None:
    outputs, targets, _ = _inputs("B,T,V", 6)
    inputs = StepInputs(None, outputs, targets, 3.0)
    with_ignore, without = bt.metrics.Accuracy(), bt.metrics.Accuracy(ignore_index=None)
    for metric in (with_ignore, without):
        metric.compute(inputs)  # constants are made at the first step
    with torch.no_grad(), CountOps() as counted:
        with_ignore.compute(inputs)
    assert len(counted.ops) <= 7, counted.ops  # argmax, eq, sum; ne, sum (kept); mul, aminmax (range)
    with torch.no_grad(), CountOps() as counted:
        without.compute(inputs)
    assert len(counted.ops) <= 4, counted.ops


def test_layout_dims_are_not_reshaped() -> None:
    # a non-contiguous [N, C, H, W] (channels-last) is scored where it lies
    outputs = torch.randn(2, 4, 6, 5).to(memory_format=torch.channels_last)
    targets = torch.randint(0, 4, (2, 6, 5))
    got = step(bt.metrics.Accuracy(topk=(1, 2)), StepInputs(None, outputs, targets, 2.0))
    assert got == pytest.approx([_reference(outputs, targets, 1, k) for k in (1, 2)], abs=1e-12)
    assert not math.isnan(got[0])


def test_targets_are_checked_at_every_call() -> None:
    # issue 29: a sampled check (check_targets_every) let the steps between checks store
    # accuracies of out-of-range targets; the setting is kept for old code and ignored
    metric = bt.metrics.Accuracy(check_targets_every=4)
    outputs = torch.randn(6, 5)
    bad = torch.randint(0, 5, (6,))
    bad[2] = 5  # == classes: the upper boundary alone
    negative = torch.randint(0, 5, (6,))
    negative[0] = -1  # the lower boundary alone
    for call in range(9):
        for targets in (bad, negative):
            raw = [float(v) for v in metric.compute(StepInputs(None, outputs, targets, 6.0))]
            raw += list(metric.read_host(StepInputs(None, outputs, targets, 6.0)))
            error = metric.input_error(raw)
            assert error is not None and "outside [0, 5)" in error, (call, error)


@pytest.mark.parametrize("bad", [1.5, "-100", True], ids=["float", "str", "bool"])
def test_ignore_index_must_be_an_integer_or_none(bad: object) -> None:
    with pytest.raises(bt.ConfigError, match=rf"Accuracy ignore_index must be an integer or None, got {bad!r}"):
        bt.metrics.Accuracy(ignore_index=bad)  # type: ignore[arg-type]


def test_check_targets_every_must_be_a_positive_integer() -> None:
    with pytest.raises(bt.ConfigError, match="check_targets_every must be a positive integer, got 0"):
        bt.metrics.Accuracy(check_targets_every=0)


@pytest.mark.parametrize("shape", [(16, 7), (4, 9, 7)], ids=["classifier", "lm"])
def test_fused_counts_of_the_gpu_path_equal_the_plain_counts(shape: tuple[int, ...]) -> None:
    # Off the CPU, hits and kept flags are counted by one reduction over a shared buffer; forced
    # here on the CPU to compare its values with the plain path, step after step (buffer reuse).
    g = torch.Generator().manual_seed(3)
    plain, fused = bt.metrics.Accuracy(), bt.metrics.Accuracy()
    fused._fuse_counts = True
    for _ in range(5):
        outputs = torch.randn(*shape, generator=g)
        targets = torch.randint(0, 7, shape[:-1], generator=g)
        targets.view(-1)[::3] = -100
        inputs = StepInputs(None, outputs, targets, float(shape[0]))
        assert [float(v) for v in fused.compute(inputs)] == [float(v) for v in plain.compute(inputs)]
    assert fused._facts is not None and fused._facts.counts is not None, "the fused path ran"


def test_a_class_index_as_ignore_index_keeps_the_plain_path_and_masks_hits() -> None:
    # ignore_index=0 (a pad id that is also a class): a prediction of 0 on an ignored target is no
    # hit. The fused counting cannot mask hits, so it must not be used there even when forced.
    g = torch.Generator().manual_seed(4)
    plain, forced = bt.metrics.Accuracy(ignore_index=0), bt.metrics.Accuracy(ignore_index=0)
    forced._fuse_counts = True
    outputs = torch.randn(24, 5, generator=g)
    targets = outputs.argmax(1)  # every prediction right...
    targets[::2] = 0  # ...and half the targets are padding, some of them predicted as 0
    inputs = StepInputs(None, outputs, targets, 24.0)
    kept = targets != 0
    expected = float((outputs.argmax(1)[kept] == targets[kept]).float().mean())
    assert step(plain, inputs) == [expected] == [1.0]
    assert step(forced, inputs) == [expected]
    assert forced._facts is not None and forced._facts.counts is None, "the fused path cannot mask hits"


@pytest.mark.parametrize(
    ("dtype", "ignore"),
    [(torch.uint8, 255), (torch.int8, 127), (torch.int8, -128)],
    ids=["uint8-max", "int8-max", "int8-min"],
)
def test_an_ignore_index_at_the_edge_of_the_target_dtype_is_ignored(dtype: torch.dtype, ignore: int) -> None:
    g = torch.Generator().manual_seed(6)
    outputs = torch.randn(10, 4, generator=g)
    targets = torch.randint(0, 4, (10,), generator=g).to(dtype)
    targets[[1, 4, 7]] = ignore
    metric = bt.metrics.Accuracy(ignore_index=ignore, check_targets_every=1)
    inputs = StepInputs(None, outputs, targets, 10.0)
    kept = targets.long() != ignore
    expected = float((outputs.argmax(1)[kept] == targets.long()[kept]).float().mean())
    assert step(metric, inputs) == [expected]
    assert metric.input_error(raw(metric, inputs)) is None  # the ignored value is no bad index


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 64, 65), (4, 65, 64), (32, 10), (2, 3000)])
def test_top1_indices_are_argmax_ties_nans_and_infinities_included(shape, dtype) -> None:
    """The CPU path past ``CPU_MAX_FROM`` scores takes ``max(dim).indices``: the first highest score,
    a NaN counting as the highest, as ``argmax`` says."""
    g = torch.Generator().manual_seed(sum(shape))
    for trial in range(12):
        scores = torch.randint(-2, 3, shape, generator=g).to(dtype)  # many ties
        for value, fraction in ((float("nan"), 0.03 * (trial % 3)), (float("-inf"), 0.2), (float("inf"), 0.02)):
            scores[torch.rand(shape, generator=g) < fraction] = value
        for dim in (1, -1):
            assert torch.equal(F.top1_indices(scores, dim), scores.argmax(dim))
    assert (math.prod(shape) >= F.CPU_MAX_FROM) == (shape != (32, 10))
