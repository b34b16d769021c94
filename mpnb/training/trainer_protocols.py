"""What the Trainer's helpers use of it, as small protocols.

``trainer.py`` imports its helpers (checkpoints, the session follower, the fit capture, the
one-fit-per-thread guard), so they cannot import the class; each names here the few members it
uses, and :class:`~mpnb.Trainer` has them all. Code above ``training/`` (analysis, the UI)
names the class itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mpnb.precision.modes import Mode
    from mpnb.training.amp_step import AmpStep
    from mpnb.training.history import History
    from mpnb.training.step_precision import TrainingPrecision

__all__: list[str] = []


class Described(Protocol):
    """A fit that can say what it trains (the one-fit-per-thread guard names it)."""

    def describe(self) -> str: ...


class _Training(Protocol):
    """What every helper reads of a trainer: its step, history, device and mode."""

    amp: AmpStep

    @property
    def history(self) -> History: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def mode(self) -> Mode: ...


class Checkpointed(_Training, Protocol):
    """What a checkpoint reads from a trainer and puts back into it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    @property
    def position(self) -> tuple[int, int, int | None]: ...

    @position.setter
    def position(self, position: tuple[int, int, int | None]) -> None: ...


class Switched(_Training, Protocol):
    """A trainer whose running fit follows the session's switches."""

    def use_precision(self, precision: TrainingPrecision) -> None: ...


class Fitting(Protocol):
    """A trainer a fit capture notes, to fit again on the same data."""

    @property
    def history(self) -> History: ...

    @property
    def mode(self) -> Mode: ...

    def fit(
        self, data: Iterable[Any], epochs: int | None = None, *, max_steps: int | None = None
    ) -> History: ...
