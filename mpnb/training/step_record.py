"""One optimizer step's row: a typed record, measured and built in one place.

:class:`StepAccount` is the one piece of code that measures a step, for mpnb's own
:class:`~mpnb.training.amp_step.AmpStep` and for the integrations' loops alike. It owns the step
clock (and the forward pass's), the memory sample, the micro-batches' losses (summed in fp32 and
divided once, at the step) and their examples, and a pause's exclusion from the step's time.
:meth:`StepAccount.close` turns what the open step gathered into a :class:`StepRecord`, whose
row the :class:`~mpnb.training.telemetry.Recorder` keeps as it is: tensors stay on the device
until its flush reads every pending value in one copy. A new column is one field of the record and
one entry of :meth:`StepRecord.row`.

Example:
    >>> import torch
    >>> account = StepAccount(torch.device("cpu"))
    >>> account.start()
    >>> account.add_loss(torch.tensor(0.5))
    >>> account.add_loss(torch.tensor(0.25))
    >>> account.add_samples(8)
    >>> record = account.close(step=1, epoch=0, loss_scale=1.0, skipped=False, lr=0.1, mode="bf16")
    >>> float(record.loss), record.samples, record.row()["mode"]
    (0.375, 8, 'bf16')
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from mpnb.errors import check_number
from mpnb.precision.backends import backend_for
from mpnb.training.history import History
from mpnb.training.step_clock import DeviceInterval, StepClock
from mpnb.training.telemetry import MemorySampler, Sink, add_in_fp32

__all__: list[str] = []

#: A stretch of time as its parts: host seconds, or intervals between device events (read at the flush).
Duration = tuple[float | DeviceInterval, ...]


class StepRecord(NamedTuple):
    """One optimizer step, as recorded. Each field has one type; a tensor stays on the device
    until the recorder's flush, and a duration's device intervals are read there too. A tuple:
    made once a step in one call, and a flush's records turn into columns in one transposition.

    Attributes:
        step, epoch: the step's number (from 1, over the trainer's life) and its epoch.
        loss: the step's loss (the mean of its micro-batches'), NaN when none was read.
        loss_missing: no loss could be read for the step (then ``loss`` is NaN).
        loss_scale, skipped: the scale its backward used, and whether overflow skipped it.
        lr: the learning rate of the first parameter group.
        step_time: from the previous step's end to this one's, less pauses and outside work.
        forward_time: each micro-batch's forward pass, summed; None where not measured.
        samples: the examples in the step; None where unknown (``samples_per_s`` is then NaN).
        memory: the device's ``(used, peak, reserved)`` bytes, NaN for what it cannot say.
        grad_norm: the unscaled gradients' total norm (NaN unless clipping or asked for).
        mode: the precision mode the step ran in.
    """

    step: int
    epoch: int
    loss: torch.Tensor | float
    loss_missing: bool
    loss_scale: torch.Tensor | float
    skipped: torch.Tensor | bool
    lr: float
    step_time: Duration
    forward_time: Duration | None
    samples: int | None
    memory: tuple[float, float, float]
    grad_norm: torch.Tensor | float
    mode: str

    def row(self) -> dict[str, Any]:
        """The record as the recorder's row: History's columns, and ``samples`` (from which the
        flush derives ``samples_per_s``)."""
        return {name: values[0] for name, values in StepRecord.columns_of([self]).items()}

    @staticmethod
    def columns_of(records: Sequence[StepRecord]) -> dict[str, list[Any]]:
        """Records as the recorder's columns (what :meth:`row` gives, column-wise), made in one pass:
        a flush turns its pending records at once. A duration of one part is that part; of several,
        a list (the recorder sums them); a forward time not measured, NaN.

        Example:
            >>> account = StepAccount(torch.device("cpu"))
            >>> first = account.close(step=1, epoch=0, loss_scale=1.0, skipped=False, lr=0.1, mode="bf16")
            >>> second = account.close(step=2, epoch=0, loss_scale=1.0, skipped=False, lr=0.1, mode="bf16")
            >>> StepRecord.columns_of([first, second])["step"]
            [1, 2]
        """
        fields = map(list, zip(*records))
        steps, epochs, losses, missing, scales, skips, lrs, step_times, *rest = fields
        forward_times, samples, memories, norms, modes = rest
        used, peak, reserved = map(list, zip(*memories))
        return {
            "step": steps,
            "epoch": epochs,
            "loss": losses,
            "loss_missing": missing,
            "loss_scale": scales,
            "skipped": skips,
            "lr": lrs,
            "step_time": _durations(step_times),
            "forward_time": _durations(forward_times),
            "samples": samples,
            "memory_used": used,
            "memory_peak": peak,
            "memory_reserved": reserved,
            "grad_norm": norms,
            "mode": modes,
        }


_FIRST = operator.itemgetter(0)


def _durations(durations: list[Duration | None]) -> list[Any]:
    """Durations as a column: one of one part is that part, of several a list (the recorder
    sums them), one not measured (None) NaN. The usual column, every duration of one part, is
    taken without a Python step per row (a flush turns up to ``flush_every`` of them).

    >>> _durations([(0.5,), (0.25, 0.25), None])
    [0.5, [0.25, 0.25], nan]
    """
    if None not in durations and set(map(len, durations)) == {1}:
        return list(map(_FIRST, durations))
    return [
        math.nan if parts is None else parts[0] if len(parts) == 1 else list(parts)
        for parts in durations
    ]


def flush_every_for(on_nonfinite: str, flush_every: object) -> int:
    """Steps between telemetry flushes: ``flush_every`` (a whole number above 0, checked here for
    every loop that takes it), or every step with ``on_nonfinite="stop"``, since a loop can stop
    at a bad step only if it knows of it there (one host read a step on an accelerator).

    >>> flush_every_for("warn", 64), flush_every_for("stop", 64)
    (64, 1)

    Raises:
        MpnbError: ``flush_every`` is not a whole number above 0.
    """
    flush_every = check_number(
        "flush_every", flush_every, whole=True, meaning="steps between flushes"
    )
    return 1 if on_nonfinite == "stop" else int(flush_every)


@dataclasses.dataclass(frozen=True)
class WatchedRun:
    """What an :class:`Instrument` sees of the run it watches (handed to :meth:`Instrument.begin`).

    Attributes:
        history: the run's history: its rows, and its events (an instrument notes its findings there).
        device: where the steps run.
        scales_loss: the run's mode scales the loss (fp16): a step can be skipped.
        loss_scale: the loss scale the next step's backward uses, read without a device sync.
        autocast: a fresh forward-pass context of the run's precision (for a step replayed).
        tell_sinks: shows the sinks the history as it is (after a note made between two flushes).
        reschedule: asks each instrument again which step it next watches (see
            :meth:`Instrument.next_watched_step`): call it when an instrument wants a step sooner
            than it said (trouble seen at a flush).

    Example:
        >>> run = WatchedRun(History(), torch.device("cpu"))
        >>> run.scales_loss, run.loss_scale()
        (False, 1.0)
    """

    history: History
    device: torch.device
    scales_loss: bool = False
    loss_scale: Callable[[], torch.Tensor | float] = lambda: 1.0
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    tell_sinks: Callable[[], None] = lambda: None
    reschedule: Callable[[], None] = lambda: None


class Instrument(Sink):
    """Watches the steps a :class:`StepAccount` measures, at a step's few moments. Every moment
    does nothing by default: an instrument overrides the ones it needs (the numerics watch, the
    overflow locators of :mod:`mpnb.numerics.origin`).

    In a run's order: :meth:`begin`; per micro-batch :meth:`before_forward`; per optimizer step
    :meth:`step_end`, then :meth:`step_skipped` when the step is known on the host to be skipped;
    as a telemetry :class:`~mpnb.training.telemetry.Sink`, :meth:`update` at each flush and
    :meth:`close` at the run's end; :meth:`detach` last, however the run ended. None of them
    may read a device value: the flush is the place for that.

    An instrument is called only at the moments it overrides, and only at the steps it watches:
    :meth:`next_watched_step` says which (every step by default); the steps between cost the
    run nothing of it. :meth:`step_skipped` is told of every skip known on the host.

    Example:
        >>> class Steps(Instrument):
        ...     def step_end(self, step):
        ...         print("step", step, "ended")
        >>> account = StepAccount(torch.device("cpu"))
        >>> account.watch([Steps()], WatchedRun(History(), torch.device("cpu")), next_step=1)
        >>> account.start()
        >>> record = account.close(step=1, epoch=0, loss_scale=1.0, skipped=False, lr=0.1, mode="fp32")
        step 1 ended
    """

    def begin(self, run: WatchedRun) -> None:
        """A run (a fit) begins: ``run`` is what the instrument may read of it."""

    def next_watched_step(self, step: int) -> int | float:
        """The first step from ``step`` on whose moments this instrument needs (``step`` itself
        by default: every step), or ``math.inf`` for none until it asks again
        (:attr:`WatchedRun.reschedule`). Asked when the run begins, after each step it watched,
        and when it asks."""
        return step

    def before_forward(self, step: int, first: bool) -> None:
        """A micro-batch of optimizer step ``step`` is about to run its forward pass; ``first``:
        it is the step's first."""

    def step_end(self, step: int) -> None:
        """Optimizer step ``step`` ended: its backward and its optimizer call are done."""

    def step_skipped(
        self,
        step: int,
        scale: torch.Tensor | float,
        compute_loss: Callable[[], torch.Tensor] | None,
    ) -> None:
        """Step ``step``, whose backward used loss scale ``scale``, was skipped (gradients
        overflowed). ``compute_loss`` runs its last micro-batch's forward again (None where the
        batch is not mpnb's: a framework's loop)."""

    def detach(self) -> None:
        """Take off whatever the instrument put on the model. Runs however the run ended; safe
        to call twice."""


