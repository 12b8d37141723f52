"""One Tap row per optimizer step: micro-batches from ``backward()``, values from the step hooks.

Each ``backward()`` call is a micro-batch of the optimizer step that follows it (its loss, and the
logits and targets of the classification loss computed for it). With one optimizer (the usual
loop) a row closes at each of its steps: one micro-batch goes to ``tap.step(loss=, outputs=,
targets=)``, the Tap's short path; several go to ``tap.accumulate`` (each handed over as soon as
the next one arrives, so no more than one micro-batch's logits are held beyond the loop's own)
and ``tap.step()``; several that are not one loss graph divided by a constant each are several
losses, summed into one micro-batch. With several optimizers (a GAN) a row closes once every optimizer stepped
(or when one steps a second time before the others did): the first optimizer's micro-batches are
the Tap's loss and accuracy, the others' losses are ``loss_1``... of :class:`OptimizerFacts`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import deque
from collections.abc import Callable

import torch

from batchtap.autolog._facts import FactsRow, OptimizerFacts
from batchtap.autolog._steps import StepEvent
from batchtap.metrics.accuracy import Accuracy
from batchtap.metrics.inputs import samples_of
from batchtap.tap import Tap

__all__ = ["MicroBatch", "Rows"]


@dataclasses.dataclass(slots=True)
class MicroBatch:
    """One ``backward()``: its loss (constants undone) and what its classification loss saw.

    Attributes:
        loss: the loss with every constant factor undone (accumulation count, GradScaler scale).
        raw: the tensor given to ``backward()`` (detached); None for a sum of several.
        scale: the GradScaler scale ``raw`` carries, if any.
        divided: ``raw`` carries a constant factor other than the scale.
        shape: the graph's node names down to the loss (see :class:`~batchtap.autolog._graph.Resolved`).
        normalised: ``loss`` is a summed loss divided by the step's item count (token-normalised):
            the step's loss is the sum of its micro-batches' ``loss``, not their mean.
        samples: the micro-batch's samples for throughput (``LossCall.samples``: sequences where the
            loss flattened them); 0 where unknown.
        tokens: the micro-batch's tokens for throughput where the loop's framework tells them (the HF
            Trainer on a causal LM: ``input_ids`` tokens, as ``BatchtapTrainer`` counts), else None.
    """

    loss: torch.Tensor
    outputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    ignore_index: int = -100
    raw: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    divided: bool = False
    shape: tuple[str, ...] = ()
    normalised: bool = False
    factors: tuple[float | None, ...] = ()
    samples: int = 0
    tokens: int | None = None

    def given(self) -> torch.Tensor:
        """What the gradients saw of this loss: the tensor given to ``backward()`` with the
        GradScaler scale undone, any other factor (a loss weight) kept. Device ops only."""
        if self.raw is None:
            return self.loss
        return self.raw / self.scale if self.scale is not None else self.raw


#: what several backward() calls before one optimizer step are
_ACCUMULATION, _NORMALISED, _UNDIVIDED, _LOSSES = "accumulation", "normalised", "undivided", "losses"
#: the kinds whose micro-batches are handed to tap.accumulate as they come
_MICRO_BATCHES = (_ACCUMULATION, _NORMALISED, _UNDIVIDED)
#: ... and the kinds among them whose step loss is the sum of the micro-batches' losses
_SUMMED = (_NORMALISED, _UNDIVIDED)


class Rows:
    """Assembles rows and drives the Tap (training thread only).

    Args:
        tap: the autolog Tap, its run started before the first row.
        facts: the Tap's :class:`OptimizerFacts`.
        accuracy: the Tap's accuracy metric (its ``ignore_index`` follows the loss function's).
        say: ``say(key, message)`` reports something once per run.
    """

    def __init__(self, tap: Tap, facts: OptimizerFacts, accuracy: Accuracy, say: Callable[[str, str], None]) -> None:
        self.tap = tap
        self.facts = facts
        self.accuracy = accuracy
        self.say = say
        self.optimizers: list[torch.optim.Optimizer] = []  # slot order: the order they were made (or first stepped)
        self._slots: dict[int, int] = {}
        self.pending: list[MicroBatch] = []
        self._kind: str | None = None  # what the pending backward() calls are, once there are two
        self.events = 0  # optimizer steps seen (the loader watch reads it)
        self.rows = 0
        self._row: dict[int, StepEvent] = {}
        self._direct: MicroBatch | None = None  # the row's one micro-batch, for tap.step(loss=...)
        self._accumulated = 0
        self._other_losses: dict[int, torch.Tensor] = {}
        # token-normalised and undivided accumulation: the step's loss is the sum of the micro-batches', and
        # the Tap averages them weighted by samples; what was handed over, to make its mean that sum
        self._handed_weight = 0.0
        self._handed_sum: torch.Tensor | None = None  # sum of loss x weight handed over
        self._handed_total: torch.Tensor | None = None  # sum of the losses handed over
        self._scaler = False
        self._shape: tuple[bool, bool] | None = None  # (loss, outputs) of the run's first hand-over
        self._ignore_index: int | None = None
        self._sizes: list[float] = []  # samples of the row's accumulation micro-batches
        # the row's samples for throughput where they differ from the outputs' rows that weigh its micro-batches
        # (a flattened sequence batch: B sequences, B*T rows); 0 once a micro-batch's are unknown
        self._samples = 0
        self._flattened = False
        self._trainer_noted = False  # the HF Trainer's mean of means was said
        # the watched loader's wait for each batch it handed out, oldest first: each micro-batch handed to
        # tap.accumulate takes the oldest, the wait of the batch it trained on (a loop that fetches a step's
        # batches before training on them, as the HF Trainer does, hands them over later than it fetched)
        self.waits: deque[float] = deque()

    # ------------------------------------------------------------------ what arrives

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._slots:
            return
        if self.facts.bound:
            self.say(
                "late-optimizer",
                f"an optimizer ({type(optimizer).__name__}) was made after the first recorded step, which "
                "fixes the columns: its steps close rows but its lr and gradient norm are not recorded; "
                "make every optimizer before the first step (or pass them: bt.autolog(optimizers=[...]))",
            )
            return
        self._slots[id(optimizer)] = len(self.optimizers)
        self.optimizers.append(optimizer)

    def on_backward(self, micro: MicroBatch) -> None:
        pending = self.pending
        pending.append(micro)
        if len(pending) == 2 and self._kind is None:
            self._kind = self._several(pending[0], pending[1])
        if len(self.optimizers) <= 1 and len(pending) > 1:
            if self._kind in _MICRO_BATCHES:
                # the earlier micro-batch belongs to the coming step of the one optimizer: hand it over
                self._accumulate(pending.pop(0), summed=self._kind in _SUMMED)
            else:
                pending[:] = [_summed(pending)]

    def drop_pending(self) -> bool:
        """Forget the pending ``backward()`` calls (their optimizer step raised); returns whether
        some micro-batches of them were already handed to ``tap.accumulate``."""
        self.pending.clear()
        self.waits.clear()
        self._kind = None
        self._handed_weight, self._handed_sum, self._handed_total = 0.0, None, None
        self._sizes = []
        return len(self.optimizers) <= 1 and self._accumulated > 0  # one optimizer: handed over at backward

    def _several(self, first: MicroBatch, second: MicroBatch) -> str:
        """What two ``backward()`` calls before one optimizer step are, from their graphs alone:
        micro-batches of gradient accumulation (the same loss graph, each divided by a constant)
        or several losses (a GAN's discriminator on real and fake data, a multi-loss loop)."""
        if first.normalised and second.normalised and first.shape == second.shape:
            self.say(
                "normalised",
                "several backward() calls before one optimizer step, each a summed loss divided by a count "
                "computed by the loop (token-normalised accumulation: CE(reduction='sum') / num_items_in_batch): "
                "loss = the sum of what backward() got over the step, sum(CE) / N, read on the device (not a "
                "mean of per-micro-batch means)",
            )
            return _NORMALISED
        if first.divided and second.divided and first.shape == second.shape and _same(first.factors, second.factors):
            self.say(
                "accumulation",
                "several backward() calls before one optimizer step, each the same loss graph divided by a "
                "constant: recorded as gradient-accumulation micro-batches (loss = their sample-weighted mean, "
                "each with its division by the accumulation count undone; accuracy over all their targets)",
            )
            return _ACCUMULATION
        if not first.divided and not second.divided:
            same = first.shape == second.shape and _same(first.factors, second.factors)
            self.say(
                "several-losses",
                "several backward() calls before one optimizer step, none divided by a constant: recorded as "
                "several losses, loss = their sum (what the step's gradients are the gradient of; a loop "
                "accumulating micro-batches without dividing by their count minimizes that sum too)"
                + ("; each the same loss graph: accuracy over all their targets" if same else ""),
            )
            if same:  # undivided accumulation (or one loss on several batches): every batch's targets count
                return _UNDIVIDED
        else:
            self.say(
                "losses-assumed",
                "several backward() calls before one optimizer step that are not one loss graph divided by a "
                "constant each (different graphs, or some divided and some not): assumed to be several "
                "losses, loss = the sum of the tensors given to backward() (their constant weights kept, "
                "the GradScaler scale undone), which is what the step's gradients are the gradient of",
            )
        return _LOSSES

    def on_step(self, event: StepEvent) -> None:
        self.events += 1
        slot = self._slots.get(id(event.optimizer))
        if slot is None:
            if self.facts.bound:
                self.add_optimizer(event.optimizer)  # says why it is not recorded
                slot = -1
            else:
                self.add_optimizer(event.optimizer)
                slot = self._slots[id(event.optimizer)]
        if slot in self._row:
            self.say(
                "uneven-optimizers",
                "an optimizer stepped again before every other optimizer stepped once: its row was "
                "closed without the others' values (optimizers stepping at different rates)",
            )
            self.close()
        if event.scale is not None:
            self._scaler = True
        micro, self.pending = self.pending, []
        kind, self._kind = self._kind, None
        if len(micro) > 1 and kind == _LOSSES:
            micro = [_summed(micro)]
        if slot == 0:
            if len(micro) == 1 and not self._accumulated and len(self.optimizers) == 1:
                self._direct = micro[0]
            else:
                summed = kind in _SUMMED
                for i, m in enumerate(micro):
                    self._accumulate(m, summed=summed, last=summed and i == len(micro) - 1)
        elif slot > 0 and micro:
            losses = [m.loss for m in micro]
            if len(losses) == 1:
                self._other_losses[slot] = losses[0]
            else:  # token-normalised micro-batches add up to the step's loss; others average
                stacked = torch.stack(losses)
                self._other_losses[slot] = stacked.sum() if kind in _SUMMED else stacked.mean()
        if slot >= 0:
            self._row[slot] = event
        if len(self._row) >= len(self.optimizers):
            self.close()

    # ------------------------------------------------------------------ to the Tap

    def close(self) -> None:
        """Write the open row (at every optimizer's step, and at the run's end)."""
        row, self._row = self._row, {}
        direct, self._direct = self._direct, None
        accumulated, self._accumulated = self._accumulated, 0
        others, self._other_losses = self._other_losses, {}
        self._handed_weight, self._handed_sum, self._handed_total = 0.0, None, None
        sizes, self._sizes = self._sizes, []
        samples, flattened, self._samples, self._flattened = self._samples, self._flattened, 0, False
        self.waits.clear()  # a step's batches are fetched by its end: what is left must not shift the next
        if not row:
            return
        facts = self.facts
        if not facts.bound:
            facts.bind([len(o.param_groups) for o in self.optimizers], scaler=self._scaler)
        n = len(facts.groups)
        scaled = next((e for e in row.values() if e.scale is not None), None)
        skips = [e.skipped for e in row.values() if e.skipped is not None]
        facts.set_row(
            FactsRow(
                lrs=[row[s].lrs if s in row else None for s in range(n)],
                grad_norms=[row[s].grad_norm if s in row else None for s in range(n)],
                losses=[None, *(others.get(s) for s in range(1, n))],
                scale=scaled.scale if scaled is not None else None,
                skipped=_any_skip(skips) if facts.scaler else None,
            )
        )
        if direct is not None:
            if not self._fits(direct, "step"):
                return
            outputs, targets = self._classification(direct)
            if outputs is not None and 0 < direct.samples != outputs.shape[0]:  # a flattened sequence batch
                self.tap.step(
                    direct.loss, outputs=outputs, targets=targets, batch_size=direct.samples, tokens=direct.tokens
                )
            else:
                self.tap.step(direct.loss, outputs=outputs, targets=targets, tokens=direct.tokens)
        else:
            if not accumulated and not self._fits(None, "step"):
                return
            # the micro-batches were weighed by their outputs' rows; throughput counts the samples
            if flattened and samples > 0:
                self.tap.step(batch_size=samples)
            else:
                self.tap.step()
            if len(set(sizes)) > 1 and not self._trainer_noted:
                self._note_mean_of_means(sizes)
        self.rows += 1

    def _note_mean_of_means(self, sizes: list[float]) -> None:
        """Say why the HF Trainer's logged loss is not the stored one, at its first step whose
        micro-batches (each divided by their count: the accumulation kind) differ in size."""
        if not _in_hf_trainer():
            return
        self._trainer_noted = True
        shown = ", ".join(f"{s:g}" for s in sizes)
        self.say(
            "trainer-mean-of-means",
            "the HF Trainer's logged loss differs from the stored one wherever a step's micro-batches differ in "
            f"size (here {shown} samples): the Trainer divides each micro-batch's mean loss by their count and "
            f"adds them (a mean of means), batchtap stores the mean over the step's {sum(sizes):g} samples "
            '(docs/autolog.md, "The step\'s loss"); with equal micro-batches the two agree',
        )

    def _accumulate(self, micro: MicroBatch, *, summed: bool = False, last: bool = False) -> None:
        fixed, outputs = self._shape, micro.outputs
        if fixed is not None and fixed[1] and outputs is not None and micro.ignore_index == self._ignore_index:
            targets = micro.targets  # the usual micro-batch: what _fits and _classification let through as is
        else:
            if not self._fits(micro, "accumulate"):
                return
            outputs, targets = self._classification(micro)
        loss = micro.loss
        # the Tap's weight of this micro-batch (shape metadata), as samples_of(None, outputs, targets)
        samples = (
            float(outputs.shape[0]) if outputs is not None and outputs.dim() > 0 else samples_of(None, outputs, targets)
        )
        if summed:
            loss = self._normalised(loss, samples if math.isfinite(samples) else 1.0, last)
        elif math.isfinite(samples):
            self._sizes.append(samples)
        if outputs is not None and micro.samples > 0 and (self._samples or not self._accumulated):
            self._samples += micro.samples
            self._flattened = self._flattened or micro.samples != outputs.shape[0]
        else:
            self._samples = 0  # unknown for one micro-batch: the step's are
        wait = self.waits.popleft() if self.waits else None
        self.tap.accumulate(loss, outputs=outputs, targets=targets, data_time=wait, tokens=micro.tokens)
        self._accumulated += 1

    def _normalised(self, loss: torch.Tensor, weight: float, last: bool) -> torch.Tensor:
        """The loss to hand over for a micro-batch whose step loss is a sum (token-normalised, or
        undivided accumulation). The Tap's step loss is the mean
        of the handed losses weighted by samples (a host count, as the Tap weighs them); the step's
        loss here is their plain sum: the last micro-batch carries what makes that mean the sum
        (device ops only, exact up to float32 rounding)."""
        total = loss if self._handed_total is None else self._handed_total + loss
        if last:
            handed = self._handed_sum
            weights = self._handed_weight + weight
            loss = total * weights if handed is None else total * weights - handed
            loss = loss / weight
            self._handed_weight, self._handed_sum, self._handed_total = 0.0, None, None
            return loss
        part = loss * weight
        self._handed_sum = part if self._handed_sum is None else self._handed_sum + part
        self._handed_weight += weight
        self._handed_total = total
        return loss

    def _classification(self, micro: MicroBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if micro.ignore_index == self._ignore_index and micro.outputs is not None and self._shape is not None:
            if self._shape[1]:  # the usual micro-batch: the run's accuracy inputs, as before
                return micro.outputs, micro.targets
        if micro.outputs is None or self._shape is None or not self._shape[1]:
            return None, None
        if self._ignore_index is None:
            self._ignore_index = micro.ignore_index
            self.accuracy.ignore_index = micro.ignore_index  # before the Tap's first step builds its writer
        elif micro.ignore_index != self._ignore_index:
            self.say(
                "ignore-index",
                f"the loss function's ignore_index changed from {self._ignore_index} to {micro.ignore_index}; "
                f"accuracy keeps leaving out {self._ignore_index}",
            )
        return micro.outputs, micro.targets

    def _fits(self, micro: MicroBatch | None, call: str) -> bool:
        """Whether this hand-over has what the run's first one had (its columns are fixed)."""
        fixed = self._shape
        if fixed is not None and micro is not None and (micro.outputs is not None or not fixed[1]):
            return True  # the usual hand-over: a loss, and logits where the first one had them
        shape = (micro is not None, micro is not None and micro.outputs is not None)
        if self._shape is None:
            self._shape = shape
            return True
        if shape[0] < self._shape[0] or shape[1] < self._shape[1]:
            self.say(
                "missing-inputs",
                "an optimizer step came without the "
                + ("loss" if shape[0] < self._shape[0] else "classification logits and targets")
                + " that the run's first step had (no backward() before it, or another loss function): "
                "such steps are not recorded",
            )
            return False
        return True


def _in_hf_trainer() -> bool:
    """Whether a ``transformers.Trainer`` training loop is on the stack (looked for only when
    ``transformers.trainer`` was imported, and only at a step of unequal micro-batches)."""
    module = sys.modules.get("transformers.trainer")
    path = getattr(module, "__file__", None)
    frame = sys._getframe(1) if path else None
    while frame is not None:
        if frame.f_code.co_filename == path:
            return True
        frame = frame.f_back
    return False


def _same(first: tuple[float | None, ...], second: tuple[float | None, ...]) -> bool:
    """Whether two micro-batches' constant factors can be one accumulation count: equal where the
    host knows both (``loss / 4`` each time), whatever they are where only the device does.
    ``0.3 * ce_a`` and ``0.7 * ce_b`` are weighted losses, not micro-batches."""
    return len(first) == len(second) and all(a is None or b is None or a == b for a, b in zip(first, second))


def _summed(micro: list[MicroBatch]) -> MicroBatch:
    """Several losses of one optimizer step as one: the sum of what the gradients saw of each, with
    the first classification loss's logits and targets (accuracy)."""
    total = micro[0].given()
    for m in micro[1:]:
        total = total + m.given()
    first = next((m for m in micro if m.outputs is not None), None)
    if first is None:
        return MicroBatch(total)
    return MicroBatch(
        total, first.outputs, first.targets, first.ignore_index, samples=first.samples, tokens=first.tokens
    )


def _any_skip(skips: list[torch.Tensor | float]) -> torch.Tensor | float | None:
    if not skips:
        return None
    if len(skips) == 1:
        return skips[0]
    if all(not isinstance(s, torch.Tensor) for s in skips):
        return max(float(s) for s in skips)  # type: ignore[arg-type]
    device = next(s.device for s in skips if isinstance(s, torch.Tensor))
    return torch.stack([torch.as_tensor(s, dtype=torch.float32, device=device) for s in skips]).amax()
