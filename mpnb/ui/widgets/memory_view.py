"""The dashboard's memory view: where a step of the running fit puts its memory, by category.

A button under the live dashboard counts the trainer's step on the batch it trained last (the
account of :mod:`mpnb.analysis.memory`: a shape-only copy of the model, nothing computed, the
fit untouched) and draws it as stacked bars, in the mode the fit trains in now. A click while
the fit runs is delivered between two optimizer steps, like Stop and Pause; press it again
after switching mode (``%amp fp16``) to see the difference.

Example:
    >>> import mpnb.examples as ex
    >>> trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    >>> view = MemoryView(trainer)
    >>> view.button.click()
    >>> view.note.value, view.figure
    ('train a step first: the view counts the batch trained last', None)
    >>> _ = trainer.fit(train, max_steps=1)
    >>> view.button.click()
    >>> [trace.name for trace in view.figure.data][:3]
    ['parameters', 'gradients', 'optimizer state']
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from mpnb.analysis.memory import MemoryReport, account_step
from mpnb.ui.plots.memory_figure import memory_figure

__all__: list[str] = []


class MemoryView:
    """A "memory by category" button and the bars it draws, for one trainer.

    Attributes:
        widget: what to display (the button, a note, the figure).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.button = widgets.Button(
            description="Memory by category",
            icon="bar-chart",
            tooltip="count a step on the last batch: parameters, gradients, activations...",
            layout=widgets.Layout(
                width="auto", flex="0 0 auto"
            ),  # the whole description, never cut
        )
        self.note = widgets.Label("")
        # made at the first count: each FigureWidget sends plotly.js (about 5 MB) to the page
        self.figure: go.FigureWidget | None = None
        self.widget = widgets.VBox([widgets.HBox([self.button, self.note])])
        self.button.on_click(lambda _: self.show())

    def show(self) -> None:
        """Count the step on the trainer's last batch and draw it."""
        batch = self.trainer.last_batch
        if batch is None:
            self.note.value = "train a step first: the view counts the batch trained last"
            return
        account = account_step(self.trainer, batch)
        drawn = memory_figure(MemoryReport([account], {}))
        if self.figure is None:
            self.figure = go.FigureWidget()
            self.widget.children = (*self.widget.children, self.figure)
        with self.figure.batch_update():
            self.figure.data = []
            self.figure.add_traces(list(drawn.data))
            self.figure.layout = drawn.layout
        how = "on shape-only tensors" if account.shape_only else "on the real step"
        self.note.value = f"step {self.trainer.amp.steps}, {account.mode}, counted {how}"
