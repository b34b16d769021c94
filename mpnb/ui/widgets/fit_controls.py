"""Stop and Pause / Resume buttons for a running fit, shown above its live dashboard.

The buttons call :class:`~mpnb.training.control.FitControl` and nothing else; the fit
honours them between optimizer steps. While the fit runs, a
:class:`~mpnb.ui.widgets.events.KernelEventPump` delivers the clicks (and the control panel's
switches) to the busy kernel.

Example:
    >>> from mpnb.training.control import FitControl
    >>> control = FitControl()
    >>> buttons = FitButtons(control)
    >>> buttons.stop_button.click()
    >>> control.stop_requested, buttons.state_label.value
    (True, 'stopping after this step')
"""

from __future__ import annotations

import ipywidgets as widgets

from mpnb.training.control import FitControl
from mpnb.training.history import History
from mpnb.training.telemetry import Sink
from mpnb.ui.widgets.events import KernelEventPump

__all__: list[str] = []

_STATE_TEXT = {
    "idle": "finished",
    "running": "running",
    "paused": "paused between steps",
    "stopping": "stopping after this step",
    "abandoned": "ended: its cell raised an error",
}


class FitButtons(Sink):
    """The Stop and Pause / Resume buttons of one fit, and the pump that delivers their clicks.

    Attributes:
        widget: the row of buttons to display.
    """

    def __init__(self, control: FitControl, pump: KernelEventPump | None = None) -> None:
        self.control = control
        self.pump = pump or KernelEventPump()
        self.stop_button = widgets.Button(
            description="Stop", icon="stop", tooltip="finish this step, keep everything"
        )
        self.pause_button = widgets.ToggleButton(
            description="Pause", icon="pause", tooltip="hold between steps"
        )
        self.state_label = widgets.Label(_STATE_TEXT[control.state])
        self.widget = widgets.HBox([self.stop_button, self.pause_button, self.state_label])
        self.stop_button.on_click(lambda _: control.stop())
        self.pause_button.observe(self._on_pause, "value")
        control.pollers.append(self.pump)
        control.on_state.append(self._show_state)

    def _on_pause(self, change: dict) -> None:
        if change["new"]:
            self.control.pause()
        else:
            self.control.resume()

    def _show_state(self, state: str) -> None:
        if self.state_label.value == _STATE_TEXT["abandoned"] and state == "idle":
            return  # the fit's owner ended it after its cell raised: that stays said
        self.state_label.value = _STATE_TEXT[state]
        self.pause_button.description = "Resume" if state == "paused" else "Pause"
        self.pause_button.icon = "play" if state == "paused" else "pause"
        if state in ("idle", "stopping", "abandoned"):
            self.stop_button.disabled = self.pause_button.disabled = True

    def close(self, history: History) -> None:
        """The fit ended: stop pumping and let go of the control."""
        self.pump.close()
        if self.pump in self.control.pollers:
            self.control.pollers.remove(self.pump)
        if self._show_state in self.control.on_state:
            self.control.on_state.remove(self._show_state)
        self._show_state("idle")
