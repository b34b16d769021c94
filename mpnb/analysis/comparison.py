"""The same experiment in several precision modes, side by side.

``compare(make_run, modes)`` builds a fresh run per mode with ``make_run(mode)`` (same model,
data and seed each time), warms each up, then trains the modes' timed steps in interleaved
turns (see :mod:`mpnb.analysis.schedule`), and reports per mode the median step time and
its interquartile range, the speedup over fp32 with its interval, throughput, the memory of
the mode's own turns, final loss, an optional metric, and skipped steps
(:mod:`mpnb.analysis.results`). A mode the device cannot run is listed with the reason,
never dropped.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy
import torch

from mpnb import views
from mpnb.analysis.memory import MemoryAccount, account_step
from mpnb.analysis.results import Comparison, ModeResult
from mpnb.analysis.runs import MakeRun, built_run, first_batch, mode_labels
from mpnb.analysis.schedule import ModeRun, default_block, interleave
from mpnb.analysis.slow_modes import slow_reason
from mpnb.errors import MAKE_RUN_USAGE, check_count, check_function, warn_user
from mpnb.training.batches import epochs_holding
from mpnb.training.control import refuse_inside_a_fit
from mpnb.training.random_state import kept_random_state
from mpnb.training.telemetry import Sink

if TYPE_CHECKING:
    from mpnb.training.trainer import Trainer

__all__ = ["Comparison", "ComparisonProgress", "ModeResult", "compare"]


class ComparisonProgress:
    """How :func:`compare` shows its progress; this base class shows nothing.

    ``sink_for(mode, steps, warmup)`` gives the telemetry sink that watches one mode's run
    of ``steps`` steps, the first ``warmup`` of them untimed;
    ``finished(result)`` hears each mode's end, ``close(comparison)`` the whole result.
    ``shows_table``: whether the view puts the comparison's table on screen itself when it closes.

    Example:
        >>> class Announce(ComparisonProgress):
        ...     def finished(self, result):
        ...         print(f"{result.mode} done")
        >>> Announce().finished(ModeResult("bf16"))  # as compare(..., progress=Announce()) would
        bf16 done
        >>> ComparisonProgress().sink_for("bf16", steps=10) is None
        True
    """

    shows_table = False

    def sink_for(self, mode: str, steps: int, warmup: int = 0) -> Sink | None:
        return None

    def finished(self, result: ModeResult) -> None:
        pass

    def close(self, comparison: Comparison) -> None:
        pass


def progress_view(
    progress: str | ComparisonProgress | None, modes: list[str], title: str
) -> ComparisonProgress:
    """The view ``progress`` names: None shows nothing; a string is made by the UI layer's view."""
    if progress is None:
        return ComparisonProgress()
    if isinstance(progress, ComparisonProgress):
        return progress
    return views.view("comparison_progress")(progress, modes, title)


def _notes(trainer: Trainer) -> list[str]:
    """What a mode's row says of its run before its figures: slow here, diverged."""
    reason = slow_reason(trainer)
    notes = [f"{reason}: expect this to be slow"] if reason else []
    history = trainer.history
    diverged = history.first_trouble(skips=False)
    if diverged is not None:
        notes.append(f"its loss is not finite from step {history.step[diverged]}: it diverged")
    return notes


def mode_result(
    name: str,
    trainer: Any,
    warmup: int,
    metric: Callable[[], object] | None = None,
    memory: Callable[[], MemoryAccount | None] | None = None,
) -> ModeResult:
    """The result of a finished run: ``trainer``'s history with the first ``warmup`` steps
    untimed, its ``metric()`` (NaN without one), then ``memory()``, the account of its step's
    memory (None: not counted). A metric that raises, or gives what is no number, is NaN with a
    note and a warning naming the mode, and so is an account that fails (no account): the
    comparison's other figures stand."""
    notes = _notes(trainer)

    def kept_without(said: str) -> None:  # one figure lost, said; the others stand
        warn_user(f"{name}: {said}; its other figures are kept")
        notes.append(said)

    value = math.nan
    if metric is not None:
        try:
            measured = metric()
        except Exception as error:  # the user's metric: any failure of it is its own
            kept_without(f"its metric raised {type(error).__name__}: {error}")
        else:
            if _is_number(measured):
                value = float(measured)  # type: ignore[arg-type]
            else:  # a string float() would read, None, a tensor of several values
                kept_without(f"its metric returned {_kind_of(measured)}, not a number")
    account = None
    if memory is not None:  # after the metric: the run as it trained is measured
        try:
            account = memory()
        except Exception as error:  # a step the account cannot run (a batch it cannot resize)
            kept_without(
                f"its step's memory could not be counted ({type(error).__name__}: {error})"
            )
    return ModeResult(
        name,
        trainer.history,
        timed_from=warmup,
        metric=value,
        notes=notes,
        verdict=trainer.mode.compare_verdict(trainer.device),
        memory=account,
    )


def _is_number(value: object) -> bool:
    """A real number: a Python or numpy number (a yes/no one too: 1 or 0), or a one-value
    tensor or array.

    >>> _is_number(0.5), _is_number(torch.tensor(0.5)), _is_number("0.5"), _is_number(True)
    (True, True, False, True)
    >>> _is_number(numpy.float32(0.5)), _is_number(numpy.array([0.5]))
    (True, True)
    """
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.dtype.is_complex
    if isinstance(value, numpy.ndarray):  # what sklearn's metrics may return
        return value.size == 1 and value.dtype.kind in "biuf"
    return isinstance(value, numbers.Real)


