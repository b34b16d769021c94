"""A comparison across modes as a figure and as a self-contained HTML report.

The figure overlays the modes in five panels that share one legend (a click on a mode hides
it everywhere): loss, and its difference from fp32's loss at the same step; the loss scale
on a log axis with skipped steps marked; memory in use; and step time of the timed steps,
raw (faint) and smoothed. Each mode has its own colour and line style, so curves that lie
on top of each other stay visible. The report adds the comparison table, each mode's memory by
category (stacked bars: what bf16 saves on activations, what its weight copies add) and the
device report; plotly.js is embedded, so the page opens with no network.

Example:
    >>> from mpnb.analysis.comparison import Comparison, ModeResult
    >>> from mpnb.training.history import History
    >>> h = History()
    >>> h.extend({"step": [1, 2], "loss": [1.0, 0.5], "step_time": [0.02, 0.01]})
    >>> page = comparison_html(Comparison([ModeResult("bf16", h)], steps=2, warmup=0), "demo")
    >>> "<table>" in page, "<script src=\\"http" in page
    (True, False)
    >>> list(MODE_TRACES)
    ['loss', 'loss - fp32', 'loss scale', 'skipped step', 'memory in use', 'step time', 'step time (smoothed)']
"""

from __future__ import annotations

import html
import math
import os
import statistics
from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mpnb._files import atomic_write
from mpnb.analysis.comparison import Comparison
from mpnb.precision.modes import reference_name
from mpnb.training.history import History
from mpnb.ui.plots.figure import LOG_AXIS
from mpnb.ui.plots.memory_figure import memory_figure

__all__: list[str] = []

#: A fixed colour per mode, the same in the live view and in the report.
MODE_COLORS = {
    "fp32": "#1f77b4",
    "tf32": "#9467bd",
    "fp16": "#d62728",
    "bf16": "#2ca02c",
    "off": "#7f7f7f",
}
#: A line style per mode, so that curves on top of each other stay visible.
MODE_DASHES = {"fp32": "solid", "tf32": "dash", "fp16": "dot", "bf16": "dashdot", "off": "longdash"}

#: Each mode's traces, in order (mode ``i``'s trace ``j`` is ``figure.data[i * len(MODE_TRACES) + j]``),
#: with the (row, column) of their panel.
MODE_TRACES: dict[str, tuple[int, int]] = {
    "loss": (1, 1),
    "loss - fp32": (1, 2),
    "loss scale": (2, 1),
    "skipped step": (2, 1),
    "memory in use": (2, 2),
    "step time": (3, 1),
    "step time (smoothed)": (3, 1),
}

_SMOOTHING = 9  # steps in the step-time median
_PANELS = (
    "loss",
    "loss minus fp32's loss",
    "loss scale (x = skipped step)",
    "memory in use (MiB)",
    f"step time (ms): faint, each step; bold, median of {_SMOOTHING} steps",
)
#: What a trace's name adds to its mode's, where the panel holds two lines of each mode.
_SERIES = {"step time": "each step", "step time (smoothed)": f"median of {_SMOOTHING} steps"}
_MIB = 2.0**20


def _style(mode: str, trace: str) -> dict:
    line = {"color": MODE_COLORS.get(mode), "dash": MODE_DASHES.get(mode, "solid"), "width": 2}
    if trace == "skipped step":
        return {
            "mode": "markers",
            "marker": {"color": MODE_COLORS.get(mode), "symbol": "x", "size": 9},
        }
    if trace == "step time":
        return {"mode": "lines", "line": {**line, "width": 1, "dash": "solid"}, "opacity": 0.25}
    if trace == "loss scale":
        return {"mode": "lines", "line": {**line, "shape": "hv"}}
    return {"mode": "lines", "line": line}


def empty_comparison_figure(modes: Sequence[str], title: str = "") -> go.Figure:
    """The five panels with every mode's traces (see :data:`MODE_TRACES`) present and empty."""
    figure = make_subplots(
        rows=3,
        cols=2,
        specs=[[{}, {}], [{}, {}], [{"colspan": 2}, None]],
        subplot_titles=_PANELS,
        horizontal_spacing=0.1,
        vertical_spacing=0.1,
    )
    for mode in modes:
        for trace, (row, col) in MODE_TRACES.items():
            scatter = go.Scatter(
                x=[],
                y=[],
                name=f"{mode}, {_SERIES[trace]}" if trace in _SERIES else mode,
                legendgroup=mode,
                showlegend=trace == "loss",
                hovertext=trace,
                **_style(mode, trace),
            )
            figure.add_trace(scatter, row=row, col=col)
    figure.update_yaxes(LOG_AXIS, row=2, col=1)
    figure.update_xaxes(title_text="step", row=3, col=1)
    figure.update_layout(
        title={"text": title, "font": {"size": 14}},
        height=760,
        template="plotly_white",
        # right of the panels, where it covers no panel and no panel's title
        legend={"x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"},
        margin={"l": 50, "r": 20, "t": 70 if title else 50, "b": 40},
    )
    return figure


