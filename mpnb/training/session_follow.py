"""A running fit follows the session's switches (mode, fp32 math, op lists), made from the
control panel or a widget while it trains, at the next step boundary; each one it follows is a
``"switch"`` event on the history. A switch of mode or op lists is how an overflow is ended
mid-fit: an fp16 loss scale the skips lowered goes back to its initial scale then
(:meth:`~mpnb.training.amp_step.AmpStep.scale_back`).

Only what still differs at the step boundary is followed: a scoped switch in model code
(``with mpnb.tf32(False):``) is entered and left within a step and changes nothing here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpnb.errors import MpnbError
from mpnb.precision.names import Fp32Math
from mpnb.precision.policy import session
from mpnb.training.step_precision import TrainingPrecision

if TYPE_CHECKING:
    from mpnb.training.trainer_protocols import Switched

__all__: list[str] = []

#: What :func:`session_wishes` returns, in order, named as the session's change notices name them.
WISHES = ("mode", "fp32_math", "oplists")


def session_wishes() -> tuple[Any, ...]:
    """What a running fit follows: the session's mode and device, fp32-math wish, op lists."""
    snapshot = session.snapshot()
    return (snapshot.mode, snapshot.device), snapshot.fp32_wish, session.oplists.lists.copy()


class SessionFollower:
    """Applies the session's switches to ``trainer`` (an :class:`~mpnb.training.trainer.Trainer`)."""

    def __init__(self, trainer: Switched) -> None:
        self.trainer = trainer
        self.followed: tuple[Any, ...] = ()  # the session's wishes the fit last followed

    def restart(self) -> None:
        """A fit starts: what the session wishes now is what it trains with."""
        self.followed = session_wishes()

    def follow(self, changed: tuple[str, ...]) -> None:
        """Apply the switches named in ``changed`` that still differ, before the next step."""
        if not changed:
            return
        trainer = self.trainer
        followed, self.followed = self.followed, session_wishes()
        changed = tuple(
            what for what, old, new in zip(WISHES, followed, self.followed) if old != new
        )
        next_step = trainer.amp.steps + 1
        if "mode" in changed:
            try:
                self.switch_to(TrainingPrecision.resolve(None, trainer.device), next_step)
            except MpnbError as error:
                trainer.history.note(f"mode not switched: {error}", kind="switch", step=next_step)
        if "fp32_math" in changed and "mode" not in changed:  # a new mode brings its own fp32 math
            level = session.fp32_math.level
            owner = trainer.mode.with_fp32_math(level is Fp32Math.REDUCED)
            if (
                owner is not None
            ):  # the fit's mode owns the flags (fp32, tf32): move between the two
                self.switch_to(TrainingPrecision.resolve(owner, trainer.device), next_step)
            else:
                trainer.history.note(
                    f"fp32 math {level.value if level else 'as found'}",
                    kind="switch",
                    step=next_step,
                )
        if "oplists" in changed:
            lists = session.oplists.lists
            text = f"lower {len(lists.lower)}, fp32 {len(lists.fp32)}" if lists else "none"
            trainer.history.note(f"op lists: {text}", kind="switch", step=next_step)
        if "mode" in changed or "oplists" in changed:
            trainer.amp.scale_back("the precision changed", step=next_step)

    def switch_to(self, precision: TrainingPrecision, next_step: int) -> None:
        """Train in ``precision`` from ``next_step`` on (its fp32-math scope replaces the old one)."""
        trainer = self.trainer
        if precision.mode == trainer.mode:
            return
        message = f"mode {trainer.mode.label} -> {precision.mode.label}"
        trainer.use_precision(precision)
        trainer.history.note(message, kind="switch", step=next_step, mode=precision.mode.label)
