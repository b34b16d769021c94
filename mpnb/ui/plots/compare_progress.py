"""Progress of a comparison while it runs: overlaid live curves in a notebook, a bar per mode elsewhere.

:class:`LiveComparison` draws every mode's curves into one FigureWidget (the report's panels)
as the modes train in turns, one colour and line style per mode, so the curves overlay as
they arrive; the table appears under the plot when the last mode ends.
:class:`TextComparison` prints each mode's progress bar as its turn runs (rewritten in place
on a terminal, a line every few seconds in a log), and a line as each mode ends.

Example:
    >>> import io
    >>> from mpnb.training.history import History
    >>> out = io.StringIO()
    >>> view = TextComparison(["bf16"], interval=0, stream=out)
    >>> h = History()
    >>> h.extend({"step": [1, 2], "loss": [0.9, 0.7], "step_time": [0.02, 0.01]})
    >>> view.sink_for("bf16", 4, warmup=1).update(h)
    >>> out.getvalue().splitlines()[-1]
    'bf16  [##########----------]    2/4 steps  10.0 ms/step  loss 0.7'
"""

from __future__ import annotations

import html
import math
import statistics
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from mpnb.analysis.comparison import Comparison, ComparisonProgress, ModeResult
from mpnb.precision.modes import reference_name
from mpnb.training.history import History
from mpnb.training.telemetry import Sink
from mpnb.ui.plots.pacing import PacedPlot

__all__: list[str] = []

_BAR_WIDTH = 20


def make_comparison_progress(
    kind: str, modes: Sequence[str], title: str = ""
) -> ComparisonProgress:
    """The view for ``kind`` (``"auto"``, ``"live"``, ``"text"``); a live one is displayed now."""
    from mpnb.ui.environment import display_kind

    if display_kind(kind, "comparison") == "text":
        return TextComparison(modes)
    from IPython.display import display

    view = LiveComparison(modes, title)
    display(view.widget)
    return view


#: The steps the bar's rate is the median of: the latest, the first step left out.
_RATE_STEPS = 10


def _latest(history: History) -> tuple[int, str, float]:
    """The latest step, its rate as the bar says it and its loss. The first step warms up
    (kernels chosen, caches filled: tens of times a step after it on a first run) and is said
    as that; the rate after it is the median of the latest steps past the first."""
    last = len(history) - 1
    if last == 0:
        rate = f"first step {history.step_time[0] * 1e3:.1f} ms"
    else:
        recent = sorted(history.step_time[max(1, last + 1 - _RATE_STEPS) :])
        rate = f"{statistics.median(recent) * 1e3:.1f} ms/step"
    return history.step[last], rate, history.loss[last]


class TextComparison(ComparisonProgress):
    """A progress bar per mode, and a line when each mode ends.

    Args:
        modes: the modes in the order they run (for aligned names).
        interval: seconds between lines when the stream is not a terminal.
        stream: where to print (stdout).
    """

    def __init__(
        self, modes: Sequence[str], *, interval: float = 2.0, stream: TextIO | None = None
    ) -> None:
        self.width = max((len(mode) for mode in modes), default=4)
        self.interval, self.stream = interval, stream
        self.bar_shown = False  # a bar is on the terminal's current line (rewritten in place)

    def _out(self) -> TextIO:
        return self.stream or sys.stdout

    def sink_for(self, mode: str, steps: int, warmup: int = 0) -> Sink:
        return _TextBar(self, mode, steps)

    def finished(self, result: ModeResult) -> None:
        name = result.mode.ljust(self.width)
        if result.skipped_reason:
            line = f"{name}  not run: {result.skipped_reason}"
        else:
            line = f"{name}  done: {len(result.history)} steps, median {result.median_step_s * 1e3:.1f} ms/step"
        if self.bar_shown:  # end the bar's line first
            print(file=self._out())
            self.bar_shown = False
        print(line, file=self._out(), flush=True)


class _TextBar(Sink):
    def __init__(self, view: TextComparison, mode: str, steps: int) -> None:
        self.view, self.mode, self.steps = view, mode, steps
        self.tty = bool(getattr(view._out(), "isatty", lambda: False)())
        self._last = -math.inf

    def due(self, now: float) -> bool:
        return self.tty or now - self._last >= self.view.interval

    def update(self, history: History) -> None:
        now = time.perf_counter()
        if len(history) and self.due(now):
            self._last = now
            self._show(history)

    def close(self, history: History) -> None:
        """The end of a turn: a terminal's bar shows where the mode got (the modes' bars share the line)."""
        if self.tty and len(history):
            self._show(history)

    def _show(self, history: History) -> None:
        step, rate, loss = _latest(history)
        filled = min(_BAR_WIDTH, round(_BAR_WIDTH * step / self.steps))
        line = (
            f"{self.mode.ljust(self.view.width)}  [{'#' * filled}{'-' * (_BAR_WIDTH - filled)}]  "
            f"{step:>{len(str(self.steps))}}/{self.steps} steps  {rate}  loss {loss:.4g}"
        )
        print(
            f"\r{line}" if self.tty else line,
            end="" if self.tty else "\n",
            file=self.view._out(),
            flush=True,
        )
        self.view.bar_shown = self.tty


