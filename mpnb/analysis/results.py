"""What a comparison found, per mode: timings with their spread, memory, loss, and the table.

:class:`ModeResult` holds one mode's run (its history, which rows were timed turns) and the
memory measured in its own turns; :class:`Comparison` holds them all and renders the table
(text, HTML, CSV, JSON). Timing statistics come from :mod:`mpnb.analysis.timing`.

Example:
    >>> from mpnb.training.history import History
    >>> def result(mode, times):
    ...     h = History()
    ...     h.extend({"step": list(range(1, 7)), "loss": [1.0] * 6, "step_time": times})
    ...     return ModeResult(mode, h, blocks=[(0, 2), (2, 4), (4, 6)])
    >>> fp32 = result("fp32", [0.020, 0.021, 0.020, 0.022, 0.021, 0.020])
    >>> bf16 = result("bf16", [0.010, 0.011, 0.010, 0.011, 0.010, 0.010])
    >>> row = Comparison([fp32, bf16], steps=6, warmup=0).rows()[1]
    >>> round(row["speedup_vs_fp32"], 1), row["speedup_verdict"], round(row["step_time_iqr_s"] * 1e3, 2)
    (2.0, 'faster', 0.75)
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
import textwrap
from typing import Any

from mpnb._files import atomic_write
from mpnb._render import csv_cell, html_list, html_table, text_notes, text_table
from mpnb.analysis.memory import CATEGORIES, MemoryAccount, MemoryReport
from mpnb.analysis.timing import NO_SPEEDUP, Speedup, StepTimeStats, speedup_over, step_time_stats
from mpnb.precision.backends import format_bytes
from mpnb.precision.modes import parse_mode, reference_name
from mpnb.precision.modes.base import EMULATED, NO_EFFECT
from mpnb.training.history import History

__all__ = ["Comparison", "ModeResult"]

_COLUMNS = (
    "mode",
    "median step (ms)",
    "IQR (ms)",
    "speedup vs fp32",
    "samples/s",
    "peak memory of the run",
    "added by training",
    "final loss",
    "metric",
    "skipped steps",
    "note",
)
#: The terminal's headers, on two lines where a header is longer than its cells (no note column:
#: the notes are said once each, under the table).
_TEXT_HEADERS = {
    "median step (ms)": "median\nstep (ms)",
    "IQR (ms)": "IQR\n(ms)",
    "speedup vs fp32": "speedup\nvs fp32",
    "peak memory of the run": "peak memory\nof the run",
    "added by training": "added by\ntraining",
    "final loss": "final\nloss",
    "skipped steps": "skipped\nsteps",
}


@dataclasses.dataclass
class ModeResult:
    """One mode's run, or why it did not run.

    Attributes:
        mode: the mode's name.
        history: the run's history (None when the mode was skipped).
        timed_from: index of the first timed row (after warm-up).
        metric: what the run's metric returned, or NaN.
        skipped_reason: why the mode did not run, or None.
        notes: what the reader should know (fp16 convolutions on a CPU are slow...).
        blocks: the history rows ``(start, stop)`` of each timed turn, round by round
            (one block of all timed rows when the mode ran on its own).
        peak_memory: the most memory in use during the mode's own timed turns (bytes; NaN
            where the device cannot say).
        added_memory: the most the run added over the memory in use when one of its timed
            turns began: what training steps in this mode cost on top of the state kept
            between steps (weights, optimizer state).
        verdict: what the mode's speedup column says instead of a figure, from the mode
            (:meth:`~mpnb.precision.modes.base.Mode.compare_verdict`): ``"no effect on this
            hardware"`` (tf32 where fp32 math stays exact: its speedup is only noise), or
            ``"emulated: ..."`` (fp8 on a CPU: its step time measures the emulation, so no
            speedup is reported); empty for a real figure.

    Example:
        >>> from mpnb.training.history import History
        >>> history = History()
        >>> history.extend({"step": [1, 2, 3, 4], "loss": [1.0, 0.8, 0.6, 0.5],
        ...                 "step_time": [0.5, 0.020, 0.021, 0.019]})
        >>> bf16 = ModeResult("bf16", history, timed_from=1)
        >>> bf16.median_step_s, bf16.summary()["timed_steps"], bf16.summary()["final_loss"]
        (0.02, 3, 0.5)
        >>> ModeResult("fp16", skipped_reason="no fp16 here").summary()["timed_steps"]
        0
    """

    mode: str
    history: History | None = None
    timed_from: int = 0
    metric: float = math.nan
    skipped_reason: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    blocks: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    peak_memory: float = math.nan
    added_memory: float = math.nan
    verdict: str = ""
    memory: MemoryAccount | None = None

    def block_times(self) -> list[list[float]]:
        """The timed step times (seconds), one list per turn, of :attr:`timed_size` steps."""
        if self.history is None:
            return []
        times = self.history.step_time
        return [[times[i] for i in rows] for rows in self._rows_of_timed_size()]

    def times_of(self, size: int | None) -> list[list[float]]:
        """The timed step times, one list per turn: of steps of ``size`` samples (and of unknown
        size) only, or of every step for None."""
        if self.history is None:
            return []
        times = self.history.step_time
        return [[times[i] for i in rows] for rows in self._timed_rows(self._sizes(), size)]

    @property
    def timed_size(self) -> int | None:
        """The samples of the steps that are timed, or None when every step is (see :func:`_full_size`)."""
        return None if self.history is None else self._timed_size(self._sizes())

    def _timed_size(self, sizes: list[int | None]) -> int | None:
        return _full_size(sizes, self._timed_rows(sizes, None))

    def _rows_of_timed_size(self) -> list[list[int]]:
        """Each timed turn's rows of :attr:`timed_size` (reading the sizes once)."""
        sizes = self._sizes()
        return self._timed_rows(sizes, self._timed_size(sizes))

    def _timed_rows(self, sizes: list[int | None], size: int | None) -> list[list[int]]:
        """Each timed turn's rows: those of ``size`` samples (and of unknown size), or all for None."""
        blocks = self.blocks or [(self.timed_from, len(sizes))]
        return [
            [i for i in range(start, stop) if size is None or sizes[i] in (size, None)]
            for start, stop in blocks
        ]

    def _sizes(self) -> list[int | None]:
        """Each row's samples, from its throughput and time (None where either is unknown)."""
        assert self.history is not None
        pairs = zip(self.history.samples_per_s, self.history.step_time)
        return [round(rate * time) if math.isfinite(rate * time) else None for rate, time in pairs]

    @property
    def step_times(self) -> StepTimeStats:
        """Median and interquartile range of the timed steps."""
        return step_time_stats([t for block in self.block_times() for t in block])

    @property
    def median_step_s(self) -> float:
        return self.step_times.median_s

    @property
    def samples_per_s(self) -> float:
        """The median throughput of the timed steps."""
        if self.history is None:
            return math.nan
        rates = self.history.samples_per_s
        timed = [
            rates[i] for rows in self._rows_of_timed_size() for i in rows if math.isfinite(rates[i])
        ]
        return statistics.median(timed) if timed else math.nan

    def summary(self) -> dict[str, Any]:
        """The numbers of the table row, unformatted."""
        base = self.history.summary() if self.history else {}
        times = self.step_times
        warning = times.spread_warning
        return {
            "mode": self.mode,
            "median_step_s": times.median_s,
            "step_time_iqr_s": times.iqr_s,
            "timed_steps": times.count,
            "samples_per_s": self.samples_per_s,
            "peak_memory": self.peak_memory,
            "added_memory": self.added_memory,
            "final_loss": base.get("final_loss", math.nan),
            "metric": self.metric,
            "skipped_steps": base.get("skipped", 0),
            "skipped_reason": self.skipped_reason,
            "notes": [*self.notes, warning] if warning else list(self.notes),
            **{
                f"memory {category}": self.memory.categories.get(category, 0)
                if self.memory
                else math.nan
                for category in CATEGORIES
            },
        }