def smoothed(values: Sequence[float], window: int = _SMOOTHING) -> list[float]:
    """Trailing median of ``window`` values (fewer at the start): ``smoothed([1, 9, 1, 1], 3)`` -> ``[1, 5.0, 1, 1]``."""
    return [statistics.median(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def mode_points(
    history: History, timed_from: int, baseline: History | None = None, start: int = 0
) -> dict[str, tuple[list[float], list[float]]]:
    """Per trace of :data:`MODE_TRACES`, the (x, y) points of history rows ``start`` onwards.

    Args:
        history: the mode's history.
        timed_from: its first timed row (step times are drawn from there).
        baseline: fp32's history, for the loss difference (None: no difference drawn).
        start: the first row to give (a live view sends only what is new).
    """
    steps, losses, scales = history.step[start:], history.loss[start:], history.loss_scale[start:]
    skipped = history.skipped[start:]
    timed = max(start, timed_from)
    times = [t * 1e3 for t in history.step_time[timed:]]
    smooth_from = max(
        0, timed - timed_from - _SMOOTHING + 1
    )  # enough earlier timed rows for the median
    context = [t * 1e3 for t in history.step_time[timed_from + smooth_from : timed]]
    return {
        "loss": (steps, losses),
        "loss - fp32": loss_difference(history, baseline, start),
        "loss scale": (steps, scales),
        "skipped step": (
            [s for s, k in zip(steps, skipped) if k],
            [v for v, k in zip(scales, skipped) if k],
        ),
        "memory in use": (steps, [v / _MIB for v in history.memory_used[start:]]),
        "step time": (history.step[timed:], times),
        "step time (smoothed)": (history.step[timed:], smoothed(context + times)[len(context) :]),
    }


def loss_difference(
    history: History, baseline: History | None, start: int = 0
) -> tuple[list[float], list[float]]:
    """The mode's loss minus fp32's at the same step, rows ``start`` onwards while fp32 has that step.

    Steps count from 1 with no gaps, so fp32's loss at step ``s`` is ``baseline.loss[s - 1]``.
    """
    base = baseline.loss if baseline is not None else []
    paired = [
        (s, loss - base[s - 1])
        for s, loss in zip(history.step[start:], history.loss[start:])
        if 0 < s <= len(base)
    ]
    return [s for s, _ in paired], [difference for _, difference in paired]


def comparison_figure(comparison: Comparison) -> go.Figure:
    """Every panel, every mode that ran, every point."""
    ran = [result for result in comparison.results if result.history is not None]
    reference = reference_name()
    baseline = next((result.history for result in ran if result.mode == reference), None)
    figure = empty_comparison_figure([result.mode for result in ran])
    for index, result in enumerate(ran):
        points = mode_points(
            result.history, result.timed_from, baseline if result.mode != reference else None
        )
        for offset, (xs, ys) in enumerate(points.values()):
            figure.data[index * len(MODE_TRACES) + offset].update(x=xs, y=[_finite(y) for y in ys])
    return figure


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def comparison_html(comparison: Comparison, title: str, device_report: str = "") -> str:
    """The whole report page as a string."""
    plot = comparison_figure(comparison).to_html(
        include_plotlyjs=True, full_html=False, config={"displaylogo": False}
    )
    memory = comparison.memory_report()
    bars = (
        memory_figure(memory).to_html(
            include_plotlyjs=False, full_html=False, config={"displaylogo": False}
        )
        if memory.accounts
        else ""
    )
    device = f"<h2>Device</h2><pre>{html.escape(device_report)}</pre>" if device_report else ""
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 12px}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p>{_method(comparison)}</p>"
        f"{comparison._repr_html_()}{plot}{bars}{device}</body></html>\n"
    )


def write_comparison_report(
    path: str | os.PathLike[str], comparison: Comparison, title: str, device_report: str = ""
) -> None:
    """Write :func:`comparison_html` to ``path``, replacing it whole (never writing through a link)."""
    with atomic_write(path) as file:
        file.write(comparison_html(comparison, title, device_report))


#: The files a comparison is written to, in its folder.
COMPARISON_FILES = ("comparison.csv", "comparison.json", "report.html")


def write_comparison_files(
    folder: str | os.PathLike[str], comparison: Comparison, title: str, device_report: str = ""
) -> list[str]:
    """Write comparison.csv, comparison.json and report.html into ``folder`` (made if missing).

    Returns:
        The three paths written.
    """
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, name) for name in COMPARISON_FILES]
    comparison.to_csv(paths[0])
    comparison.to_json(paths[1])
    write_comparison_report(paths[2], comparison, title, device_report)
    return paths


def _method(comparison: Comparison) -> str:
    """How the numbers were taken, in a sentence or two."""
    turns = (
        f"in interleaved turns of {comparison.block} step(s)"
        if 0 < comparison.block < comparison.steps
        else "one mode after another"
    )
    return (
        f"{comparison.steps} timed steps per mode after {comparison.warmup} warm-up steps, {turns}. "
        "Step time: median and interquartile range (IQR). Speedup: the median over rounds of fp32's median "
        "step time over the mode's, with the quartiles of those ratios; 'no clear difference' when they hold "
        "1.0. Memory: measured in the mode's own timed turns (peak counter reset at each); 'added by training' is the most a turn added over the memory in use when it began."
    )
