"""The dashboard's remedy: when a skipped step's origin is named, a button that runs that
module in float32 from the next step.

The button appears under the live dashboard of a Trainer, or of a framework's loop
(transformers, Lightning, Accelerate), at the first ``"origin"`` event of its history
(:mod:`mpnb.numerics.origin`) and calls its ``keep_in_fp32``
(:meth:`mpnb.Trainer.keep_in_fp32`). A click while the fit runs is delivered between two
optimizer steps, like Stop and Pause; the module is put back when the fit ends. When the fit has
ended, a Trainer's button stays: a click then keeps the module from the next fit's first step (the
model is not changed between fits); a framework loop's is disabled, its run being over. The
button says the module's whole name; the note beside it says the origin as the history does,
its step once.

Example:
    >>> import mpnb.examples as ex
    >>> from mpnb.training.history import History
    >>> trainer, _, _ = ex.example_trainer("fp16", "cpu", widths=(4, 8), dashboard=None)
    >>> view = RemedyView(trainer, waits_between_fits=True)
    >>> view.button.layout.display
    'none'
    >>> trainer.history.note("step 1 skipped: ...", kind="origin", step=1, module="DigitsCNN.classifier")
    >>> view.update(trainer.history)
    >>> view.button.description, view.button.layout.display, view.note.value
    ('Run classifier in fp32', None, 'step 1 skipped: ...')
    >>> view.button.click()  # no fit runs: it waits for the next one
    >>> view.note.value, "forward" in vars(trainer.model.classifier)
    ("classifier runs in fp32 from the next fit's first step, until that fit ends", False)
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from mpnb.errors import MpnbError
from mpnb.numerics.origin import ORIGIN_KIND
from mpnb.training.control import FitState
from mpnb.training.history import History
from mpnb.training.telemetry import Sink
from mpnb.ui.plots.figure import event_text

__all__: list[str] = []


class RemedyView(Sink):
    """A button offering the remedy for the last named origin of ``trainer``'s history
    (``trainer``: a Trainer, or a framework loop's telemetry).

    Args:
        trainer: what the remedy is asked of (its ``keep_in_fp32`` and ``control``).
        waits_between_fits: asked for after the fit ended, the remedy waits for the next fit
            (a Trainer); otherwise the button is disabled when the run ends.

    Attributes:
        widget: what to display (hidden until an origin is named).
    """

    def __init__(self, trainer: Any, *, waits_between_fits: bool = False) -> None:
        self.trainer = trainer
        self.waits_between_fits = waits_between_fits
        self.module: str | None = None
        self.button = widgets.Button(
            icon="wrench",
            tooltip="autocast off inside this module, its inputs cast up",
            layout=widgets.Layout(
                width="auto", flex="0 0 auto"
            ),  # the module's whole name, never cut
        )
        self.button.layout.display = "none"
        self.note = widgets.Label("")
        self.widget = widgets.HBox([self.button, self.note])
        self.button.on_click(lambda _: self.apply())

    def update(self, history: History) -> None:
        """Offer the remedy for the latest origin named in a module; once it is applied (by the
        button or by code), say from which step."""
        named = [e for e in history.events if e.get("kind") == ORIGIN_KIND and e.get("module")]
        if named and named[-1]["module"] != self.module:
            self.module = named[-1]["module"]
            short = _short(self.module)
            self.button.description = f"Run {short} in fp32"
            self.button.tooltip = f"run {short} with autocast off inside it, its inputs cast up"
            self.button.layout.display = None
            self.button.disabled = False
            self.note.value = event_text(named[-1])  # its step said once, as the dashboard does
        kept = self._kept(history)
        if kept is not None:
            self.button.disabled = True
            self.note.value = f"{event_text(kept)}, until the fit ends"

    def close(self, history: History) -> None:
        """The fit ended: say what a click does now (or disable the button: see the class)."""
        self.update(history)
        if self.module is None:
            return
        short = _short(self.module)
        if self.waits_between_fits:  # a remedy lasts its fit: offered again for the next
            self.button.disabled = False
            self.note.value = f"the fit ended: a click runs {short} in fp32 in the next fit"
        else:
            self.button.disabled = True
            self.note.value = f"the run ended: {short} can be kept in fp32 while a run trains"

    def _kept(self, history: History) -> dict | None:
        """The switch that keeps this view's module in fp32, if one came after its origin."""
        if self.module is None:
            return None
        short = _short(self.module)
        origin_at = max(
            e["step"] for e in history.events if e.get("kind") == ORIGIN_KIND and e.get("module")
        )
        return next(
            (
                e
                for e in reversed(history.events)
                if e.get("kind") == "switch" and e.get("module") == short and e["step"] > origin_at
            ),
            None,
        )

    def apply(self) -> None:
        """Keep the module in float32 from the next step (see :meth:`mpnb.Trainer.keep_in_fp32`),
        or from the next fit's first step when none runs."""
        if self.module is None:
            return
        running = self.trainer.control.state is not FitState.IDLE
        try:
            found = self.trainer.keep_in_fp32(self.module)
        except MpnbError as error:
            self.note.value = str(error)
            return
        self.button.disabled = True
        self.note.value = (
            f"{found} runs in fp32 from the next step, until the fit ends"
            if running
            else f"{found} runs in fp32 from the next fit's first step, until that fit ends"
        )


def _short(module: str) -> str:
    """The module's name inside the model (an origin's name starts with the root's class)."""
    return module.split(".", 1)[1] if "." in module else module
