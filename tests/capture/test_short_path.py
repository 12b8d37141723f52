"""The short step path (capture/short.py) against the general path it stands in for.

Each scenario runs twice on the same inputs: once as shipped, once with the short path switched off
(``short_step`` made to build nothing, so every step takes the general path). Records (timing
values aside), events and the stop must be identical, and the shipped run must really have taken
the short path for most of its steps.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
import batchtap.capture.short as short_module
from batchtap.capture import session as session_module
from batchtap.errors import InputError, RunStateError
from tests.conftest import ListSink, classifier

TIMING = {"step_time", "data_time", "throughput"}


def _steps(seed: int = 0) -> Iterator[dict[str, Any]]:
    """A loop's tap.step() keyword arguments: mostly one shape, a short last batch per 'epoch',
    batch_size= and tokens= now and then, one step under CPU autocast, an empty extras dict now and
    then, extras (a number and a tensor) at most steps, and the loop's own epoch= and batch= in the
    last third."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the model's initial weights
    model, opt = classifier()
    for step in range(90):
        n = 7 if step % 30 == 29 else 16  # the short last batch of an epoch
        x, y = torch.randn(n, 8, generator=gen), torch.randint(0, 5, (n,), generator=gen)
        if step == 40:
            y[3] = -100  # a padded target: left out of the accuracy
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step == 50):
            out = model(x)
            loss = F.cross_entropy(out.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        kwargs: dict[str, Any] = {"loss": loss, "outputs": out, "targets": y}
        if step % 11 == 3:
            kwargs["batch_size"] = n
        if step % 13 == 5:
            kwargs["tokens"] = 4 * n
        if step == 50:
            kwargs["autocast"] = True
        if step >= 60:  # a loop that passes its own position (the recipe callback, Lightning)
            kwargs["epoch"], kwargs["batch"] = 7, step - 60
        # extras: a host float and a device tensor most steps (Lightning's learning rate, a loop's
        # own scalar), an empty dict now and then (absent at that step)
        kwargs["extra"] = {} if step % 17 == 2 else {"lr": 0.1 / (1 + step), "margin": out.detach().max()}
        yield kwargs


def _run(monkeypatch: pytest.MonkeyPatch, *, short: bool, nan_at: int | None = None) -> tuple[ListSink, int]:
    """Drive the steps through a fresh Tap; returns the sink and how many steps took the general path."""
    with monkeypatch.context() as patch:
        general = _count_general_steps(patch, short=short)
        captures: list[Any] = []
        create = session_module.RunCapture.create
        patch.setattr(
            session_module.RunCapture, "create", lambda *a, **k: captures.append(create(*a, **k)) or captures[-1]
        )
        sink = ListSink()
        tap = bt.Tap(
            [bt.metrics.Loss(), bt.metrics.Accuracy(), bt.metrics.StepTime(), bt.metrics.Throughput()],
            [sink],
            flush_every=8,
            capacity=16,
        )
        with tap, tap.run(name="short"):
            for step, kwargs in enumerate(_steps()):
                autocast = kwargs.pop("autocast", False)
                if step == nan_at:
                    kwargs["loss"] = kwargs["loss"] * math.nan
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    tap.step(**kwargs)
                if tap.should_stop:
                    break
    return sink, general[0]


def _count_general_steps(patch: pytest.MonkeyPatch, *, short: bool) -> list[int]:
    """Count the steps that take the general path (a one-item list, updated in place); without
    ``short`` no short path is ever built."""
    general = [0]
    record = session_module.RunCapture.record

    def counting_record(self: Any, *args: Any, **kwargs: Any) -> None:
        general[0] += 1
        record(self, *args, **kwargs)

    patch.setattr(session_module.RunCapture, "record", counting_record)
    if not short:
        patch.setattr(short_module, "short_step", lambda *a, **k: None)
    return general


def _comparable(sink: ListSink) -> list[tuple[Any, ...]]:
    """Each record without its timing values, but with what throughput counted (samples or tokens)."""
    return [
        (
            r.step,
            r.epoch,
            r.batch,
            {k: v for k, v in r.values.items() if k not in TIMING},
            round(r.values["throughput"] * r.values["step_time"], 3) if "throughput" in r.values else None,
        )
        for r in sink.records
    ]


def _events(sink: ListSink) -> list[tuple[Any, ...]]:
    return [(e.step, e.kind, e.message) for e in sink.events]


def test_the_short_path_records_what_the_general_path_records(monkeypatch: pytest.MonkeyPatch) -> None:
    short, general_steps_short = _run(monkeypatch, short=True)
    plain, general_steps_plain = _run(monkeypatch, short=False)
    assert _comparable(short) == _comparable(plain)
    assert _events(short) == _events(plain)
    assert [r.values.get("accuracy") for r in short.records][40] == pytest.approx(
        [r.values.get("accuracy") for r in plain.records][40]
    )
    assert general_steps_plain == 90
    # the general path: the first step, each change of shape or of batch_size/tokens' presence
    # (back and forth), the autocast step; the short path everything else
    assert general_steps_short < 20, general_steps_short
    assert all(not math.isnan(r.values["step_time"]) for r in short.records[1:])
    assert sum("lr" in r.values for r in short.records) == 90 - len(range(2, 90, 17))


def test_a_nan_loss_stops_at_the_same_step_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    short, _ = _run(monkeypatch, short=True, nan_at=23)
    plain, _ = _run(monkeypatch, short=False, nan_at=23)
    assert _comparable(short) == _comparable(plain)
    assert short.records[-1].step == plain.records[-1].step == 23
    assert short.ended[0].stop_reason == plain.ended[0].stop_reason
    assert "non-finite loss" in (short.ended[0].stop_reason or "")


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Patch the short path's builder to record every closure it builds (None: no short path)."""
    built: list[object] = []
    real = short_module.short_step

    def counting(*args: Any, **kwargs: Any) -> Any:
        closure = real(*args, **kwargs)
        built.append(closure)
        return closure

    monkeypatch.setattr(short_module, "short_step", counting)
    return built


def _steady_tap(sink: ListSink) -> tuple[bt.Tap, Callable[[], None]]:
    # targets checked at every step, so the bad one below is seen at the step it came in
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy(check_targets_every=1)], [sink], flush_every=4, capacity=8)
    out, y = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])

    def step(targets: torch.Tensor = y) -> None:
        tap.step(loss=torch.tensor(0.5), outputs=out, targets=targets)

    return tap, step


