"""Modes that are slow on a device, said before a run starts, with a measured estimate of its length.

fp16 convolutions have no fast kernels on CPUs: a CNN's fp16 step there takes many times its
fp32 step. A CPU without bf16 units emulates bf16 (the example CNN's bf16 step ~8x its fp32
step), as the hardware probe of ``%amp`` finds. Rather than leave a user staring at a crawling progress bar, ``mpnb train`` and
``mpnb compare`` say so up front, with how long the run will take, measured on one step of a
copy of the model (the run itself is untouched: same weights, same random state).

Example:
    >>> import mpnb.examples as ex
    >>> trainer, train, _ = ex.example_trainer("fp16", "cpu", widths=(4, 8), dashboard=None)
    >>> slow_reason(trainer)
    'fp16 convolutions have no fast CPU kernels'
    >>> notice = slow_mode_notice(trainer, next(iter(train)), steps=100)
    >>> notice.startswith("fp16 convolutions have no fast CPU kernels: about ")
    True
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any

import torch

from mpnb.training.batches import batch_loss, to_device
from mpnb.training.random_state import kept_random_state

if TYPE_CHECKING:
    from mpnb.training.trainer import Trainer

__all__: list[str] = []


def slow_reason(trainer: Trainer) -> str | None:
    """Why the trainer's mode is slow on its device, or None when it is not known to be."""
    return trainer.mode.slow_reason(trainer.model, trainer.device)


def step_seconds(trainer: Trainer, batch: Any, repeats: int = 2) -> float:
    """Seconds of one forward and backward pass of ``batch`` in the trainer's mode (the fastest of
    ``repeats``), on a copy of the model, with torch's random state put back afterwards."""
    model = copy.deepcopy(trainer.model)
    batch = to_device(batch, trainer.device)
    dtype = trainer.amp.precision.mode.autocast_dtype
    fastest = float("inf")
    with kept_random_state(trainer.device.type), trainer.amp.precision.model_scope(model):
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.autocast(trainer.device.type, dtype=dtype, enabled=dtype is not None):
                loss = batch_loss(model, batch, trainer.loss_fn, trainer.step_fn)
            loss.backward()
            fastest = min(fastest, time.perf_counter() - start)
    return fastest


def slow_mode_notice(trainer: Trainer, batch: Any, steps: int) -> str | None:
    """``"fp16 convolutions have no fast CPU kernels: about 41 ms a step here, so 100 steps take
    about 4 s"``, or None when the trainer's mode is not slow on its device."""
    reason = slow_reason(trainer)
    if reason is None:
        return None
    seconds = step_seconds(trainer, batch)
    return f"{reason}: about {seconds * 1e3:.0f} ms a step here, so {steps} steps take about {_duration(seconds * steps)}"


def _duration(seconds: float) -> str:
    """``"4 s"``, ``"3 min"``, ``"1.5 h"``."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
