"""The same experiment in several precision modes, side by side.

``compare(make_run, modes)`` builds a fresh run per mode with ``make_run(mode)`` (same model,
data and seed each time), trains it for ``warmup + steps`` optimizer steps, and reports per
mode the median step time over the timed steps, the speedup over fp32, throughput, peak
memory, final loss, an optional metric, and skipped steps. A mode the device cannot run is
listed with the reason, never dropped.

Example:
    >>> import mpnb.examples as ex
    >>> def make_run(mode):
    ...     trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)
    ...     return trainer, train
    >>> result = compare(make_run, modes=["fp32", "bf16"], steps=3, warmup=1, progress=None)
    >>> [row["mode"] for row in result.rows()], result.results[1].history.mode[-1]
    (['fp32', 'bf16'], 'bf16')
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from mpnb import views
from mpnb._render import html_table, text_table
from mpnb.errors import MpnbError
from mpnb.precision.backends import backend_for, format_bytes
from mpnb.precision.modes import parse_mode
from mpnb.training.control import refuse_inside_a_fit
from mpnb.training.history import History
from mpnb.training.telemetry import Sink

__all__ = ["Comparison", "ComparisonProgress", "ModeResult", "compare", "compare_runs", "mode_result"]

#: ``make_run(mode)`` returns ``(trainer, train_data)`` or ``(trainer, train_data, metric)``,
#: where ``metric(trainer) -> float`` is measured after training (test accuracy, say).
MakeRun = Callable[[str], Sequence[Any]]

_COLUMNS = (
    "mode",
    "median step (ms)",
    "speedup vs fp32",
    "samples/s",
    "peak memory",
    "final loss",
    "metric",
    "skipped steps",
    "note",
)


@dataclasses.dataclass
class ModeResult:
    """One mode's run, or why it did not run.

    Attributes:
        mode: the mode's name.
        history: the run's history (None when the mode was skipped).
        timed_from: index of the first timed row (after warm-up).
        metric: what ``make_run``'s metric returned, or NaN.
        skipped_reason: why the mode did not run, or None.
        notes: what the reader should know (fp16 convolutions on a CPU are slow...).
    """

    mode: str
    history: History | None = None
    timed_from: int = 0
    metric: float = math.nan
    skipped_reason: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def median_step_s(self) -> float:
        times = self.history.step_time[self.timed_from :] if self.history else []
        return statistics.median(times) if times else math.nan

    @property
    def samples_per_s(self) -> float:
        rates = [v for v in (self.history.samples_per_s[self.timed_from :] if self.history else []) if math.isfinite(v)]
        return statistics.median(rates) if rates else math.nan

    def summary(self) -> dict[str, Any]:
        """The numbers of the table row, unformatted."""
        base = self.history.summary() if self.history else {}
        return {
            "mode": self.mode,
            "median_step_s": self.median_step_s,
            "samples_per_s": self.samples_per_s,
            "peak_memory": base.get("peak_memory", math.nan),
            "final_loss": base.get("final_loss", math.nan),
            "metric": self.metric,
            "skipped_steps": base.get("skipped", 0),
            "skipped_reason": self.skipped_reason,
            "notes": list(self.notes),
        }


@dataclasses.dataclass
class Comparison:
    """The results of :func:`compare`, one per mode, in the order asked for."""

    results: list[ModeResult]
    steps: int
    warmup: int
    metric_name: str = "metric"

    def result(self, mode: str) -> ModeResult:
        """The result of one mode."""
        name = parse_mode(mode).value
        return next(r for r in self.results if r.mode == name)

    def rows(self) -> list[dict[str, Any]]:
        """Per mode: the numbers, with the speedup over fp32 (NaN without an fp32 run)."""
        baseline = next((r.median_step_s for r in self.results if r.mode == "fp32" and r.history), math.nan)
        rows = []
        for result in self.results:
            row = result.summary()
            row["speedup_vs_fp32"] = baseline / row["median_step_s"] if result.history else math.nan
            rows.append(row)
        return rows

    def _table(self) -> list[list[str]]:
        table = []
        for row in self.rows():
            if row["skipped_reason"]:
                table.append([row["mode"], *["-"] * 7, f"not run: {row['skipped_reason']}"])
                continue
            table.append(
                [
                    row["mode"],
                    f"{row['median_step_s'] * 1e3:.2f}",
                    _number(row["speedup_vs_fp32"], "{:.2f}x"),
                    _number(row["samples_per_s"], "{:.0f}"),
                    format_bytes(row["peak_memory"]),
                    _number(row["final_loss"], "{:.4g}"),
                    _number(row["metric"], "{:.4g}"),
                    str(row["skipped_steps"]),
                    "; ".join(row["notes"]),
                ]
            )
        return table

    def _columns(self) -> list[str]:
        return [self.metric_name if column == "metric" else column for column in _COLUMNS]

    def __str__(self) -> str:
        return text_table(self._columns(), self._table())

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return html_table(self._columns(), self._table())

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the rows as JSON (NaN as null)."""
        rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in self.rows()]
        with open(path, "w", encoding="utf-8") as file:
            json.dump({"steps": self.steps, "warmup": self.warmup, "modes": rows}, file, indent=2)

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write the rows as CSV."""
        rows = self.rows()
        with open(path, "w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]) if rows else ["mode"])
            writer.writeheader()
            for row in rows:
                writer.writerow({**row, "notes": "; ".join(row["notes"])})


def _number(value: float, pattern: str) -> str:
    return pattern.format(value) if isinstance(value, (int, float)) and math.isfinite(value) else "-"


class ComparisonProgress:
    """How :func:`compare` shows its progress; this base class shows nothing.

    ``sink_for(mode, steps, warmup)`` gives the telemetry sink that watches one mode's run
    of ``steps`` steps, the first ``warmup`` of them untimed;
    ``finished(result)`` hears each mode's end, ``close(comparison)`` the whole result.
    """

    def sink_for(self, mode: str, steps: int, warmup: int = 0) -> Sink | None:
        return None

    def finished(self, result: ModeResult) -> None:
        pass

    def close(self, comparison: Comparison) -> None:
        pass


def _progress_view(progress: str | ComparisonProgress | None, modes: list[str], title: str) -> ComparisonProgress:
    if progress is None:
        return ComparisonProgress()
    if isinstance(progress, ComparisonProgress):
        return progress
    return views.view("comparison_progress")(progress, modes, title)


def _notes(mode: str, trainer: Any) -> list[str]:
    has_convolutions = any(isinstance(m, nn.modules.conv._ConvNd) for m in trainer.model.modules())
    if mode == "fp16" and trainer.device.type == "cpu" and has_convolutions:
        return ["fp16 convolutions have no fast CPU kernels: expect this to be slow"]
    backend = backend_for(trainer.device)
    if mode == "tf32" and not backend.has_fast_fp32_math():
        return [f"tf32: {backend.describe_reduced_fp32_math()}"]
    return []


def mode_result(name: str, trainer: Any, warmup: int, metric: float = math.nan) -> ModeResult:
    """The result of a finished run: ``trainer``'s history with the first ``warmup`` steps untimed."""
    history = trainer.history
    return ModeResult(
        name, history, timed_from=min(warmup, max(len(history) - 1, 0)), metric=metric, notes=_notes(name, trainer)
    )


