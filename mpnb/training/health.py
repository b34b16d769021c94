"""Say when a run stops learning: a non-finite loss on a step the optimizer took, a collapsed loss
scale, an update whose gradients are all zero; and give a collapsed scale back when the overflow
that lowered it is gone.

Checked on the values the recorder has already brought to the host (no read of its own): a
:class:`HealthWatch` is a :class:`~mpnb.training.telemetry.Sink`. At the first problem of each
kind it puts an event on the history (the dashboard marks it) and, as ``on_nonfinite`` says,
warns (``"warn"``, the default), asks the loop to stop (``"stop"``: :attr:`HealthWatch.stop`
turns True; the Trainer ends the fit after that step), or only records (``"ignore"``).

- *non-finite loss*: a NaN or inf loss on a step that was not skipped. In fp16 an overflowing
  step's loss is often inf and GradScaler skips it: that is loss scaling working, not a
  problem. In bf16 and fp32 there is no scaler: the NaN reaches the weights.
- *collapsed scale*: the fp16 loss scale fell below 1 (from 65536 by default, that is 17
  overflowing steps in a row): gradients overflow at every scale, and every step is skipped.
- *zero gradients*: a step was taken while the scale stood below 1 (the scaled gradients
  underflow fp16 to zero), or its recorded gradient norm is 0: the weights do not move.

A change that ends an overflow mid-fit (the remedy of :mod:`mpnb.numerics.fp32_modules`, a
switch of mode or op lists) leaves behind the scale the skips lowered, too small to train at:
:func:`scale_back` puts it back to the scaler's initial scale, as an event on the history.

Example:
    >>> from mpnb.training.history import History
    >>> history, watch = History(), HealthWatch("ignore")
    >>> history.extend({"step": [1, 2], "loss": [0.5, float("nan")], "skipped": [False, False]})
    >>> watch.update(history)
    >>> [event["kind"] for event in history.events], history.events[0]["step"]
    (['nonfinite'], 2)
"""

from __future__ import annotations

import math

import torch

from mpnb.errors import InvalidChoiceError, warn_user
from mpnb.training.history import History
from mpnb.training.step_watch import initial_scale, scale_in_use
from mpnb.training.telemetry import Sink

__all__: list[str] = []

ON_NONFINITE = ("warn", "stop", "ignore")
#: A loss scale below this has collapsed: the loss is scaled down, and steps are still skipped.
COLLAPSED_SCALE = 1.0
#: The kind of the event :func:`scale_back` notes (a dashboard marks it).
SCALE_BACK_KIND = "scale"
#: What to try, by the mode the step ran in.
ADVICE = {
    "fp16": "try bf16, keep the op that overflows in fp32 (%oplist), or lower the learning rate",
    "bf16": "keep the op that overflows in fp32 (%oplist), lower the learning rate, or clip gradients",
    "": "lower the learning rate, clip gradients (clip_grad_norm), or look for an op that gives inf or NaN",
}


