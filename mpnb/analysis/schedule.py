"""Run several modes' trainings in interleaved turns, each as exact as if it ran alone.

A comparison first builds every mode's run and trains its warm-up steps, one mode after
another; then, round after round, each mode trains a block of a few timed steps in turn
(the order reversed every other round), until every mode has its timed steps. Drift of a
shared machine (another job starting, the CPU clocking down) then falls on all modes alike,
and each round gives a paired measurement of every mode.

Interleaving must not change what a run computes. Each mode keeps torch's random state of
its own, put back before each of its turns and saved after it, so a mode's dropout masks
and data order are those it would draw alone. Memory is measured per timed turn: the device's
peak counter is reset at the start of each, so a mode's peak is reached in its own turns
only, whatever ran before it. Memory the allocator keeps cached (a CPU's freed heap) is
handed back before a mode's first timed turn only: handing it back every turn would make
the next steps fault their memory in again (12% slower steps, measured on a CPU). Build
and warm-up turns are left out: the first mode built would otherwise carry the process's
one-time costs (data loaded, kernels initialised).

Example:
    >>> import mpnb.examples as ex
    >>> from mpnb.analysis.comparison import mode_result
    >>> class Run:
    ...     def __init__(self, mode):
    ...         self.mode, self.trainer, self.data = mode, None, None
    ...     def advance(self, steps, sink):
    ...         if self.trainer is None:
    ...             self.trainer, self.data, _ = ex.example_trainer(self.mode, "cpu", widths=(4, 8), dashboard=None)
    ...         before = self.trainer.amp.steps
    ...         if steps:
    ...             self.trainer.fit(self.data, max_steps=steps)
    ...         return self.trainer.amp.steps - before
    ...     def result(self, warmup):
    ...         return mode_result(self.mode, self.trainer, warmup)
    >>> results = interleave({"fp32": Run("fp32"), "bf16": Run("bf16")}, steps=4, warmup=1, block=2)
    >>> [(r.mode, len(r.history), r.blocks) for r in results]
    [('fp32', 5, [(1, 3), (3, 5)]), ('bf16', 5, [(1, 3), (3, 5)])]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from mpnb.analysis.results import ModeResult
from mpnb.analysis.runs import check_trains_in
from mpnb.errors import MpnbError
from mpnb.precision.backends import backend_for
from mpnb.precision.policy import session
from mpnb.training.own_run import shared_part
from mpnb.training.random_state import RandomState, kept_random_state
from mpnb.training.telemetry import Sink

__all__: list[str] = []


class ModeRun(Protocol):
    """One mode's training, advanced a turn at a time by :func:`interleave`.

    Attributes:
        trainer: the run's :class:`~mpnb.training.trainer.Trainer`, None until built.
        data: the data its fits take, None until built.
    """

    trainer: Any
    data: Any

    def advance(self, steps: int, sink: Sink | None) -> int:
        """Train up to ``steps`` more optimizer steps, reporting to ``sink``; return the steps taken.

        The first call also builds the run (it may then raise :class:`~mpnb.errors.MpnbError`:
        the mode cannot run here) and may be asked for 0 steps. Fewer steps than asked means
        the run has ended (its planned epochs are done, or it stopped).
        """

    def result(self, warmup: int) -> ModeResult:
        """The finished run's result, its first ``warmup`` rows untimed."""