class StepAccount:
    """What the open optimizer step has gathered, and the clocks that time it.

    Call :meth:`start` when a step's work begins (or :meth:`forward_start` / :meth:`forward_end`
    around each forward pass), :meth:`add_loss` and :meth:`add_samples` per micro-batch, and
    :meth:`close` at the step's end, which returns its :class:`StepRecord` and opens the next.

    Args:
        device: where the step runs (its clock and memory).
    """

    def __init__(self, device: torch.device) -> None:
        self.clock = StepClock(device)
        self.forward_clock = StepClock(
            device
        )  # a forward pass to its backward: the process's own work
        self.memory = MemorySampler(backend_for(device), device)
        self.instruments: list[Instrument] = []  # called at each step's moments, in this order
        self.next_step = 1  # the open step's number, as the instruments are told it
        self._forward: Callable[[], torch.Tensor] | None = None  # the last micro-batch's forward
        self._moments = _Moments([])
        self._woken_at: int | float = math.inf  # the next step an instrument watches
        self.discard()

    # -- instruments -----------------------------------------------------------------------

    def watch(self, instruments: Sequence[Instrument], run: WatchedRun, next_step: int) -> None:
        """Call ``instruments`` at the moments of the steps from here on, the next one numbered
        ``next_step``; each begins watching ``run`` first."""
        self.instruments, self.next_step = list(instruments), next_step
        self._moments = _Moments(self.instruments)
        run = dataclasses.replace(run, reschedule=self.reschedule)
        for instrument in self.instruments:
            instrument.begin(run)
        self.reschedule()

    def unwatch(self) -> None:
        """The run ended: every instrument detaches (each one, whatever another raised), and is
        called no more."""
        instruments, self.instruments, self._forward = self.instruments, [], None
        self._moments, self._woken_at = _Moments([]), math.inf
        with contextlib.ExitStack() as detaching:
            for instrument in instruments:
                detaching.callback(instrument.detach)

    def reschedule(self) -> None:
        """Ask the instruments again which step one of them watches next."""
        self._woken_at = min(
            (instrument.next_watched_step(self.next_step) for instrument in self.instruments),
            default=math.inf,
        )

    def _before_forward(self) -> None:
        first = not self.open
        for before_forward in self._moments.before_forward:
            before_forward(self.next_step, first)

    def _step_ended(
        self, step: int, scale: torch.Tensor | float, skipped: torch.Tensor | bool, watched: bool
    ) -> None:
        if watched:
            for step_end in self._moments.step_end:
                step_end(step)
        if skipped is True:  # known on the host; a device flag is read at the flush, not here
            for step_skipped in self._moments.step_skipped:
                step_skipped(step, scale, self._forward)
        self.reschedule()

    # -- time ------------------------------------------------------------------------------

    def start(self) -> None:
        """A micro-batch's work begins (the step's time starts, unless it has already): the
        instruments' :meth:`~Instrument.before_forward`."""
        self._forward = None
        if self.next_step >= self._woken_at:
            self._before_forward()
        self.clock.start()

    def forward_start(self, forward: Callable[[], torch.Tensor] | None = None) -> None:
        """A forward pass begins: the step's time starts here too, if it has not yet. ``forward``:
        the function that runs it and returns the loss, for an instrument that replays a skipped
        step. The instruments' :meth:`~Instrument.before_forward` run first, outside the clocks."""
        self._forward = forward
        if self.next_step >= self._woken_at:
            self._before_forward()
        self.clock.start(self.forward_clock.start_anew())  # one reading of the clock opens both

    def forward_end(self, loss: torch.Tensor | float | None = None) -> None:
        """The forward pass's loss is handed to backward: its time is the step's forward time;
        ``loss``, when given, is the micro-batch's (as :meth:`add_loss` takes it)."""
        forward_time = self.forward_clock.stop()
        if forward_time is None:  # no forward_start() before: the step's time starts here
            self.clock.start()
        else:
            self._forward_parts.append(forward_time)
        if loss is not None:
            self._add_plain(loss)

    def interrupt(self) -> None:
        """Work outside the steps starts inside an open step (an evaluation between micro-batches):
        the step's time so far is kept, and goes on at the next :meth:`start`."""
        part = self.clock.stop() if self.open else None
        if part is not None:
            self._step_parts.append(part)

    def restart_clock(self) -> None:
        """Forget the time since the last step (a pause, work outside the steps)."""
        self.clock.restart()

    # -- the micro-batches ---------------------------------------------------------------

    def add_loss(self, loss: torch.Tensor | float, normalized: bool = False) -> None:
        """A micro-batch's loss, kept as given (a bf16 loss stays bf16: the flush reads it exactly).
        ``normalized``: already divided so that the step's losses sum to its loss; otherwise the
        step's loss is the mean of its micro-batches' (summed in fp32, divided once)."""
        if normalized:
            self.open = True
            self._summed = add_in_fp32(self._summed, loss)
        else:
            self._add_plain(loss)

    def _add_plain(self, loss: torch.Tensor | float) -> None:
        """A micro-batch's loss, one of those the step's loss is the mean of."""
        self.open = True
        plain = self._plain
        self._plain = loss if plain is None else add_in_fp32(plain, loss)
        self._plain_count += 1

    def add_samples(self, count: int | None) -> None:
        """Examples in a micro-batch (None or 0 when unknown)."""
        self.open = True
        if count:
            self._samples += count

    @property
    def loss(self) -> torch.Tensor | float | None:
        """The open step's loss so far: its normalized losses' sum plus the mean of the others;
        None when no loss came."""
        if not self._plain_count:
            return self._summed
        mean = (
            self._plain if self._plain_count == 1 else self._plain / self._plain_count
        )  # a sum of several: fp32
        return mean if self._summed is None else add_in_fp32(self._summed, mean)

    def discard(self) -> None:
        """Forget what the open step gathered (its losses, examples and times so far)."""
        self.open = False  # a micro-batch of the open step was added (its loss or its examples)
        self._summed: torch.Tensor | float | None = None
        self._plain: torch.Tensor | float | None = None
        self._plain_count = 0
        self._samples = 0
        self._step_parts: list[float | DeviceInterval] = []
        self._forward_parts: list[float | DeviceInterval] = []

    # -- the step's end ------------------------------------------------------------------

    def close(
        self,
        *,
        step: int,
        epoch: int,
        loss_scale: torch.Tensor | float,
        skipped: torch.Tensor | bool,
        lr: float,
        mode: str,
        grad_norm: torch.Tensor | float = math.nan,
        keep: Callable[[StepRecord], object] | None = None,
    ) -> StepRecord:
        """The step ends: its record, from what was gathered and the clocks; the next step opens.
        ``keep`` takes the record (a recorder's ``hold``) before any instrument hears of the
        step, so that an instrument that fails, or an interrupt inside one, cannot lose it. Then
        the instruments' :meth:`~Instrument.step_end` (and :meth:`~Instrument.step_skipped`)."""
        step_time = (*self._step_parts, self.clock.lap())
        # the usual step, one micro-batch's loss: as it is (what the property returns for it)
        loss = self._plain if self._plain_count == 1 and self._summed is None else self.loss
        record = StepRecord(
            step,
            epoch,
            math.nan if loss is None else loss,
            loss is None,
            loss_scale,
            skipped,
            lr,
            step_time,
            tuple(self._forward_parts) or None,
            self._samples,
            self.memory.sample(time.perf_counter()),
            grad_norm,
            mode,
        )
        self.discard()
        self.next_step = step + 1
        # asked before the record is kept: its flush may tell an instrument, which reschedules
        watched = step >= self._woken_at
        if keep is not None:
            keep(record)
        if watched or skipped is True:  # an instrument watches it, or must hear of it
            self._step_ended(step, loss_scale, skipped, watched)
        return record


class _Moments:
    """Each moment's calls: the bound methods of the instruments that override it, in order."""

    __slots__ = ("before_forward", "step_end", "step_skipped")

    def __init__(self, instruments: Sequence[Instrument]) -> None:
        def overriding(name: str) -> list[Callable[..., None]]:
            default = getattr(Instrument, name)
            return [
                getattr(instrument, name)
                for instrument in instruments
                if getattr(type(instrument), name) is not default
            ]

        self.before_forward = overriding("before_forward")
        self.step_end = overriding("step_end")
        self.step_skipped = overriding("step_skipped")
