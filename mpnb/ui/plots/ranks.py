"""How a launch shows its ranks while they train: a live plotly figure in a notebook, a line of
text elsewhere.

Four panels, one trace per rank: loss, step time (a straggler is named in its legend entry and
in the title), memory in use, and the loss scale of every rank with its skipped steps; the
title says whether the ranks agree on the scale and the skips, as data-parallel ranks must.

Example:
    >>> import io
    >>> from mpnb.distributed.rank_rows import RankRows
    >>> rows = RankRows()
    >>> for rank, seconds in ((0, 0.010), (1, 0.014)):
    ...     steps = list(range(1, 13))
    ...     rows.add(rank, 0, {"step": steps, "loss": [1 / s for s in steps], "step_time": [seconds] * 12})
    >>> out = io.StringIO()
    >>> TextRanks("demo", interval=0, stream=out).update(rows)
    >>> print(out.getvalue().splitlines()[-1])
    step 12 on 2 ranks | loss 0.08333 / 0.08333 | step 10.0 / 14.0 ms | skipped 0, same on every rank | slow: rank 1 (1.4x)
    >>> live = LiveRanks("demo")
    >>> live.close(rows)
    >>> [trace.name for trace in live.figure.data if trace.showlegend]
    ['rank 0', 'rank 1 (slow: 1.4x)']
    >>> live.figure.layout.title.text
    'demo: 12 steps on 2 ranks; scale and skips agree; rank 1 is slow (1.4x the others)'
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

import plotly.graph_objects as go

from mpnb.distributed.rank_rows import RankRows, RanksView
from mpnb.ui.plots.decimate import MinMaxSeries
from mpnb.ui.plots.figure import four_panels
from mpnb.ui.plots.pacing import RedrawPacer

__all__: list[str] = []

MIB = 2.0**20
#: Panel (row, column) -> what it shows of each rank's history, and how it is scaled.
PANELS = {
    (1, 1): ("loss", 1.0),
    (1, 2): ("step_time", 1e3),
    (2, 1): ("memory_used", 1 / MIB),
    (2, 2): ("loss_scale", 1.0),
}
_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def verdict(rows: RankRows) -> list[str]:
    """What to say across ranks: agreement on scale and skips, and the stragglers."""
    disagree = rows.disagreements()
    said = [
        f"ranks DISAGREE on scale or skips at steps {disagree[:5]}"
        if disagree
        else "scale and skips agree"
    ]
    said += [
        f"rank {rank} is slow ({ratio}x the others)" for rank, ratio in rows.stragglers().items()
    ]
    return said


class TextRanks(RanksView):
    """One line every ``interval`` seconds while the ranks train, and one at the end."""

    def __init__(
        self, title: str = "", *, interval: float = 2.0, stream: TextIO | None = None
    ) -> None:
        self.title, self.interval, self.stream = title, interval, stream
        self._last = -math.inf

    def update(self, rows: RankRows) -> None:
        now = time.perf_counter()
        if now - self._last >= self.interval and rows.common_steps():
            self._last = now
            self._print(self.line(rows))

    def close(self, rows: RankRows) -> None:
        if rows.common_steps():
            self._print("finished: " + self.line(rows))

    def line(self, rows: RankRows) -> str:
        latest = rows.latest()
        last = rows.common_steps() - 1
        histories = list(latest.values())
        losses = " / ".join(f"{h.loss[last]:.4g}" for h in histories)
        times = " / ".join(f"{h.step_time[last] * 1e3:.1f}" for h in histories)
        skipped = len(histories[0].skipped_steps)
        disagree = rows.disagreements()
        agreement = f"DISAGREE at steps {disagree[:5]}" if disagree else "same on every rank"
        slow = ", ".join(f"rank {rank} ({ratio}x)" for rank, ratio in rows.stragglers().items())
        return (
            f"step {histories[0].step[last]} on {len(histories)} ranks | loss {losses} | step {times} ms | "
            f"skipped {skipped}, {agreement}" + (f" | slow: {slow}" if slow else "")
        )

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)


class LiveRanks(RanksView):
    """The live per-rank figure (a plotly FigureWidget), redrawn at most every ``min_interval`` s."""

    def __init__(
        self, title: str = "", *, min_interval: float = 0.5, max_points: int = 300
    ) -> None:
        self.title, self.max_points = title, max_points
        self.figure = go.FigureWidget(
            four_panels(
                ("loss", "step time (ms)", "memory in use (MiB)", "loss scale"),
                title,
                log_panel=(2, 2),
            )
        )
        self.pacer = RedrawPacer(min_interval)
        self._series: dict[tuple[int, tuple[int, int]], MinMaxSeries] = {}
        self._seen: dict[int, int] = {}
        self._fit: dict[int, int] = {}

    def update(self, rows: RankRows) -> None:
        self._ingest(rows)
        if self.pacer.due(time.perf_counter()):
            self._redraw(rows)

    def close(self, rows: RankRows) -> None:
        self._ingest(rows)
        self._redraw(rows)

    def _ingest(self, rows: RankRows) -> None:
        for rank, history in rows.latest().items():
            # another fit on this rank: its curves start again
            if self._fit.get(rank) != id(history):
                self._fit[rank], self._seen[rank] = id(history), 0
                for panel in PANELS:
                    self._series[(rank, panel)] = MinMaxSeries(self.max_points)
            start = self._seen[rank]
            steps = history.step[start:]
            for panel, (column, scale) in PANELS.items():
                self._series[(rank, panel)].extend(
                    steps, [value * scale for value in history.columns[column][start:]]
                )
            self._seen[rank] = len(history)

    def _redraw(self, rows: RankRows) -> None:
        started = time.perf_counter()
        slow = rows.stragglers()
        with self.figure.batch_update():
            for rank in rows.ranks:
                self._draw_rank(rank, slow.get(rank))
            self.figure.layout.title.text = (
                f"{self.title}: {rows.common_steps()} steps on {len(rows.ranks)} ranks; "
                + ("; ".join(verdict(rows)))
            )
        self.pacer.record(started, time.perf_counter())

    def _draw_rank(self, rank: int, slow: float | None) -> None:
        names = {trace.name for trace in self.figure.data}
        label = f"rank {rank}"
        if label not in names:
            color = _COLORS[rank % len(_COLORS)]
            for (row, col), (column, _) in PANELS.items():
                self.figure.add_trace(
                    go.Scatter(
                        x=[],
                        y=[],
                        mode="lines",
                        name=label,
                        legendgroup=label,
                        showlegend=(row, col) == (1, 1),
                        line={
                            "color": color,
                            "shape": "hv" if column == "loss_scale" else "linear",
                        },
                    ),
                    row=row,
                    col=col,
                )
        traces = [trace for trace in self.figure.data if trace.legendgroup == label]
        for trace, panel in zip(traces, PANELS):
            xs, ys = self._series[(rank, panel)].points()
            trace.x, trace.y = xs, ys
        traces[0].name = f"{label} (slow: {slow}x)" if slow else label
