"""The numerics watch as heatmaps: a row a module, a column a sampled step. On the left the
colour says how close the module's largest activation came to the dtype's limit (log10 of the
headroom: 0 is the limit itself, where a step with a non-finite value is drawn too); on the right,
the share of its activations fp16 would make subnormal or zero. A named origin of an overflow
(:mod:`mpnb.numerics.origin`) is marked with a cross on both.

Example:
    >>> from mpnb.numerics.watch import NumericsLog
    >>> log = NumericsLog(["fc", "head"], limit=65504.0)
    >>> log.add(10, [[60000.0, 0.0, 0.0, 1.0], [6.5, 0.0, 0.25, 1.0]])
    >>> figure = numerics_heatmap(log, origin=("head", 10))
    >>> figure.data[0].y, [round(row[0], 2) for row in figure.data[0].z]
    (('fc', 'head'), [0.04, 4.0])
    >>> figure.data[1].z, figure.data[2].name
    (([0.0], [0.25]), 'origin of the overflow')
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mpnb.numerics.watch import NumericsLog

__all__: list[str] = []

#: The heatmaps' cell where an overflow began: a watched module's row and a step's column (an
#: `~mpnb.numerics.origin.Origin`'s module, placed on the grid).
OriginCell = tuple[str, int]


def numerics_heatmap(log: NumericsLog, origin: OriginCell | None = None) -> go.Figure:
    """Headroom to the limit and fp16-underflow share, module x sampled step, with ``origin``
    marked where it falls on a sampled step (or on the nearest one after it)."""
    figure = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        column_widths=[0.62, 0.38],
        horizontal_spacing=0.03,
        subplot_titles=(f"headroom to {log.limit:g} (largest activation)", "fp16-underflow share"),
    )
    headroom, notes = _headroom_cells(log)
    figure.add_trace(
        go.Heatmap(
            z=headroom,
            x=log.steps,
            y=log.modules,
            text=notes,
            hovertemplate="%{y}, step %{x}: %{text}<extra></extra>",
            colorscale="RdBu",
            zmin=0,
            zmax=6,
            colorbar={"title": "log10 headroom", "x": 0.6, "len": 0.9},
        ),
        row=1,
        col=1,
    )
    figure.add_trace(
        go.Heatmap(
            z=[log.underflow_share.get(name, []) for name in log.modules],
            x=log.steps,
            y=log.modules,
            hovertemplate="%{y}, step %{x}: %{z:.1%} of values below fp16's normal range"
            "<extra></extra>",
            colorscale="Purples",
            zmin=0,
            zmax=1,
            colorbar={"title": "share", "tickformat": ".0%", "len": 0.9},
        ),
        row=1,
        col=2,
    )
    marked = _origin_cell(log, origin)
    if marked is not None:
        for column in (1, 2):
            figure.add_trace(
                go.Scatter(
                    x=[marked[1]],
                    y=[marked[0]],
                    mode="markers",
                    marker={"symbol": "x-thin", "size": 16, "line": {"width": 3, "color": "black"}},
                    name="origin of the overflow",
                    hovertemplate=f"overflow began here (step {origin[1]})<extra></extra>",
                    showlegend=column == 1,
                ),
                row=1,
                col=column,
            )
    figure.update_layout(
        template="plotly_white",
        height=160 + 22 * len(log.modules),
        margin={"l": 160, "r": 20, "t": 50, "b": 40},
        legend={"orientation": "h", "y": -0.15},
    )
    figure.update_yaxes(autorange="reversed", row=1, col=1)
    figure.update_xaxes(title_text="step")
    return figure


def _headroom_cells(log: NumericsLog) -> tuple[list[list[float | None]], list[list[str]]]:
    """log10 of the headroom per module and sampled step, and each cell's hover text."""
    z, text = [], []
    for name in log.modules:
        row: list[float | None] = []
        notes: list[str] = []
        gradients = log.gradient_max.get(name, [])
        for index, (value, bad) in enumerate(
            zip(log.activation_max.get(name, []), log.nonfinite.get(name, []))
        ):
            if value != value:  # NaN: the module did not run on that step
                row.append(None)
                notes.append("not run")
                continue
            headroom = log.limit / value if value > 0 else math.inf
            if bad:  # past the limit: drawn at it
                row.append(0.0)
            else:
                row.append(math.log10(headroom) if math.isfinite(headroom) else None)
            gradient = gradients[index] if index < len(gradients) else math.nan
            notes.append(
                f"max {value:.3g}, gradient max {gradient:.3g}"
                + (f", {int(bad)} non-finite" if bad else "")
            )
        z.append(row)
        text.append(notes)
    return z, text


def _origin_cell(log: NumericsLog, origin: OriginCell | None) -> OriginCell | None:
    """The heatmap cell of ``origin``: its module's row (the module, or the watched module
    nearest inside it), at the first sampled step at or after it (the last one if none)."""
    if origin is None or not log.steps:
        return None
    module, step = origin
    row = _watched_row(log.modules, module)
    if row is None:
        return None
    column = next((sampled for sampled in log.steps if sampled >= step), log.steps[-1])
    return row, column


def _watched_row(modules: Sequence[str], module: str) -> str | None:
    """``module`` itself if watched, else the first watched module inside it."""
    if module in modules:
        return module
    return next((name for name in modules if name.startswith(module + ".")), None)
