"""The torch.amp recipe as one helper: autocast, loss scaling, clipping, stepping, telemetry.

For people who keep their own loop::

    amp = mpnb.AmpStep(optimizer, mode="fp16")
    for x, y in data:
        with amp.autocast():
            loss = loss_fn(model(x), y)
        amp.backward(loss)
        amp.step(samples=len(x))
    amp.history.skipped_steps

It is torch.autocast and torch.amp.GradScaler, nothing re-implemented: fp16 gets a real
scaler, every other mode a disabled one (which passes everything through). Telemetry is
recorded without host-device synchronisation (see :mod:`mpnb.training.telemetry`).

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 1)
    >>> amp = AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cpu")
    >>> for _ in range(3):
    ...     with amp.autocast():
    ...         loss = model(torch.ones(8, 4)).float().pow(2).mean()
    ...     amp.backward(loss)
    ...     _ = amp.step(samples=8)
    >>> len(amp.history), amp.history.skipped_steps
    (3, [])
"""

from __future__ import annotations

import collections
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from mpnb.errors import MpnbError, check_count, check_flag, check_number, quoted, warn_user
from mpnb.precision.modes import Mode
from mpnb.training.gradients import check_loss, rescale, unscale_and_clip
from mpnb.training.health import HealthWatch, scale_back
from mpnb.training.history import History
from mpnb.training.master_weights import (
    LOW_PRECISION_WEIGHTS,
    check_scalable,
    low_precision_notice,
    unscale_refusal,
)
from mpnb.training.step_precision import TrainingPrecision
from mpnb.training.step_record import StepAccount, flush_every_for
from mpnb.training.step_watch import OptimizerStepWatch, lr_in_use, scale_in_use
from mpnb.training.telemetry import MinScaleAlarm, Recorder, Sink
from mpnb.training.window import Window, WindowPhase

__all__ = ["AmpStep"]


def check_optimizer(optimizer: object) -> None:
    """Refuse what is not an optimizer (its class, a model or a loss in its place), naming it.

    >>> check_optimizer(torch.optim.SGD)
    Traceback (most recent call last):
    ...
    mpnb.errors.MpnbError: optimizer takes a torch.optim.Optimizer made over the model's parameters, such as torch.optim.SGD(model.parameters(), lr=0.01); got the class SGD
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        given = (
            f"the class {optimizer.__name__}"
            if isinstance(optimizer, type)
            else f"a {type(optimizer).__name__}"
        )
        raise MpnbError(
            "optimizer takes a torch.optim.Optimizer made over the model's parameters, such as "
            f"torch.optim.SGD(model.parameters(), lr=0.01); got {given}"
        )
    needed = required_arguments(optimizer, "step")
    if needed:  # LBFGS's closure, which torch's GradScaler does not take either
        raise MpnbError(
            f"{type(optimizer).__name__}.step() needs {', '.join(needed)}, and mpnb steps the "
            "optimizer as torch's GradScaler does, with no argument: use an optimizer whose "
            "step() takes none (SGD, Adam, AdamW...)"
        )


#: The float32 range GradScaler keeps its scale and factors in: a setting outside it becomes 0
#: (weights trained to NaN) or inf there; half the smallest subnormal rounds to 0.
_FLOAT32 = torch.finfo(torch.float32)
_ROUNDS_TO_ZERO = _FLOAT32.smallest_normal * 2.0**-24
_SCALE = {"above": _ROUNDS_TO_ZERO, "below": _FLOAT32.max}
#: GradScaler's settings, as options and as its state_dict names them: what each is, and its
#: bounds (torch asserts only the two factors' sides of 1; a fractional growth_interval fails at
#: the first update, a scale of 0 trains the weights to NaN).
_SCALER_SETTINGS: dict[str, dict[str, Any]] = {
    "init_scale": {**_SCALE, "meaning": "the first loss scale"},
    "scale": {**_SCALE, "meaning": "the scaler's loss scale now"},
    "growth_factor": {
        "above": 1.0,
        "below": _FLOAT32.max,
        "meaning": "the loss scale's growth after good steps",
    },
    "backoff_factor": {
        "above": _ROUNDS_TO_ZERO,
        "below": 1.0,
        "meaning": "the loss scale's cut at a skipped step",
    },
    "growth_interval": {
        "whole": True,
        "below": 2**63,
        "meaning": "good steps before the scale grows",
    },
    "_growth_tracker": {
        "whole": True,
        "above": -1,
        "below": 2**63,
        "meaning": "good steps counted since the last growth",
    },
}


def check_scaler_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with each GradScaler setting as a plain Python number (a numpy scalar handed
    to GradScaler would reach its ``state_dict``, and a checkpoint then holds what loading
    refuses), or an error for one outside its bounds, naming it (``settings``: by name, as the
    options or a scaler's ``state_dict`` name them; other names are passed over as they are).

    >>> check_scaler_settings({"init_scale": 0.0})
    Traceback (most recent call last):
    ...
    mpnb.errors.MpnbError: init_scale must be a number above 7.00649e-46 and below 3.40282e+38 (the first loss scale), got 0.0
    """
    return {
        name: check_number(name, value, **_SCALER_SETTINGS[name])
        if name in _SCALER_SETTINGS
        else value
        for name, value in settings.items()
    }


