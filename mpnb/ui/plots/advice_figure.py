"""The numerics advisor's heatmap: modules x metrics, each column scaled to its own maximum.

Example:
    >>> from mpnb.numerics.advisor import Advice, ModuleNumerics
    >>> row = ModuleNumerics("fc", "Linear", 2.0, 0.5, 0.0, {"fp16": 1e-3, "bf16": 1e-2})
    >>> figure = advice_heatmap(Advice([row], [], [], 1024.0, "bf16", []))
    >>> figure.data[0].y, figure.data[0].z[0][:2]
    (('fc',), [1.0, 1.0])
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from mpnb.numerics.advisor import METRICS, Advice

__all__: list[str] = []


def advice_heatmap(advice: Advice) -> go.Figure:
    """A plotly heatmap of ``advice.rows``; the cells show the raw values, the colour the column share."""
    columns = list(zip(*(row.values() for row in advice.rows))) if advice.rows else []
    scaled = []
    for column in columns:
        finite = [v for v in column if math.isfinite(v)]
        top = max(finite, default=0.0) or 1.0
        scaled.append([v / top if math.isfinite(v) else math.nan for v in column])
    z = [list(values) for values in zip(*scaled)] if scaled else []
    text = [[f"{v:.3g}" for v in row.values()] for row in advice.rows]
    heatmap = go.Heatmap(
        z=z,
        x=list(METRICS),
        y=[r.module for r in advice.rows],
        text=text,
        texttemplate="%{text}",
        colorscale="Reds",
    )
    figure = go.Figure(heatmap)
    figure.update_layout(
        title="numerics per module (colour: share of the column's maximum)",
        height=120 + 28 * len(advice.rows),
    )
    return figure
