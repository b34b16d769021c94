"""The dashboard's remedy: when a skipped step's origin is named, a button that runs that
module in float32 from the next step.

The button appears under the live dashboard of a Trainer, or of a framework's loop
(transformers, Lightning, Accelerate), at the first ``"origin"`` event of its history
(:mod:`mpnb.numerics.origin`) and calls its ``keep_in_fp32``
(:meth:`mpnb.Trainer.keep_in_fp32`). A click while the fit runs is delivered between two
optimizer steps, like Stop and Pause; the module is put back when the fit ends.

Example:
    >>> import mpnb.examples as ex
    >>> from mpnb.training.history import History
    >>> trainer, _, _ = ex.example_trainer("fp16", "cpu", widths=(4, 8), dashboard=None)
    >>> view = RemedyView(trainer)
    >>> view.button.layout.display
    'none'
    >>> trainer.history.note("step 1 skipped: ...", kind="origin", module="DigitsCNN.classifier")
    >>> view.update(trainer.history)
    >>> view.button.description, view.button.layout.display
    ('Run classifier in fp32', None)
    >>> view.button.click()
    >>> view.note.value
    'classifier runs in fp32 from the next step, until the fit ends'
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from mpnb.errors import MpnbError
from mpnb.numerics.origin import ORIGIN_KIND
from mpnb.training.history import History
from mpnb.training.telemetry import Sink

__all__: list[str] = []


class RemedyView(Sink):
    """A button offering the remedy for the last named origin of ``trainer``'s history
    (``trainer``: a Trainer, or a framework loop's telemetry).

    Attributes:
        widget: what to display (hidden until an origin is named).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.module: str | None = None
        self.button = widgets.Button(
            icon="wrench", tooltip="autocast off inside this module, its inputs cast up"
        )
        self.button.layout.display = "none"
        self.note = widgets.Label("")
        self.widget = widgets.HBox([self.button, self.note])
        self.button.on_click(lambda _: self.apply())

    def update(self, history: History) -> None:
        """Offer the remedy for the latest origin named in a module."""
        named = [e for e in history.events if e.get("kind") == ORIGIN_KIND and e.get("module")]
        if not named or named[-1]["module"] == self.module:
            return
        self.module = named[-1]["module"]
        short = self.module.split(".", 1)[1] if "." in self.module else self.module
        self.button.description = f"Run {short} in fp32"
        self.button.layout.display = None
        self.button.disabled = False
        self.note.value = f"step {named[-1]['step']}: {named[-1]['message']}"

    def apply(self) -> None:
        """Keep the module in float32 from the next step (see :meth:`mpnb.Trainer.keep_in_fp32`)."""
        if self.module is None:
            return
        try:
            found = self.trainer.keep_in_fp32(self.module)
        except MpnbError as error:
            self.note.value = str(error)
            return
        self.button.disabled = True
        self.note.value = f"{found} runs in fp32 from the next step, until the fit ends"
