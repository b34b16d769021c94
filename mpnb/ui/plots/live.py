"""The live dashboard: a plotly FigureWidget that redraws while a training cell runs.

Redraws are throttled (at most one per ``min_interval`` seconds, plus a final one, and
never more often than keeps redrawing under ``max_share`` of the run's time) and batched
(one widget message per redraw). Each trace is decimated by streaming min/max
buckets, so a redraw sends at most ``max_points`` points per trace: message size and
redraw time stay flat however long the run. The full history stays in the recorder. A switch made
during the run (mode, fp32 math, op lists, a remedy), an alarm or a named origin is drawn as a
vertical line with a marker whose hover text says it, and listed under the plots
(:func:`~mpnb.ui.plots.figure.show_events`). The figure takes the output's whole width
(:func:`fill_output_width`).

Example:
    >>> from mpnb.training.history import History
    >>> dash = LiveDashboard("demo", max_points=100)
    >>> h = History()
    >>> h.extend({"step": list(range(1, 10001)), "loss": [1.0 / s for s in range(1, 10001)]})
    >>> dash.close(h)
    >>> len(dash.figure.data[0].x) <= 100, dash.redraws
    (True, 1)
"""

from __future__ import annotations

import plotly.graph_objects as go

from mpnb.training.history import History
from mpnb.ui.plots.decimate import MinMaxSeries
from mpnb.ui.plots.figure import (
    TRACES,
    empty_figure,
    marked_events,
    show_events,
    trace_points,
)
from mpnb.ui.plots.pacing import PacedPlot

__all__: list[str] = []


def fill_output_width(figure: go.FigureWidget) -> None:
    """Size ``figure`` to the width of the output it is shown in, once the page has it.

    plotly.js sizes a figure to its container when it first draws, but a FigureWidget's view
    first draws before the page attaches it, so it falls back to 700 pixels (in a 968 pixel
    output, measured in JupyterLab 4), and resizes itself only when the window does. Asking for
    autosize again once the view is on the page makes plotly.js measure the container then.
    Call it at a redraw (the view is on the page by then); it costs two small layout messages.
    """
    figure.layout.autosize = False
    figure.layout.autosize = True


#: The first redraws that size the figure to its output: the first may come before the page
#: shows the figure (a fast fit), the next ones after.
_SIZINGS = 3


class LiveDashboard(PacedPlot):
    """A telemetry sink that draws into a FigureWidget.

    Args:
        title: shown above the panels.
        min_interval: seconds between redraws (0.25 = at most 4 per second).
        max_points: points per trace in one redraw.
        max_share: redrawing takes at most about this share of the training loop's time
            (see :class:`~mpnb.ui.plots.pacing.RedrawPacer`).

    Attributes:
        figure: the FigureWidget; display it to see it (``make_dashboard`` does).
        redraws: how many redraws were sent.
    """

    def __init__(
        self,
        title: str = "",
        *,
        min_interval: float = 0.25,
        max_points: int = 500,
        max_share: float = 0.01,
    ) -> None:
        self.figure = go.FigureWidget(empty_figure(title))
        super().__init__(min_interval, max_share)
        self._title = title
        self._series = {name: MinMaxSeries(max_points) for name in TRACES}
        self._seen = 0
        self._events_seen = 0
        self._events: list[dict] = []  # the marked ones
        self._sized = 0  # the redraws that sized the figure to its output (see fill_output_width)

    def _ingest(self, history: History) -> None:
        for name, (xs, ys) in trace_points(history, self._seen).items():
            self._series[name].extend(xs, ys)
        self._seen = len(history)
        fresh = marked_events(history, self._events_seen)
        self._events_seen = len(history.events)
        if not fresh:
            return
        self._events.extend(fresh)
        with self.figure.batch_update():
            show_events(self.figure, self._events, self._title)

    def _draw(self) -> None:
        """Send every trace's decimated points in one message."""
        if self._sized < _SIZINGS:
            self._sized += 1
            fill_output_width(self.figure)
        points = [series.points() for series in self._series.values()]
        self.figure.plotly_restyle(
            {"x": [x for x, _ in points], "y": [y for _, y in points]},
            trace_indexes=list(range(len(points))),
        )
