"""A comparison across modes as a figure and as a self-contained HTML report.

The figure overlays the modes: loss per step, and step time per step (the timed steps).
The report adds the comparison table and the device report; plotly.js is embedded, so the
page opens with no network.

Example:
    >>> from mpnb.analysis.comparison import Comparison, ModeResult
    >>> from mpnb.training.history import History
    >>> h = History()
    >>> h.extend({"step": [1, 2], "loss": [1.0, 0.5], "step_time": [0.02, 0.01]})
    >>> page = comparison_html(Comparison([ModeResult("bf16", h)], steps=2, warmup=0), "demo")
    >>> "<table>" in page, "<script src=\\"http" in page
    (True, False)
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mpnb.analysis.comparison import Comparison

__all__ = [
    "MODE_COLORS",
    "comparison_figure",
    "comparison_html",
    "empty_comparison_figure",
    "write_comparison_files",
    "write_comparison_report",
]

#: A fixed colour per mode, the same in the live view and in the report.
MODE_COLORS = {"fp32": "#1f77b4", "tf32": "#9467bd", "fp16": "#d62728", "bf16": "#2ca02c", "off": "#7f7f7f"}


def empty_comparison_figure(modes: Sequence[str], title: str = "") -> go.Figure:
    """Loss and step-time panels with two empty lines per mode: traces ``2 * i`` and ``2 * i + 1``."""
    figure = make_subplots(rows=1, cols=2, subplot_titles=("loss", "step time (ms)"), horizontal_spacing=0.1)
    for mode in modes:
        style = {"line": {"color": MODE_COLORS.get(mode)}, "legendgroup": mode, "mode": "lines"}
        figure.add_trace(go.Scatter(x=[], y=[], name=mode, **style), row=1, col=1)
        figure.add_trace(go.Scatter(x=[], y=[], name=mode, showlegend=False, **style), row=1, col=2)
    figure.update_xaxes(title_text="step")
    figure.update_layout(
        title={"text": title, "font": {"size": 14}},
        height=380,
        template="plotly_white",
        margin={"l": 50, "r": 20, "t": 70 if title else 50, "b": 40},
    )
    return figure


def comparison_figure(comparison: Comparison) -> go.Figure:
    """Loss per step and step time per timed step, one colour per mode that ran."""
    ran = [result for result in comparison.results if result.history is not None]
    figure = empty_comparison_figure([result.mode for result in ran])
    for index, result in enumerate(ran):
        history, timed = result.history, slice(result.timed_from, None)
        figure.data[2 * index].update(x=history.step, y=history.loss)
        figure.data[2 * index + 1].update(x=history.step[timed], y=[t * 1e3 for t in history.step_time[timed]])
    return figure


def comparison_html(comparison: Comparison, title: str, device_report: str = "") -> str:
    """The whole report page as a string."""
    plot = comparison_figure(comparison).to_html(include_plotlyjs=True, full_html=False, config={"displaylogo": False})
    device = f"<h2>Device</h2><pre>{html.escape(device_report)}</pre>" if device_report else ""
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 12px}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p>{comparison.steps} timed steps per mode after {comparison.warmup} warm-up steps; "
        "speedup is fp32's median step time over the mode's.</p>"
        f"{comparison._repr_html_()}{plot}{device}</body></html>\n"
    )


def write_comparison_report(
    path: str | os.PathLike[str], comparison: Comparison, title: str, device_report: str = ""
) -> None:
    """Write :func:`comparison_html` to ``path``."""
    with open(path, "w", encoding="utf-8") as file:
        file.write(comparison_html(comparison, title, device_report))


def write_comparison_files(
    folder: str | os.PathLike[str], comparison: Comparison, title: str, device_report: str = ""
) -> list[str]:
    """Write comparison.csv, comparison.json and report.html into ``folder`` (made if missing).

    Returns:
        The three paths written.
    """
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, name) for name in ("comparison.csv", "comparison.json", "report.html")]
    comparison.to_csv(paths[0])
    comparison.to_json(paths[1])
    write_comparison_report(paths[2], comparison, title, device_report)
    return paths
