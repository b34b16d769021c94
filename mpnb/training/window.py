"""The accumulation window being trained: what its micro-batches leave for the optimizer step.

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

import torch

from mpnb.training.step_clock import DeviceInterval

__all__: list[str] = []


class Window:
    """One accumulation window's state, from its first backward until its step is recorded.

    Attributes:
        open: a backward ran since the last recorded step: gradients may be there.
        micro_batches: backwards that finished.
        samples: the examples in them, as the loop said.
        loss_sum: their losses summed in fp32, on the device (None before the first).
        forward_times: each micro-batch's forward time.
        backward_unfinished: a backward raised half-way: the gradients hold part of a micro-batch.
        rescaled: a short window's gradients were rescaled to the mean of its micro-batches.
    """

    __slots__ = ("backward_unfinished", "forward_times", "loss_sum", "micro_batches", "open", "rescaled", "samples")

    def __init__(self) -> None:
        self.close()

    def close(self) -> None:
        """Forget everything: the next backward opens a new window."""
        self.open = self.backward_unfinished = self.rescaled = False
        self.micro_batches = self.samples = 0
        self.loss_sum: torch.Tensor | None = None
        self.forward_times: list[float | DeviceInterval] = []