class LiveComparison(ComparisonProgress):
    """Every mode's curves overlaid in one FigureWidget, drawn while the modes train.

    The panels are those of the report (:func:`~mpnb.ui.plots.compare_report.empty_comparison_figure`).
    The modes train in interleaved turns, so all their curves grow together.

    Args:
        modes: one group of traces per mode, in this order.
        title: shown above the plot.
        min_interval, max_share: redraw pacing (see :class:`~mpnb.ui.plots.pacing.RedrawPacer`).
        max_points: points per line in one redraw (streaming min/max decimation).
        show_table: put the comparison table under the plot when the last mode ends.

    Attributes:
        widget: status line, figure and (at the end) the table; display it to see it.
        figure: the FigureWidget; mode ``i``'s traces start at ``i * len(MODE_TRACES)``.
    """

    def __init__(
        self,
        modes: Sequence[str],
        title: str = "",
        *,
        min_interval: float = 0.25,
        max_share: float = 0.01,
        max_points: int = 500,
        show_table: bool = True,
    ) -> None:
        import ipywidgets as widgets
        import plotly.graph_objects as go

        from mpnb.ui.plots.compare_report import empty_comparison_figure

        self.figure = go.FigureWidget(empty_comparison_figure(modes, title))
        self.modes = list(modes)
        self.pacing = {
            "min_interval": min_interval,
            "max_share": max_share,
            "max_points": max_points,
        }
        self.status = widgets.HTML()
        self.table = widgets.HTML()
        self.shows_table = show_table
        self.widget = widgets.VBox([self.status, self.figure, self.table])
        self.lines: dict[str, _LiveLines] = {}

    def sink_for(self, mode: str, steps: int, warmup: int = 0) -> Sink:
        from mpnb.ui.plots.compare_report import MODE_TRACES

        self.status.value = f"training {', '.join(self.modes)} in turns ({steps} steps each)"
        first = self.modes.index(mode) * len(MODE_TRACES)
        self.lines[mode] = _LiveLines(self, self.figure, first, warmup, **self.pacing)
        return self.lines[mode]

    def baseline(self) -> History | None:
        """fp32's history so far, for the other modes' loss difference."""
        reference = self.lines.get(reference_name())
        return reference.history if reference is not None else None

    def finished(self, result: ModeResult) -> None:
        if result.skipped_reason:
            self.status.value = (
                f"{html.escape(result.mode)} not run: {html.escape(result.skipped_reason)}"
            )

    def close(self, comparison: Comparison) -> None:
        ran = sum(result.history is not None for result in comparison.results)
        self.status.value = f"done: {ran} of {len(comparison.results)} mode(s) ran"
        if self.shows_table:
            self.table.value = comparison._repr_html_()


class _LiveLines(PacedPlot):
    """One mode's traces in a :class:`LiveComparison` figure, fed as its rows arrive."""

    def __init__(
        self,
        view: LiveComparison,
        figure,
        first_trace: int,
        warmup: int,
        *,
        min_interval: float,
        max_share: float,
        max_points: int,
    ) -> None:
        from mpnb.ui.plots.compare_report import MODE_TRACES
        from mpnb.ui.plots.decimate import MinMaxSeries

        super().__init__(min_interval, max_share)
        self.view, self.figure = view, figure
        self.names = list(MODE_TRACES)
        self.traces = list(range(first_trace, first_trace + len(self.names)))
        self.series = {
            name: MinMaxSeries(max_points) for name in self.names if name != "skipped step"
        }
        self.skipped: tuple[list[float], list[float]] = ([], [])
        self.history: History | None = None
        self._seen, self._diff_seen, self.warmup = 0, 0, warmup

    def _ingest(self, history: History) -> None:
        from mpnb.ui.plots.compare_report import loss_difference, mode_points

        self.history = history
        points = mode_points(history, self.warmup, None, self._seen)
        for name, (xs, ys) in points.items():
            if name == "skipped step":
                self.skipped[0].extend(xs)
                self.skipped[1].extend(ys)
            elif name != "loss - fp32":
                self.series[name].extend(xs, ys)
        self._seen = len(history)
        baseline = self.view.baseline()
        if baseline is not None and baseline is not history:
            xs, ys = loss_difference(history, baseline, self._diff_seen)
            self.series["loss - fp32"].extend(xs, ys)
            self._diff_seen += len(xs)

    def _draw(self) -> None:
        drawn = [
            self.skipped if name == "skipped step" else self.series[name].points()
            for name in self.names
        ]
        self.figure.plotly_restyle(
            {"x": [xs for xs, _ in drawn], "y": [ys for _, ys in drawn]}, trace_indexes=self.traces
        )
