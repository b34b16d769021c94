"""The numerics watch as a heatmap: a row a module, a column a sampled step, the colour how close
the module's largest activation came to the dtype's limit (log10 of the headroom: 0 is the
limit itself, where a step with a non-finite value is drawn too).

Example:
    >>> from mpnb.training.numerics_watch import NumericsLog
    >>> log = NumericsLog(["fc", "head"], limit=65504.0)
    >>> log.add(10, [[60000.0, 0.0, 0.0, 1.0], [6.5, 0.0, 0.0, 1.0]])
    >>> figure = numerics_heatmap(log)
    >>> figure.data[0].y, [round(row[0], 2) for row in figure.data[0].z]
    (('fc', 'head'), [0.04, 4.0])
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from mpnb.training.numerics_watch import NumericsLog

__all__: list[str] = []


def numerics_heatmap(log: NumericsLog) -> go.Figure:
    """Headroom to the limit, module x sampled step (red near the limit, blue far from it)."""
    z, text = [], []
    for name in log.modules:
        row, notes = [], []
        for value, bad in zip(log.activation_max.get(name, []), log.nonfinite.get(name, [])):
            if value != value:  # NaN: the module did not run on that step
                row.append(None)
                notes.append("not run")
                continue
            headroom = log.limit / value if value > 0 else math.inf
            if bad:  # past the limit: drawn at it
                row.append(0.0)
            else:
                row.append(math.log10(headroom) if math.isfinite(headroom) else None)
            notes.append(f"max {value:.3g}" + (f", {int(bad)} non-finite" if bad else ""))
        z.append(row)
        text.append(notes)
    heatmap = go.Heatmap(
        z=z,
        x=log.steps,
        y=log.modules,
        text=text,
        hovertemplate="%{y}, step %{x}: %{text}<extra></extra>",
        colorscale="RdBu",
        zmin=0,
        zmax=6,
        colorbar={"title": "log10 headroom"},
    )
    figure = go.Figure(heatmap)
    figure.update_layout(
        title={
            "text": f"largest activation against {log.limit:g}, per module",
            "font": {"size": 14},
        },
        xaxis_title="step",
        yaxis={"autorange": "reversed"},
        template="plotly_white",
        height=140 + 22 * len(log.modules),
        margin={"l": 160, "r": 20, "t": 50, "b": 40},
    )
    return figure
