"""The precision lab: pick a model, the modes, batch size and steps, press Run, compare.

A widget app for JupyterLab and for Voila (``voila widgets/precision_lab.ipynb``). Run trains
the chosen example model once per mode with :func:`mpnb.analysis.comparison.compare`, draws the modes'
loss and step-time curves overlaid while they train, and ends with the comparison table (step time, speedup vs
fp32, throughput, peak memory, final loss, test accuracy, skipped steps).

Example:
    >>> lab = PrecisionLab()
    >>> lab.modes.value = ("fp32", "bf16"); lab.steps.value = 5; lab.dashboard = None
    >>> lab.run_button.click()
    >>> [row["mode"] for row in lab.comparison.rows()]
    ['fp32', 'bf16']
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import torch

import mpnb.examples as ex
from mpnb.analysis.comparison import Comparison, ModeResult, compare
from mpnb.errors import MpnbError
from mpnb.precision.backends import available_device_types
from mpnb.precision.modes import mode_names, parse_mode
from mpnb.ui.plots.compare_progress import LiveComparison

__all__ = ["PrecisionLab"]


class PrecisionLab:
    """The lab's controls, its output area and the last comparison.

    Attributes:
        widget: the whole app, to display.
        comparison: the last Run's :class:`~mpnb.analysis.comparison.Comparison`, or None.
        dashboard: ``"live"``: the modes' curves overlaid live while they train; None: no plot.

    Example (the choices it offers, and Run with no mode picked; the module's example runs one):
        >>> lab = PrecisionLab()
        >>> lab.model.options, lab.modes.options
        (('cnn', 'mlp', 'transformer'), ('fp32', 'tf32', 'fp16', 'bf16', 'fp8', 'mxfp8'))
        >>> lab.modes.value = ()
        >>> lab.run() is None, lab.status.value
        (True, "<span style='color:#b00020'>pick at least one mode</span>")
    """

    def __init__(self) -> None:
        self.model = widgets.Dropdown(options=list(ex.MODELS), value="cnn", description="model")
        self.device = widgets.Dropdown(options=available_device_types(), description="device")
        choices = tuple(  # the modes that run on a device this machine has (no nvfp4 on a CPU)
            name
            for name in mode_names()
            if not parse_mode(name).changes_nothing
            and any(not parse_mode(name).unavailable(torch.device(d)) for d in self.device.options)
        )
        self.modes = widgets.SelectMultiple(
            options=choices, value=("fp32", "bf16"), description="modes", rows=5
        )
        self.batch_size = widgets.IntSlider(
            value=64, min=16, max=512, step=16, description="batch size"
        )
        self.steps = widgets.IntSlider(value=60, min=5, max=1000, step=5, description="steps")
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.status = widgets.HTML()
        self.output = widgets.Output()
        self.table = widgets.HTML()
        controls = widgets.HBox(
            [
                widgets.VBox([self.model, self.device, self.modes]),
                widgets.VBox([self.batch_size, self.steps, self.run_button]),
            ]
        )
        self.widget = widgets.VBox([controls, self.status, self.table, self.output])
        self.comparison: Comparison | None = None
        self.dashboard: str | None = "live"
        self.run_button.on_click(lambda _: self.run())

    def run(self) -> Comparison | None:
        """Compare the chosen modes; show progress, then the table."""
        if not self.modes.value:
            self.status.value = "<span style='color:#b00020'>pick at least one mode</span>"
            return None
        self.run_button.disabled = True
        self.table.value = ""
        self.output.outputs = ()
        done: list[str] = []
        try:
            with self.output:
                self.comparison = compare(
                    self._make_run,
                    self.modes.value,
                    steps=self.steps.value,
                    warmup=min(5, self.steps.value),
                    progress=self._live_view(),
                    on_result=lambda result: self._progress(done, result),
                    metric_name="test accuracy",
                )
            self.table.value = self.comparison._repr_html_()
            self.status.value = f"done: {len(done)} mode(s), {self.steps.value} timed steps each"
        # a fit already running on this thread (Run pressed during a fit), say
        except MpnbError as error:
            self.status.value = (
                f"<span style='color:#b00020'>not run: {html.escape(str(error))}</span>"
            )
            return None
        finally:
            self.run_button.disabled = False
        return self.comparison

    def _make_run(self, mode: str):
        self.status.value = f"training in {html.escape(mode)}..."
        trainer, train, test = ex.example_trainer(
            mode,
            self.device.value,
            model=self.model.value,
            batch_size=self.batch_size.value,
            dashboard=None,
        )
        return trainer, train, lambda fitted: ex.accuracy(fitted.model, test, fitted.device)

    def _live_view(self) -> LiveComparison | None:
        """The overlaid live curves, shown in the output area (None when ``dashboard`` is None)."""
        if self.dashboard is None:
            return None
        from IPython.display import display

        view = LiveComparison(self.modes.value, show_table=False)
        display(view.widget)
        return view

    def _progress(self, done: list[str], result: ModeResult) -> None:
        done.append(result.mode)
        self.status.value = f"finished {', '.join(done)}"

    def show(self) -> PrecisionLab:
        """Display the app (the notebook's one call)."""
        from IPython.display import display

        display(self.widget)
        return self