def _kind_of(value: object) -> str:
    """What a metric returned, in a few words.

    >>> _kind_of("0.5"), _kind_of(torch.ones(2))
    ('a str', 'a tensor of 2 values')
    """
    if isinstance(value, torch.Tensor):
        return f"a tensor of {value.numel()} values"
    return f"a {type(value).__name__}"


def compare_runs(
    run_for: Callable[[str], ModeRun],
    modes: Iterable[str],
    steps: int,
    warmup: int,
    *,
    block: int | None = None,
    progress: str | ComparisonProgress | None = "auto",
    on_result: Callable[[ModeResult], None] | None = None,
    metric_name: str = "metric",
    title: str = "",
) -> Comparison:
    """The loop behind :func:`compare` and ``%%compare``: check every mode, run them interleaved, collect.

    Args:
        run_for: the (not yet built) run of a mode; built by its first ``advance``.
        block: timed steps per turn (default :func:`~mpnb.analysis.schedule.default_block`);
            ``block >= steps`` runs the modes one after another.

    Raises:
        InvalidChoiceError: an unknown mode name.
        ValueError: steps < 1, warmup < 0 or block < 1.
        MpnbError: a fit is running on this thread (a comparison started from a widget during it).
    """
    refuse_inside_a_fit("a comparison")
    names = mode_labels(modes)
    steps, warmup = check_count("steps", steps), check_count("warmup", warmup, least=0)
    block = default_block(steps) if block is None else check_count("block", block)
    view = progress_view(progress, names, title)

    def ended(result: ModeResult) -> None:
        view.finished(result)
        if on_result is not None:
            on_result(result)

    sinks = {name: view.sink_for(name, warmup + steps, warmup) for name in names}
    runs = {name: run_for(name) for name in names}
    results = interleave(runs, steps, warmup, block, sinks, ended)
    comparison = Comparison(results, steps, warmup, metric_name, block)
    view.close(comparison)
    return comparison


def compare(
    make_run: MakeRun,
    modes: Iterable[str] = ("fp32", "tf32", "fp16", "bf16"),
    steps: int = 200,
    warmup: int = 5,
    *,
    block: int | None = None,
    progress: str | ComparisonProgress | None = "auto",
    on_result: Callable[[ModeResult], None] | None = None,
    metric_name: str = "metric",
) -> Comparison:
    """Train the run ``make_run(mode)`` builds in each mode and compare.

    Args:
        make_run: builds a fresh run for a mode (see :data:`MakeRun`).
        modes: mode names; every name is checked before anything runs.
        steps: timed optimizer steps per mode.
        warmup: steps run first and left out of the timing.
        block: timed steps each mode trains per turn (default about a tenth of ``steps``, at
            most 10); ``block=steps`` runs the modes one after another, as mpnb 0.1 did.
        progress: ``"auto"`` (live overlaid curves in a notebook, a progress line per mode
            elsewhere), ``"live"``, ``"text"``, a :class:`ComparisonProgress`, or None to
            leave each run's own dashboard in charge.
        on_result: called as each mode ends.
        metric_name: the table's name for the metric column.

    Raises:
        InvalidChoiceError: an unknown mode name.
        ValueError: steps < 1, warmup < 0 or block < 1.

    Example:
        >>> import mpnb.examples as ex
        >>> def make_run(mode):
        ...     trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)
        ...     return trainer, train
        >>> result = compare(make_run, modes=["fp32", "bf16"], steps=3, warmup=1, progress=None)
        >>> [row["mode"] for row in result.rows()], result.results[1].history.mode[-1]
        (['fp32', 'bf16'], 'bf16')
    """
    check_function("make_run", make_run, MAKE_RUN_USAGE, "compare(make_run, modes, steps)")
    return compare_runs(
        lambda name: _BuiltRun(
            name, make_run, warmup + steps, replace_dashboard=progress is not None
        ),
        modes,
        steps,
        warmup,
        block=block,
        progress=progress,
        on_result=on_result,
        metric_name=metric_name,
    )


class _BuiltRun:
    """A mode's run as ``make_run`` builds it: its fits continue one another, turn after turn."""

    def __init__(
        self, name: str, make_run: MakeRun, total_steps: int, replace_dashboard: bool
    ) -> None:
        self.name, self.make_run, self.total_steps = name, make_run, total_steps
        self.replace_dashboard = replace_dashboard
        self.trainer: Any = None
        self.fitted = False

    def advance(self, steps: int, sink: Sink | None) -> int:
        if self.trainer is None:
            self.trainer, self.data, self.metric = built_run(self.make_run, self.name)
        if steps == 0 or (self.fitted and (not self.trainer.resumable or self.trainer.stopped)):
            return 0
        trainer, data = self.trainer, self.data
        epochs = (
            None if self.fitted else epochs_holding(data, self.total_steps * trainer.amp.accumulate)
        )
        own_dashboard = trainer.dashboard
        if self.replace_dashboard:
            trainer.dashboard = sink
        before = trainer.amp.steps
        try:
            self.fitted = True
            trainer.fit(data, epochs=epochs, max_steps=steps)
        finally:
            trainer.dashboard = own_dashboard
        return trainer.amp.steps - before

    def result(self, warmup: int) -> ModeResult:
        metric = self.metric
        measure = None if metric is None else (lambda: metric(self.trainer))
        return mode_result(self.name, self.trainer, warmup, measure, self._memory)

    def _memory(self) -> MemoryAccount | None:
        """The account of the run's step on its data's first batch, read again without changing
        the random state (a DataLoader's iterator draws a seed); None for a one-shot iterator,
        whose batches are used up."""
        if isinstance(self.data, Iterator):
            return None
        with kept_random_state(self.trainer.device.type):
            return account_step(self.trainer, first_batch(self.data))
