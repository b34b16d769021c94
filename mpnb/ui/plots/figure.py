"""The four-panel training dashboard as a plotly figure: loss, loss scale, memory, throughput.

Used by the live widget (:mod:`mpnb.ui.plots.live`), by ``History.plot()`` and by the HTML
report of ``mpnb train``: one layout, one mapping from history rows to traces.

Example:
    >>> from mpnb.training.history import ALARM_KINDS, History
    >>> h = History()
    >>> h.extend({"step": [1, 2], "loss": [1.0, 0.5], "loss_scale": [8.0, 4.0], "skipped": [True, False]})
    >>> fig = dashboard_figure(h)
    >>> [t.name for t in fig.data]
    ['loss', 'loss scale', 'skipped step', 'memory in use', 'peak memory', 'samples/s']
    >>> fig.data[2].x.tolist()
    [1.0]
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mpnb.training.history import ALARM_KINDS, History

__all__: list[str] = []

#: The history events a dashboard marks with a vertical line.
MARKED_KINDS = ("switch", "origin", *ALARM_KINDS)

MIB = 2.0**20

#: Trace name -> (row, column) of its panel.
TRACES: dict[str, tuple[int, int]] = {
    "loss": (1, 1),
    "loss scale": (1, 2),
    "skipped step": (1, 2),
    "memory in use": (2, 1),
    "peak memory": (2, 1),
    "samples/s": (2, 2),
}

_STYLE = {
    "loss": {"line": {"color": "#1f77b4"}},
    "loss scale": {"line": {"color": "#2ca02c", "shape": "hv"}},
    "skipped step": {"mode": "markers", "marker": {"color": "#d62728", "symbol": "x", "size": 9}},
    "memory in use": {"line": {"color": "#9467bd"}},
    "peak memory": {"line": {"color": "#9467bd", "dash": "dot"}},
    "samples/s": {"line": {"color": "#ff7f0e"}},
}


def empty_figure(title: str = "") -> go.Figure:
    """The dashboard layout with every trace present and empty."""
    figure = four_panels(
        ("loss", "loss scale (x = skipped step)", "memory (MiB)", "throughput (samples/s)"),
        title,
        log_panel=(1, 2),
    )
    for name, (row, col) in TRACES.items():
        figure.add_trace(
            go.Scatter(x=[], y=[], name=name, **{"mode": "lines", **_STYLE[name]}), row=row, col=col
        )
    return figure


#: A log axis whose ticks read as their values: plotly's own log ticks label 0.5 as "5" and 0.2
#: as "2" (the digit, in a smaller font), which reads as a loss scale of 5. Labelled in full,
#: every digit's tick crowds a short axis spanning one to two decades (0.3 ... 0.9 1 2): at
#: most about three labelled ticks (0.5 1 2; 1 100 10000), the others as unlabelled grid lines.
LOG_AXIS = {"type": "log", "tickformat": "~g", "nticks": 3, "minor": {"showgrid": True}}


def four_panels(
    titles: tuple[str, str, str, str], title: str, log_panel: tuple[int, int]
) -> go.Figure:
    """Two rows of two panels over steps, in the dashboards' style; ``log_panel`` (row, column) on a log scale.

    >>> four_panels(("a", "b", "c", "d"), "demo", log_panel=(2, 2)).layout.yaxis4.type
    'log'
    """
    figure = make_subplots(
        rows=2, cols=2, subplot_titles=titles, horizontal_spacing=0.1, vertical_spacing=0.16
    )
    figure.update_yaxes(LOG_AXIS, row=log_panel[0], col=log_panel[1])
    figure.update_xaxes(title_text="step", row=2)
    figure.update_layout(
        title={"text": title, "font": {"size": 14}},
        height=520,
        margin={"l": 50, "r": 20, "t": 70, "b": 40},
        legend={"orientation": "h", "y": -0.12},
        template="plotly_white",
    )
    return figure


def trace_points(history: History, start: int = 0) -> dict[str, tuple[list[float], list[float]]]:
    """Per trace, the (x, y) points of history rows ``start`` onwards (steps on x)."""
    steps = history.step[start:]
    scales = history.loss_scale[start:]
    skipped = history.skipped[start:]
    return {
        "loss": (steps, history.loss[start:]),
        "loss scale": (steps, scales),
        "skipped step": (
            [s for s, k in zip(steps, skipped) if k],
            [v for v, k in zip(scales, skipped) if k],
        ),
        "memory in use": (steps, [v / MIB for v in history.memory_used[start:]]),
        "peak memory": (steps, [v / MIB for v in history.memory_peak[start:]]),
        "samples/s": (steps, history.samples_per_s[start:]),
    }


def marked_events(history: History, start: int = 0) -> list[dict]:
    """The events a dashboard marks, ``start`` onwards: switches (a mode, fp32-math or op-list change
    during a run) and alarms (a non-finite loss, a collapsed loss scale)."""
    return [event for event in history.events[start:] if event.get("kind") in MARKED_KINDS]


def mark_event(figure: go.Figure, event: dict) -> None:
    """A dotted vertical line on every panel where a switch took effect, an alarm went off or a
    skipped step's origin was named, labelled on the loss panel (alarms in red)."""
    alarm = event.get("kind") in ALARM_KINDS
    color = "#c0392b" if alarm else "#555"
    # a switch acts between two steps; an alarm or a named origin is about its own step
    x = event["step"] if alarm or event.get("kind") == "origin" else event["step"] - 0.5
    figure.add_vline(x=x, line={"dash": "dot", "color": color, "width": 1}, row="all", col="all")
    figure.add_annotation(
        x=x,
        y=1,
        yref="y domain",
        text=event["message"],
        showarrow=False,
        xanchor="left",
        font={"size": 10, "color": color},
        row=1,
        col=1,
    )


def dashboard_figure(history: History, title: str | None = None) -> go.Figure:
    """A static dashboard of a whole history (every point; no decimation)."""
    figure = empty_figure(history.meta.get("model", "") if title is None else title)
    for trace, (xs, ys) in zip(figure.data, trace_points(history).values()):
        trace.x = np.asarray(xs, dtype=np.float64)
        trace.y = np.asarray([v if math.isfinite(v) else math.nan for v in ys], dtype=np.float64)
    for event in marked_events(history):
        mark_event(figure, event)
    return figure
