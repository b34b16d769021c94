"""Where a step's memory goes, per mode, as stacked bars: one bar per mode, one colour per
category, the measured lines (kernels' buffers, memory beyond the allocator) stacked after the
counted ones with a hatch, so a saving (bf16's activations) and a cost (its weight copies) read
at a glance.

Example:
    >>> from mpnb.analysis.memory import MemoryAccount, MemoryReport
    >>> report = MemoryReport(
    ...     [
    ...         MemoryAccount("fp32", 64, "cpu", {"parameters": 4 * 2**20, "activations": 8 * 2**20}),
    ...         MemoryAccount("bf16", 64, "cpu", {"parameters": 4 * 2**20, "activations": 4 * 2**20,
    ...                                           "weight copies": 2**20}),
    ...     ],
    ...     {},
    ... )
    >>> figure = memory_figure(report)
    >>> [trace.name for trace in figure.data]
    ['parameters', 'activations', 'weight copies']
    >>> figure.data[1].x
    (8.0, 4.0)
"""

from __future__ import annotations

import plotly.graph_objects as go

from mpnb.analysis.memory import CATEGORIES, MemoryReport

__all__: list[str] = []

#: A colour per line of the account, the same wherever the breakdown is drawn.
CATEGORY_COLORS = {
    "parameters": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer state": "#9467bd",
    "activations": "#2ca02c",
    "weight copies": "#d62728",
    "workspace": "#8c564b",
    "batch": "#e377c2",
    "other": "#7f7f7f",
    "inside kernels": "#bcbd22",
    "outside the allocator": "#c7c7c7",
}

_MEASURED = ("inside kernels", "outside the allocator")
_MIB = 2.0**20


def memory_figure(
    report: MemoryReport, title: str = "memory of a training step, by category"
) -> go.Figure:
    """Horizontal stacked bars in MiB: a bar per mode, a segment per non-empty line; the
    measured lines only where positive (a negative difference is noise of the measurement, shown
    in the table)."""
    modes = [account.mode for account in report.accounts]
    figure = go.Figure()
    for line in (*CATEGORIES, *_MEASURED):
        values = [account.lines()[line] or 0 for account in report.accounts]
        values = [max(0, value) for value in values] if line in _MEASURED else values
        if not any(values):
            continue
        figure.add_trace(
            go.Bar(
                name=line,
                y=modes,
                x=[value / _MIB for value in values],
                orientation="h",
                marker={
                    "color": CATEGORY_COLORS[line],
                    "pattern": {"shape": "/" if line in _MEASURED else ""},
                },
                hovertemplate=f"{line}: %{{x:.1f}} MiB<extra>%{{y}}</extra>",
            )
        )
    batch = {account.batch_size for account in report.accounts}
    subtitle = f" (batch {batch.pop()})" if len(batch) == 1 else ""
    figure.update_layout(
        barmode="stack",
        title={"text": title + subtitle, "font": {"size": 14}},
        xaxis_title="MiB at the step's peak",
        yaxis={"autorange": "reversed"},
        template="plotly_white",
        # the legend stands right of the bars, a category a line: below them, it wrapped onto
        # the axis title in a narrow output
        height=max(140 + 45 * len(modes), 100 + 24 * len(figure.data)),
        legend={"x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top", "traceorder": "normal"},
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
    )
    return figure