def _full_size(sizes: list[int | None], timed_rows: list[list[int]]) -> int | None:
    """The size of the steps to time, or None to time every step. An epoch's short last batch or
    accumulation window is a quicker step of less work, which would read as spread: where the full
    size (the largest) is that of at least half the timed steps of known size, only full steps are
    timed. Where sizes vary more (bucketed lengths) or are unknown, every step is."""
    known = [sizes[i] for rows in timed_rows for i in rows if sizes[i] is not None]
    largest = max(known, default=None)
    return largest if largest is not None and 2 * known.count(largest) >= len(known) else None


@dataclasses.dataclass
class Comparison:
    """The results of a comparison, one per mode, in the order asked for.

    Attributes:
        results: one :class:`ModeResult` per mode.
        steps: timed steps per mode.
        warmup: untimed steps per mode.
        metric_name: the table's name for the metric column.
        block: timed steps per turn (``block >= steps``: the modes ran one after another).

    Example:
        >>> from mpnb.training.history import History
        >>> def result(mode, seconds):
        ...     history = History()
        ...     history.extend({"step": [1, 2, 3, 4], "loss": [1.0] * 4, "step_time": [seconds] * 4})
        ...     return ModeResult(mode, history, blocks=[(0, 2), (2, 4)])
        >>> skipped = ModeResult("fp16", skipped_reason="no fp16 here")
        >>> comparison = Comparison([result("fp32", 0.04), result("bf16", 0.02), skipped], 4, 0)
        >>> comparison.speedup("bf16").median, comparison.result("fp16").skipped_reason
        (2.0, 'no fp16 here')
        >>> [row["mode"] for row in comparison.rows()]
        ['fp32', 'bf16', 'fp16']
    """

    results: list[ModeResult]
    steps: int
    warmup: int
    metric_name: str = "metric"
    block: int = 0

    def result(self, mode: str) -> ModeResult:
        """The result of one mode."""
        name = parse_mode(mode).label
        found = next((r for r in self.results if r.mode == name), None)
        if found is None:
            raise KeyError(
                f"mode {name!r} was not compared; this comparison has {[r.mode for r in self.results]}"
            )
        return found

    def speedup(self, mode: str) -> Speedup:
        """``mode``'s speedup over fp32, with the quartiles of its per-round ratios."""
        baseline, result = self._baseline(), self.result(mode)
        if baseline is None or result.history is None:
            return NO_SPEEDUP
        baseline_size, result_size = baseline.timed_size, result.timed_size
        size = (
            baseline_size if baseline_size == result_size else None
        )  # the same work on both sides
        return speedup_over(baseline.times_of(size), result.times_of(size))

    def _baseline(self) -> ModeResult | None:
        """The reference mode's run (fp32), when it ran."""
        return next((r for r in self.results if r.mode == reference_name() and r.history), None)

    def rows(self) -> list[dict[str, Any]]:
        """Per mode: the numbers, with the speedup over fp32 and its interval (NaN without an fp32 run)."""
        rows = []
        for result in self.results:
            row = result.summary()
            speedup = self.speedup(result.mode)
            verdict = speedup.verdict
            if result is self._baseline() or not result.history:
                verdict = ""
            elif result.verdict:
                verdict = result.verdict
            if verdict == EMULATED:
                speedup = NO_SPEEDUP
            row.update(
                speedup_vs_fp32=speedup.median,
                speedup_low=speedup.low,
                speedup_high=speedup.high,
                speedup_verdict=verdict,
            )
            rows.append(row)
        return rows

    def _table(self) -> list[list[str]]:
        table = []
        for result, row in zip(self.results, self.rows(), strict=True):
            if row["skipped_reason"]:
                table.append(
                    [row["mode"], *["-"] * (len(_COLUMNS) - 2), f"not run: {row['skipped_reason']}"]
                )
                continue
            table.append(
                [
                    row["mode"],
                    _number(row["median_step_s"] * 1e3, "{:.2f}"),
                    _number(row["step_time_iqr_s"] * 1e3, "{:.2f}"),
                    _speedup_text(row),
                    _number(row["samples_per_s"], "{:.0f}"),
                    _bytes(row["peak_memory"]),
                    _bytes(row["added_memory"]),
                    # a diverged run's last loss reads nan or inf; "-" where no loss was read
                    _number(
                        row["final_loss"], "{:.4g}", nan="nan" if _read_a_loss(result) else "-"
                    ),
                    _number(row["metric"], "{:.4g}"),  # NaN: no metric, or none measured
                    str(row["skipped_steps"]),
                    "; ".join(row["notes"]),
                ]
            )
        return table

    def _columns(self) -> list[str]:
        return [self.metric_name if column == "metric" else column for column in _COLUMNS]

    def memory_report(self) -> MemoryReport:
        """Each mode's memory account, by category (modes without one are left out)."""
        return MemoryReport([r.memory for r in self.results if r.memory is not None], {})

    def _text_table(self) -> str:
        """The table for a terminal: under 120 columns (two-line headers, no note column), then
        each note once, with the modes it concerns (none named when it concerns every mode).
        HTML, CSV and JSON keep every column and each row's own notes."""
        headers = [
            _TEXT_HEADERS.get(column, column) for column in _COLUMNS[:-1] if column != "metric"
        ]
        metric = self.metric_name  # on the headers' last line, beside "mode", unless long
        headers.insert(
            _COLUMNS.index("metric"),
            metric if len(metric) <= 16 else "\n".join(textwrap.wrap(metric, 16, max_lines=2)),
        )
        table, notes, spreads = [], {}, []
        for result, row, cells in zip(self.results, self.rows(), self._table()):
            if row["skipped_reason"]:
                table.append(cells[:-1])
                notes.setdefault(f"not run: {row['skipped_reason']}", []).append(row["mode"])
                continue
            verdict = row["speedup_verdict"]
            if verdict in (NO_EFFECT, EMULATED, "no clear difference"):
                speedup = "-" if verdict in (NO_EFFECT, EMULATED) else _interval_text(row)
                explained = "no clear difference from fp32 (its interval holds 1.00x)"
                said = verdict == EMULATED and any("emulated" in n for n in result.notes)
                if not said:  # the mode's own note says it is emulated, and why
                    notes.setdefault(
                        explained if verdict == "no clear difference" else verdict, []
                    ).append(row["mode"])
                cells = [*cells[:3], speedup, *cells[4:]]
            table.append(cells[:-1])
            for note in result.notes:
                notes.setdefault(note, []).append(row["mode"])
            if result.step_times.spread_warning:
                spreads.append(f"{result.step_times.relative_spread:.0%} {row['mode']}")
        if spreads:
            notes[_spread_note(spreads)] = [row["mode"] for row in self.rows()]
        text = text_table(headers, table)
        everyone = [row["mode"] for row in self.rows()]
        lines = [
            note if modes == everyone else f"{', '.join(modes)}: {note}"
            for note, modes in notes.items()
        ]
        return f"{text}\n\nnotes:\n{text_notes(lines)}" if lines else text

    def __str__(self) -> str:
        text = self._text_table()
        memory = self.memory_report()
        if memory.accounts:
            text += f"\n\n{_MEMORY_TITLE}:\n{text_table(memory.headers(), memory.table())}"
            text += f"\n{text_notes(memory.notes())}"
        return text

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        page = html_table(self._columns(), self._table())
        memory = self.memory_report()
        if memory.accounts:
            page += f"<p>{_MEMORY_TITLE}:</p>{html_table(memory.headers(), memory.table())}"
            page += html_list(memory.notes(), "mpnb-notes")
        return page

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the rows as JSON (NaN and infinities as null: strict JSON has neither).

        The file is replaced whole, never written through a link (see :func:`mpnb._files.atomic_write`).
        """
        rows = [
            {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in r.items()
            }
            for r in self.rows()
        ]
        with atomic_write(path) as file:
            json.dump(
                {"steps": self.steps, "warmup": self.warmup, "block": self.block, "modes": rows},
                file,
                indent=2,
            )

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write the rows as CSV, each text as a spreadsheet shows it and never runs it (a skip
        reason starting with ``=`` is no formula). The file is replaced whole, never written
        through a link (see :func:`mpnb._files.atomic_write`)."""
        rows = self.rows()
        with atomic_write(path, newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]) if rows else ["mode"])
            writer.writeheader()
            for row in rows:
                cells = {**row, "notes": "; ".join(row["notes"])}
                writer.writerow({name: csv_cell(value) for name, value in cells.items()})


