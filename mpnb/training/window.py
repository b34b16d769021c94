"""The accumulation window being trained: where its gradients stand before the optimizer step.

A window goes through one phase at a time (:class:`WindowPhase`); each method here is one move
between phases, and refuses the moves that would train on gradients nobody can account for.
What a step measures (its losses, examples and times) is the step account's
(:mod:`mpnb.training.step_record`); this is the recipe's state.

Example:
    >>> window = Window()
    >>> window.phase
    <WindowPhase.EMPTY: 'empty'>
    >>> window.start_backward(); window.end_backward()
    >>> window.phase, window.micro_batches
    (<WindowPhase.ACCUMULATING: 'accumulating'>, 1)
    >>> window.close()
    >>> window.phase, window.micro_batches
    (<WindowPhase.EMPTY: 'empty'>, 0)
"""

from __future__ import annotations

import enum

__all__: list[str] = []

_DISCARD = "discard_window() drops the window"


class WindowPhase(enum.Enum):
    """Where an accumulation window stands.

    ``EMPTY``: no backward since the last recorded step; the gradients are None.
    ``FORWARD``: a :meth:`~mpnb.AmpStep.train_step` forward is running (inside any other phase
    but ``BACKWARD`` and ``RESCALED``; the window returns to that phase when it ends).
    ``BACKWARD``: a backward is running, or raised half-way: the gradients hold part of a
    micro-batch, and only :meth:`Window.close` (a discard) leaves this phase after a failure.
    ``ACCUMULATING``: one or more backwards finished, each adding its gradients at
    ``1/accumulate``.
    ``RESCALED``: a window the data ended early was rescaled to the mean of its micro-batches and
    waits for its optimizer step (a retry after a failed step does not rescale again).
    """

    EMPTY = "empty"
    FORWARD = "forward"
    BACKWARD = "backward"
    ACCUMULATING = "accumulating"
    RESCALED = "rescaled"


#: The phases in which a window takes a new micro-batch (each other phase's refusal says why).
#: Tested by identity, not set membership: an Enum member's hash is a Python call, twice a step.
# each phase as a global: read at every micro-batch, where an enum's class attribute costs more
_EMPTY, _FORWARD, _BACKWARD = WindowPhase.EMPTY, WindowPhase.FORWARD, WindowPhase.BACKWARD
_ACCUMULATING, _RESCALED = WindowPhase.ACCUMULATING, WindowPhase.RESCALED


class Window:
    """One accumulation window, from its first backward until its step is recorded.

    Attributes:
        phase: where the window stands (:class:`WindowPhase`).
        micro_batches: backwards that finished.
    """

    __slots__ = ("_before_forward", "micro_batches", "phase")

    def __init__(self) -> None:
        self._before_forward = _EMPTY
        self.close()

    def close(self) -> None:
        """Forget everything (the step was recorded, or the window discarded): the next backward
        opens a new window."""
        self.phase = _EMPTY
        self.micro_batches = 0

    @property
    def is_open(self) -> bool:
        """A backward ran since the last recorded step, or a forward is running: the optimizer's
        gradients or the mode must not change now."""
        return self.phase is not _EMPTY

    def start_forward(self) -> None:
        """A :meth:`~mpnb.AmpStep.train_step` forward begins.

        Raises:
            RuntimeError: another forward of this window is running, or the window cannot take
                another micro-batch (see :meth:`start_backward`).
        """
        phase = self.phase
        if phase is not _EMPTY and phase is not _ACCUMULATING:  # on the way of every micro-batch
            if phase is _FORWARD:
                raise RuntimeError(
                    "AmpStep.train_step() called from inside the forward of another train_step()"
                )
            self._refuse_more()
        self._before_forward, self.phase = phase, _FORWARD

    def end_forward(self) -> None:
        """The forward returned or raised: the window is where it was before it."""
        self.phase = self._before_forward

    def start_backward(self) -> None:
        """A backward begins: until :meth:`end_backward`, the gradients hold part of it.

        Raises:
            RuntimeError: a backward of this window failed half-way, or the window was rescaled
                for a step that has not happened: adding gradients to either would train on a
                sum nobody asked for. Nothing changes.
        """
        phase = self.phase
        if phase is not _EMPTY and phase is not _ACCUMULATING:
            self._refuse_more()
        self.phase = _BACKWARD

    def end_backward(self) -> None:
        """The backward returned: its micro-batch is in the gradients."""
        self.phase = _ACCUMULATING
        self.micro_batches += 1

    def check_steppable(self) -> None:
        """Raise unless every backward of the window finished.

        Raises:
            RuntimeError: a backward failed half-way, leaving part of its gradients.
        """
        if self.phase is _BACKWARD:
            raise RuntimeError(
                "a backward of this accumulation window failed half-way, leaving part of its "
                f"gradients: {_DISCARD}"
            )

    def mark_rescaled(self) -> None:
        """The window's gradients were rescaled to the mean of its micro-batches."""
        self.phase = _RESCALED

    def _refuse_more(self) -> None:
        self.check_steppable()
        if self.phase is _RESCALED:
            raise RuntimeError(
                f"this accumulation window was rescaled to the mean of its {self.micro_batches} "
                "micro-batches for an optimizer step that failed: finish_window() retries the "
                f"step, {_DISCARD}"
            )
