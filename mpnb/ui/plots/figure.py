"""The four-panel training dashboard as a plotly figure: loss, loss scale, memory, throughput.

Used by the live widget (:mod:`mpnb.ui.plots.live`), by ``History.plot()`` and by the HTML
report of ``mpnb train``: one layout, one mapping from history rows to traces.

The history's events (a switch, an alarm, a named origin, a loss scale given back) are dotted
vertical lines through every panel and a marker at the top of the loss panel whose hover text
is the event, and they are listed, one line each, under the plots: no text is written into a
panel, where labels of nearby events would overlap. Steps whose loss is NaN or inf are markers
at the bottom of the loss panel, so its axis runs as far as the others. Nothing non-finite is
sent to the page.

Example:
    >>> from mpnb.training.history import ALARM_KINDS, History
    >>> h = History()
    >>> h.extend({"step": [1, 2], "loss": [1.0, 0.5], "loss_scale": [8.0, 4.0], "skipped": [True, False]})
    >>> h.note("mode fp16 -> bf16", kind="switch", step=2)
    >>> fig = dashboard_figure(h)
    >>> [t.name for t in fig.data]
    ['loss', 'loss scale', 'skipped step', 'memory in use', 'peak memory', 'samples/s', 'non-finite loss', 'events']
    >>> fig.data[2].x.tolist(), fig.data[-1].hovertext, fig.layout.annotations[-1].text
    ([1.0], ('from step 2: mode fp16 -> bf16',), 'from step 2: mode fp16 -> bf16')
"""

from __future__ import annotations

import math
import re

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mpnb.training.history import ALARM_KINDS, History

__all__: list[str] = []

#: The history events a dashboard marks with a vertical line and lists under the plots.
MARKED_KINDS = ("switch", "origin", "scale", *ALARM_KINDS)

MIB = 2.0**20

#: Trace name -> (row, column) of its panel.
TRACES: dict[str, tuple[int, int]] = {
    "loss": (1, 1),
    "loss scale": (1, 2),
    "skipped step": (1, 2),
    "memory in use": (2, 1),
    "peak memory": (2, 1),
    "samples/s": (2, 2),
    "non-finite loss": (1, 1),
}
#: The loss panel's second y axis, 0 at its bottom and 1 at its top, hidden: where the markers
#: of non-finite losses and of events stand, whatever the loss's own range.
MARK_AXIS = "y5"
#: Where on :data:`MARK_AXIS` each kind of marker stands.
NONFINITE_AT, EVENT_AT = 0.03, 0.97
#: Events listed under the plots (the latest; the history keeps them all), and the longest line.
LISTED_EVENTS, LISTED_CHARACTERS = 6, 120

_STYLE = {
    "loss": {"line": {"color": "#1f77b4"}},
    "loss scale": {"line": {"color": "#2ca02c", "shape": "hv"}},
    "skipped step": {"mode": "markers", "marker": {"color": "#d62728", "symbol": "x", "size": 9}},
    "memory in use": {"line": {"color": "#9467bd"}},
    "peak memory": {"line": {"color": "#9467bd", "dash": "dot"}},
    "samples/s": {"line": {"color": "#ff7f0e"}},
    "non-finite loss": {
        "mode": "markers",
        "marker": {"color": "#d62728", "symbol": "line-ns-open", "size": 10},
        "yaxis": MARK_AXIS,
        "hovertemplate": "step %{x}: loss NaN or inf<extra></extra>",
        "showlegend": False,  # its hover says it; a seventh entry would wrap the legend
    },
}
_ALARM_COLOR, _EVENT_COLOR = "#c0392b", "#555"
#: The dashboards' height and bottom margin without listed events, in pixels, and how far under
#: the plots (past the step axis's title and the legend) the list of events starts.
_HEIGHT, _BOTTOM, _LIST_BELOW = 520, 40, 72


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
    figure.update_layout(
        {f"yaxis{MARK_AXIS[1:]}": {"overlaying": "y", "range": [0, 1], "visible": False}}
    )
    figure.update_traces(yaxis=MARK_AXIS, selector={"name": "non-finite loss"})
    figure.add_trace(
        go.Scatter(
            x=[],
            y=[],
            name="events",
            mode="markers",
            marker={"symbol": "triangle-down", "size": 10, "color": []},
            hovertemplate="%{hovertext}<extra></extra>",
            hovertext=[],
            xaxis="x",
            yaxis=MARK_AXIS,
            showlegend=False,
        )
    )
    figure.add_annotation(
        name="events",
        text="",
        xref="paper",
        yref="paper",
        x=0,
        y=0,
        xanchor="left",
        yanchor="top",
        align="left",
        showarrow=False,
        visible=False,
        font={"size": 11, "color": _EVENT_COLOR},
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
        autosize=True,  # the output's width (plotly.js draws 700 pixels wide otherwise)
        height=_HEIGHT,
        margin={"l": 50, "r": 20, "t": 70, "b": _BOTTOM},
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
        "non-finite loss": _nonfinite_losses(history, start),
    }


