"""The numerics watch as heatmaps: a row a module, a column a sampled step. On the left the
colour says how close the module's largest activation came to the dtype's limit (log10 of the
headroom: 0 is the limit itself, where a step with a non-finite value is drawn too); on the right,
the share of its activations fp16 would make subnormal or zero. A named origin of an overflow
(:mod:`mpnb.numerics.origin`) is marked with a cross on both. Modules never called as modules on
a sampled step (``nn.MultiheadAttention``'s ``out_proj``, whose weights it uses directly) have no
row: a line under the heatmaps names them. A cell a module did not run is blank (None): nothing
non-finite goes to the page, where the kernel could not send it as JSON.

Example:
    >>> from mpnb.numerics.watch import NumericsLog
    >>> log = NumericsLog(["fc", "head"], limit=65504.0)
    >>> log.add(10, [[60000.0, 0.0, 0.0, 1.0], [6.5, 0.0, 0.25, 1.0]])
    >>> figure = numerics_heatmap(log, origin=("head", 10))
    >>> figure.data[0].y, [round(row[0], 2) for row in figure.data[0].z]
    (('fc', 'head'), [0.04, 4.0])
    >>> figure.data[1].z, figure.data[2].name
    (([0.0], [0.25]), 'origin of the overflow')
    >>> log = NumericsLog(["fc", "out_proj"], limit=65504.0)
    >>> log.add(10, [[6.5, 0.0, 0.25, 1.0], [float("nan")] * 4])
    >>> figure = numerics_heatmap(log)
    >>> figure.data[0].y, figure.layout.annotations[-1].text
    (('fc',), 'not called as modules, so not measured: out_proj')
"""

from __future__ import annotations

import math
import textwrap
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
    marked where it falls on a sampled step (or on the nearest one after it). Each panel's
    colour bar lies flat under it, inside its own width."""
    modules = log.ran
    figure = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        column_widths=[0.6, 0.4],
        horizontal_spacing=0.04,
        subplot_titles=("headroom to the limit", "fp16-underflow share"),
    )
    headroom, notes = _headroom_cells(log, modules)
    left, right = figure.layout.xaxis.domain, figure.layout.xaxis2.domain
    figure.add_trace(
        go.Heatmap(
            z=headroom,
            x=log.steps,
            y=modules,
            text=notes,
            hovertemplate="%{y}, step %{x}: %{text}<extra></extra>",
            colorscale="RdBu",
            zmin=0,
            zmax=6,
            colorbar=_flat_colorbar(left, f"log10 headroom to {log.limit:g}"),
        ),
        row=1,
        col=1,
    )
    figure.add_trace(
        go.Heatmap(
            z=[[_finite(value) for value in log.underflow_share.get(name, [])] for name in modules],
            x=log.steps,
            y=modules,
            hovertemplate="%{y}, step %{x}: %{z:.1%} of values below fp16's normal range"
            "<extra></extra>",
            colorscale="Purples",
            zmin=0,
            zmax=1,
            colorbar={**_flat_colorbar(right, "share of activations"), "tickformat": ".0%"},
        ),
        row=1,
        col=2,
    )
    lines = []
    marked = _origin_cell(modules, log.steps, origin)
    if marked is not None:
        shown_at = "" if marked[1] == origin[1] else f", drawn at sampled step {marked[1]}"
        lines.append(f"x: the overflow began in {origin[0]} at step {origin[1]}{shown_at}")
        for column in (1, 2):
            figure.add_trace(
                go.Scatter(
                    x=[marked[1]],
                    y=[marked[0]],
                    mode="markers",
                    marker={"symbol": "x-thin", "size": 16, "line": {"width": 3, "color": "black"}},
                    name="origin of the overflow",
                    hovertemplate=f"the overflow began here at step {origin[1]}{shown_at}"
                    "<extra></extra>",
                    showlegend=False,
                ),
                row=1,
                col=column,
            )
    if log.never_ran:  # wrapped: the page may be narrow
        never = f"not called as modules, so not measured: {', '.join(log.never_ran)}"
        lines.extend(textwrap.wrap(never, 90, break_on_hyphens=False))
    bottom = 110 + 16 * len(lines)
    figure.update_layout(
        template="plotly_white",
        autosize=True,  # the output's width (plotly.js draws 700 pixels wide otherwise)
        height=40 + 22 * len(modules) + bottom + 40,
        margin={"l": 160, "r": 20, "t": 40, "b": bottom},
        showlegend=False,
    )
    if lines:
        figure.add_annotation(
            text="<br>".join(lines),
            xref="paper",
            yref="paper",
            x=0,
            y=0,
            yshift=-(bottom - 4),
            xanchor="left",
            yanchor="bottom",
            align="left",
            showarrow=False,
            font={"size": 11, "color": "#555"},
        )
    figure.update_annotations(font_size=13, selector={"text": "headroom to the limit"})
    figure.update_annotations(font_size=13, selector={"text": "fp16-underflow share"})
    figure.update_yaxes(autorange="reversed", row=1, col=1)
    figure.update_xaxes(title_text="step", title_standoff=4)
    return figure


def _flat_colorbar(domain: tuple[float, float], title: str) -> dict:
    """A horizontal colour bar under the panel whose x domain is ``domain``, no wider than it."""
    return {
        "title": {"text": title, "side": "top"},
        "orientation": "h",
        "x": (domain[0] + domain[1]) / 2,
        "xanchor": "center",
        "len": 0.9 * (domain[1] - domain[0]),
        "lenmode": "fraction",
        "y": 0,
        "yanchor": "top",
        "ypad": 40,
        "thickness": 10,
    }


def _finite(value: float) -> float | None:
    """``value``, or None (a blank cell) when it is NaN or infinite."""
    return value if math.isfinite(value) else None


def _headroom_cells(
    log: NumericsLog, modules: Sequence[str]
) -> tuple[list[list[float | None]], list[list[str]]]:
    """log10 of the headroom per module and sampled step, and each cell's hover text."""
    z, text = [], []
    for name in modules:
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


def _origin_cell(
    modules: Sequence[str], steps: Sequence[int], origin: OriginCell | None
) -> OriginCell | None:
    """The heatmap cell of ``origin``: its module's row (the module, or the drawn module
    nearest inside it), at the first sampled step at or after it (the last one if none)."""
    if origin is None or not steps:
        return None
    module, step = origin
    row = _watched_row(modules, module)
    if row is None:
        return None
    column = next((sampled for sampled in steps if sampled >= step), steps[-1])
    return row, column


def _watched_row(modules: Sequence[str], module: str) -> str | None:
    """``module`` itself if watched, else the first watched module inside it."""
    if module in modules:
        return module
    return next((name for name in modules if name.startswith(module + ".")), None)