class HealthWatch(Sink):
    """Find the first non-finite loss and the first collapsed scale in the recorded rows.

    Args:
        on_nonfinite: ``"warn"``, ``"stop"`` or ``"ignore"``.

    Attributes:
        stop: True once a problem was found under ``on_nonfinite="stop"``.
        found: the kinds found so far (``"nonfinite"``, ``"collapse"``, ``"zero_gradients"``),
            each reported once until :meth:`restart` (each ``fit`` restarts it) or, for the
            last two, :meth:`rearm` (a scale given back).
    """

    def __init__(self, on_nonfinite: str = "warn") -> None:
        if on_nonfinite not in ON_NONFINITE:
            raise InvalidChoiceError("on_nonfinite", on_nonfinite, ON_NONFINITE)
        self.on_nonfinite = on_nonfinite
        self.stop = False
        self.found: set[str] = set()
        self._checked = 0

    def update(self, history: History) -> None:
        losses, skips, scales, unread_losses, norms = (
            history.loss,
            history.skipped,
            history.loss_scale,
            history.loss_missing,
            history.grad_norm,
        )
        start, self._checked = self._checked, len(history)
        if (
            all(map(math.isfinite, losses[start:]))  # the usual flush: nothing to report
            and min(scales[start:], default=math.inf) >= COLLAPSED_SCALE
            and 0.0 not in norms[start:]
        ):
            return
        for index in range(start, len(history)):
            loss, skipped, scale = losses[index], skips[index], scales[index]
            step = history.step[index]
            unread = unread_losses[index]  # NaN that stands for "unknown", not a diverged loss
            if (
                "nonfinite" not in self.found
                and not (skipped or unread)
                and not math.isfinite(loss)
            ):
                self._report(
                    history, index, "nonfinite", f"loss is {loss} at step {history.step[index]}"
                )
            if "collapse" not in self.found and scale < COLLAPSED_SCALE:
                self._report(
                    history,
                    index,
                    "collapse",
                    f"loss scale collapsed to {scale:g} at step {step}: gradients overflow fp16 at "
                    "every scale, so steps are skipped",
                )
            if "zero_gradients" not in self.found and not skipped:
                if scale < COLLAPSED_SCALE:
                    self._report(
                        history,
                        index,
                        "zero_gradients",
                        f"step {step} was taken at loss scale {scale:.2g}: its scaled gradients "
                        "underflow fp16 to zero, so the weights barely move",
                    )
                elif norms[index] == 0.0:
                    self._report(
                        history,
                        index,
                        "zero_gradients",
                        f"gradient norm 0 at step {step}: every gradient is zero, so the weights "
                        "do not move",
                    )
        self._checked = len(history)

    def _report(self, history: History, index: int, kind: str, what: str) -> None:
        self.found.add(kind)
        # where the last located overflow began (the origin) and what to call for it, when a
        # replay or the watched steps named it; else the mode's general advice
        named = [e for e in history.events if e.get("kind") == "origin" and "origin" in e]
        where = f" (step {named[-1]['step']}: {named[-1]['origin']})" if named else ""
        remedy = named[-1].get("remedy") if named else None
        advice = f"remedy: {remedy}" if remedy else ADVICE.get(history.mode[index], ADVICE[""])
        message = f"{what}{where}; {advice}"
        if self.on_nonfinite == "stop":
            self.stop = True
            message += " (stopping: on_nonfinite='stop')"
        history.note(message, kind=kind, step=history.step[index])
        if self.on_nonfinite != "ignore":
            warn_user(message)

    def rearm(self) -> None:
        """Report a collapsed scale and zero gradients again (the scale was given back)."""
        self.found -= {"collapse", "zero_gradients"}

    def restart(self, history: History) -> None:
        """Check only rows recorded from now on, and report again (a new fit on a continued history)."""
        self._checked = len(history)
        self.stop = False
        self.found.clear()


def scale_back(
    scaler: torch.amp.GradScaler | None, history: History, step: int, cause: str
) -> bool:
    """Put a loss scale that overflowing steps lowered back to the scaler's initial scale, noted on
    ``history`` as a ``"scale"`` event at ``step`` (the first step to use it); ``cause`` says what ended the overflow. Call it
    between two optimizer steps, after a change that ends the overflow (a remedy, a switch): at a
    collapsed scale every gradient underflows, and GradScaler alone would take thousands of steps
    to grow it back. True when the scale was put back; nothing changes when it stands at its
    initial scale or above, or without an enabled scaler. One host read of the scale.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> _ = scaler.scale(torch.ones(()))  # the scale tensor exists from the first use
        >>> scaler.update(new_scale=2.0**-40)  # forty overflowing steps later
        >>> history = History()
        >>> scale_back(scaler, history, 41, "the remedy ended the overflow"), scaler.get_scale()
        (True, 1024.0)
        >>> history.events[0]["message"]
        'loss scale back to 1024 from 9.1e-13: the remedy ended the overflow'
    """
    if scaler is None or not scaler.is_enabled():
        return False
    scale, initial = float(scale_in_use(scaler)), initial_scale(scaler)
    if scale >= initial:
        return False
    scaler.update(new_scale=initial)
    history.note(
        f"loss scale back to {initial:g} from {scale:.2g}: {cause}",
        kind=SCALE_BACK_KIND,
        step=step,
        scale=initial,
    )
    return True
