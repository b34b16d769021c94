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
import functools
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpnb.errors import MpnbError, check_count, check_flag
from mpnb.numerics.instruments import fit_instruments
from mpnb.oplists.refusals import refusal_error
from mpnb.precision.modes import Mode, chosen_mode
from mpnb.precision.policy import get_mode
from mpnb.training.amp_step import AmpStep, check_optimizer
from mpnb.training.batches import (
    LossFn,
    StepFn,
    batch_loss,
    check_loss_fn,
    indexed,
    samples_in,
)
from mpnb.training.capture import FitCapture, active_capture, note_fit, streamed
from mpnb.training.checkpoint import (
    apply_checkpoint,
    checked_state,
    checkpoint_state,
    read_checkpoint,
    write_checkpoint,
)
from mpnb.training.control import (
    GO_ON,
    Checkpoint,
    FitControl,
    FitEnd,
    FitState,
    running_on_this_thread,
)
from mpnb.training.data_position import DataPosition
from mpnb.training.history import History
from mpnb.training.interrupts import StopRequest
from mpnb.training.master_weights import UnscalableWeightsError, check_scalable, unscalable
from mpnb.training.parallel import (
    agreed_stop,
    check_same_mode,
    check_strategy,
    check_switch,
    rank_share,
    refresh_sharded,
    wrap_model,
)
from mpnb.training.session_follow import SessionFollower
from mpnb.training.sharded_checkpoint import load_sharded, save_sharded
from mpnb.training.step_precision import TrainingPrecision
from mpnb.training.step_record import WatchedRun
from mpnb.training.step_watch import scale_in_use
from mpnb.training.telemetry import Sink, check_dashboard, dashboard_sinks

if TYPE_CHECKING:  # the type of a result the Trainer hands on; the watch itself is not named here
    from mpnb.numerics.instruments import NumericsLog

__all__ = ["Trainer", "FitInterrupted"]


class FitInterrupted(KeyboardInterrupt):
    """``fit`` stopped at a consistent point after an interrupt; ``history`` keeps every finished step.

    Example (the signal Ctrl-C sends arrives as the third batch is read; the two finished steps stay):
        >>> import signal, torch, mpnb.examples as ex
        >>> model = ex.DigitsCNN(widths=(4, 8))
        >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), torch.nn.functional.cross_entropy,
        ...                   mode="bf16", device="cpu", dashboard=None)
        >>> def interrupted(batches, at):
        ...     for index, batch in enumerate(batches):
        ...         if index == at:
        ...             signal.raise_signal(signal.SIGINT)
        ...         yield batch
        >>> try:
        ...     trainer.fit(interrupted(ex.digits(batch_size=256)[0], at=2))
        ... except FitInterrupted as stopped:
        ...     print(stopped)
        ...     print(stopped.history.step)
        fit stopped after step 2 (epoch 0, batch 2); trainer.history keeps every finished step; call fit(data) to continue
        [1, 2]
    """

    def __init__(self, message: str, history: History) -> None:
        super().__init__(message)
        self.history = history