def default_block(steps: int) -> int:
    """Timed steps per turn: about a tenth of the steps, at most 10 (``default_block(100) == 10``)."""
    return max(1, min(10, steps // 10))


class _Turns:
    """One mode's own random state and memory figures across its turns."""

    def __init__(self, random_state: RandomState) -> None:
        self.random_state = random_state  # put back before each turn, taken again after it
        self.peak, self.added = math.nan, math.nan
        self.rows: list[tuple[int, int]] = []  # the history rows of each timed turn

    @property
    def timed(self) -> int:
        """Timed steps so far."""
        return sum(stop - start for start, stop in self.rows)

    @contextlib.contextmanager
    def turn(self, device: torch.device, measure_memory: bool) -> Iterator[None]:
        """Run one turn with this mode's random state, measuring the memory it reaches if asked."""
        self.random_state.restore()
        backend = backend_for(device)
        # the mode's first timed turn: other modes' freed memory goes back
        if measure_memory and not self.rows:
            backend.release_cached_memory()
        measured = measure_memory and backend.reset_peak_memory(device.index)
        start = backend.memory(device.index).used if measured else None
        try:
            yield
        finally:
            self.random_state = RandomState.capture(self.random_state.device_type)
            if measured and start is not None:
                peak = backend.memory(device.index).peak
                if peak is not None:
                    self.peak = max(_or_zero(self.peak), float(peak))
                    self.added = max(_or_zero(self.added), float(peak - start))


def _or_zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def interleave(
    runs: Mapping[str, ModeRun],
    steps: int,
    warmup: int,
    block: int,
    sinks: Mapping[str, Sink | None] | None = None,
    on_end: Callable[[ModeResult], None] | None = None,
) -> list[ModeResult]:
    """Warm up every run, then train ``steps`` timed steps of each in interleaved turns of ``block``.

    Args:
        runs: one run per mode name, in the order the modes were asked for.
        steps: timed steps per mode.
        warmup: untimed steps each run trains first.
        block: timed steps per turn; ``block >= steps`` trains the modes one after another.
        sinks: where each mode's run reports its progress.
        on_end: hears each mode's result as soon as that mode is done.

    Returns:
        One result per mode, in the order of ``runs``; a mode whose run could not be built
        (an :class:`~mpnb.errors.MpnbError`) is listed with the reason.
    """
    device = session.resolved_device()
    sinks = sinks or {}
    ended: dict[str, ModeResult] = {}
    devices: dict[str, torch.device] = {}

    def take_turn(name: str, count: int, timed_turn: bool) -> int:
        run = runs[name]
        with turns[name].turn(devices.get(name, device), measure_memory=timed_turn):
            taken = run.advance(count, sinks.get(name))
        _check_own_run(name, run, {other: runs[other] for other in devices})
        devices[name] = run.trainer.device
        return taken

    def end(name: str, result: ModeResult) -> None:
        ended[name] = result
        if on_end is not None:
            on_end(result)

    with kept_random_state(device.type) as found:
        turns = {
            name: _Turns(found) for name in runs
        }  # every mode starts from the state the comparison found
        for name in runs:  # build and warm up, one mode after another
            try:
                taken = take_turn(name, warmup, timed_turn=False)
            except MpnbError as error:
                end(name, ModeResult(name, skipped_reason=str(error)))
                continue
            if taken < warmup:
                end(name, _result(runs[name], turns[name], warmup, steps))
        order = [name for name in runs if name not in ended]
        while order:
            for name in order:
                count = min(block, steps - turns[name].timed)
                first_row = len(runs[name].trainer.history)
                try:
                    taken = take_turn(name, count, timed_turn=True)
                except MpnbError as error:
                    if first_row:  # a run that trained: its own error
                        raise
                    # no warm-up: its first step is where the mode finds it cannot train
                    end(name, ModeResult(name, skipped_reason=str(error)))
                    continue
                if taken:
                    turns[name].rows.append((first_row, first_row + taken))
                if taken < count or turns[name].timed >= steps:
                    end(name, _result(runs[name], turns[name], warmup, steps))
            order = [name for name in reversed(order) if name not in ended]
    return [ended[name] for name in runs]


def _check_own_run(name: str, run: ModeRun, others: Mapping[str, ModeRun]) -> None:
    """A mode's run must train in that mode, with a trainer and model of its own: anything else
    would fill the row of one mode with another's steps."""
    trainer = run.trainer
    for other, other_run in others.items():
        if other == name or other_run.trainer is None:
            continue
        shared = shared_part(trainer, run.data, other_run.trainer, other_run.data)
        if shared == "one data iterator":
            raise ValueError(
                f"the runs of modes {other!r} and {name!r} share one data iterator: each would "
                "train on the batches the other left; give each run its own (a list or a "
                "DataLoader, or a generator made in make_run; in %%compare: inside the cell)"
            )
        if shared is not None:
            raise ValueError(
                f"the runs of modes {other!r} and {name!r} share {shared}: build a fresh model, "
                "optimizer and Trainer for each mode (in %%compare: inside the cell)"
            )
    check_trains_in(trainer, name)


def _result(run: ModeRun, turns: _Turns, warmup: int, steps: int) -> ModeResult:
    result = run.result(warmup)
    result.blocks = list(turns.rows)
    result.peak_memory, result.added_memory = turns.peak, turns.added
    if turns.timed < steps:
        result.notes.append(
            f"ended after {turns.timed} of {steps} timed steps (its data or planned epochs ran out, or it stopped): "
            "its figures rest on fewer steps"
        )
    return result
