"""mpnb's telemetry for a training loop that someone else runs: one row per optimizer step.

The framework callbacks (:mod:`mpnb.integrations.transformers`, :mod:`mpnb.integrations.lightning`)
and the loop helpers (:mod:`mpnb.integrations.accelerate`) translate their framework's hooks
into the calls below; everything else is shared with :class:`mpnb.Trainer`: the same
:class:`~mpnb.training.telemetry.Recorder` (no host-device sync per step), step clock, memory
sampler, health checks, dashboard and :class:`~mpnb.training.control.FitControl`.

Per optimizer step: :meth:`~LoopTelemetry.window_begin` at its first micro-batch,
:meth:`~LoopTelemetry.add_loss` (and :meth:`~LoopTelemetry.add_samples`) per micro-batch,
:meth:`~LoopTelemetry.before_optimizer_step` just before the optimizer is called (through the
framework's scaler or not), :meth:`~LoopTelemetry.step_end` after it. :meth:`~LoopTelemetry.begin`
once before training, :meth:`~LoopTelemetry.end` after it, however it ended.

Example (a hand-written bf16 loop; a framework's callback makes these calls for you):
    >>> import torch
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> telemetry = LoopTelemetry("my loop", dashboard=None)
    >>> telemetry.begin(model, optimizer, scaler=None, device="cpu", asked=None)
    >>> for _ in range(3):
    ...     telemetry.window_begin()
    ...     with torch.autocast("cpu", dtype=torch.bfloat16):
    ...         loss = model(torch.ones(8, 4)).float().pow(2).mean()
    ...     loss.backward()
    ...     telemetry.add_loss(loss)
    ...     telemetry.add_samples(8)
    ...     telemetry.before_optimizer_step()
    ...     optimizer.step()
    ...     optimizer.zero_grad()
    ...     _ = telemetry.step_end()
    >>> telemetry.end()
    >>> len(telemetry.history), telemetry.history.mode
    (3, ['bf16', 'bf16', 'bf16'])
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpnb import views
from mpnb._render import dtype_name
from mpnb.errors import check_flag
from mpnb.integrations.honesty import (
    UNSEEN,
    Notices,
    fp16_without_scaling,
    mode_unseen,
    no_loss,
    not_prepared,
    precision_mismatch,
    session_autocast_around,
    session_lists_inside,
)
from mpnb.integrations.observed import PrecisionObserver, check_precision
from mpnb.numerics.instruments import FitInstruments, check_watch_numerics, fit_instruments
from mpnb.precision.modes import Mode, mode_found_in
from mpnb.precision.policy import session
from mpnb.training.control import FitControl
from mpnb.training.health import HealthWatch, scale_back
from mpnb.training.history import History
from mpnb.training.master_weights import (
    LOW_PRECISION_WEIGHTS,
    check_scalable,
    low_precision_notice,
)
from mpnb.training.step_record import StepAccount, WatchedRun, flush_every_for
from mpnb.training.step_watch import OptimizerStepWatch, lr_in_use, scale_in_use
from mpnb.training.telemetry import Recorder, Sink, check_dashboard, dashboard_sinks

if TYPE_CHECKING:  # the type of a result handed on; the watch itself is not named here
    from mpnb.numerics.instruments import NumericsLog

__all__: list[str] = []

#: The observed precisions of weights that are themselves bf16 or fp16 (no fp32 master copy).
_LOW_PRECISION_WEIGHTS = ("bf16-true", "fp16-true")


class LoopTelemetry:
    """Telemetry, controls and notices for a loop mpnb does not drive.

    Args:
        framework: the name notices use ("transformers.Trainer", "Lightning", ...).
        dashboard: ``"auto"`` (live plot in a notebook, text progress elsewhere), ``"live"``,
            ``"text"``, a :class:`~mpnb.training.telemetry.Sink`, or None.
        on_nonfinite: ``"warn"`` (default), ``"stop"`` or ``"ignore"``: what a NaN/inf loss triggers.
            A step whose loss could not be read (:meth:`step_end` with no :meth:`add_loss`) is not
            one: its row says ``loss_missing``.
        flush_every: steps between copies of the device values to the host (a whole number >= 1;
            1 with ``on_nonfinite="stop"``, so that the framework stops at the bad step).
        watch_numerics: every how many optimizer steps to measure each leaf module's numerics
            (:mod:`mpnb.numerics.watch`; read at the flush, :attr:`numerics`), and every
            step for a few steps after a flush shows trouble. True (the default): every
            :data:`~mpnb.numerics.watch.DEFAULT_EVERY` steps, under 1% of a run. False: off.
        locate_overflow: once a flush shows a skipped step or a non-finite loss, watch the next
            steps as they run to name the module and op where the inf/NaN began (an
            ``"origin"`` event; :class:`~mpnb.numerics.origin.NextStepsLocator`).

    Attributes:
        history: one row per optimizer step, across every run this object recorded.
        control: Stop / Pause / Resume (the dashboard's buttons use it); the framework's hooks
            turn a stop into the framework's own stop.
    """

    def __init__(
        self,
        framework: str,
        dashboard: str | Sink | None = "auto",
        on_nonfinite: str = "warn",
        flush_every: int = 64,
        watch_numerics: int | bool | None = True,
        locate_overflow: bool = True,
    ) -> None:
        dashboard = check_dashboard(dashboard)
        watch_numerics = check_watch_numerics(watch_numerics)  # refused here, not at a run's start
        check_flag("locate_overflow", locate_overflow)
        flush_every = flush_every_for(on_nonfinite, flush_every)
        self.framework, self.dashboard = framework, dashboard
        self.history = History()
        self.control = FitControl()
        self.control.subject = self  # the dashboard's remedy and heatmaps read and steer it
        self.health = HealthWatch(on_nonfinite)
        self.recorder = Recorder(
            self.history,
            flush_every=flush_every,
            sinks=[self.health],
        )
        self.notices = Notices(self.history)
        self.steps = 0
        self.runs = 0
        #: Why a step may give no loss to read, where the framework's settings say (in its notice).
        self.no_loss_reason: str | None = None
        self.watch_numerics, self.locate_overflow = watch_numerics, locate_overflow
        #: The numerics watch's log of the last run (None without ``watch_numerics``).
        self.numerics: NumericsLog | None = None
        self._run: _Run | None = None

    @property
    def running(self) -> bool:
        return self._run is not None

    def begin(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: torch.amp.GradScaler | None,
        device: torch.device | str,
        asked: str | Mode | None,
        title: str | None = None,
        on_stop: Callable[[], None] | None = None,
        after_step: int = 0,
    ) -> None:
        """Attach to a run about to start: hooks on ``model`` and ``optimizer``, the dashboard.

        ``after_step``: the framework's own count of optimizer steps as the run starts (one
        resumed from the framework's checkpoint): the rows number on from it, as its logs and
        checkpoints do, unless this telemetry has counted further itself.

        ``asked``: the precision the framework was asked for (a name in
        :func:`~mpnb.integrations.observed.precisions`, or None when unknown). ``on_stop``: the
        framework's own stop (``trainer.should_stop = True``), called the moment Stop is pressed (the
        dashboard, ``control.stop()`` from anywhere, another callback), whichever hook runs next:
        the framework ends as its own stop ends it (Lightning and transformers after the running
        batch; the micro-batches of an unfinished accumulation window are dropped, unstepped). A
        run that never reached :meth:`end` (its framework raised) is ended first. Each run is marked in the history (an event of kind ``"run"`` at the
        step it starts after) and says its notices anew.

        Raises:
            UnscalableWeightsError: ``optimizer`` trains fp16 weights and ``scaler`` scales the
                loss: GradScaler would refuse them at the first step (``model.float()`` is the
                fix; :mod:`mpnb.training.master_weights`). Nothing is attached.
        """
        asked = check_precision(asked)
        device = torch.device(device)
        # before anything changes: GradScaler would refuse fp16 weights at the first step
        check_scalable(optimizer, scaler is not None and scaler.is_enabled(), model)
        if self._run is not None:
            self.end()
        instruments = fit_instruments(
            model,
            device.type,
            watch_numerics=self.watch_numerics,
            locate_overflow=self.locate_overflow,
            replays=False,  # the framework holds the batches: no step can be replayed
        )
        self._run = _Run(model, optimizer, scaler, device, asked, instruments)
        self.steps = max(self.steps, after_step)
        if instruments.numerics is not None:
            self.numerics = instruments.numerics
        self.runs += 1
        name = title or self.framework
        self.history.note(
            f"run {self.runs} ({name}) starts after step {self.steps}", kind="run", step=self.steps
        )
        self.notices.restart()
        self.health.restart(self.history)
        sinks = dashboard_sinks(
            self.dashboard, title or f"{self.framework} (mpnb telemetry)", self.control
        )
        sinks = [*self._run.instruments, *sinks]  # read at a flush before a view draws them
        self.recorder.attach(*sinks)
        self._run.sinks = sinks
        self._run.account.watch(instruments, self._run.watched(self.history), self.steps + 1)
        self.control.begin()
        # a framework that raises tells its callbacks nothing: in a notebook, the end of the
        # cell that raised ends the run, whatever shows it (a dashboard, a sink, nothing)
        end_with_its_cell = views.installed("cell_end")
        if end_with_its_cell is not None:
            end_with_its_cell(self.control)
        self._run.control_listener = self._follow_control(self._run, on_stop)
        self.control.on_state.append(self._run.control_listener)
        self.notices.say("session_autocast", session_autocast_around(device.type, self.framework))
        self.notices.say(
            "session_oplists", session_lists_inside(session.oplists.lists, self.framework)
        )

    def hold(self, handle: torch.utils.hooks.RemovableHandle) -> None:
        """Take ``handle`` (a hook the caller put on for this run) off with the run's own hooks,
        at :meth:`end` or when the next :meth:`begin` ends a run that never reached it."""
        self._require_run().handles.append(handle)

    def window_begin(self) -> None:
        """The first micro-batch of an optimizer step starts: its time starts (if not already), and
        the precision hook goes back on if this step is one to read (see ``PrecisionObserver``)."""
        run = self._require_run()
        run.account.start()  # the instruments' moment: before the forward
        run.observer.rearm()

    def add_loss(self, loss: torch.Tensor | float, normalized: bool = False) -> None:
        """A micro-batch's loss. ``normalized``: already divided so that the window's losses sum
        to the step's loss (Lightning's accumulation, transformers' ``num_items_in_batch``);
        otherwise the step's loss is the mean of the window's losses."""
        run = self._require_run()
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"{self.framework}: a step's loss must be one number, got a tensor of shape {list(loss.shape)} "
                    "(reduce it first, e.g. loss.mean())"
                )
            # kept in its dtype (the flush reads a bf16 / fp16 loss exactly), without its graph; a loss
            # the framework detached already (Lightning's) is kept as it is: no new tensor a step
            value = loss.detach() if loss.requires_grad else loss
        else:
            try:
                value = float(loss)
            except (TypeError, ValueError):
                raise TypeError(
                    f"{self.framework}: a step's loss must be a tensor or a number, got {loss!r}"
                ) from None
        run.account.add_loss(value, normalized)

    def add_samples(self, count: int | None) -> None:
        """Examples in a micro-batch (None when unknown)."""
        self._require_run().account.add_samples(count)

    def before_optimizer_step(self) -> None:
        """The optimizer is about to be called: note the scale it steps with, and the learning rate."""
        run = self._require_run()
        run.scale_before = scale_in_use(run.scaler)
        run.lr = lr_in_use(run.optimizer)
        if run.watch is not None:
            run.watch.reset()
        run.before_called = True

    def step_end(self, epoch: int = 0, *, optimizer_called: bool = True) -> bool:
        """The optimizer step is over: record its row (in the framework's ``epoch``), say what
        needs saying, then deliver the dashboard's requests (waits here while paused). Returns
        True when the framework should stop: Stop was asked for (the dashboard, ``control.stop()``)
        or a non-finite loss stops the run (``on_nonfinite="stop"``).

        ``optimizer_called=False``: the framework counted the step without calling the optimizer
        (Lightning does for a ``training_step`` that returned None); the row is not marked skipped,
        which says that gradients overflowed."""
        run = self._require_run()
        epoch = self.check_epoch(epoch)
        prepared = run.before_called  # else the step's scale, learning rate and skip are unknown
        watched = run.watch is not None and prepared and optimizer_called
        skipped = run.watch.skipped(run.scaler, run.device) if watched else False
        observed = run.observer.step_end()
        if run.layer_mode is not None and observed in run.layer_mode.observed_as:
            observed = run.layer_mode.name  # its layers ran (torchao's float8 layers: fp8)
        self.steps += 1
        record = run.account.close(  # and the instruments' step end
            step=self.steps,
            epoch=epoch,
            loss_scale=run.scale_before,
            skipped=skipped,
            lr=run.lr,
            mode=observed if observed is not None else UNSEEN,
            keep=self.recorder.hold,
        )
        self.recorder.flush_if_due()  # with what the instruments noted of the step
        run.next_window()
        if record.loss_missing:
            self.notices.say(
                "no_loss", no_loss(self.framework, self.steps, self.no_loss_reason), self.steps
            )
        if not prepared:
            self.notices.say("not_prepared", not_prepared(self.framework, self.steps), self.steps)
        if observed is None:
            self.notices.say("mode_unseen", mode_unseen(self.framework, self.steps), self.steps)
        # the precision's notices, when it is first seen or changes
        if observed != run.checked_precision:
            run.checked_precision = observed
            self.notices.say(
                "precision_mismatch",
                precision_mismatch(run.asked, observed, self.framework),
                self.steps,
            )
            scaling = fp16_without_scaling(observed, run.scaler, self.framework)
            self.notices.say("fp16_without_scaling", scaling, self.steps)
            # bf16 / fp16 weights where they were not asked for as such: updates below their
            # resolution are lost (the observer names the weights' dtype before autocast's)
            if observed in _LOW_PRECISION_WEIGHTS and run.asked != observed:
                weights = low_precision_notice(run.optimizer, run.model)
                self.notices.say(LOW_PRECISION_WEIGHTS, weights, self.steps)
        # delivers the dashboard's requests (a Stop), waits while paused
        checkpoint = self.control.checkpoint()
        if "reset" in checkpoint.changed:  # every switch put back, the remedies too
            run.instruments.undo_for_reset(self.history, self.steps + 1)
        if checkpoint.paused_s:
            run.account.restart_clock()  # the pause is no step's work: the next step's time starts at its first batch
        return self.stop_requested

    def check_epoch(self, epoch: object) -> int:
        """``epoch`` as an int (a numpy integer is one); refuses anything else, naming it.

        Raises:
            TypeError: ``epoch`` is not a whole number (a bool, a float, a string...).
        """
        if hasattr(type(epoch), "__index__") and not isinstance(epoch, bool):
            return operator.index(epoch)
        raise TypeError(f"{self.framework}: epoch must be a whole number, got {epoch!r}")

    def outside_steps_start(self) -> None:
        """Work outside the training steps starts (an evaluation), maybe between two micro-batches
        of a step (Lightning validates every n batches, whatever the accumulation): the open
        step's time so far is kept. Optional before :meth:`outside_steps`."""
        self._require_run().account.interrupt()

    def outside_steps(self) -> None:
        """Work outside the training steps just ran (an evaluation, a checkpoint save): the next
        step's time starts at its own first micro-batch instead of at the previous step's end,
        and adds to what a step that the work interrupted had run (:meth:`outside_steps_start`)."""
        self._require_run().account.restart_clock()

    def keep_in_fp32(self, module: str) -> str:
        """Run ``module`` of the running model in float32 (autocast off inside it, its inputs cast
        up) from the next step until the run ends, noted on the history as a switch: the remedy
        for an overflow named in it. The framework's loss scale, lowered by the skips, goes back
        to its scaler's initial scale (a ``"scale"`` event). Call it between steps (a callback,
        a dashboard button).

        Raises:
            MpnbError: no module of that name (the closest are listed); nothing changes.
            RuntimeError: no run is being recorded.
        """
        run = self._require_run()
        found = run.instruments.keep_in_fp32(module, self.steps + 1)
        self.recorder.flush()  # the rows before it are checked at the scale they ran at
        if scale_back(run.scaler, self.history, self.steps + 1, f"{found} runs in fp32 now"):
            self.health.rearm()
            if run.before_called:  # the next step's scale, read already (a loop helper's)
                run.scale_before = scale_in_use(run.scaler)
        return found

    @property
    def stop_requested(self) -> bool:
        """Stop was asked for (dashboard, ``control.stop()``) or a non-finite loss stops the run."""
        return self.control.stop_requested or self.health.stop

    def end(self) -> None:
        """The run ended: flush, close the dashboard, take every hook off. Safe to call twice."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            self.recorder.close()
        finally:
            self.recorder.detach(*run.sinks)
            run.detach()
            self.control.on_state.remove(run.control_listener)
            self.control.end()

    def _follow_control(
        self, run: _Run, on_stop: Callable[[], None] | None
    ) -> Callable[[str], None]:
        """A :attr:`FitControl.on_state` listener for ``run``: Stop calls ``on_stop`` the moment it is
        pressed; an abandoned run (its notebook cell raised, see :mod:`mpnb.ui.cell_end`) is ended,
        with a note saying why."""

        def listener(state: str) -> None:
            if state == "stopping" and on_stop is not None:
                on_stop()
            elif state == "abandoned" and self._run is run:
                reason = self.control.abandoned_because
                self.history.note(
                    f"run {self.runs} ended without {self.framework} saying so: {reason}",
                    kind="run failed",
                    step=self.steps,
                )
                self.end()

        return listener

    def _require_run(self) -> _Run:
        if self._run is None:
            raise RuntimeError(
                f"{self.framework}: no run is being recorded (begin() was not called, or end() was)"
            )
        return self._run

    def __repr__(self) -> str:
        state = "recording" if self._run is not None else "idle"
        return f"<mpnb LoopTelemetry for {self.framework}: {self.steps} steps, {state}>"


class WithTelemetry:
    """What every integration shows of its :class:`LoopTelemetry` (held as ``self.telemetry``)."""

    telemetry: LoopTelemetry

    @property
    def history(self) -> History:
        """One row per optimizer step, the rows not yet copied to the host included (a framework
        that raised mid-run, as ``transformers.Trainer`` does without telling its callbacks, leaves
        them pending)."""
        self.telemetry.recorder.flush()
        return self.telemetry.history

    @property
    def control(self) -> FitControl:
        """Stop / Pause / Resume of the running training."""
        return self.telemetry.control

    @property
    def numerics(self) -> NumericsLog | None:
        """Each leaf module's sampled numerics (with ``watch_numerics``; see
        :mod:`mpnb.numerics.watch`), the steps not yet copied to the host included."""
        self.telemetry.recorder.flush()
        return self.telemetry.numerics

    def keep_in_fp32(self, module: str) -> str:
        """Run ``module`` in float32 from the next step until the run ends (see
        :meth:`LoopTelemetry.keep_in_fp32`)."""
        return self.telemetry.keep_in_fp32(module)


class _Run:
    """What one attached run holds: its hooks, clock, and the open optimizer step's values."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        device: torch.device,
        asked: str | None,
        instruments: FitInstruments,
    ) -> None:
        self.optimizer, self.scaler, self.device, self.asked = optimizer, scaler, device, asked
        self.account = StepAccount(device)  # the open step's clock, memory, losses and examples
        # without an enabled scaler no step is ever skipped: nothing to watch, no hook in the optimizer
        self.watch = (
            OptimizerStepWatch(optimizer) if scaler is not None and scaler.is_enabled() else None
        )
        self.observer = PrecisionObserver(model, device.type)
        self.model = model
        # a mode whose layers the loop converted before training (Accelerate's fp8, torchao's recipe)
        self.layer_mode = mode_found_in(model)
        if self.layer_mode is not None and asked == dtype_name(self.layer_mode.autocast_dtype):
            # layers converted, the rest under bf16 autocast, is how fp8 is asked where the
            # framework has no fp8 setting (Lightning's configure_model): the conversion is the request
            self.asked = self.layer_mode.name
        self.instruments = instruments  # numerics watch, overflow locator; the fp32 remedies
        self.sinks: list[Sink] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.control_listener: Callable[[str], None] = lambda state: (
            None
        )  # Stop to the framework, and more
        # the observed precision the notices were checked for
        self.checked_precision: str | None = None
        self.next_window()

    def next_window(self) -> None:
        """The next optimizer step's values start afresh (what it measures: :attr:`account`)."""
        self.scale_before: torch.Tensor | float = 1.0
        self.lr: Any = math.nan
        self.before_called = False

    def watched(self, history: History) -> WatchedRun:
        """What the run's instruments see of it."""
        scaler = self.scaler
        return WatchedRun(
            history=history,
            device=self.device,
            scales_loss=scaler is not None and scaler.is_enabled(),
            loss_scale=lambda: scale_in_use(scaler),
        )

    def detach(self) -> None:
        self.account.unwatch()
        self.instruments.release()
        if self.watch is not None:
            self.watch.remove()
        self.observer.remove()
        for handle in self.handles:
            handle.remove()