_MEMORY_TITLE = "memory of a step, by category (counted on each mode's first batch)"


def _number(value: float, pattern: str, *, nan: str = "-") -> str:
    """A table cell: ``value`` by ``pattern``; an infinity as ``inf`` / ``-inf``, as the CSV
    holds it; NaN as ``nan`` (the mark of no value by default).

    >>> _number(0.25, "{:.2f}"), _number(float("-inf"), "{:.2f}"), _number(float("nan"), "{:.2f}")
    ('0.25', '-inf', '-')
    """
    if not isinstance(value, (int, float)):
        return "-"
    if math.isnan(value):
        return nan
    return pattern.format(value) if math.isfinite(value) else str(value)


def _read_a_loss(result: ModeResult) -> bool:
    """Whether ``result``'s run recorded a step whose loss was read (its final loss is one)."""
    history = result.history
    return bool(history) and not all(history.loss_missing)


def _bytes(value: float) -> str:
    return format_bytes(value) if math.isfinite(value) else "-"


def _spread_note(spreads: list[str]) -> str:
    """The step-time spread warning, once for every mode it concerns."""
    return (
        f"step times spread (IQR/median) {', '.join(spreads)}: other load on the machine is the "
        "likely cause; more steps (steps=, --steps) narrow it"
    )


def _interval_text(row: dict[str, Any]) -> str:
    """``"1.02x (0.97-1.08)"``."""
    return f"{row['speedup_vs_fp32']:.2f}x ({row['speedup_low']:.2f}-{row['speedup_high']:.2f})"


def _speedup_text(row: dict[str, Any]) -> str:
    """``"1.32x (1.25-1.40)"``, ``"1.02x: no clear difference (0.97-1.08)"`` or ``"no effect on this hardware"``."""
    verdict, median = row["speedup_verdict"], row["speedup_vs_fp32"]
    if verdict in (NO_EFFECT, EMULATED) or not math.isfinite(median):
        return verdict or "-"
    text = f"{median:.2f}x"
    if verdict == "no clear difference":
        text += f": {verdict}"
    if verdict:
        text += f" ({row['speedup_low']:.2f}-{row['speedup_high']:.2f})"
    return text