#: ``run_mode(mode, sink)`` trains one mode, showing progress in ``sink``, and returns its result;
#: an :class:`~mpnb.errors.MpnbError` means the mode cannot run here.
RunMode = Callable[[str, "Sink | None"], ModeResult]


def compare_runs(
    run_mode: RunMode,
    modes: Iterable[str],
    steps: int,
    warmup: int,
    *,
    progress: str | ComparisonProgress | None = "auto",
    on_result: Callable[[ModeResult], None] | None = None,
    metric_name: str = "metric",
    title: str = "",
) -> Comparison:
    """The loop behind :func:`compare` and ``%%compare``: check every mode, run each, collect.

    Raises:
        InvalidChoiceError: an unknown mode name.
        ValueError: steps < 1 or warmup < 0.
        MpnbError: a fit is running on this thread (a comparison started from a widget during it).
    """
    refuse_inside_a_fit("a comparison")
    names = [parse_mode(mode).value for mode in modes]
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    view = _progress_view(progress, names, title)
    results = []
    for name in names:
        try:
            result = run_mode(name, view.sink_for(name, warmup + steps, warmup))
        except MpnbError as error:
            result = ModeResult(name, skipped_reason=str(error))
        results.append(result)
        view.finished(result)
        if on_result is not None:
            on_result(result)
    comparison = Comparison(results, steps, warmup, metric_name)
    view.close(comparison)
    return comparison


def compare(
    make_run: MakeRun,
    modes: Iterable[str] = ("fp32", "tf32", "fp16", "bf16"),
    steps: int = 200,
    warmup: int = 5,
    *,
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
        progress: ``"auto"`` (live overlaid curves in a notebook, a progress line per mode
            elsewhere), ``"live"``, ``"text"``, a :class:`ComparisonProgress`, or None to
            leave each run's own dashboard in charge.
        on_result: called after each mode.
        metric_name: the table's name for the metric column.

    Raises:
        InvalidChoiceError: an unknown mode name.
        ValueError: steps < 1 or warmup < 0.
    """

    def run_mode(name: str, sink: Sink | None) -> ModeResult:
        trainer, data, *metric = make_run(name)
        return _run(name, trainer, data, metric[0] if metric else None, steps, warmup, sink, progress is not None)

    return compare_runs(run_mode, modes, steps, warmup, progress=progress, on_result=on_result, metric_name=metric_name)


def _run(
    name: str,
    trainer: Any,
    data: Any,
    metric: Callable | None,
    steps: int,
    warmup: int,
    sink: Sink | None,
    replace_dashboard: bool,
) -> ModeResult:
    total = warmup + steps
    epochs = math.ceil(total / len(data)) if hasattr(data, "__len__") and len(data) else None
    own_dashboard = trainer.dashboard
    if replace_dashboard:
        trainer.dashboard = sink
    try:
        trainer.fit(data, epochs=epochs, max_steps=total)
    finally:
        trainer.dashboard = own_dashboard
    return mode_result(name, trainer, warmup, float(metric(trainer)) if metric is not None else math.nan)
