"""mpnb inside Hugging Face ``transformers.Trainer``: telemetry, the live dashboard, Stop / Pause, notices.

Needs ``pip install 'mpnb[transformers]'``. Add the callback; change nothing else::

    from mpnb.integrations.transformers import MpnbCallback, precision_args

    callback = MpnbCallback()
    args = TrainingArguments("out", use_cpu=True, **precision_args("bf16"))
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    callback.history.summary()

What each row holds, and where it comes from:

- loss: the loss the Trainer adds to its own log for that optimizer step (the model output's
  ``loss``, summed over the step's micro-batches where the model was given
  ``num_items_in_batch``, so divided by the step's token count already; averaged otherwise),
  kept on the device until the next flush. One case differs: a ``compute_loss`` override that
  calls a model taking loss keyword arguments without passing ``num_items_in_batch`` on makes
  the Trainer sum the micro-batches' means (its logged loss and its gradients are k times the
  mean, for k micro-batches), where the row holds the mean. mpnb cannot tell that case from a
  Trainer told to divide (``trainer.model_accepts_loss_kwargs = False``, as some subclasses set);
- loss scale and skipped: the GradScaler the Trainer's Accelerator really uses (none: scale 1,
  nothing skipped), skips seen as the optimizer step GradScaler did not let through;
- mode: read from autocast and the weights during the step's forward pass (see
  :class:`~mpnb.integrations.observed.PrecisionObserver` for which steps are read), not from
  ``TrainingArguments``. On a CPU,
  ``fp16=True`` trains in fp32 (transformers 5.23 with Accelerate 1.15) or, on older stacks, fp16
  autocast with no scaler at all: either way the callback warns.

A ``compute_loss`` override that computes the loss outside the model (or adds a term to it) is
not seen, nor is the loss of ``label_smoothing_factor`` (the Trainer's label smoother computes
it outside the model, and the callback says so): such steps have ``loss_missing`` (or the
model's own loss). Evaluation and checkpoint
saves during training are left out of the next step's time; ``epoch`` is the Trainer's epoch.

Stop on the dashboard (or ``callback.control.stop()``) sets ``control.should_training_stop``:
the Trainer ends after the current step and runs its own end of training (saving included).

Example:
    >>> precision_args("bf16")
    {'bf16': True, 'fp16': False, 'tf32': None}
    >>> precision_args("fp32")
    {'bf16': False, 'fp16': False, 'tf32': None}
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import TrainerCallback

from mpnb.errors import InvalidChoiceError
from mpnb.integrations.loop_telemetry import LoopTelemetry, WithTelemetry
from mpnb.precision.modes import Mode, parse_mode, registered
from mpnb.precision.policy import session
from mpnb.training.batches import samples_in
from mpnb.training.telemetry import Sink

__all__ = ["MpnbCallback", "precision_args"]

_FRAMEWORK = "transformers.Trainer"


def precision_args(
    mode: str | Mode | None = None, device: str | torch.device | None = None
) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords for a mode (default: the session's ``%amp`` mode).

    ``tf32`` is set only on CUDA (the Trainer refuses it elsewhere): True for mode tf32, False
    for fp32; None leaves the Trainer's default. Only precision is set: on a machine without a
    GPU, transformers refuses ``bf16=True`` unless ``use_cpu=True`` is given beside it.

    Raises:
        InvalidChoiceError: an unknown mode, naming the valid ones.

    Example:
        >>> precision_args("tf32", device="cuda")
        {'bf16': False, 'fp16': False, 'tf32': True}
        >>> precision_args("half", device="cpu")  # tf32 is left to the Trainer off CUDA
        {'bf16': False, 'fp16': True, 'tf32': None}
    """
    chosen = parse_mode(mode) if mode is not None else session.mode
    on_cuda = device is not None and torch.device(device).type == "cuda"
    arguments = chosen.training_arguments(on_cuda)
    if arguments is None:
        valid = [m.name for m in registered() if m().training_arguments(on_cuda) is not None]
        hint = chosen.framework_hint
        raise InvalidChoiceError(
            "TrainingArguments setting for mode",
            chosen.label,
            valid,
            f"TrainingArguments has no {chosen.name} setting: {hint}." if hint else "",
        )
    return arguments