def test_a_step_from_another_thread_is_refused_on_the_short_path_too(monkeypatch: pytest.MonkeyPatch) -> None:
    built = _count_builds(monkeypatch)
    sink = ListSink()
    tap, step = _steady_tap(sink)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    with tap, tap.run():
        for _ in range(5):
            step()  # the short path is built and in use
        assert [c for c in built if c is not None]  # the short path was built
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        step()
    assert len(errors) == 1 and isinstance(errors[0], RunStateError)
    assert [r.step for r in sink.records] == list(range(6))  # nothing of the refused call, nothing lost


def test_an_error_the_pipeline_found_is_raised_at_the_next_step_on_the_short_path_too() -> None:
    sink = ListSink()
    tap, step = _steady_tap(sink)
    bad = torch.tensor([0, 1, 2, 0, 1, 7])  # class 7 of 3: only its value tells
    with pytest.raises(InputError, match="outside"), tap, tap.run():
        for _ in range(3):
            step()
        step(bad)  # same metadata: the short path takes it; the pipeline finds the bad index
        tap.flush()
        for _ in range(3):
            step()
    assert [r.step for r in sink.records] == [0, 1, 2, 3]
    assert math.isnan(sink.records[3].values["accuracy"])


def test_a_closure_is_built_for_a_repeated_signature_only_and_outlives_a_short_last_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[object] = []
    real = short_module.short_step

    def counting(capture: Any, *args: Any, **kwargs: Any) -> Any:
        built.append(capture.short_key)
        return real(capture, *args, **kwargs)

    monkeypatch.setattr(short_module, "short_step", counting)
    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=4, capacity=8)
    loss = torch.tensor(0.5)
    with tap, tap.run():
        for n in range(3, 23):  # dynamic padding: another shape at every step
            tap.step(loss=loss, outputs=torch.randn(n, 4), targets=torch.zeros(n, dtype=torch.long))
        assert built == []
        for epoch in range(3):  # 5 full batches, then a short last one
            for n in (8, 8, 8, 8, 8, 3):
                tap.step(loss=loss, outputs=torch.randn(n, 4), targets=torch.zeros(n, dtype=torch.long))
    assert len(built) == 1  # the full batches' closure, built once, used in every epoch
    assert len(sink.records) == 20 + 18


def test_steps_without_any_input_take_the_short_path_too(monkeypatch: pytest.MonkeyPatch) -> None:
    built = _count_builds(monkeypatch)
    sink = ListSink()
    tap = bt.Tap([bt.metrics.StepTime()], [sink], flush_every=4, capacity=8)
    with tap, tap.run():
        for _ in range(10):
            tap.step()
        assert [c for c in built if c is not None]  # the short path was built
    assert [r.step for r in sink.records] == list(range(10))
    assert all(r.values["step_time"] >= 0 for r in sink.records[1:])


