"""An autolog session: the Tap, the patches, the run's life cycle, and what it says once."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from batchtap._exit import Terminated, ending_of, sigterm_received
from batchtap.autolog._facts import OptimizerFacts
from batchtap.autolog._graph import resolve
from batchtap.autolog._loader import LoaderWatch
from batchtap.autolog._losses import LossCalls
from batchtap.autolog._patches import PatchRegistry
from batchtap.autolog._rows import MicroBatch, Rows
from batchtap.autolog._steps import OptimizerSteps, StepEvent
from batchtap.autolog._trainers import without_process_factor
from batchtap.metrics.accuracy import Accuracy
from batchtap.metrics.base import Metric
from batchtap.metrics.layers import Layers, find_model
from batchtap.metrics.scalars import Loss, Memory
from batchtap.metrics.timing import DataTime, StepTime, Throughput
from batchtap.records import RunStatus
from batchtap.rules.engine import RuleLike
from batchtap.sinks.base import Sink
from batchtap.tap import Tap

__all__ = ["Session"]

log = logging.getLogger("batchtap")

#: What ``say`` reports as a note (``info``): how autolog read the loop (accumulation, several
#: losses, an assumed loss, no accuracy), a choice, not something it failed to record.
NOTES = frozenset(
    {
        "accumulation",
        "normalised",
        "several-losses",
        "losses-assumed",
        "assumed",
        "loss-only",
        "twice",
        "trainer-mean-of-means",
    }
)


class Session:
    """One ``bt.autolog()``: builds the Tap, installs the patches, starts and ends the run.

    Args:
        name, config: the run's name and stored config.
        sinks, rules, flush_every, flush_seconds: passed to the :class:`~batchtap.Tap`.
        optimizers: optimizers made before autolog, in the order their values are named
            (``lr``, ``lr_1``...); others are added as they are made or first step.
    """

    def __init__(
        self,
        *,
        name: str | None,
        config: Any,
        sinks: Sequence[Sink] | None,
        rules: Sequence[RuleLike],
        flush_every: int,
        flush_seconds: float,
        optimizers: Sequence[torch.optim.Optimizer],
        layers: int | None = None,
    ) -> None:
        self.name, self.config = name, config
        self.facts = OptimizerFacts()
        self.accuracy = Accuracy()
        metrics: list[Metric] = [
            Loss(nonnegative=False),  # a custom loss may be negative (a GAN's, a log-likelihood's)
            self.accuracy,
            self.facts,
            StepTime(),
            DataTime(),
            Throughput(),
            Memory(),
        ]
        # per-layer values: the model is attached when the first optimizer shows its parameters
        self.layers = Layers(None, every=layers) if layers is not None else None
        if self.layers is not None:
            metrics.append(self.layers)
        self.tap = _SessionTap(
            self, metrics, sinks, flush_every=flush_every, flush_seconds=flush_seconds, rules=rules, fit_metrics=True
        )
        self.patches = PatchRegistry()
        self.calls = LossCalls()
        self.rows = Rows(self.tap, self.facts, self.accuracy, self.say)
        self.steps = OptimizerSteps(self._on_step, self._on_optimizer, self.guard)
        self.loaders = LoaderWatch(self._watch, lambda: self.rows.events, self.rows.waits)
        self.started = False
        self.ended = False
        self.broken = False
        self._said: set[str] = set()
        self._waiting: list[tuple[str, bool]] = []  # (message, a note?) said before the run started
        self._failure: tuple[RunStatus, str] | None = None  # an uncaught exception seen at exit
        self._excepthook: Any = None
        self._exit_code: object = None  # what sys.exit() was last called with
        for optimizer in optimizers:
            self.rows.add_optimizer(optimizer)

    # ------------------------------------------------------------------ life cycle

    def install(self) -> None:
        """Patch, start the run (or wait for the process group torchrun's script makes), hook exit."""
        try:
            self.calls.install(self.patches)
            self.steps.install(self.patches)
            self.loaders.install(self.patches)
            self._patch_backward()
            self._patch_destroy_process_group()
        except BaseException:
            self.patches.undo()
            raise
        if not _process_group_pending():
            self.start()
        self._excepthook = sys.excepthook
        sys.excepthook = self._on_uncaught
        self._patch_exit()
        atexit.register(self._at_exit)

    def start(self) -> None:
        if self.started or self.ended:
            return
        self.started = True
        self.tap.start(name=self.name, config=self.config)
        waiting, self._waiting = self._waiting, []
        for message, info in waiting:
            self.tap.warn(message, info=info)

    def end(self, status: RunStatus | str = RunStatus.FINISHED, reason: str | None = None) -> None:
        """Close the last row, end the run with ``status``, undo every patch, close the Tap."""
        if self.ended:
            return
        self.ended = True
        self.steps.enabled = self.loaders.enabled = False
        self.patches.undo()
        if sys.excepthook == self._on_uncaught:
            sys.excepthook = self._excepthook
        atexit.unregister(self._at_exit)
        try:
            if self.started and not self.broken:
                self.guard(self.rows.close)
                if self.rows.rows == 0 and self.rows.events == 0:
                    self.say("no-step", "no optimizer step was seen: nothing was recorded per step")
            if self.started and self.tap.run_info is not None:
                self.tap.finish(RunStatus(status), reason=reason)
        finally:
            self.tap.close()

    def _on_uncaught(self, kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):
            self._failure = (RunStatus.STOPPED, "KeyboardInterrupt")
        elif issubclass(kind, Terminated):
            self._failure = (RunStatus.STOPPED, "SIGTERM")
        else:
            self._failure = (RunStatus.FAILED, f"{kind.__name__}: {value}")
        (self._excepthook or sys.__excepthook__)(kind, value, tb)

    def _at_exit(self) -> None:
        status, reason = self._failure or (RunStatus.FINISHED, None)
        if sigterm_received():  # also where another excepthook took the Terminated first
            status, reason = RunStatus.STOPPED, "SIGTERM"
        elif self._failure is None and self._exit_code not in (None, 0):
            # sys.exit(n): no excepthook sees a SystemExit, and n != 0 says the script failed
            status, reason = RunStatus.FAILED, f"the script exited with status {self._exit_code}"
        try:
            self.end(status, reason)
        except Exception:  # never turn interpreter exit into a traceback of ours
            log.exception("batchtap autolog: ending the run at exit failed")

    # ------------------------------------------------------------------ never crash the user's loop

    def guard(self, action: Callable[..., None], *args: Any) -> None:
        """Run ``action(*args)``; an error stops autolog's recording (said once), never the training."""
        if self.broken:
            return
        try:
            action(*args)
        except Exception as exc:  # noqa: BLE001 - the user's training goes on whatever happened here
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """An error of autolog's own: recording stops (said once), the training goes on."""
        self.broken = True
        self.steps.enabled = self.loaders.enabled = False
        self.say("error", f"autolog stopped recording after an error of its own: {type(exc).__name__}: {exc}")
        log.debug("batchtap autolog error", exc_info=True)

    def say(self, key: str, message: str) -> None:
        """Report ``message`` once per run: a warning event with the run, and the log; a note
        (:data:`NOTES`: how autolog read the loop) as an ``info`` event, printed once by the console."""
        if key in self._said:
            return
        self._said.add(key)
        message = f"autolog: {message}"
        info = key in NOTES
        if self.started and self.tap.run_info is not None:
            self.tap.warn(message, info=info)
        else:
            if not info:  # a note waits for the run's console line
                log.warning("batchtap: %s", message)
            self._waiting.append((message, info))

    # ------------------------------------------------------------------ what the patches report

    def _on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.start()  # a torchrun script made its process group before its optimizer
        self.rows.add_optimizer(optimizer)
        if self.layers is not None and not self.layers.attached and self.rows.rows == 0:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            model = find_model(params)
            if model is None:
                self.say(
                    "layers", "autolog(layers=): no torch.nn.Module holds the optimizer's parameters; not recorded"
                )
            else:
                self.layers.attach(model)

    def _on_step(self, event: StepEvent) -> None:
        self.start()
        self.rows.on_step(event)

    def _watch(self, iterator: Any) -> Iterator[Any] | None:
        if self.broken or not self.started or self.tap.run_info is None:
            return None
        return self.tap.watch(iterator)

    def _patch_exit(self) -> None:
        """Note sys.exit()'s status: a SystemExit reaches no excepthook, and the exit status is not
        visible at exit. (A bare ``raise SystemExit(n)`` is not seen: its run is stored finished.)"""
        original = sys.exit
        session = self

        def exit(status: Any = None) -> Any:  # noqa: A001 - sys.exit's own name
            session._exit_code = 1 if status is not None and not isinstance(status, int) else status
            return original(status)

        exit.__wrapped__ = original  # type: ignore[attr-defined]
        exit.__doc__ = original.__doc__
        self.patches.replace(sys, "exit", exit)

    def _patch_backward(self) -> None:
        original = torch.autograd.backward
        session = self
        is_compiling = torch.compiler.is_compiling

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if not session.broken and not session.ended and not is_compiling():
                try:  # session.guard, inlined: this runs at every backward()
                    session._on_backward(tensors)
                except Exception as exc:  # noqa: BLE001 - the user's training goes on whatever happened here
                    session._failed(exc)
            return original(tensors, *args, **kwargs)

        backward.__wrapped__ = original  # type: ignore[attr-defined]
        backward.__doc__ = original.__doc__
        self.patches.replace(torch.autograd, "backward", backward)

    def _patch_destroy_process_group(self) -> None:
        """End the run when the script ends its process group: every rank calls it at the same
        point, and the run's last exchange across ranks needs the group (after it, it would wait
        out the collective timeout)."""
        import torch.distributed as dist

        if not dist.is_available():
            return
        original = dist.destroy_process_group
        session = self

        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            if not args and not kwargs.get("group") and not session.ended:
                session.end()  # the script is done training: its run is finished
            return original(*args, **kwargs)

        destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        destroy_process_group.__doc__ = original.__doc__
        self.patches.replace(dist, "destroy_process_group", destroy_process_group)

    def _on_backward(self, tensors: Any) -> None:
        # at every backward(): kept to attribute reads where nothing is out of the ordinary
        steps = self.steps
        if steps._clips:
            steps.clear_clips()  # a clip before this backward() belongs to an earlier step
        if steps.watch.nesting.depth and steps.raised():
            # the backward() calls before an optimizer step that raised belong to no recorded step
            handed = self.rows.drop_pending()
            self.say(
                "step-raised",
                "an optimizer step raised and the loop went on: the backward() calls before it are not recorded"
                + (
                    " (except accumulation micro-batches already handed over: they count in the next step's row)"
                    if handed
                    else ""
                )
                + "; later steps are recorded",
            )
        if isinstance(tensors, (list, tuple)):
            if len(tensors) != 1:
                self.say("several-tensors", "backward() of several tensors at once: their losses are not recorded")
                return
            tensors = tensors[0]
        if not isinstance(tensors, torch.Tensor) or tensors.grad_fn is None:
            return
        if tensors.dim() != 0:
            self.say("non-scalar", "backward() of a non-scalar tensor (with a gradient argument): loss not recorded")
            return
        calls = self.calls
        found = resolve(tensors, calls.by_node, steps.loss_scale() if steps._scaler is not None else None)
        if found.divided and not found.normalised and "transformers.trainer" in sys.modules:
            without_process_factor(found)  # the HF Trainer's x num_processes is no accumulation division
        call = found.call if found.call is not None and found.call.logits is not None else calls.last_classification()
        calls.by_node.clear()
        if found.call is None:
            if found.undone:
                self.say(
                    "assumed",
                    "loss: no recognised loss function (F.cross_entropy, F.nll_loss, nn.CrossEntropyLoss) "
                    "under the tensor given to backward(); recorded that tensor with its constant factors "
                    f"undone ({', '.join(found.undone)}), assuming they are accumulation or loss-scale factors",
                )
            if call is None:
                self.say(
                    "loss-only",
                    "no classification loss (F.cross_entropy, nn.CrossEntropyLoss, F.nll_loss with class "
                    "targets) was computed with a gradient: loss only, no accuracy (a custom or regression "
                    "loss, or a loss function imported by name before bt.autolog() ran)",
                )
        classified = call is not None and call.logits is not None
        self.rows.on_backward(
            MicroBatch(  # positional: MicroBatch's field order
                found.loss,
                call.logits if classified else None,  # type: ignore[union-attr]
                call.targets if classified else None,  # type: ignore[union-attr]
                call.ignore_index if classified else -100,  # type: ignore[union-attr]
                tensors.detach(),
                found.scale,
                found.divided,
                found.shape,
                found.normalised,
                found.factors,
                call.samples if classified else 0,  # type: ignore[union-attr]
                call.tokens if classified else None,  # type: ignore[union-attr]
            )
        )


def _process_group_pending() -> bool:
    """torchrun started this process but its script has not made the process group yet: every
    rank must start the run together, after ``init_process_group``."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    if world <= 1:
        return False
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


class _SessionTap(Tap):
    """The session's Tap: leaving ``with bt.autolog():`` ends the session (its last row closed, every
    patch undone, the run ended by how the block ended), as leaving ``with tap:`` ends a run."""

    def __init__(self, session: Session, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session = session

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        try:
            if not self._session.ended:
                self._session.end(*ending_of(error))
        finally:
            super().__exit__(kind, error, tb)
