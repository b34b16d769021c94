"""The what-if's heatmap: layer x format, each cell its worst matmul's relative error.

The colour is the error on a log scale; a cell past its format's threshold (the layer to keep
in higher precision) is marked with a frame and "keep", and the format's error threshold is
written under its name. A format that does not apply to a layer (a scaled one on a
convolution) leaves the cell empty.

Example:
    >>> from mpnb.numerics.whatif import WhatIf
    >>> rows = [
    ...     {"layer": "fc", "matmul": m, "format": "fp16", "rel_error": e, "overflow": o,
    ...      "underflow": 0.0, "scale_range": (1.0, 1.0)}
    ...     for m, e, o in (("forward", 3e-4, 0.0), ("input_grad", float("inf"), 0.01), ("weight_grad", 3e-4, 0.0))
    ... ]
    >>> figure = whatif_heatmap(WhatIf(rows, ["fp16"]))
    >>> figure.data[0].y, figure.data[0].text[0][0]
    (('fc',), 'keep<br>inf<br>input_grad')
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from mpnb.numerics.whatif import WhatIf

__all__: list[str] = []


def whatif_heatmap(result: WhatIf) -> go.Figure:
    """A plotly heatmap of ``result``: rows the layers (first on top), columns the formats."""
    z, text = [], []
    for layer in result.layers:
        z_row, text_row = [], []
        for format_name in result.formats:
            row = result.worst(layer, format_name)
            if row is None:
                z_row.append(None)
                text_row.append("")
                continue
            error = row["rel_error"]
            z_row.append(math.log10(error) if 0 < error < math.inf else (1.0 if error else -8.0))
            threshold = result.threshold_of(format_name)
            mark = "keep<br>" if threshold and threshold.passed(row) else ""
            text_row.append(f"{mark}{error:.2g}<br>{row['matmul']}")
        z.append(z_row)
        text.append(text_row)
    columns = [_column(result, name) for name in result.formats]
    heatmap = go.Heatmap(
        z=z,
        x=columns,
        y=list(result.layers),
        text=text,
        texttemplate="%{text}",
        colorscale="Reds",
        zmin=-4,
        zmax=0,
        colorbar={"title": "log10 error"},
    )
    figure = go.Figure(heatmap)
    for y, layer in enumerate(result.layers):
        for x, format_name in enumerate(result.formats):
            row, threshold = result.worst(layer, format_name), result.threshold_of(format_name)
            if row is not None and threshold is not None and threshold.passed(row):
                figure.add_shape(
                    type="rect",
                    x0=x - 0.5,
                    x1=x + 0.5,
                    y0=y - 0.5,
                    y1=y + 0.5,
                    line={"color": "black", "width": 2},
                )
    figure.update_layout(
        title="what if: each layer's worst matmul error per format (framed: keep it higher)",
        yaxis={"autorange": "reversed"},
        height=160 + 30 * len(result.layers),
    )
    return figure


def _column(result: WhatIf, name: str) -> str:
    """A format's column heading: its name and error threshold (none set: said)."""
    threshold = result.threshold_of(name)
    return f"{name}<br>" + (f"keep > {threshold.rel_error:g}" if threshold else "no threshold")
