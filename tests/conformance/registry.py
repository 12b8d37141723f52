"""The conformance matrix: every scenario through every front-end, each stored value against the
loop's own ``.item()`` truth taken in the same run (``test_matrix.py`` is its one test).

Entry format (a new front-end or scenario is one entry here or in a cell module, never a new test file)
-------------------------------------------------------------------------------------------------------

* **Scenario**: ``Scenario(name, doc, counted="samples")`` in :data:`SCENARIOS`; ``counted`` is what
  its throughput counts (``"samples"``, or ``"tokens"`` where the loop weighs by kept tokens), held in
  every cell: stored throughput x step_time = that count of the step (the loops' truth carries the
  counts); :data:`COUNTED` names the cells whose front-end counts something else, and why. The raw
  loops' options for it are in ``loops.OPTIONS[name]``; a framework front-end reads the name and builds
  its own version.
* **Front-end**: ``FrontEnd(name, run, doc)`` in :data:`FRONTENDS`. ``run(scenario, workdir)`` trains
  the scenario through the front-end, storing into the SQLite file ``workdir / "store.db"``, and
  returns a ``compare.Outcome``: the truth of every optimizer step (``{"epoch", "batch", "loss",
  "accuracy", "lr", "grad_norm", ...}``, read with ``.item()`` in the same run), the host reads per
  step where the front-end counts them (else None), and whether ``data_time`` must be stored.
  ``compare.check`` then holds every stored value to its truth (clocked values: finite, >= 0;
  throughput also to the step's count).
* **Expectation of a cell** ``(scenario, front-end)``: absent from :data:`MARKS` = exact. Else
  ``NA(reason)``: the cell cannot apply (shown as a skip with the reason); ``XFAIL(reason)``: wrong
  today (a strict xfail, so the test fails loudly once it is fixed: then delete the mark).
* **Cell modules**: a module named in :data:`CELL_MODULES` that exists (e.g. the Keras engineer's
  ``tests/conformance/keras_cells.py``) may define ``FRONTENDS``, ``SCENARIOS`` (lists of the same
  entries) and ``MARKS`` (same dict form); they are merged in. A front-end that only runs some
  scenarios marks the others ``NA`` (an unmarked cell is expected exact); a module's own scenario
  meets the front-ends of other sources as ``NA`` unless the module marks the cell.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conformance.compare import Outcome

__all__ = [
    "CELL_MODULES",
    "COUNTED",
    "FRONTENDS",
    "MARKS",
    "NA",
    "SCENARIOS",
    "XFAIL",
    "FrontEnd",
    "Scenario",
    "cells",
    "counted",
]


@dataclass(frozen=True)
class Scenario:
    """``counted``: what the scenario's throughput counts per second (``compare.COUNTS``): ``samples``
    (the batches' rows, sequences for a sequence model: docs/loops.md, "Throughput") unless the loop
    tells the step's tokens; the check holds throughput x step_time to that count of each step."""

    name: str
    doc: str
    counted: str = "samples"


@dataclass(frozen=True)
class FrontEnd:
    name: str
    run: Callable[[str, Path], Outcome]
    doc: str


@dataclass(frozen=True)
class NA:
    """The cell cannot apply; ``reason`` says why (shown in the skip)."""

    reason: str


@dataclass(frozen=True)
class XFAIL:
    """The cell is wrong today; ``reason`` says what and whose fix it waits for (strict xfail)."""

    reason: str


SCENARIOS: list[Scenario] = [
    Scenario("plain", "one batch per optimizer step, loss.backward()"),
    Scenario("divided-accum", "2 micro-batches, (loss / 2).backward() each"),
    Scenario("undivided-accum", "2 micro-batches, loss.backward() each (the step's loss: their sum, as the gradients)"),
    Scenario(
        "token-normalised-accum",
        "2 micro-batches of -100-padded sequences, CE(reduction='sum') / N backward() each, N = kept tokens of "
        "the whole step (the HF Trainer's causal-LM path): the step's loss is sum CE / N",
        counted="tokens",  # the loop weighs each micro-batch by its kept tokens (batch_size=): tokens/s
    ),
    Scenario("clip-torch", "clip_grad_norm_(max_norm=0.05): every step clips; grad_norm is the pre-clip norm"),
    Scenario(
        "clip-get_total_norm",
        "get_total_norm + clip_grads_with_norm_ (accelerate >= 1.x and the HF Trainer clip this way)",
    ),
    Scenario("amp-skipped-first-step", "fp16 autocast + GradScaler('cpu'); an inf in step 0's gradients: skipped"),
    Scenario("two-losses", "two backward() calls per step (loss, then an auxiliary loss): the step's loss is the sum"),
    Scenario("pad-100", "sequence targets padded with -100 (F.cross_entropy's default ignore_index)"),
    Scenario("pad-1", "sequence targets padded with -1 (ignore_index=-1)"),
    Scenario(
        "pad-100-accum",
        "as pad-100 with 2 micro-batches, (loss / 2).backward() each: the loss flattens (B, T, V) to (B*T, V), "
        "throughput still counts the B sequences",
    ),
    Scenario("ddp-2-ranks", "DistributedDataParallel, 2 gloo ranks on loopback"),
    Scenario(
        "ddp-2-ranks-undivided-accum",
        "as ddp-2-ranks with 2 undivided micro-batches per step (the HF Trainer's path for a BERT-like model, "
        "which also multiplies each loss by the number of processes): the step's loss is the ranks' mean of their sums",
    ),
    Scenario("fsdp2-2-ranks", "fully_shard per layer, 2 gloo ranks; clip_grad_norm_ returns a DTensor"),
    Scenario("fsdp2-2-ranks-full_tensor", "as fsdp2-2-ranks, the explicit API given grad_norm.full_tensor() instead"),
    Scenario("fsdp2-cuda-1-rank", "as fsdp2-2-ranks on one GPU, a single-rank mesh (nccl); skips without CUDA"),
]


def _raw(name: str) -> Callable[[str, Path], Outcome]:
    def run(scenario: str, workdir: Path) -> Outcome:
        from tests.conformance.raw import run_raw

        return run_raw(name, scenario, workdir)

    return run


#: the package each framework front-end needs
_FRAMEWORK_MODULES = {
    "lightning": "lightning",
    "lightning-autolog": "lightning",
    "hf": "transformers",
    "hf-autolog": "transformers",
    "accelerate": "accelerate",
}


def _framework(name: str) -> Callable[[str, Path], Outcome]:
    def run(scenario: str, workdir: Path) -> Outcome:
        from tests.conformance import frameworks
        from tests.conformance.loops import OPTIONS

        if OPTIONS[scenario].device == "cuda":
            import torch

            if not torch.cuda.is_available():
                pytest.skip("needs CUDA (a GPU cell: bench/gpu_check.sh runs it)")
            pytest.importorskip(_FRAMEWORK_MODULES[name])  # the GPU image has lightning, not transformers/accelerate
        if OPTIONS[scenario].dist != "none":  # the framework's ranks under torchrun, this process waits
            from tests.conformance._fw_worker import launch

            return launch(name, scenario, workdir)
        return frameworks.RUNNERS[name](scenario, workdir)

    return run


FRONTENDS: list[FrontEnd] = [
    FrontEnd("explicit", _raw("explicit"), "bt.Tap(optimizer=, model=, scaler=) + watch/accumulate/step"),
    FrontEnd("autolog", _raw("autolog"), "bt.autolog() at the top of the unmodified loop"),
    FrontEnd("run", _raw("run"), "batchtap run SCRIPT (a subprocess; each rank its own under torchrun-style env)"),
    FrontEnd("lightning", _framework("lightning"), "BatchtapCallback on a real lightning.Trainer"),
    FrontEnd(
        "lightning-autolog",
        _framework("lightning-autolog"),
        "bt.autolog() over a real lightning.Trainer, no callback (what batchtap run records of a Lightning script)",
    ),
    FrontEnd("hf", _framework("hf"), "BatchtapTrainer (a real transformers.Trainer)"),
    FrontEnd(
        "hf-autolog",
        _framework("hf-autolog"),
        "bt.autolog() over the plain transformers.Trainer (what batchtap run records of a Trainer script)",
    ),
    FrontEnd("accelerate", _framework("accelerate"), "BatchtapTracker + tap calls in a real Accelerate loop"),
]

_FULL_TENSOR = NA("only the explicit API is handed a norm: .full_tensor() is a choice of the loop's explicit call")


MARKS: dict[tuple[str, str], NA | XFAIL] = {
    # wrong today: XFAIL(reason) marks go here; each flips to a strict-xfail failure once fixed
    **{("fsdp2-2-ranks-full_tensor", f): _FULL_TENSOR for f in ("autolog", "run", "lightning", "hf", "accelerate")},
    # Lightning: automatic optimization, one loss per training_step, divided by accumulate_grad_batches
    ("undivided-accum", "lightning"): NA("Lightning divides training_step's loss by accumulate_grad_batches itself"),
    ("ddp-2-ranks-undivided-accum", "lightning"): NA(
        "Lightning divides training_step's loss by accumulate_grad_batches itself"
    ),
    ("token-normalised-accum", "lightning"): NA(
        "Lightning divides each micro-batch's loss by accumulate_grad_batches; it has no step-wide token count"
    ),
    ("clip-get_total_norm", "lightning"): NA("Lightning clips with clip_grad_norm_ (gradient_clip_val): clip-torch"),
    ("amp-skipped-first-step", "lightning"): NA(
        "Trainer(accelerator='cpu', precision='16-mixed') turns itself into bf16-mixed, which has no GradScaler"
    ),
    # the HF Trainer: one loss per micro-batch from the model, clipped through Accelerate
    ("clip-torch", "hf"): NA("the Trainer clips through accelerator.clip_grad_norm_: clip-get_total_norm"),
    ("amp-skipped-first-step", "hf"): NA(
        "the Trainer's fp16 goes through Accelerate, which makes no GradScaler with cpu=True: no step is skipped"
    ),
    ("two-losses", "hf"): NA("the Trainer backpropagates the one loss compute_loss returns per micro-batch"),
    ("pad-1", "hf"): NA("transformers' model losses ignore -100 only"),
    ("fsdp2-2-ranks", "hf"): NA(
        "TrainingArguments(use_cpu=True, fsdp='full_shard', fsdp_config={'version': 2}) under torchrun trains DDP, not "
        "FSDP2: the Trainer's Accelerator stays DistributedType.MULTI_CPU (accelerate picks FSDP for GPU-family types "
        "only) and wraps a DistributedDataParallel of plain Parameters (checked in the cell: delete this mark to rerun it)"
    ),
    # Accelerate: accelerator.backward divides by gradient_accumulation_steps
    ("undivided-accum", "accelerate"): NA("accelerator.backward always divides by gradient_accumulation_steps"),
    ("ddp-2-ranks-undivided-accum", "accelerate"): NA(
        "accelerator.backward always divides by gradient_accumulation_steps"
    ),
    ("fsdp2-2-ranks", "accelerate"): NA(
        "Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)) under torchrun trains DDP, "
        "not FSDP2: its state stays DistributedType.MULTI_CPU (accelerate picks FSDP for GPU-family types only) and "
        "prepare() returns a DistributedDataParallel of plain Parameters (checked in the cell: delete this mark to rerun it)"
    ),
    ("clip-torch", "accelerate"): NA("an Accelerate loop clips with accelerator.clip_grad_norm_: clip-get_total_norm"),
    ("amp-skipped-first-step", "accelerate"): NA(
        "Accelerator(cpu=True, mixed_precision='fp16') makes no GradScaler (scaler None): no step is skipped"
    ),
}

# the Lightning scenarios are the same with or without the callback, the Trainer's with or without BatchtapTrainer
MARKS.update({(s, "lightning-autolog"): m for (s, f), m in list(MARKS.items()) if f == "lightning"})
MARKS.update({(s, "hf-autolog"): m for (s, f), m in list(MARKS.items()) if f == "hf"})

#: modules that add entries of their own (imported when they exist)
CELL_MODULES: tuple[str, ...] = ("tests.conformance.keras_cells",)


def _merged() -> tuple[list[Scenario], list[tuple[FrontEnd, str | None]], dict[tuple[str, str], NA | XFAIL]]:
    """Scenarios, front-ends (with the module that added each, None for this one) and marks, merged.

    A scenario a cell module added meets the front-ends of other sources as NA unless that module
    marks the cell otherwise: a module cannot know the front-ends added after it was written.
    """
    scenarios = list(SCENARIOS)
    frontends: list[tuple[FrontEnd, str | None]] = [(f, None) for f in FRONTENDS]
    marks = dict(MARKS)
    for name in CELL_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        module = importlib.import_module(name)
        own_scenarios = list(getattr(module, "SCENARIOS", []))
        own_frontends = [f.name for f in getattr(module, "FRONTENDS", [])]
        module_marks = getattr(module, "MARKS", {})
        scenarios += own_scenarios
        frontends += [(f, name) for f in getattr(module, "FRONTENDS", [])]
        marks.update(module_marks)
        for scenario in own_scenarios:
            for frontend, _ in frontends:
                key = (scenario.name, frontend.name)
                if frontend.name not in own_frontends and key not in module_marks:
                    marks[key] = NA(f"a scenario of {name.rsplit('.', 1)[-1]}.py, not written for this front-end")
    return scenarios, frontends, marks


_NO_TOKENS = "autolog reads no token count: N is a device tensor (a host read), so it counts the sequences"
_INPUT_TOKENS = "the HF Trainer's causal LM: its input_ids tokens are counted (padding included)"

#: cells whose throughput counts something other than their scenario declares: (count, why); docs/loops.md,
#: "Throughput", says the same
COUNTED: dict[tuple[str, str], tuple[str, str]] = {
    ("token-normalised-accum", "autolog"): ("samples", _NO_TOKENS),
    ("token-normalised-accum", "run"): ("samples", _NO_TOKENS),
    # BatchtapTrainer and autolog over the HF Trainer count alike (autolog reads the Trainer's micro-batch)
    **{
        (scenario, frontend): ("input_tokens", _INPUT_TOKENS)
        for scenario in ("token-normalised-accum", "pad-100", "pad-100-accum")
        for frontend in ("hf", "hf-autolog")
    },
}


def counted(scenario: Scenario, frontend: FrontEnd) -> str:
    """What the cell's throughput counts: the scenario's declaration unless :data:`COUNTED` says otherwise."""
    return COUNTED.get((scenario.name, frontend.name), (scenario.counted, ""))[0]


def cells() -> Iterator[object]:
    """Every cell as a ``pytest.param(scenario, frontend)`` with its id and marks."""
    scenarios, frontends, marks = _merged()
    for frontend, _ in frontends:
        for scenario in scenarios:
            mark = marks.get((scenario.name, frontend.name))
            cell_id = f"{frontend.name}-{scenario.name}"
            if isinstance(mark, NA):
                yield pytest.param(scenario, frontend, id=cell_id, marks=pytest.mark.skip(reason=f"n/a: {mark.reason}"))
            elif isinstance(mark, XFAIL):
                yield pytest.param(
                    scenario, frontend, id=cell_id, marks=pytest.mark.xfail(strict=True, reason=mark.reason)
                )
            else:
                yield pytest.param(scenario, frontend, id=cell_id)


def table(*, modules: bool = True) -> str:
    """The matrix as TESTING.md shows it: a row per scenario, a column per front-end, each cell
    "exact", "n/a [k]" or "xfail [k]" with the reasons listed under the table
    (``python -c "from tests.conformance.registry import table; print(table())"``)."""
    scenarios, frontends, marks = _merged() if modules else (SCENARIOS, [(f, None) for f in FRONTENDS], MARKS)
    names = [f.name for f, _ in frontends]
    reasons: list[str] = []
    lines = ["| scenario | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for s in scenarios:
        row = []
        for n in names:
            mark = marks.get((s.name, n))
            if mark is None:
                row.append("exact")
                continue
            label = f"{'n/a' if isinstance(mark, NA) else '**xfail**'}: {mark.reason}"
            if label not in reasons:
                reasons.append(label)
            row.append(f"{'n/a' if isinstance(mark, NA) else '**xfail**'} [{reasons.index(label) + 1}]")
        lines.append(f"| `{s.name}` | " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"{i}. {r}" for i, r in enumerate(reasons, 1)]
    return "\n".join(lines)