def _nonfinite_losses(history: History, start: int) -> tuple[list[float], list[float]]:
    """The steps whose loss is NaN or inf (not merely unread), at the loss panel's bottom."""
    rows = zip(history.step[start:], history.loss[start:], history.loss_missing[start:])
    steps = [step for step, loss, unread in rows if not (math.isfinite(loss) or unread)]
    return steps, [NONFINITE_AT] * len(steps)


def marked_events(history: History, start: int = 0) -> list[dict]:
    """The events a dashboard marks, ``start`` onwards: switches (a mode, fp32-math or op-list
    change during a run, a remedy), a loss scale given back, a named origin and alarms (a
    non-finite loss, a collapsed loss scale, zero gradients)."""
    return [event for event in history.events[start:] if event.get("kind") in MARKED_KINDS]


def event_x(event: dict) -> float:
    """Where ``event`` stands on the step axis: a switch or a scale given back acts from its step,
    so between it and the one before; an alarm or a named origin is about its own step."""
    own_step = event.get("kind") in ALARM_KINDS or event.get("kind") == "origin"
    return event["step"] if own_step else event["step"] - 0.5


def event_text(event: dict) -> str:
    """One line for ``event``, its step said once: ``"from step 5: mode fp16 -> bf16"`` (a switch
    acts from there), ``"step 1 skipped: ..."``, ``"loss scale collapsed to 0.5 at step 18: ..."``.

    >>> event_text({"kind": "collapse", "step": 18, "message": "loss scale collapsed at step 18"})
    'loss scale collapsed at step 18'
    >>> event_text({"kind": "zero_gradients", "step": 3, "message": "gradients all zero"})
    'step 3: gradients all zero'
    """
    message, step = event["message"], event["step"]
    if re.search(rf"\bstep {step}\b", message):  # it says its step already
        return message
    return f"{'step' if event_x(event) == step else 'from step'} {step}: {message}"


def show_events(figure: go.Figure, events: list[dict], title: str) -> None:
    """The marked ``events`` (all of them so far) on ``figure``: a dotted vertical line through
    every panel and a marker at the top of the loss panel, its hover text the event (alarms in
    red); the latest :data:`LISTED_EVENTS` listed under the plots, one line each (the figure
    grows to hold them); the title says the mode a switch changed to."""
    colors = [
        _ALARM_COLOR if event.get("kind") in ALARM_KINDS else _EVENT_COLOR for event in events
    ]
    # every line at once: shapes added one by one inside a widget's batch update get mixed up
    figure.layout.shapes = [
        {
            "type": "line",
            "x0": event_x(event),
            "x1": event_x(event),
            "y0": 0,
            "y1": 1,
            "xref": f"x{panel}",
            "yref": f"y{panel} domain",
            "line": {"dash": "dot", "color": color, "width": 1},
        }
        for event, color in zip(events, colors)
        for panel in ("", "2", "3", "4")
    ]
    marker = figure.data[len(TRACES)]
    marker.x = [event_x(event) for event in events]
    marker.y = [EVENT_AT] * len(events)
    marker.hovertext = [event_text(event) for event in events]
    marker.marker.color = colors
    listed = events[-LISTED_EVENTS:]
    lines = [_listed(event) for event in listed]
    if len(events) > len(listed):
        lines.append(f"... and {len(events) - len(listed)} earlier (history.events)")
    bottom = _LIST_BELOW + 16 * len(lines) + 10 if lines else _BOTTOM
    figure.layout.annotations[-1].update(
        text="<br>".join(lines), visible=bool(lines), yshift=-_LIST_BELOW
    )
    figure.layout.update(height=_HEIGHT + bottom - _BOTTOM, margin={"b": bottom})
    switched = [event for event in events if event.get("kind") == "switch" and "mode" in event]
    if switched:
        last = switched[-1]
        title = f"{title} (now {last['mode']}, from step {last['step']})"
    figure.layout.title.text = title


def _listed(event: dict) -> str:
    """The event's line in the list, cut to :data:`LISTED_CHARACTERS` (its marker's hover text
    has it whole); an alarm in red."""
    text = event_text(event)
    if len(text) > LISTED_CHARACTERS:
        text = text[: LISTED_CHARACTERS - 3] + "..."
    text = text.replace("<", "&lt;")  # plotly reads a "<" as the start of a tag
    if event.get("kind") in ALARM_KINDS:
        return f'<span style="color:{_ALARM_COLOR}">{text}</span>'
    return text


def dashboard_figure(history: History, title: str | None = None) -> go.Figure:
    """A static dashboard of a whole history (every point; no decimation)."""
    title = history.meta.get("model", "") if title is None else title
    figure = empty_figure(title)
    for trace, (xs, ys) in zip(figure.data, trace_points(history).values()):
        finite = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        trace.x = np.asarray([x for x, _ in finite], dtype=np.float64)
        trace.y = np.asarray([y for _, y in finite], dtype=np.float64)
    show_events(figure, marked_events(history), title)
    return figure
