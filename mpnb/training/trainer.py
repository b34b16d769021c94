"""``Trainer``: fit a model in a precision mode, with telemetry, a live dashboard and safe interrupts.

Example:
    >>> import torch, mpnb.examples as ex
    >>> train, _ = ex.digits(batch_size=128)
    >>> model = ex.DigitsCNN(widths=(8, 16))
    >>> trainer = Trainer(model, torch.optim.Adam(model.parameters(), 1e-2), torch.nn.functional.cross_entropy,
    ...                   mode="bf16", device="cpu", dashboard=None)
    >>> history = trainer.fit(train, max_steps=5)
    >>> len(history), history.mode[-1]
    (5, 'bf16')
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mpnb import views
from mpnb.errors import MpnbError
from mpnb.precision.modes import Mode
from mpnb.precision.policy import session
from mpnb.training.amp_step import AmpStep
from mpnb.training.capture import FitCapture, active_capture
from mpnb.training.control import FitControl
from mpnb.training.history import History
from mpnb.training.interrupts import StopRequest
from mpnb.training.step_precision import TrainingPrecision
from mpnb.training.telemetry import Sink

__all__ = ["Trainer", "FitInterrupted"]

CHECKPOINT_FORMAT = "mpnb-trainer"


class FitInterrupted(KeyboardInterrupt):
    """``fit`` stopped at a consistent point after an interrupt; ``history`` keeps every finished step."""

    def __init__(self, message: str, history: History) -> None:
        super().__init__(message)
        self.history = history


class Trainer:
    """Train ``model`` with ``optimizer`` on ``loss_fn(model(inputs), targets)`` in a precision mode.

    Args:
        model: moved to ``device``.
        optimizer: built on the model's parameters.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``.
        mode: ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"`` or ``"off"``; default the session
            mode (``%amp``). fp32/tf32 set their fp32-math flags only while ``fit`` runs.
        device: default the session device (auto-detected: cuda, hpu, else cpu).
        dashboard: ``"auto"`` (live plot in a notebook, text progress elsewhere), ``"live"``,
            ``"text"``, None for no display, or a :class:`~mpnb.training.telemetry.Sink`.
        **amp_options: passed to :class:`~mpnb.training.amp_step.AmpStep` (scheduler,
            accumulate, clip_grad_norm, record_grad_norm, init_scale, growth_factor,
            backoff_factor, growth_interval, min_scale, flush_every).

    Attributes:
        history: every step of every ``fit`` call so far.
        amp: the step helper (``trainer.amp.scaler`` is the GradScaler).
        control: stop / pause / resume the running fit (the live dashboard's buttons use it).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        mode: str | Mode | None = None,
        device: str | torch.device | None = None,
        dashboard: str | Sink | None = "auto",
        **amp_options: Any,
    ) -> None:
        self.amp = AmpStep(optimizer, mode=mode, device=device, **amp_options)
        self.device = self.amp.precision.device
        self.model = model.to(self.device)
        self.optimizer, self.loss_fn = optimizer, loss_fn
        self.dashboard = dashboard
        self._epoch, self._batch = 0, 0  # position: next batch to train on
        self._end_epoch: int | None = None  # set while a planned run is unfinished
        self._window_start = (0, 0)  # position of the current accumulation window's first batch
        self.control = FitControl()
        self._math = contextlib.ExitStack()  # the fp32-math scope of the precision training runs in

    @property
    def history(self) -> History:
        """Every recorded step."""
        return self.amp.history

    @property
    def mode(self) -> Mode:
        """The precision mode training runs in."""
        return self.amp.precision.mode

    def fit(
        self,
        data: Iterable[Sequence[Any]],
        epochs: int | None = None,
        *,
        max_steps: int | None = None,
    ) -> History:
        """Train on ``data`` (an iterable of ``(inputs, targets)`` batches) and return the history.

        ``epochs`` counts epochs from where training stands. After an interrupted ``fit``,
        calling ``fit(data)`` without ``epochs`` finishes the interrupted run: it resumes at
        the batch after the last finished step (exact for data whose order depends only on
        the epoch, such as :class:`mpnb.examples.Batches` or a DataLoader without shuffle).
        ``max_steps`` stops after that many optimizer steps in this call.

        Interrupting (Ctrl-C, the kernel's stop button) finishes the current optimizer step,
        keeps its telemetry, then raises :class:`FitInterrupted` (a KeyboardInterrupt);
        a second interrupt stops at once. An error in the middle of an accumulation window
        drops that window's gradients, and the next ``fit(data)`` starts it again.

        Inside :func:`~mpnb.training.capture.capture_fits` (what ``%%compare`` uses) the fit
        trains in the captured mode, within the captured step budget, reporting to its sink.
        """
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be a positive number, got {epochs}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be a positive number, got {max_steps}")
        capture = active_capture()
        if capture is not None:
            max_steps = self._join(capture, max_steps)
            if max_steps == 0:
                return self.history
        sinks = self._sinks(capture)
        steps_before = self.amp.steps
        if epochs is not None or self._end_epoch is None:
            self._end_epoch = self._epoch + (epochs or 1)  # a partly trained epoch counts as one
        self.history.meta.update(model=self.describe(), device=str(self.device), mode=self.mode.value)
        self.amp.recorder.sinks.extend(sinks)
        self.amp.restart_clock()
        self.model.train()
        self.control.begin()
        try:
            with self._math, StopRequest() as stop:
                self._math.enter_context(self.amp.precision.math_scope())
                finished = self._run(data, stop, max_steps)
        except BaseException:
            self._drop_unfinished_window()
            raise
        finally:
            self.control.end()
            self.amp.close()
            for sink in sinks:
                self.amp.recorder.sinks.remove(sink)
            if capture is not None:
                capture.steps_taken += self.amp.steps - steps_before
        if finished:
            self._end_epoch = None
        if stop.requested and not finished:
            message = (
                f"fit stopped after step {self.amp.steps} (epoch {self._epoch}, batch {self._batch}); "
                "trainer.history keeps every finished step; call fit(data) to continue"
            )
            self.history.note("interrupted", kind="interrupt")
            raise FitInterrupted(message, self.history)
        if self.control.stop_requested and not finished:
            self.history.note("stopped", kind="stop")
        return self.history

    def _join(self, capture: FitCapture, max_steps: int | None) -> int:
        """Train in the capture's mode, within its step budget: the steps this fit may take."""
        capture.adopt(self)
        if self.mode is not capture.mode:
            self.amp.set_precision(TrainingPrecision.resolve(capture.mode, self.device))
        return capture.steps_allowed(max_steps)

    def _sinks(self, capture: FitCapture | None) -> list[Sink]:
        if capture is not None:
            return [capture.sink] if capture.sink is not None else []
        return _dashboard_sinks(self.dashboard, self.describe(), self.control)

    def _run(self, data: Iterable[Sequence[Any]], stop: StopRequest, max_steps: int | None) -> bool:
        """Train until the planned end, ``max_steps`` or a stop request; True when the plan is done."""
        assert self._end_epoch is not None
        steps_left = max_steps
        while self._epoch < self._end_epoch:
            if hasattr(data, "set_epoch"):
                data.set_epoch(self._epoch)
            self.amp.epoch = self._epoch
            for batch in itertools.islice(data, self._batch, None):
                if self.amp.between_steps:
                    checkpoint = self.control.checkpoint(interrupted=lambda: stop.requested)
                    self._follow_session(checkpoint.changed)
                    if checkpoint.paused_s:
                        self.amp.restart_clock()  # the pause is not step time
                    if stop.requested or checkpoint.stop or steps_left == 0:
                        return False
                    self._window_start = (self._epoch, self._batch)
                if self._train_batch(batch) and steps_left is not None:
                    steps_left -= 1
                self._batch += 1
            self._epoch, self._batch = self._epoch + 1, 0
        return True

    def _follow_session(self, changed: tuple[str, ...]) -> None:
        """Apply switches made while the fit runs (from the panel or a widget) before the next step."""
        if not changed:
            return
        next_step = self.amp.steps + 1
        if {"mode", "reset", "unloaded"} & set(changed):
            try:
                self._switch_to(TrainingPrecision.resolve(None, self.device), next_step)
            except MpnbError as error:
                self.history.note(f"mode not switched: {error}", kind="switch", step=next_step)
        if "fp32_math" in changed:
            level = session.fp32_math.level
            if self.mode in (Mode.FP32, Mode.TF32):  # the fit's mode owns the flags: move between the two
                self._switch_to(TrainingPrecision.resolve(Mode.TF32 if level else Mode.FP32, self.device), next_step)
            else:
                self.history.note(f"fp32 math {level.value if level else 'as found'}", kind="switch", step=next_step)
        if "oplists" in changed:
            lists = session.oplists.lists
            text = f"lower {len(lists.lower)}, fp32 {len(lists.fp32)}" if lists else "none"
            self.history.note(f"op lists: {text}", kind="switch", step=next_step)

    def _switch_to(self, precision: TrainingPrecision, next_step: int) -> None:
        if precision.mode is self.mode:
            return
        message = f"mode {self.mode.value} -> {precision.mode.value}"
        self._math.close()
        self.amp.set_precision(precision)
        self._math.enter_context(precision.math_scope())
        self.history.note(message, kind="switch", step=next_step)

    def _drop_unfinished_window(self) -> None:
        """After an error mid-window: drop its gradients and go back to the window's first batch."""
        if not self.amp.between_steps:
            self.amp.discard_window()
            self._epoch, self._batch = self._window_start

    def _train_batch(self, batch: Sequence[Any]) -> bool:
        inputs, targets = (_to_device(part, self.device) for part in batch)
        with self.amp.autocast():
            loss = self.loss_fn(self.model(inputs), targets)
        self.amp.backward(loss)
        return self.amp.step(samples=_batch_size(inputs))

    def describe(self) -> str:
        """``"DigitsCNN, bf16 on cpu, 25,578 parameters"``."""
        count = sum(p.numel() for p in self.model.parameters())
        return f"{type(self.model).__name__}, {self.amp.precision.describe()}, {count:,} parameters"

    def __repr__(self) -> str:
        return f"<mpnb.Trainer {self.describe()}, {self.amp.steps} steps>"

    # -- checkpoints -------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer, scaler, scheduler, position and history in one file."""
        scheduler = self.amp.scheduler
        torch.save(
            {
                "format": CHECKPOINT_FORMAT,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "amp": self.amp.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "position": [self._epoch, self._batch, self._end_epoch],
                "history": self.history.to_dict(),
            },
            path,
        )

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore a :meth:`save` file (read with ``torch.load(weights_only=True)``).

        Raises:
            ValueError: the file is not an mpnb trainer checkpoint.
        """
        state = torch.load(path, map_location=self.device, weights_only=True)
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{os.fspath(path)!r} is not an mpnb trainer checkpoint (saved by Trainer.save)")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.amp.load_state_dict(state["amp"])
        if self.amp.scheduler is not None and state["scheduler"] is not None:
            self.amp.scheduler.load_state_dict(state["scheduler"])
        self._epoch, self._batch, self._end_epoch = state["position"]
        self.amp.recorder.history = History.from_dict(state["history"])


def _to_device(value: Any, device: torch.device) -> Any:
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def _batch_size(inputs: Any) -> int | None:
    return len(inputs) if isinstance(inputs, torch.Tensor) and inputs.dim() else None


def _dashboard_sinks(dashboard: str | Sink | None, title: str, control: FitControl) -> list[Sink]:
    if dashboard is None:
        return []
    if isinstance(dashboard, Sink):
        return [dashboard]
    return views.view("dashboard")(dashboard, title, control)
