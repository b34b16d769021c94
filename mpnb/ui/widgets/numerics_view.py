"""The dashboard's numerics view: the numerics watch's heatmaps, redrawn live as the fit runs.

Under the live dashboard of a Trainer (or of a framework's loop) that watches numerics
(``Trainer(watch_numerics=k)``, ``MpnbCallback(watch_numerics=k)``): at
each telemetry flush the sampled steps read so far are drawn, a row a module (headroom to the
dtype's limit, fp16-underflow share; :mod:`mpnb.ui.plots.numerics_figure`), and when an
overflow's origin is named (:mod:`mpnb.numerics.origin`) a cross marks its module at
that step. It reads what the watch already brought to the host: drawing adds no device work.

Example:
    >>> import mpnb.examples as ex
    >>> trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None,
    ...                                        watch_numerics=2)
    >>> view = trainer.dashboard = NumericsView(trainer)  # a live dashboard carries it
    >>> _ = trainer.fit(train, max_steps=4)
    >>> view.figure.data[0].x, view.note.value
    ((2, 4), 'sampled steps 2-4, 7 modules')
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from mpnb.numerics.origin import ORIGIN_KIND
from mpnb.training.history import History
from mpnb.training.telemetry import Sink
from mpnb.ui.plots.live import fill_output_width
from mpnb.ui.plots.numerics_figure import OriginCell, numerics_heatmap

__all__: list[str] = []


class NumericsView(Sink):
    """The live heatmaps of ``trainer``'s numerics watch (:attr:`mpnb.Trainer.numerics`).

    The watch is on in every fit, but a short fit may sample no step: the figure (a plotly
    FigureWidget, whose state carries plotly.js to the page) is made at the first sampled step.

    Attributes:
        widget: what to display (a note, and the figure from the first sampled step on).
        figure: the heatmaps' FigureWidget; None until a step was sampled.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.note = widgets.Label("numerics: waiting for the first sampled step")
        self.figure: go.FigureWidget | None = None
        self.widget = widgets.VBox([self.note])
        self._drawn: tuple[int, OriginCell | None] = (0, None)

    def update(self, history: History) -> None:
        """Redraw when the watch has read new sampled steps or an origin was named."""
        log = self.trainer.numerics
        if log is None or not log.steps:
            return
        origin = _last_origin(history)
        if (len(log.steps), origin) == self._drawn:
            return
        self._drawn = (len(log.steps), origin)
        drawn = numerics_heatmap(log, origin)
        if self.figure is None:
            self.figure = go.FigureWidget()
            self.widget.children = (self.note, self.figure)
        with self.figure.batch_update():
            self.figure.data = []
            self.figure.layout = drawn.layout
            self.figure.add_traces(list(drawn.data))
        fill_output_width(self.figure)  # its layout was replaced: its width with it
        span = f"{log.steps[0]}-{log.steps[-1]}" if len(log.steps) > 1 else f"{log.steps[0]}"
        self.note.value = f"sampled steps {span}, {len(log.modules)} modules" + (
            f"; overflow began in {origin[0]} at step {origin[1]}" if origin else ""
        )

    def close(self, history: History) -> None:
        self.update(history)


def _last_origin(history: History) -> OriginCell | None:
    """The module (without the root's class) and step of the history's last named origin."""
    named = [e for e in history.events if e.get("kind") == ORIGIN_KIND and e.get("module")]
    if not named:
        return None
    module = named[-1]["module"]
    return (module.split(".", 1)[1] if "." in module else module), named[-1]["step"]