def settings_of(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    """The settings of a GradScaler given whole: its scale now, its factors and interval."""
    return {
        "scale": scaler.get_scale(),
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
    }


def forget_unfinished_update(scaler: torch.amp.GradScaler) -> None:
    """Forget what a GradScaler recorded of an optimizer step whose ``update()`` did not finish
    (an interrupt inside it): torch would refuse every later step of that optimizer with "step()
    has already been called since the last update()". What the end of ``update()`` does."""
    scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)


def check_scheduler(scheduler: object, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a scheduler that is none (a name, such as ``"cosine"``) or that steps another
    optimizer than ``optimizer``."""
    if scheduler is None:
        return
    if isinstance(scheduler, type) or not callable(getattr(scheduler, "step", None)):
        raise MpnbError(
            "scheduler must be a learning-rate scheduler built on the optimizer, such as "
            f"torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100); got {quoted(scheduler)}"
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise MpnbError(
            "the scheduler steps another optimizer than the one given: build it on this one"
        )
    needed = required_arguments(scheduler, "step")
    if needed:
        raise MpnbError(
            f"the scheduler's step() needs {', '.join(needed)} ({type(scheduler).__name__}), "
            "and mpnb steps the scheduler with no argument after each optimizer step: leave "
            "scheduler= out and call its step() yourself between fits or in a callback"
        )


def misplaced_arguments(first: object, more: tuple[object, ...]) -> str:
    """What to say to ``AmpStep(first, *more)``: it takes the optimizer alone, its options by name.

    >>> misplaced_arguments(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), ("bf16",))
    "AmpStep takes one argument, the optimizer, and its options by name: AmpStep(optimizer, mode='bf16')"
    """
    if isinstance(first, torch.nn.Module):
        return (
            f"AmpStep takes the optimizer alone, not the model (got a {type(first).__name__} "
            "first): the forward is yours, AmpStep scales, steps and records; "
            "AmpStep(optimizer, mode=...), or mpnb.Trainer(model, optimizer, loss_fn) for a "
            "whole loop"
        )
    shown = f"mode={more[0]!r}" if isinstance(more[0], str) else "mode=..."
    return (
        "AmpStep takes one argument, the optimizer, and its options by name: "
        f"AmpStep(optimizer, {shown})"
    )


def required_arguments(instance: object, method: str) -> list[str]:
    """The names of the arguments ``instance``'s method ``method`` cannot be called without, read
    from its class (torch wraps an optimizer's ``step`` on the instance); none where its
    signature cannot be read.

    >>> required_arguments(torch.optim.LBFGS([torch.zeros(1, requires_grad=True)]), "step")
    ['closure']
    """
    try:
        parameters = list(inspect.signature(getattr(type(instance), method)).parameters.values())
    except (AttributeError, TypeError, ValueError):
        return []
    return [
        parameter.name
        for parameter in parameters[1:]  # self
        if parameter.default is inspect.Parameter.empty
        and parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    ]


class AmpStep:
    """One optimizer's mixed-precision step: ``autocast()``, ``backward(loss)``, ``step()``.

    Args:
        optimizer: the optimizer to step.
        mode: ``"fp16"``, ``"bf16"``, ``"fp32"``, ``"tf32"``, ``"fp8"`` or ``"off"``; default the
            session mode. fp8 here is its bf16 autocast: convert the model's Linear layers with
            ``with mpnb.fp8_layers(model):`` around the loop (a Trainer does it itself).
        device: default the session device.
        scheduler: an LR scheduler, stepped only after steps the optimizer really took (a step
            skipped for overflow leaves the schedule where it was).
        accumulate: micro-batches per optimizer step; each loss is divided by it.
        clip_grad_norm: clip the total norm of the unscaled gradients to this value.
        record_grad_norm: record the unscaled gradient norm even without clipping.
        scaler: the loss scaler to use, as a ``torch.amp.GradScaler`` for this device: enabled
            in fp16, disabled (or none) in every other mode. Default: one built from the four
            settings below.
        init_scale, growth_factor, backoff_factor, growth_interval: the settings of the
            GradScaler built when ``scaler`` is not given; None keeps GradScaler's default
            (``2.0**16``, ``2.0``, ``0.5``, ``2000``).
        min_scale: warn (once) when the fp16 loss scale falls below this.
        on_nonfinite: at the first NaN/inf loss on a step taken, or a collapsed fp16 scale:
            ``"warn"`` (default), ``"stop"`` (:attr:`health` ``.stop`` turns True; the Trainer
            ends the fit there; telemetry is then read every step, one host read per step on
            an accelerator), or ``"ignore"`` (an event on the history, no warning). See
            :mod:`mpnb.training.health`.
        flush_every: steps between device-to-host telemetry copies.
        sinks: telemetry sinks (dashboard, text progress...).
        history: continue this history (default: a new one).

    Attributes:
        scaler: the torch.amp.GradScaler (disabled unless fp16).
        steps: optimizer steps taken or skipped so far.
        health: finds non-finite losses and a collapsed scale in what is recorded.
        epoch: written into each row; a training loop sets it.

    Raises:
        UnscalableWeightsError: the optimizer trains fp16 weights in a mode that scales the loss
            (GradScaler cannot unscale their gradients): ``model.float()`` keeps fp32 master
            weights, and autocast casts each op (:mod:`mpnb.training.master_weights`).

    Example (fp16, with a real loss scaler):
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> amp = AmpStep(optimizer, mode="fp16", device="cpu", init_scale=2.0**8)
        >>> with amp.autocast():
        ...     loss = model(torch.ones(8, 4)).float().pow(2).mean()
        >>> amp.backward(loss)
        >>> amp.step(samples=8)
        True
        >>> amp.scaler.is_enabled(), amp.history.loss_scale, amp.history.skipped_steps
        (True, [256.0], [])
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *misplaced: object,
        mode: str | Mode | None = None,
        device: str | torch.device | None = None,
        scheduler: Any = None,
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        record_grad_norm: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        init_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        min_scale: float | None = None,
        on_nonfinite: str = "warn",
        flush_every: int = 64,
        sinks: Iterable[Sink] = (),
        history: History | None = None,
    ) -> None:
        if misplaced:  # the options go by name; Python's own error would count arguments
            raise MpnbError(misplaced_arguments(optimizer, misplaced))
        check_optimizer(optimizer)
        accumulate = check_count(
            "accumulate", accumulate, meaning="micro-batches an optimizer step"
        )
        if clip_grad_norm is not None:
            clip_grad_norm = check_number(
                "clip_grad_norm",
                clip_grad_norm,
                finite=False,  # inf: torch's way to measure the norm without clipping
                meaning="the largest gradient norm",
            )
        if min_scale is not None:
            min_scale = check_number(  # type: ignore[assignment]
                "min_scale", min_scale, meaning="the loss scale that alarms below it"
            )
        flush_every = flush_every_for(on_nonfinite, flush_every)
        check_flag("record_grad_norm", record_grad_norm)
        check_scheduler(scheduler, optimizer)
        self.precision = TrainingPrecision.resolve(mode, device)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.accumulate, self.clip_grad_norm, self.record_grad_norm = (
            accumulate,
            clip_grad_norm,
            record_grad_norm,
        )
        settings = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        self._scaler_options = check_scaler_settings(
            {name: value for name, value in settings.items() if value is not None}
        )
        self._scalers: dict[bool, torch.amp.GradScaler] = {}
        if scaler is not None:
            if self._scaler_options:
                given = ", ".join(f"{name}=" for name in self._scaler_options)
                raise MpnbError(
                    f"give scaler= or {given}, not both: a GradScaler carries its own settings"
                )
            if not isinstance(scaler, torch.amp.GradScaler):
                raise MpnbError(
                    f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}"
                )
            if scaler._device != self.precision.device.type:
                raise MpnbError(
                    f"scaler is a GradScaler for {scaler._device!r}, training runs on "
                    f"{self.precision.device.type!r}: build it as GradScaler({self.precision.device.type!r})"
                )
            if scaler.is_enabled() != self.precision.needs_scaler:
                mode = self.precision.mode.label
                raise MpnbError(
                    f"mode {mode!r} scales the loss: give an enabled GradScaler, or leave scaler= out"
                    if self.precision.needs_scaler
                    else f"mode {mode!r} does not scale the loss: leave scaler= out, or give GradScaler(..., enabled=False)"
                )
            if scaler.is_enabled():
                check_scaler_settings(settings_of(scaler))
            self._scalers[scaler.is_enabled()] = scaler  # a later switch of mode comes back to it
        # fp16 weights refused before anything is hooked (GradScaler cannot unscale them)
        check_scalable(optimizer, self.precision.needs_scaler)
        self._use_precision(self.precision)
        self.health = HealthWatch(on_nonfinite)
        all_sinks = [
            *([MinScaleAlarm(min_scale)] if min_scale is not None else []),
            self.health,
            *sinks,
        ]
        self.recorder = Recorder(history, flush_every=flush_every, sinks=all_sinks)
        self.health.restart(self.recorder.history)
        self.account = StepAccount(
            self.precision.device
        )  # the open step's clock, memory, losses, examples
        self.steps = self.recorder.history.step[-1] if len(self.recorder.history) else 0
        self.epoch = 0
        self._window = Window()
        self._step_watch = OptimizerStepWatch(optimizer)
        self.last_skipped: torch.Tensor | bool = False  # the last optimizer step's, as measured
        self.last_scale: torch.Tensor | float = 1.0  # the loss scale it used
        self._weights_checked = False  # check_weights, at the first step unless called before

    # -- the three calls of a training step ---------------------------------------------

    def autocast(self) -> torch.autocast:
        """The forward-pass context: autocast in fp16/bf16 modes, explicitly off otherwise."""
        self.account.forward_start()
        return self.precision.autocast.context()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled, accumulation-averaged) loss, outside autocast.

        Raises:
            MpnbError: ``loss`` is not a one-element tensor that requires grad (nothing changed).
        """
        self._backward(loss, torch.is_autocast_enabled(self._device_type))

    def train_step(self, forward: Callable[[], torch.Tensor], samples: int | None = None) -> bool:
        """A micro-batch in one call: ``forward()`` (which returns the loss) under :meth:`autocast`,
        :meth:`backward` of its loss, then :meth:`step`; returns what ``step`` returns.

        The same work as the three calls, with less Python a step (what :class:`~mpnb.Trainer`
        uses): the autocast context is built once per mode, not once per micro-batch, and whether
        backward must leave an enclosing autocast block (a ``%%autocast`` cell) is asked before the
        forward instead of after it.

        Example:
            >>> model = torch.nn.Linear(4, 1)
            >>> amp = AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cpu")
            >>> amp.train_step(lambda: model(torch.ones(8, 4)).float().pow(2).mean(), samples=8)
            True
            >>> amp.history.mode
            ['bf16']

        Raises:
            TypeError: ``forward`` is not a function.
            MpnbError: ``forward`` returned no loss to train on (see :meth:`backward`).
            RuntimeError: called from inside ``forward`` of a ``train_step`` of the same helper.
        """
        if not callable(forward):
            raise TypeError(
                "train_step wants a function that returns the loss, such as lambda: loss_fn(model(x), y); "
                f"got a {type(forward).__name__}"
            )
        # the state backward will run in
        outer_autocast = torch.is_autocast_enabled(self._device_type)
        self._window.start_forward()  # the one context object cannot be entered twice at once
        self.account.forward_start(forward)  # an instrument may replay a skipped step with it
        try:
            with self._forward_context:
                loss = forward()
        finally:
            self._window.end_forward()
        self._backward(loss, outer_autocast)
        return self._micro_batch_done(samples)

    def _backward(self, loss: torch.Tensor, under_autocast: bool) -> None:
        """:meth:`backward`, told whether it is called where autocast is on (inside the forward's block)."""
        check_loss(loss)
        self._window.start_backward()  # until it returns: partial gradients
        # recorded as given (kept on the device, read at the flush): summed in fp32, divided once
        # at the step (the mean); a backward that fails leaves a window that is discarded whole
        self.account.forward_end(loss.detach())
        if self.accumulate > 1:
            loss = loss / self.accumulate
        if under_autocast:  # leave it for the backward
            with torch.autocast(self._device_type, enabled=False):
                self.scaler.scale(loss).backward()
        else:  # the usual place, after the block: no context to build (a few microseconds a step)
            self.scaler.scale(loss).backward()
        self._window.end_backward()

    def step(self, samples: int | None = None) -> bool:
        """End a micro-batch. At the end of an accumulation window: unscale, clip, step,
        update the scale, step the scheduler if the optimizer stepped, zero the gradients
        and record a row. Returns True when the window ended (an optimizer step happened
        or was skipped for overflow).

        Raises:
            RuntimeError: ``step()`` without a ``backward()`` since the last one, or after one that
                failed half-way (:meth:`discard_window` drops what it left).
        """
        self._window.check_steppable()
        if self._window.micro_batches == 0:
            raise RuntimeError(
                "AmpStep.step() called with no backward(loss) since the previous step: call "
                "amp.backward(loss), not loss.backward() (it scales the loss where the mode "
                "needs it and records the step's loss), or amp.train_step(forward)"
            )
        return self._micro_batch_done(samples)

    def _micro_batch_done(self, samples: int | None) -> bool:
        """:meth:`step` once its checks passed (as they have right after a backward)."""
        if samples is not None and (type(samples) is not int or samples < 0):  # one test a step
            samples = check_count(
                "samples", samples, least=0, meaning="examples in the micro-batch"
            )
        self.account.add_samples(samples)
        if self._window.micro_batches % self.accumulate:
            return False
        return self._optimizer_step()

    def finish_window(self) -> bool:
        """Step an accumulation window that the data ended before it filled (an epoch's last
        batches), as the mean of the micro-batches it has: their gradients, each added at
        ``1/accumulate``, are rescaled to ``1/count`` first. Returns False, doing nothing, when no
        window is open. :class:`~mpnb.Trainer` calls it at each epoch's end; call it at yours.

        Example:
            >>> model = torch.nn.Linear(4, 1)
            >>> amp = AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cpu", accumulate=4)
            >>> amp.train_step(lambda: model(torch.ones(8, 4)).float().pow(2).mean())
            False
            >>> amp.finish_window(), len(amp.history)
            (True, 1)

        Raises:
            RuntimeError: called from inside a :meth:`train_step` forward, or a backward of the
                window failed half-way (:meth:`discard_window` drops what it left).
        """
        phase = self._window.phase
        if phase is WindowPhase.FORWARD:
            raise RuntimeError(
                "AmpStep.finish_window() called from inside the forward of a train_step()"
            )
        if phase is WindowPhase.EMPTY:
            return False
        self._window.check_steppable()
        # once: a retry after a failed optimizer step finds them rescaled
        if phase is WindowPhase.ACCUMULATING:
            rescale(self.optimizer, self.accumulate / self._window.micro_batches)
            self._window.mark_rescaled()
        return self._optimizer_step()

    def _optimizer_step(self) -> bool:
        """Unscale, clip, step, update the scale and record the window's row."""
        if not self._weights_checked:
            self.check_weights()
        scaler, optimizer, watch = self.scaler, self.optimizer, self._step_watch
        scale_before = scale_in_use(scaler) if self._scales else 1.0
        watch.reset()
        try:
            grad_norm = (
                unscale_and_clip(scaler, optimizer, self.clip_grad_norm)
                if self.clip_grad_norm is not None or self.record_grad_norm
                else math.nan
            )
            lr = lr_in_use(optimizer)
            scaler.step(optimizer)
        except BaseException as error:
            if watch.stepped:  # the update happened (a later hook failed): the step counts
                self._finish_step(scale_before, False, grad_norm, lr)
            # weights made fp16 after the check: torch's words, explained
            refused = unscale_refusal(error, optimizer) if isinstance(error, ValueError) else None
            if refused is not None:
                raise refused from error
            raise
        skipped = watch.skipped(scaler, self.precision.device) if self._scales else False
        self._finish_step(scale_before, skipped, grad_norm, lr)
        return True

    def _finish_step(
        self,
        scale_before: torch.Tensor | float,
        skipped: torch.Tensor | bool,
        grad_norm: torch.Tensor | float,
        lr: Any,
    ) -> None:
        """After the optimizer was called: update the scale, step the scheduler, record the row.

        The row is recorded however this ends: the weights have moved, so the step must count
        and its window must never be trained again, even when the scheduler or a sink fails.
        """
        # what the step's caller may ask (a skipped fp16 step's replay): host-known or a tensor
        self.last_skipped, self.last_scale = skipped, scale_before
        try:
            if self._scales:  # a disabled scaler's update does nothing
                self.scaler.update()
            if self.scheduler is not None and self._step_watch.stepped:
                self.scheduler.step()
        except BaseException:
            forget_unfinished_update(self.scaler)
            raise
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1
            self._window.close()  # before the sinks run: a failing sink cannot leave it open
            self.account.close(
                step=self.steps,
                epoch=self.epoch,
                loss_scale=scale_before,
                skipped=skipped,
                lr=lr,
                grad_norm=grad_norm,
                mode=self.precision.mode.label,
                keep=self.recorder.hold,
            )
            self.recorder.flush_if_due()  # with what the instruments noted of the step

    def check_weights(self, model: torch.nn.Module | None = None) -> None:
        """Check the weights the optimizer trains against the mode, before they train: fp16
        weights where the loss is scaled are refused (torch's GradScaler cannot unscale their
        gradients), and bf16 or fp16 weights under autocast, with no fp32 master copy, are noted on
        the history (an event of kind ``"low_precision_weights"``) and warned about: updates below
        their resolution are lost (:mod:`mpnb.training.master_weights`). ``model`` names the
        parameters. The first step does it unless it was called before; the Trainer calls it at
        each fit's start.

        Example:
            >>> import warnings
            >>> model = torch.nn.Linear(4, 1).to(torch.bfloat16)
            >>> amp = AmpStep(torch.optim.SGD(model.parameters(), lr=1e-5), mode="bf16", device="cpu")
            >>> with warnings.catch_warnings(record=True):
            ...     amp.check_weights(model)
            >>> print(amp.history.events[0]["message"])
            2 parameters (weight, bias) are bf16, with no fp32 master copy: ... call model.float() ...

        Raises:
            UnscalableWeightsError: fp16 weights in a mode that scales the loss; nothing changed.
        """
        check_scalable(self.optimizer, self.scaler.is_enabled(), model)
        self._weights_checked = True
        if self.precision.mode.autocast_dtype is None:
            return  # training in the weights' own dtype is the choice made
        notice = low_precision_notice(self.optimizer, model)
        if notice is not None:
            self.recorder.history.note(notice, kind=LOW_PRECISION_WEIGHTS, step=self.steps)
            warn_user(notice)

    def set_precision(self, precision: TrainingPrecision) -> None:
        """Switch mode between two optimizer steps (from a widget while a fit runs, say).

        Switching to fp16 brings a real GradScaler (the one used before, if any, so its scale
        carries on); leaving fp16 keeps that scaler for a return and uses a disabled one.

        Raises:
            RuntimeError: in the middle of an accumulation window.
            ValueError: another device: the model and optimizer state live on this one.
            UnscalableWeightsError: into fp16 with fp16 weights (GradScaler cannot unscale them).
        """
        if not self.between_steps:
            raise RuntimeError("the precision can change only between optimizer steps")
        if precision.device != self.precision.device:
            raise ValueError(
                f"a run cannot move from {self.precision.device} to {precision.device}"
            )
        check_scalable(self.optimizer, precision.needs_scaler)
        self._use_precision(precision)

    def scale_back(self, cause: str, step: int | None = None) -> bool:
        """Between two steps, after a change that ends an overflow (the remedy, a switch of mode
        or op lists): a loss scale that the skips lowered goes back to the scaler's initial scale,
        noted on the history at ``step`` (default: the next step, the first to use it), and a collapsed scale or zero
        gradients are reported again should they come back (:func:`~mpnb.training.health.scale_back`).
        True when the scale was put back.

        Example:
            >>> model = torch.nn.Linear(4, 1)
            >>> amp = AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="fp16", device="cpu")
            >>> with amp.autocast():
            ...     loss = model(torch.full((8, 4), float("inf"))).float().mean()
            >>> amp.backward(loss)
            >>> _ = amp.step(samples=8)  # skipped: the scale halves
            >>> amp.scaler.get_scale(), amp.scale_back("the input is finite again"), amp.scaler.get_scale()
            (32768.0, True, 65536.0)
        """
        history = self.history  # flushed first: the rows before it are checked at their scale
        if not scale_back(self.scaler, history, self.steps + 1 if step is None else step, cause):
            return False
        self.health.rearm()
        return True

    # -- helpers -----------------------------------------------------------------------

    def _use_precision(self, precision: TrainingPrecision) -> None:
        """Train in ``precision`` from the next micro-batch: its scaler, and what each step
        reads of it, taken once here."""
        self.precision = precision
        self.scaler = self._scaler(precision.needs_scaler)
        # train_step's: entered once at a time (the window's FORWARD phase)
        self._forward_context = precision.autocast.context()
        self._device_type = precision.device.type
        self._scales = self.scaler.is_enabled()  # without a scale, none to read and no skip

    def _scaler(self, enabled: bool) -> torch.amp.GradScaler:
        if enabled not in self._scalers:
            self._scalers[enabled] = torch.amp.GradScaler(
                self.precision.device.type, enabled=enabled, **self._scaler_options
            )
        return self._scalers[enabled]

    def discard_window(self) -> None:
        """Drop the micro-batches of an unfinished accumulation window (their gradients too, and what
        the scaler noted of them: whether it already unscaled them, and the infs it found)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler.is_enabled():
            self.scaler._per_optimizer_states.pop(
                id(self.optimizer), None
            )  # a fresh record on next use
        self._window.close()
        self.account.discard()

    @property
    def between_steps(self) -> bool:
        """True when no accumulation window is open: no backward ran since the last recorded step,
        not even one that failed half-way and left some gradients behind, and no :meth:`train_step`
        forward is running."""
        return self._window.phase is WindowPhase.EMPTY  # read at every batch of a fit: no property

    def restart_clock(self) -> None:
        """Forget the time since the last step (call after a pause, before the next batch)."""
        self.account.restart_clock()

    @property
    def history(self) -> History:
        """Every recorded step (pending rows are flushed first)."""
        self.recorder.flush()
        return self.recorder.history

    def close(self) -> History:
        """Flush telemetry, tell the sinks the run ended, and return the history."""
        self.recorder.close()
        return self.recorder.history

    def detach(self) -> None:
        """Remove the hook this helper put on the optimizer."""
        self._step_watch.remove()

    def state_dict(self) -> dict[str, Any]:
        """Scaler state and step counter (plain data, safe for ``torch.load(weights_only=True)``)."""
        return {"scaler": self.scaler.state_dict(), "steps": self.steps, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.steps, self.epoch = state["steps"], state["epoch"]

    def __repr__(self) -> str:
        return f"<mpnb.AmpStep {self.precision.describe()}, {self.steps} steps, accumulate={self.accumulate}>"
