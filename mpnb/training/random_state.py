"""torch's random state, on the CPU and on the accelerator, taken and put back as one.

What the analyses run on a user's model must not change the user's random stream, and runs
they compare must draw as they would alone: the advisor starts each pass from one state,
the comparison gives each mode a state of its own.

Example:
    >>> import torch
    >>> start = RandomState.capture("cpu")
    >>> first = torch.rand(2)
    >>> start.restore()
    >>> torch.equal(torch.rand(2), first)
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

__all__: list[str] = []

#: The largest seed ``torch.manual_seed`` takes (its range: 0 to 2**64 - 1).
LARGEST_SEED = 2**64 - 1


@dataclasses.dataclass(frozen=True)
class RandomState:
    """torch's CPU generator state, and every ``device_type`` generator's where it is initialised."""

    device_type: str
    cpu: torch.Tensor
    devices: Any = None  # the accelerator's per-device states; None on a CPU

    @classmethod
    def capture(cls, device_type: str) -> RandomState:
        """The state in force now (reading an accelerator's state initialises it, as its first use would)."""
        if device_type == "cpu":
            return cls(device_type, torch.get_rng_state())
        return cls(
            device_type,
            torch.get_rng_state(),
            torch.get_device_module(device_type).get_rng_state_all(),
        )

    def restore(self) -> None:
        """Put this state back."""
        torch.set_rng_state(self.cpu)
        if self.devices is not None:
            torch.get_device_module(self.device_type).set_rng_state_all(self.devices)


@contextlib.contextmanager
def kept_random_state(device_type: str) -> Iterator[RandomState]:
    """Whatever the block draws, the state is as found afterwards (errors and interrupts too)."""
    saved = RandomState.capture(device_type)
    try:
        yield saved
    finally:
        saved.restore()
