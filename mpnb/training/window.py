"""The accumulation window being trained: where its gradients stand before the optimizer step.

What a step measures (its losses, examples and times) is the step account's
(:mod:`mpnb.training.step_record`); this is the recipe's state.

Example:
    >>> window = Window()
    >>> window.micro_batches += 1
    >>> window.open, window.micro_batches
    (False, 1)
    >>> window.close()
    >>> window.micro_batches
    0
"""

from __future__ import annotations

__all__: list[str] = []


class Window:
    """One accumulation window's state, from its first backward until its step is recorded.

    Attributes:
        open: a backward ran since the last recorded step: gradients may be there.
        micro_batches: backwards that finished.
        backward_unfinished: a backward raised half-way: the gradients hold part of a micro-batch.
        rescaled: a short window's gradients were rescaled to the mean of its micro-batches.
    """

    __slots__ = ("backward_unfinished", "micro_batches", "open", "rescaled")

    def __init__(self) -> None:
        self.close()

    def close(self) -> None:
        """Forget everything: the next backward opens a new window."""
        self.open = self.backward_unfinished = self.rescaled = False
        self.micro_batches = 0