def test_a_bad_epoch_or_batch_is_refused_with_nothing_recorded() -> None:
    sink = ListSink()
    tap, step = _steady_tap(sink)
    out, y = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    with tap, tap.run():
        for _ in range(4):
            step()
        for bad in ({"epoch": "x"}, {"batch": -1}, {"epoch": 1.5}):
            with pytest.raises(InputError, match="must be an integer >= 0"):
                tap.step(loss=torch.tensor(0.5), outputs=out, targets=y, **bad)  # type: ignore[arg-type]
        tap.step(loss=torch.tensor(0.5), outputs=out, targets=y, epoch=2, batch=9)
    assert [(r.step, r.epoch, r.batch) for r in sink.records] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 2, 9)]


def _lm_run(monkeypatch: pytest.MonkeyPatch, *, short: bool) -> tuple[ListSink, int, list[str], list[tuple[int, str]]]:
    """A causal-LM-style loop with the default metrics only (each writes its ring columns itself on
    the short path): ``[B, T, V]`` logits, padding that changes at every step (an all-padded batch
    too), a short batch every 10th step (its slot is then written by the general path), targets
    checked every 3rd step, and a class index out of range at loop step 36 (the short path) and at
    loop step 49 (a short batch: the general path), both checked steps. The loop catches the InputError each raises at the next
    step and goes on, so slots that held an out-of-range target are written again a lap later."""
    writers: list[str] = []
    raised: list[tuple[int, str]] = []
    gen = torch.Generator().manual_seed(3)
    with monkeypatch.context() as patch:
        general = _count_general_steps(patch, short=short)
        captures: list[Any] = []
        create = session_module.RunCapture.create
        patch.setattr(
            session_module.RunCapture, "create", lambda *a, **k: captures.append(create(*a, **k)) or captures[-1]
        )
        sink = ListSink()
        tap = bt.Tap(
            [
                bt.metrics.Loss(),
                bt.metrics.Accuracy(check_targets_every=3),
                bt.metrics.StepTime(),
                bt.metrics.Throughput(),
            ],
            [sink],
            flush_every=8,
            capacity=16,
        )
        try:
            with tap, tap.run(name="lm"):
                for step in range(70):
                    batch = 3 if step % 10 == 9 else 4
                    logits = torch.randn(batch, 6, 11, generator=gen)
                    targets = torch.randint(0, 11, (batch, 6), generator=gen)
                    share = (0.0, 0.3, 1.0, 0.6, 0.2)[step % 5]  # of padded targets; all at every 5th step
                    targets[torch.rand(batch, 6, generator=gen) < share] = -100
                    if step in (36, 49):
                        targets[0, 0] = 11
                    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten().clamp(max=10), ignore_index=-100)
                    try:
                        tap.step(loss=loss, outputs=logits, targets=targets)
                    except InputError as exc:
                        raised.append((step, str(exc)))
                    if step in (36, 49):
                        tap.flush()  # the error is then raised at the next step
                    if step == 36:
                        ring = captures[0].ring
                        owner = ring.row_writers[36 % 16]  # type: ignore[union-attr]
                        writers = [w.__qualname__ for w in owner.writers] if owner is not None else []
        except InputError as exc:  # found at the run's last flush
            raised.append((-1, str(exc)))
    return sink, general[0], writers, raised


def test_the_metrics_own_row_writers_record_what_the_general_path_records(monkeypatch: pytest.MonkeyPatch) -> None:
    short, general_short, writers, raised_short = _lm_run(monkeypatch, short=True)
    plain, general_plain, _, raised_plain = _lm_run(monkeypatch, short=False)
    assert _comparable(short) == _comparable(plain)
    assert _events(short) == _events(plain)
    assert raised_short == raised_plain
    assert [step for step, _ in raised_short] == [37, 50]  # each at the step after the bad one
    bad = [r.step for r in short.records if math.isnan(r.values.get("accuracy", 0.0))]
    assert bad == [36, 48]  # the refused loop step 37 took no step number
    assert len(short.records) == 68
    assert sum("accuracy" not in r.values for r in short.records) == 13  # all padded: no accuracy
    assert general_plain == 68 and general_short < 20, general_short
    assert any(name.startswith("Accuracy.row_writer") for name in writers), writers  # not the default writer