def asked_precision(args: Any) -> str:
    """The precision ``TrainingArguments`` asks for (see :func:`~mpnb.integrations.observed.precisions`)."""
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "tf32" if getattr(args, "tf32", None) else "fp32"


def epoch_of_step(state: Any) -> int:
    """The epoch a step that just ended belongs to: the Trainer's ``state.epoch`` is the progress
    after it (1.0 at the end of epoch 0)."""
    return max(0, math.ceil(state.epoch or 0) - 1)


class MpnbCallback(TrainerCallback, WithTelemetry):
    """mpnb's telemetry and controls for a ``transformers.Trainer``.

    Args:
        dashboard: ``"auto"`` (live plot in a notebook, text progress elsewhere), ``"live"``,
            ``"text"``, a Sink, or None.
        on_nonfinite: ``"warn"`` (default) or ``"ignore"``.
        flush_every: optimizer steps between copies of the device values to the host.
        watch_numerics, locate_overflow: per-module numerics every k steps, and where an fp16
            overflow began (see :class:`~mpnb.integrations.loop_telemetry.LoopTelemetry`).

    Attributes:
        history: one row per optimizer step (every ``train()`` this callback saw).
        control: Stop / Pause / Resume.
        telemetry: the :class:`~mpnb.integrations.loop_telemetry.LoopTelemetry` behind it.

    Example (made here only; ``Trainer(..., callbacks=[callback]).train()`` fills it, as the
    module's notes show: a real Trainer is too slow for a docstring example and fixes
    Accelerate's precision for the rest of the process):
        >>> callback = MpnbCallback(dashboard=None)
        >>> callback, len(callback.history), str(callback.control.state)
        (<mpnb MpnbCallback for transformers.Trainer: 0 steps>, 0, 'idle')
    """

    def __init__(
        self,
        dashboard: str | Sink | None = "auto",
        on_nonfinite: str = "warn",
        flush_every: int = 64,
        watch_numerics: int | bool | None = True,
        locate_overflow: bool = True,
    ) -> None:
        self.telemetry = LoopTelemetry(
            _FRAMEWORK, dashboard, on_nonfinite, flush_every, watch_numerics, locate_overflow
        )

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = getattr(
            optimizer, "optimizer", optimizer
        )  # accelerate's AcceleratedOptimizer wraps the torch one
        self.telemetry.begin(
            model,
            inner,
            scaler=getattr(optimizer, "scaler", None),
            device=args.device,
            asked=asked_precision(args),
            title=f"{_FRAMEWORK}: {type(model).__name__}",
            on_stop=lambda: setattr(control, "should_training_stop", True),
            after_step=state.global_step,  # a run resumed from a checkpoint numbers on
        )
        smoothing = getattr(args, "label_smoothing_factor", 0)
        self.telemetry.no_loss_reason = (
            f"with label_smoothing_factor={smoothing} the Trainer's label smoother computes the loss outside the model"
            if smoothing
            else None
        )
        # held by the run: off at on_train_end, or at the next begin() when a train() raised before it
        self.telemetry.hold(model.register_forward_hook(self._forward_done, with_kwargs=True))

    def _forward_done(self, module, args, kwargs, output) -> None:
        if not (module.training and torch.is_grad_enabled()) or not self.telemetry.running:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            # with num_items_in_batch the model already divided by the step's token count
            self.telemetry.add_loss(loss, normalized=kwargs.get("num_items_in_batch") is not None)
        self.telemetry.add_samples(samples_in(kwargs or args))

    def on_step_begin(self, args, state, control, **kwargs):
        self.telemetry.window_begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.telemetry.before_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self.telemetry.step_end(epoch_of_step(state)):
            control.should_training_stop = True
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        if self.telemetry.running:  # evaluation during training: not part of the next step's time
            self.telemetry.outside_steps()

    def on_save(self, args, state, control, **kwargs):
        if self.telemetry.running:
            self.telemetry.outside_steps()

    def on_train_end(self, args, state, control, **kwargs):
        self.telemetry.end()

    def __repr__(self) -> str:
        return f"<mpnb MpnbCallback for {_FRAMEWORK}: {self.telemetry.steps} steps>"