class Trainer:
    """Train ``model`` with ``optimizer`` in a precision mode, with telemetry and a live dashboard.

    How a batch becomes a loss (:mod:`mpnb.training.batches`): with ``loss_fn``, batches are
    ``(inputs, targets)`` pairs and the loss is ``loss_fn(model(inputs), targets)``; without,
    the model computes its own loss (Hugging Face style: a dict batch is passed as keyword
    arguments, the loss is ``output.loss`` or ``output["loss"]``); ``step_fn(model, batch)``
    covers anything else. Batches of any nesting are moved to the device.

    Example (the fp16 loss scaler given whole, as Lightning's precision plugin takes it):
        >>> import torch, mpnb.examples as ex
        >>> model = ex.DigitsCNN(widths=(4, 8))
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), 0.1), torch.nn.functional.cross_entropy,
        ...                   mode="fp16", device="cpu", dashboard=None, scaler=scaler)
        >>> trainer.fit(ex.digits(batch_size=256)[0], max_steps=1).loss_scale
        [256.0]

    Args:
        model: moved to ``device``.
        optimizer: built on the model's parameters.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``, or None (see above).
        step_fn: ``step_fn(model, batch) -> scalar loss``, run under the mode's autocast.
        mode: ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``, ``"fp8"``, ``"off"``, any registered
            mode (:mod:`mpnb.precision.modes`), or a mode object; default the session mode
            (``%amp``, with its options). fp32/tf32 set their fp32-math flags only while ``fit``
            runs; fp8 converts the model's eligible Linear layers to torchao's float8 layers only
            while ``fit`` runs (:mod:`mpnb.precision.modes.fp8`; emulated on a CPU).
        recipe: the mode's recipe, for a mode that takes one (fp8: ``"tensorwise"``,
            ``"rowwise"``, ``"rowwise_with_gw_hp"``); None: the mode's default.
        keep: layers (or modules holding them) a mode that converts layers keeps in higher
            precision (fp8: ``["lm_head"]``); None: none besides the mode's own rule.
        device: default the session device (auto-detected: cuda, hpu, else cpu).
        dashboard: ``"auto"`` (live plot in a notebook, text progress elsewhere), ``"live"``,
            ``"text"``, None for no display, or a :class:`~mpnb.training.telemetry.Sink`.
        on_nonfinite: at the first NaN/inf loss on a step taken or a collapsed fp16 loss scale:
            ``"warn"`` (default; an event on the history and the dashboard, and a warning),
            ``"stop"`` (the same, and the fit ends after that step, history kept) or
            ``"ignore"`` (the event only). See :mod:`mpnb.training.health`.
        strategy: None (one process), ``"ddp"`` or ``"fsdp"``: across the processes of
            torch.distributed's group, each training on its share of the batches; ``"fsdp"``
            shards the model in place (:mod:`mpnb.training.parallel`).
        scheduler: an LR scheduler, stepped only after steps the optimizer really took (a step
            skipped for overflow leaves the schedule where it was).
        accumulate: micro-batches per optimizer step; each loss is divided by it.
        clip_grad_norm: clip the total norm of the unscaled gradients to this value.
        record_grad_norm: record the unscaled gradient norm even without clipping.
        scaler: the fp16 loss scaler, a ``torch.amp.GradScaler`` for ``device`` (enabled in
            fp16; in other modes none, or a disabled one). Default: one built from the four
            settings below, which cannot be given with it.
        init_scale: the built scaler's first scale; None: GradScaler's (``2.0**16``).
        growth_factor: its growth factor; None: GradScaler's (``2.0``).
        backoff_factor: its backoff factor; None: GradScaler's (``0.5``).
        growth_interval: its growth interval in steps; None: GradScaler's (``2000``).
        min_scale: warn (once) when the fp16 loss scale falls below this.
        flush_every: steps between device-to-host telemetry copies.
        locate_overflow: at each fit's first skipped fp16 step, replay it to name the module
            and op where the overflow began (an ``"origin"`` event on the history, marked on the
            dashboard, named by a later alarm; see :mod:`mpnb.numerics.origin`); after
            a flush shows a non-finite loss (any mode), watch the next steps as they run to name
            where the NaN/inf is made. One process only.
        watch_numerics: every how many optimizer steps to measure each leaf module's largest
            activation and gradient, fp16-underflow share and non-finite count (read at the
            telemetry's flush; :attr:`numerics`, :mod:`mpnb.numerics.watch`), and every
            step for a few steps after a flush shows a skipped step or a non-finite loss. True
            (the default): every :data:`~mpnb.numerics.watch.DEFAULT_EVERY` steps, under 1% of a
            fit (``benchmarks/numerics_watch_cost.py``). False (or None): off.

    Attributes:
        history: every step of every ``fit`` call so far.
        amp: the step helper (``trainer.amp.scaler`` is the GradScaler).
        control: stop / pause / resume the running fit (the live dashboard's buttons use it).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None,
        *,
        step_fn: StepFn | None = None,
        mode: str | Mode | None = None,
        recipe: str | None = None,
        keep: Iterable[str] | None = None,
        device: str | torch.device | None = None,
        dashboard: str | Sink | None = "auto",
        on_nonfinite: str = "warn",
        strategy: str | None = None,
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
        flush_every: int = 64,
        locate_overflow: bool = True,
        watch_numerics: int | bool | None = True,
    ) -> None:
        if loss_fn is not None and step_fn is not None:
            raise MpnbError(
                "give loss_fn or step_fn, not both: step_fn(model, batch) computes the whole loss"
            )
        check_loss_fn(loss_fn)
        dashboard = check_dashboard(dashboard)
        check_strategy(strategy)
        check_flag("locate_overflow", locate_overflow)
        _check_optimizer_trains(model, optimizer)
        if recipe is not None or keep is not None:  # options of the mode asked, or of the session's
            mode = chosen_mode(mode, get_mode(), recipe=recipe, keep=keep)
        try:
            self.amp = AmpStep(
                optimizer,
                mode=mode,
                device=device,
                on_nonfinite=on_nonfinite,
                scheduler=scheduler,
                accumulate=accumulate,
                clip_grad_norm=clip_grad_norm,
                record_grad_norm=record_grad_norm,
                scaler=scaler,
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                min_scale=min_scale,
                flush_every=flush_every,
            )
        except UnscalableWeightsError as refused:  # said again, naming the model's parameters
            raise (unscalable(optimizer, model) or refused) from None
        self.strategy = strategy
        self.model = wrap_model(
            model.to(self.device), strategy, self.device, optimizer, self.amp.precision.mode
        )
        self.optimizer, self.loss_fn, self.step_fn = optimizer, loss_fn, step_fn
        self.dashboard = dashboard
        # the next batch to train on, what a stopped fit holds, the batch trained last
        self._data = DataPosition()
        self._ended = FitEnd.NOT_RUN
        self.control = FitControl()
        self.control.subject = self  # a dashboard's memory view counts this trainer's step
        # the fit's instruments (numerics watch, overflow locators) and its fp32 remedies
        self._instruments = fit_instruments(
            self.model,
            self.device.type,
            watch_numerics=watch_numerics,
            locate_overflow=locate_overflow and strategy is None,
        )
        self._math = contextlib.ExitStack()  # the precision's fp32-math and model scopes
        self._follower = SessionFollower(self)  # the session's switches made while a fit runs

    @property
    def device(self) -> torch.device:
        """The device training runs on."""
        return self.amp.precision.device

    @property
    def history(self) -> History:
        """Every recorded step."""
        return self.amp.history

    @property
    def numerics(self) -> NumericsLog | None:
        """Each watched module's sampled numerics (``watch_numerics``); None when not watched."""
        return self._instruments.numerics

    @property
    def last_batch(self) -> Any:
        """The batch trained last, as it went to the model (on its device); None before the
        first. ``mpnb.memory`` and the dashboard's memory view count a step on it."""
        return self._data.last_batch

    @property
    def position(self) -> tuple[int, int, int | None]:
        """Where the next ``fit`` starts: ``(epoch, batch, end)``, ``end`` being the epoch an
        unfinished plan ends before (None when the last plan was finished)."""
        return self._data.position

    @position.setter
    def position(self, position: tuple[int, int, int | None]) -> None:
        self._data.position = position

    def use_precision(self, precision: TrainingPrecision) -> None:
        """Train in ``precision`` from the next step: its autocast and scaler, and its fp32-math
        scope in place of the running one (a fit's precision, switched between steps).

        Raises:
            MpnbError: a switch into or out of fp8 with ``strategy="fsdp"``, a model the new
                mode cannot convert, or fp16 weights in a mode that scales the loss: the fit goes
                on in its mode, nothing changed.
        """
        self._check_switch(precision)
        running = self.amp.precision
        self._math.close()  # the running mode's layers put back: the new mode converts its own
        try:
            self._math.enter_context(precision.math_scope())
            self._math.enter_context(precision.model_scope(self.model))
        except BaseException:
            self._math.close()
            self._math.enter_context(running.math_scope())
            self._math.enter_context(running.model_scope(self.model))
            raise
        self.amp.set_precision(precision)

    def _check_switch(self, precision: TrainingPrecision) -> None:
        """Refuse a switch to ``precision`` this run cannot make (a mode converting layers under
        FSDP, fp16 weights in a mode that scales the loss); nothing changed."""
        check_switch(self.strategy, self.mode, precision.mode)
        check_scalable(self.optimizer, precision.needs_scaler, self.model)

    def state_dict(self) -> dict[str, Any]:
        """Everything :meth:`save` writes: model, optimizer, scaler, scheduler, position and
        history, as plain data and tensors. As with torch's ``state_dict()``, the tensors are the
        live ones: ``copy.deepcopy`` the result to keep a point to come back to.

        Example:
            >>> import copy, torch, mpnb.examples as ex
            >>> trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
            >>> start = copy.deepcopy(trainer.state_dict())
            >>> _ = trainer.fit(train, max_steps=2)
            >>> trainer.load_state_dict(start)
            >>> len(trainer.history), all(torch.equal(a, b) for a, b in zip(trainer.model.state_dict().values(), start["model"].values()))
            (0, True)
        """
        return checkpoint_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to a :meth:`state_dict`: checked whole first, then applied all or nothing.

        Raises:
            MpnbError: ``state`` does not fit this trainer (nothing is changed).
        """
        apply_checkpoint(self, *checked_state(self, state))

    @property
    def resumable(self) -> bool:
        """Whether the last ``fit`` stopped before its planned end (``max_steps``, Stop, an
        interrupt): ``fit(data)`` without ``epochs`` then continues that plan."""
        return self._data.end is not None

    @property
    def stopped(self) -> bool:
        """Whether the last ``fit`` ended at a stop: the dashboard's Stop, ``control.stop()``, or
        ``on_nonfinite="stop"`` (or, with a strategy, another rank's)."""
        return self._ended.stopped

    @property
    def ended(self) -> FitEnd:
        """How the last ``fit`` ended: finished, at ``max_steps``, stopped (and by what), interrupted, failed."""
        return self._ended

    @property
    def mode(self) -> Mode:
        """The precision mode training runs in. Set it between fits to train the next ones in
        another mode (a name, or a mode object with its options), as a checkpoint saved in one
        mode is loaded first and then trained on in another; the switch is noted on the history.
        A running fit follows the session's mode instead (``%amp``, the panel, ``mpnb.set_mode``).

        Example:
            >>> model = torch.nn.Linear(4, 2)
            >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, mode="fp16", device="cpu", dashboard=None)
            >>> trainer.mode = "bf16"
            >>> trainer.mode, trainer.history.events[-1]["message"]
            (Mode('bf16'), 'mode fp16 -> bf16')

        Raises:
            InvalidChoiceError: an unknown mode or option (nothing changed).
            MpnbError: set while a fit runs, or a mode this model or device cannot train in.
        """
        return self.amp.precision.mode

    @mode.setter
    def mode(self, mode: str | Mode) -> None:
        if self.control.state is not FitState.IDLE:
            raise MpnbError(
                "trainer.mode is set between fits; a running fit follows the session's mode at "
                "its next step: %amp MODE, the panel, or mpnb.set_mode(MODE)"
            )
        precision = TrainingPrecision.resolve(mode, self.device)
        if precision.mode == self.mode:
            return
        self._check_switch(precision)
        if precision.mode.converts_layers:
            precision.mode.check_model(self.model, self.device)
        message = f"mode {self.mode.label} -> {precision.mode.label}"
        self.amp.set_precision(precision)
        step = self.amp.steps + 1
        self.history.note(message, kind="switch", step=step, mode=precision.mode.label)

    def fit(
        self,
        data: Iterable[Any],
        epochs: int | None = None,
        *,
        max_steps: int | None = None,
    ) -> History:
        """Train on ``data`` (an iterable of batches: a list, a DataLoader, a generator...) and return the history.

        ``epochs`` counts epochs from where training stands. After an interrupted ``fit``,
        calling ``fit(data)`` without ``epochs`` finishes the interrupted run: it resumes at
        the batch after the last finished step. That is exact when ``data`` gives the same
        batches in the same order each time it is iterated in an epoch (a list,
        :class:`mpnb.examples.Batches`, a DataLoader without shuffle, or one whose sampler has
        ``set_epoch``); a one-shot iterator (a generator) simply goes on where it stopped.
        ``max_steps`` stops after that many optimizer steps in this call.

        Interrupting (Ctrl-C, the kernel's stop button) finishes the current optimizer step,
        keeps its telemetry, then raises :class:`FitInterrupted` (a KeyboardInterrupt);
        a second interrupt stops at once. An error in the middle of an accumulation window
        drops that window's gradients, and the next ``fit(data)`` starts it again.

        Inside :func:`~mpnb.training.capture.capture_fits` (what ``%%compare`` uses) the fit
        trains in the captured mode, within the captured step budget, reporting to its sink.

        Raises:
            MpnbError: a fit is already running on this thread (started from a widget callback
                or from the model's own code during that fit); the running fit is not touched.
        """
        with running_on_this_thread(self):
            return self._fit(data, epochs, max_steps)

    def _fit(self, data: Iterable[Any], epochs: int | None, max_steps: int | None) -> History:
        if isinstance(epochs, torch.Tensor) and epochs.numel() > 1:  # fit(x, y)
            raise MpnbError(
                f"epochs must be a whole number >= 1, got a Tensor shaped {tuple(epochs.shape)}: "
                "fit takes batches, not x and y apart; for tensors x and y, fit([(x, y)]) or a "
                "torch DataLoader over TensorDataset(x, y)"
            )
        if epochs is not None:
            epochs = check_count("epochs", epochs)
        if max_steps is not None:
            max_steps = check_count("max_steps", max_steps)
        if not isinstance(data, Iterable):
            raise MpnbError(
                f"data must be an iterable of batches (a list, a DataLoader, a generator), got {type(data).__name__}"
            )
        self.amp.check_weights(self.model)  # fp16 weights under the scaler refused; bf16 noted
        if self.strategy is not None:
            data = rank_share(data)
        capture = active_capture()
        if capture is not None:
            max_steps = self._join(capture, data, max_steps)
        if self.strategy is not None:  # the ranks' gradients are averaged: one mode for all
            check_same_mode(self.mode.label)
        self._data.plan(epochs)
        self._ended = FitEnd.NOT_RUN  # until this fit ends
        # a capture's budget is spent: the plan stays, for a later fit(data) to go on with
        if max_steps == 0:
            return self.history
        note_fit(self.history)
        title = self.describe()  # once a fit: it counts the model's parameters
        # the instruments first: at a flush the watch reads its sampled steps before a view draws them
        sinks = [*self._instruments, *self._sinks(capture, title)]
        steps_before = self.amp.steps
        self.history.meta.update(model=title, device=str(self.device), mode=self.mode.label)
        self._data.device = indexed(self.device)  # cuda:0, as batches already there name it
        self.amp.recorder.attach(*sinks)
        self.model.train()
        self.control.begin()
        self.amp.health.restart(self.history)  # each fit reports its own first problem
        self.amp.account.watch(self._instruments, self._watched_run(), self.amp.steps + 1)
        self._follower.restart()
        try:
            with self._math, StopRequest() as stop:
                self._math.enter_context(self.amp.precision.math_scope())
                layers = self._math.enter_context(self.amp.precision.model_scope(self.model))
                self._note_layers(layers)
                refresh_sharded(self.model, self.strategy, self.mode)
                self.amp.restart_clock()  # the first step's time counts from here, not from the fit's setup
                finished = self._run(data, stop, max_steps)
        except BaseException as error:
            self._ended = FitEnd.ended_by(error)
            self._drop_unfinished_window()
            refused = refusal_error(error, self.mode.autocast_dtype)
            if refused is not None:
                raise refused from error
            raise
        finally:
            self._data.close()
            self._instruments.release()  # a remedy lasts the fit it was applied for
            self.control.end()
            try:
                self.amp.close()
            except BaseException as error:  # the last flush or a sink's close failed
                if self._ended is FitEnd.NOT_RUN:  # every step of the fit trained before it
                    self._ended = FitEnd.ended_by(error)
                raise
            finally:
                self.amp.account.unwatch()  # the instruments' hooks off, whatever the close did
                self.amp.recorder.detach(*sinks)  # and the fit's sinks, never left for the next
            if capture is not None:
                capture.steps_taken += self.amp.steps - steps_before
        if finished:
            self._data.finish()
            self._ended = FitEnd.FINISHED
        if stop.requested and not finished:
            self._ended = FitEnd.INTERRUPTED
            message = (
                f"fit stopped after step {self.amp.steps} (epoch {self._data.epoch}, batch {self._data.batch}); "
                "trainer.history keeps every finished step; call fit(data) to continue"
            )
            self.history.note("interrupted", kind="interrupt")
            raise FitInterrupted(message, self.history)
        if not finished and self._ended is FitEnd.MAX_STEPS and self.amp.health.stop:
            self._ended = FitEnd.NONFINITE  # found by the flush as the fit closed
        if not finished and self._ended.stopped:  # _run said why it stopped
            self.history.note(
                "stopped by another rank" if self._ended is FitEnd.PEER_STOPPED else "stopped",
                kind="stop",
            )
        return self.history

    def _why_stopped(self, peer_stopped: bool) -> FitEnd:
        """Why the fit stops before its plan's end, asked as it stops (while the control still
        says it was asked to): another rank, a non-finite loss, a Stop, else ``max_steps``."""
        if peer_stopped:
            return FitEnd.PEER_STOPPED
        if self.amp.health.stop:
            return FitEnd.NONFINITE
        return FitEnd.STOPPED if self.control.stop_requested else FitEnd.MAX_STEPS

    def _join(self, capture: FitCapture, data: Iterable[Any], max_steps: int | None) -> int:
        """Train in the capture's mode, within its step budget: the steps this fit may take."""
        capture.adopt(self, data)
        if self.mode != capture.mode:
            self.amp.set_precision(TrainingPrecision.resolve(capture.mode, self.device))
        return capture.steps_allowed(max_steps)

    def _note_layers(self, layers: Any) -> None:
        """What a mode that swaps layers did to the model (which layers, which kept and why),
        in the history's meta for the fit's first lines and as an event."""
        lines = getattr(layers, "layer_lines", None)
        if lines is None:
            self.history.meta.pop("layers", None)
            return
        self.history.meta["layers"] = [layers.describe(), *lines()]
        self.history.note(layers.describe(), kind="layers")

    def _sinks(self, capture: FitCapture | None, title: str) -> list[Sink]:
        if capture is not None:
            return [capture.sink] if capture.sink is not None else []
        in_a_launch = streamed(self.history, self.control)  # a worker of mpnb.distributed.launch
        if in_a_launch is not None:
            return in_a_launch
        if self.dashboard is None:
            return []
        return dashboard_sinks(self.dashboard, title, self.control)

    def _run(self, data: Iterable[Any], stop: StopRequest, max_steps: int | None) -> bool:
        """Train until the planned end, ``max_steps`` or a stop request; True when the plan is done."""
        place, amp, control, strategy = self._data, self.amp, self.control, self.strategy
        steps_left = max_steps
        # each batch's loss: a partial, not a closure (no Python frame of mpnb's between the
        # step and the model)
        model, loss_fn, step_fn = self.model, self.loss_fn, self.step_fn

        def interrupted() -> bool:  # ends a pause too
            return stop.requested

        while place.unfinished:
            amp.epoch = place.epoch
            trained_any = False
            for batch in place.epoch_batches(data):
                if amp.between_steps:
                    checkpoint = control.checkpoint(interrupted)
                    # the usual boundary: nothing to follow, no stop asked, no peer to ask
                    if not (
                        checkpoint is GO_ON
                        and strategy is None
                        and steps_left != 0
                        and not stop.requested
                        and not amp.health.stop
                    ):
                        ended = self._ends_here(checkpoint, stop, steps_left)
                        if ended is not None:
                            place.hold(batch)
                            self._ended = ended
                            return False
                    batch = place.take(batch, starts_window=True)
                else:
                    batch = place.take(batch, starts_window=False)
                steps_before = amp.steps
                try:  # the instruments: in the step's account
                    stepped = amp.train_step(
                        functools.partial(batch_loss, model, batch, loss_fn, step_fn),
                        samples_in(batch),
                    )
                except BaseException:
                    if amp.steps != steps_before:  # the update happened: its window is done
                        place.trained()
                        place.window_stepped()
                    raise
                if stepped and steps_left is not None:
                    steps_left -= 1
                place.trained()
                trained_any = True
            if self._finish_window() and steps_left is not None:
                steps_left -= 1
            place.next_epoch(trained_any)
        return True

    def _ends_here(
        self, checkpoint: Checkpoint, stop: StopRequest, steps_left: int | None
    ) -> FitEnd | None:
        """At a step boundary the control's ``checkpoint`` did not find quiet (or a stop, a
        peer or the step budget may end the fit): follow the session's switches, leave a pause
        out of the step's time, and say why the fit ends here (None: it goes on)."""
        amp = self.amp
        if checkpoint.changed:
            self._follower.follow(checkpoint.changed)
            if "reset" in checkpoint.changed:  # every switch put back, the remedies too
                self._instruments.undo_for_reset(self.history, amp.steps + 1)
        if checkpoint.paused_s:
            amp.restart_clock()  # the pause is not step time
        wants_stop = stop.requested or checkpoint.stop or amp.health.stop
        peer_stopped = False
        if self.strategy is not None:  # every rank stops at the same step, or none does
            agreed = agreed_stop(wants_stop, amp.steps, amp.recorder.flush_every, self.device)
            peer_stopped = agreed and not wants_stop
            wants_stop = agreed
        if wants_stop or steps_left == 0:
            return self._why_stopped(peer_stopped)
        return None

    def _finish_window(self) -> bool:
        """Step the window the epoch's data ended inside, if any. Once its update happened, its
        batches are trained, even if what follows the update fails."""
        steps_before = self.amp.steps
        try:
            return self.amp.finish_window()
        finally:
            if self.amp.steps != steps_before:
                self._data.window_stepped()

    def _drop_unfinished_window(self) -> None:
        """After an error mid-window: drop its gradients and go back to the window's first batch
        (for a one-shot iterator, keep the window's batches for the next fit)."""
        unfinished = not self.amp.between_steps
        self._data.drop_window(unfinished)
        if unfinished:
            self.amp.discard_window()

    def _watched_run(self) -> WatchedRun:
        """What the fit's instruments see of it (the precision as it is at each call: a fit
        follows the session's switches)."""
        return WatchedRun(
            history=self.history,
            device=self.device,
            scales_loss=self.amp.precision.needs_scaler,
            loss_scale=lambda: scale_in_use(self.amp.scaler),
            autocast=lambda: self.amp.precision.autocast.context(),
            tell_sinks=self.amp.recorder.tell_sinks,
        )

    def keep_in_fp32(self, module: str | Iterable[str]) -> str | list[str]:
        """The remedy for an overflow named in one module: run ``module`` in float32 (autocast
        off inside it, its inputs cast up) from the next step until the end of this fit, noted
        on the history as a switch; the loss scale the skips lowered goes back to the scaler's
        initial scale (a ``"scale"`` event), else its gradients would underflow to zero. Call it
        between steps: from a dashboard button, a callback. Asked for between fits, it changes
        nothing until the next fit, and lasts that fit, which starts from the initial scale.
        Returns the module's name.

        ``module`` may be a name as the model gives it (``"transformer.h.1.mlp.c_proj"``) or
        as an ``"origin"`` event gives it (the root's class first).

        Example:
            >>> import mpnb.examples as ex
            >>> trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
            >>> trainer.keep_in_fp32("classifier")
            'classifier'
            >>> "forward" in vars(trainer.model.classifier)  # between fits: not yet
            False
            >>> trainer.fit(train, max_steps=2).events[-1]["message"]
            'classifier runs in fp32 (autocast off inside it)'
            >>> "forward" in vars(trainer.model.classifier)  # put back when the fit ended
            False

        Several names (a list, as ``mpnb.whatif(...).recommend("fp16")`` gives them, or any
        iterable of names) keep each; their names are returned as a list.

        Raises:
            MpnbError: no module of that name (the closest names are listed); nothing changes.
        """
        if not isinstance(module, str) and isinstance(module, Iterable):
            names = list(module)  # a generator too, read once
            for name in names:  # every name checked before any is kept
                self._instruments.module_name(name)
            return [self.keep_in_fp32(name) for name in names]  # type: ignore[misc]
        found = self._instruments.keep_in_fp32(module, self.amp.steps + 1)
        # between fits the next fit applies it, at its first step: the scale goes back for it
        when = "now" if self._instruments.running else "from the next fit"
        self.amp.scale_back(f"{found} runs in fp32 {when}")
        return found

    def describe(self) -> str:
        """``"DigitsCNN, bf16 on cpu, 25,578 parameters"``."""
        count = sum(p.numel() for p in self.model.parameters())
        return f"{type(self.model).__name__}, {self.amp.precision.describe()}, {count:,} parameters"

    def __repr__(self) -> str:
        return f"<mpnb.Trainer {self.describe()}, {self.amp.steps} steps>"

    # -- checkpoints -------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer, scaler, scheduler, position, history and torch's random state
        in one file (with ``strategy="fsdp"``: a directory of shards, written by every rank
        together, without the random state; see :mod:`mpnb.training.sharded_checkpoint`)."""
        if self.strategy == "fsdp":
            save_sharded(self, path)
        else:
            write_checkpoint(self, path)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore a :meth:`save` file: all of it, or nothing (see :mod:`mpnb.training.checkpoint`).

        Raises:
            MpnbError: the file is damaged, not a trainer checkpoint, or does not fit this
                trainer (another model, optimizer type or parameter groups); names the file
                and the mismatch, and changes nothing.
        """
        if self.strategy == "fsdp":
            load_sharded(self, path)
            return
        state, history = read_checkpoint(self, path)
        apply_checkpoint(self, state, history, repr(os.fspath(path)))


def _check_optimizer_trains(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds none of the model's parameters (built from another model, or
    from a copy): it would train nothing, silently in bf16, with torch's "No inf checks" in fp16.

    Raises:
        MpnbError: says how to build the optimizer.
    """
    check_optimizer(optimizer)
    own = {id(parameter) for parameter in model.parameters()}
    if not any(
        id(parameter) in own for group in optimizer.param_groups for parameter in group["params"]
    ):
        raise MpnbError(
            f"the optimizer ({type(optimizer).__name__}) holds none of {type(model).__name__}'s parameters, so "
            "training would change nothing: build it from this model, e.g. torch.optim.Adam(model.parameters())"
        )
