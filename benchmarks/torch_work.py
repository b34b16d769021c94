"""A training loop's own time, read by subtraction: a block's time minus the time spent inside
torch's own calls of a training step (the model's forward, the loss, backward, the scaler, the
optimizer, autocast's entry and exit). What is left is the Python around those calls: the
loop's, and a helper's such as ``mpnb.Trainer``. Two loops that do the same torch work differ
only in what is left, and machine noise, which lands mostly inside torch's kernels, is mostly
subtracted away: on a shared 2-core machine where whole-block ratios move by 2-5% between runs,
the hand loop read against a second copy of itself leaves 0.3 us a step.

The wrappers cost a little themselves (the same on both sides, so it cancels in a difference):
compare a helper with the hand loop measured the same way, never with an unwrapped run. Build the
loops inside the ``with`` block, so that a loss function they hold is the wrapped one.

    >>> import torch
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = torch.optim.Adam(model.parameters())
    >>> with TorchWork() as work:
    ...     def block():
    ...         for _ in range(3):
    ...             torch.nn.functional.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)).backward()
    ...             optimizer.step()
    ...             optimizer.zero_grad()
    ...     left = work.left_per_step(block, steps=3)
    >>> 0 < left < 1e-3  # a few microseconds of loop Python a step
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from own_time import OwnTime
from paired_rounds import paired_rounds
from torch import nn

__all__ = ["TORCH_STEP_WORK", "TorchWork", "own_time_beyond"]

#: torch's own calls in a training step, as (owner, name) for :class:`~own_time.OwnTime`.
TORCH_STEP_WORK = [
    (nn.Module, "__call__"),  # the forward (inner modules' calls are inside the outer one's time)
    (nn.functional, "cross_entropy"),
    (nn.functional, "mse_loss"),
    (torch.Tensor, "backward"),
    (torch.optim.Adam, "step"),
    (torch.optim.Optimizer, "zero_grad"),
    (torch.amp.GradScaler, "scale"),
    (torch.amp.GradScaler, "step"),
    (torch.amp.GradScaler, "update"),
    (torch.autocast, "__enter__"),
    (torch.autocast, "__exit__"),
]


class TorchWork(OwnTime):
    """:class:`~own_time.OwnTime` over :data:`TORCH_STEP_WORK`."""

    def __init__(self) -> None:
        super().__init__(TORCH_STEP_WORK)

    def left_per_step(self, block: Callable[[], object], steps: int) -> float:
        """Seconds a step of ``block`` (``steps`` steps) spent outside torch's own calls."""
        self.seconds = 0.0
        start = time.perf_counter()
        block()
        return (time.perf_counter() - start - self.seconds) / steps


def own_time_beyond(
    work: TorchWork,
    reference: Callable[[], object],
    candidate: Callable[[], object],
    steps: int,
    rounds: int,
) -> float:
    """Seconds a step of ``candidate`` spends outside torch's own calls beyond what ``reference`` spends
    there (each a block of ``steps`` steps, built inside ``work``), over ``rounds`` paired rounds: each
    side's least disturbed round, as noise only adds time."""
    reference_left, candidate_left = paired_rounds(
        lambda _: work.left_per_step(reference, steps),
        lambda _: work.left_per_step(candidate, steps),
        rounds,
    )
    return min(candidate_left) - min(reference_left)
