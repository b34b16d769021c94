"""A sink that presses Stop, as the dashboard's button would, once a run has ``step`` rows."""

from __future__ import annotations

from mpnb.training.telemetry import Sink


class StopAt(Sink):
    def __init__(self, callback, step):
        self.callback, self.step = callback, step

    def update(self, history):
        if len(history) >= self.step:
            self.callback.control.stop()
