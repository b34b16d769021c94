"""When a live plot may redraw: not too often, and never for more than a small share of the run.

Example:
    >>> pacer = RedrawPacer(min_interval=0.25, max_share=0.01)
    >>> pacer.due(now=0.0)
    True
    >>> pacer.record(started=0.0, finished=0.001); pacer.due(now=0.1)
    False
"""

from __future__ import annotations

import collections
import math
import statistics
import time

from mpnb.training.history import History
from mpnb.training.telemetry import Sink

__all__: list[str] = []


class RedrawPacer:
    """Paces redraws: at most one per ``min_interval`` seconds, stretched to cost / ``max_share``.

    The cost is the median of the last five redraws after the first (the first pays one-time
    costs: imports, the widget's first sync), so redrawing takes at most about ``max_share``
    of the training loop's time however slow the front end is.

    Attributes:
        interval: seconds the next redraw waits for.
        redraws: how many redraws were recorded.
    """

    def __init__(self, min_interval: float = 0.25, max_share: float = 0.01) -> None:
        self.min_interval, self.max_share = min_interval, max_share
        self.interval = min_interval
        self.redraws = 0
        self._last = -math.inf
        self._costs: collections.deque[float] = collections.deque(maxlen=5)

    def due(self, now: float) -> bool:
        """True when a redraw at ``now`` (``time.perf_counter()``) keeps to the pace."""
        return now - self._last >= self.interval

    def record(self, started: float, finished: float) -> None:
        """A redraw ran from ``started`` to ``finished``."""
        self.redraws += 1
        self._last = finished
        if self.redraws > 1:
            self._costs.append(finished - started)
            cost = statistics.median(self._costs)
            self.interval = max(self.min_interval, cost / self.max_share if self.max_share else 0.0)


class PacedPlot(Sink):
    """A telemetry sink that takes in every new row and redraws at the :class:`RedrawPacer`'s pace.

    Subclasses say how rows are taken in (``_ingest``) and drawn (``_draw``); the last
    redraw happens at ``close``, whatever the pace.
    """

    def __init__(self, min_interval: float = 0.25, max_share: float = 0.01) -> None:
        self.pacer = RedrawPacer(min_interval, max_share)

    @property
    def redraws(self) -> int:
        """How many redraws were sent."""
        return self.pacer.redraws

    def due(self, now: float) -> bool:
        return self.pacer.due(now)

    def update(self, history: History) -> None:
        self._ingest(history)
        if self.due(time.perf_counter()):
            self.redraw()

    def close(self, history: History) -> None:
        self._ingest(history)
        self.redraw()

    def redraw(self) -> None:
        """Draw now, and let the pacer know what it cost."""
        started = time.perf_counter()
        self._draw()
        self.pacer.record(started, time.perf_counter())

    def _ingest(self, history: History) -> None:
        raise NotImplementedError

    def _draw(self) -> None:
        raise NotImplementedError
