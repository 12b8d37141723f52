"""Issue 29, items 1, 3, 9 and issue 27's silent traps: no stored accuracy comes from unchecked
targets, a layout that fits two readings is said so (and settled by ``class_dim``), integer one-hot
targets are scored, and the fused count stays exact past float16's reach."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF

import batchtap as bt
import batchtap.metrics.accuracy as accuracy_module
from batchtap.metrics import StepInputs
from tests.conftest import ListSink
from tests.metrics._helpers import raw

PATHS = ["short-flags-at-flush", "short-counted-each-step", "general"]


def _reference(outputs: torch.Tensor, targets: torch.Tensor, class_dim: int, ignore: int) -> float | None:
    kept = targets != ignore
    if not kept.any():
        return None
    hits = outputs.argmax(class_dim).eq(targets) & kept
    return float(hits.sum()) / float(kept.sum())


def _batches(bad_step: int, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[B, T, V] logits with -100 padding; step ``bad_step`` also pads with -1 (nanoGPT's value)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        logits = torch.randn(3, 8, 6, generator=g)
        targets = torch.randint(0, 6, (3, 8), generator=g)
        targets[:, -2:] = -100
        if step == bad_step:
            targets[1, 3:] = -1
        out.append((logits, targets))
    return out


def _tap(
    path: str, sink: ListSink, flush_every: int, monkeypatch: pytest.MonkeyPatch, ignore_index: int = -100
) -> bt.Tap:
    if path == "short-counted-each-step":
        monkeypatch.setattr(accuracy_module, "HITS_BUFFER_BYTES", 0)
    metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(ignore_index=ignore_index)]
    # sample_every=2 takes the general path at every sampled step
    sample_every = 2 if path == "general" else 1
    return bt.Tap(
        metrics, [sink], flush_every=flush_every, flush_seconds=3600, sample_every=sample_every, pipeline="thread"
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("flush_every", [1, 4])
def test_minus_one_padding_between_checks_is_never_stored_as_an_accuracy(
    path: str, flush_every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nanoGPT pads with -1; Accuracy() ignores -100. Step 10 (not a multiple of the old
    # check_targets_every=16) holds -1 targets: it used to store a wrong accuracy with no event.
    sink = ListSink()
    batches = _batches(bad_step=10, steps=60)
    tap = _tap(path, sink, flush_every, monkeypatch)
    with pytest.raises(bt.InputError) as raised, tap:
        with tap.run(name="pad"):
            for step, (logits, targets) in enumerate(batches):
                tap.step(loss=torch.tensor(1.0), outputs=logits, targets=targets)
                if step > 10:
                    tap.flush()
    # the error names the bad step, whatever the pipeline's timing
    assert str(raised.value).startswith("step 10: targets hold class indices outside [0, 6) (smallest -1")
    assert "Accuracy(ignore_index=-1)" in str(raised.value)
    stored = {r.step: r.values.get("accuracy") for r in sink.records}
    sampled = [s for s in range(60) if path != "general" or s % 2 == 0]
    assert 10 in stored and set(stored) <= set(sampled)
    for step, value in stored.items():
        logits, targets = batches[step]
        if step == 10:
            assert value is not None and math.isnan(value)
        else:
            assert value == pytest.approx(_reference(logits, targets, -1, -100), abs=1e-12), step
    anomalies = [e for e in sink.events if e.kind is bt.EventKind.ANOMALY]
    assert [(e.step, e.metric) for e in anomalies] == [(10, "accuracy")]
    assert "smallest -1" in anomalies[0].message
    assert sink.ended[0].status is bt.RunStatus.FAILED


@pytest.mark.parametrize("path", PATHS)
def test_the_padding_value_as_ignore_index_stores_exact_accuracies(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = ListSink()
    batches = _batches(bad_step=-1, steps=20)
    for _, targets in batches:
        targets[targets == -100] = -1
    tap = _tap(path, sink, 4, monkeypatch, ignore_index=-1)
    with tap, tap.run():
        for logits, targets in batches:
            tap.step(loss=torch.tensor(1.0), outputs=logits, targets=targets)
    assert sink.records and not sink.events
    for record in sink.records:
        logits, targets = batches[record.step]
        assert record.values["accuracy"] == pytest.approx(_reference(logits, targets, -1, -1), abs=1e-12)


def test_every_micro_batch_is_checked_under_accumulation() -> None:
    sink = ListSink()
    batches = _batches(bad_step=5, steps=8)
    with pytest.raises(bt.InputError, match=r"^step 2: targets hold class indices outside \[0, 6\)"):
        with bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=1) as tap, tap.run():
            for i in range(0, 8, 2):
                for logits, targets in batches[i : i + 2]:
                    tap.accumulate(loss=torch.tensor(1.0), outputs=logits, targets=targets)
                tap.step()
                tap.flush()
            for _ in range(50):
                tap.flush()
                tap.step(loss=torch.tensor(1.0))
    assert math.isnan(sink.records[2].values["accuracy"])


def test_fused_count_is_exact_past_2048_hits() -> None:
    # Item 9: float16 counts (4,003 hits stored as 4,004) must fail this. Off the CPU the general
    # path counts hits and ignored targets in one reduction (forced here with _fuse_counts).
    n, hits = 5000, 4003
    outputs = torch.zeros(n, 3)
    outputs[:, 1] = 1.0  # every prediction is class 1
    targets = torch.full((n,), 2)
    targets[:hits] = 1
    targets[-7:] = -100  # ignored, not hits
    metric = bt.metrics.Accuracy()
    metric._fuse_counts = True
    columns = raw(metric, StepInputs(None, outputs, targets, float(n)))
    assert metric._facts is not None and metric._facts.counts is not None, "the fused path ran"
    assert columns[0] == hits and columns[1] == 7
    assert metric.finalize(columns, None) == [hits / (n - 7)]  # type: ignore[arg-type]


def _layout_loop(class_dim: int | None, shapes: list[tuple[int, int, int]]) -> tuple[ListSink, list]:
    g = torch.Generator().manual_seed(7)
    sink = ListSink()
    batches = []
    for a, b, c in shapes:
        outputs = torch.randn(a, b, c, generator=g)
        # targets [a, b]: classes at dim 1 index [0, b), classes last index [0, c)
        targets = torch.randint(0, min(b, c), (a, c if class_dim == 1 else b), generator=g)
        if class_dim == 1 or (class_dim is None and b == c):
            targets = torch.randint(0, b, (a, c), generator=g)
        targets[0, 0] = -100
        batches.append((outputs, targets))
    metric = bt.metrics.Accuracy() if class_dim is None else bt.metrics.Accuracy(class_dim=class_dim)
    with bt.Tap([bt.metrics.Loss(), metric], [sink], flush_every=2) as tap, tap.run():
        for outputs, targets in batches:
            tap.step(loss=torch.tensor(1.0), outputs=outputs, targets=targets)
    return sink, batches


def test_an_ambiguous_layout_is_noted_once_at_its_step() -> None:
    # [a, b, c] with b != c is unambiguous; [8, 5, 5] and [3, 5, 5] fit both readings
    sink, batches = _layout_loop(None, [(8, 5, 7), (8, 5, 7), (8, 5, 5), (8, 5, 7), (3, 5, 5)])
    notes = [e for e in sink.events if e.kind is bt.EventKind.INFO]  # an assumption: a note, not a warning
    assert [e.step for e in notes] == [2] and [e.kind for e in sink.events] == [bt.EventKind.INFO]
    assert "class_dim=1" in notes[0].message and "class_dim=-1" in notes[0].message
    for record in sink.records:  # classes taken to be last, as before
        outputs, targets = batches[record.step]
        assert record.values["accuracy"] == pytest.approx(_reference(outputs, targets, -1, -100), abs=1e-12)


@pytest.mark.parametrize("class_dim", [1, -1])
def test_class_dim_settles_the_layout_exactly_with_no_warning(class_dim: int) -> None:
    sink, batches = _layout_loop(class_dim, [(8, 5, 5), (3, 5, 5), (8, 5, 5)])
    assert not sink.events
    for record in sink.records:
        outputs, targets = batches[record.step]
        expected = _reference(outputs, targets, class_dim, -100)
        assert record.values["accuracy"] == pytest.approx(expected, abs=1e-12)


def test_class_dim_1_matches_the_cross_entropy_reading_where_classes_last_differs() -> None:
    # the issue's [8, 5, 5] case: the two readings give different numbers
    g = torch.Generator().manual_seed(1)
    outputs = torch.randn(8, 5, 5, generator=g)
    targets = outputs.argmax(1)  # right under the [N, C, d] reading
    dim1 = bt.metrics.Accuracy(class_dim=1)
    value = dim1.finalize(raw(dim1, StepInputs(None, outputs, targets, 8.0)), None)  # type: ignore[arg-type]
    assert value == [1.0] == [_reference(outputs, targets, 1, -100)]
    assert _reference(outputs, targets, 1, -100) != _reference(outputs, targets, -1, -100)
    # and cross_entropy reads [N, C, d] the same way
    assert torch.isfinite(TF.cross_entropy(outputs, targets))


@pytest.mark.parametrize(
    ("class_dim", "outputs", "targets", "message"),
    [
        (1, (2, 5, 7), (2, 5), r"Accuracy\(class_dim=1\) needs targets of shape \[2, 7\] .* got \[2, 5\]"),
        (-1, (2, 5, 7), (2, 7), r"Accuracy\(class_dim=-1\) needs targets of shape \[2, 5\] .* got \[2, 7\]"),
    ],
)
def test_class_dim_that_does_not_fit_is_a_clear_error(class_dim, outputs, targets, message) -> None:
    inputs = StepInputs(None, torch.randn(outputs), torch.zeros(targets, dtype=torch.long), 2.0)
    with pytest.raises(bt.InputError, match=message):
        bt.metrics.Accuracy(class_dim=class_dim).check(inputs)


@pytest.mark.parametrize("bad", [0, 2, -2, True, "last"])
def test_class_dim_must_be_1_or_minus_1(bad: object) -> None:
    with pytest.raises(bt.ConfigError, match=r"class_dim must be 1 .*, -1 .* or None"):
        bt.metrics.Accuracy(class_dim=bad)  # type: ignore[arg-type]


def test_integer_one_hot_targets_are_scored_against_their_argmax_with_one_note() -> None:
    g = torch.Generator().manual_seed(2)
    sink = ListSink()
    batches = [(torch.randn(16, 4, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(6)]
    with bt.Tap(None, [sink], flush_every=2) as tap, tap.run():  # the default metrics
        for outputs, labels in batches:
            tap.step(loss=torch.tensor(1.0), outputs=outputs, targets=TF.one_hot(labels, 4))
    assert len(sink.records) == 6
    for record in sink.records:
        outputs, labels = batches[record.step]
        assert record.values["accuracy"] == pytest.approx(_reference(outputs, labels, -1, -100), abs=1e-12)
    notes = [e for e in sink.events if e.kind is bt.EventKind.INFO]  # an assumption: a note, not a warning
    assert [e.step for e in notes] == [0] and "argmax" in notes[0].message
    assert not [e for e in sink.events if e.kind is bt.EventKind.WARNING]


@pytest.mark.parametrize(
    ("outputs", "targets", "says"),
    [
        pytest.param(torch.randn(8, 4), None, "but no targets; pass targets=", id="no-targets"),
        pytest.param(torch.randn(8), torch.zeros(8, dtype=torch.long), "outputs of shape [8]", id="1d-outputs"),
        pytest.param(torch.randn(8, 4), torch.rand(8, 4), "pass targets.argmax(-1)", id="float-one-hot"),
        pytest.param(torch.randn(8, 1), torch.rand(8, 1), None, id="regression-quiet"),
        pytest.param(torch.randn(8), torch.rand(8), None, id="regression-1d-quiet"),
        pytest.param(None, None, None, id="loss-only-quiet"),
        pytest.param(torch.randn(8, 4), torch.zeros(8, dtype=torch.long), None, id="applies"),
    ],
)
def test_why_the_default_accuracy_is_left_out(outputs, targets, says) -> None:
    reason = bt.metrics.Accuracy().left_out_reason(StepInputs(torch.tensor(1.0), outputs, targets, 8.0))
    if says is None:
        assert reason is None
    else:
        assert reason is not None and says in reason and reason.startswith("no accuracy is recorded")


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        pytest.param(dict(outputs=torch.randn(8, 4)), "but no targets; pass targets=", id="no-targets"),
        pytest.param(
            dict(outputs=torch.randn(8), targets=torch.zeros(8, dtype=torch.long)), "outputs of shape [8]", id="1d"
        ),
        pytest.param(dict(outputs=torch.randn(8, 4), targets=torch.rand(8, 4)), "targets.argmax(-1)", id="float-hot"),
        pytest.param(dict(), None, id="loss-only-quiet"),
        pytest.param(dict(outputs=torch.randn(8, 1), targets=torch.rand(8, 1)), None, id="regression-quiet"),
    ],
)
def test_the_default_accuracy_left_out_by_mistake_is_warned_once(
    kwargs: dict, says: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    sink = ListSink()
    with caplog.at_level("WARNING", logger="batchtap"):
        with bt.Tap(None, [sink], flush_every=2) as tap, tap.run():  # the default metrics
            for _ in range(4):
                tap.step(loss=torch.tensor(1.0), **kwargs)
    warnings = [e for e in sink.events if e.kind is bt.EventKind.WARNING]
    assert all("accuracy" not in r.values for r in sink.records) and len(sink.records) == 4
    if says is None:
        assert warnings == []
    else:
        assert [e.step for e in warnings] == [0] and says in warnings[0].message
        assert sum(says in r.getMessage() for r in caplog.records) == 1
