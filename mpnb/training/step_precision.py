"""The precision a training loop runs in: a mode on a device, validated once.

Example:
    >>> p = TrainingPrecision.resolve("bf16", "cpu")
    >>> p.autocast.dtype, p.needs_scaler
    (torch.bfloat16, False)
    >>> TrainingPrecision.resolve("fp16", "cpu").needs_scaler
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from mpnb.errors import MpnbError
from mpnb.precision.autocast_settings import AutocastSettings
from mpnb.precision.backends import backend_for
from mpnb.precision.modes import Mode, chosen_mode, mode_found_in
from mpnb.precision.policy import session

__all__ = ["TrainingPrecision"]


@dataclasses.dataclass(frozen=True)
class TrainingPrecision:
    """A validated mode and device, and what they mean for a training step.

    Attributes:
        mode: the mode object (:mod:`mpnb.precision.modes`): its autocast dtype, whether the loss
            is scaled, its fp32-math level for the run, and what it does to the model
            (:meth:`model_scope`: fp8 converts the eligible Linear layers).
        device: where the model and batches live.
        autocast: the autocast to wrap forward passes in (disabled for fp32-like modes, so
            a surrounding ``%amp`` cell cannot leak into them).

    Example:
        >>> precision = TrainingPrecision.resolve("bf16", "cpu")
        >>> precision.describe(), precision.autocast.describe()
        ('bf16 on cpu', 'bf16 autocast on cpu (no cast cache)')
        >>> with precision.autocast.context():
        ...     torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype
        torch.bfloat16
        >>> TrainingPrecision.resolve("fp32", "cpu").autocast.describe()
        'autocast off on cpu'
    """

    mode: Mode
    device: torch.device
    autocast: AutocastSettings

    @classmethod
    def resolve(
        cls,
        mode: str | Mode | None = None,
        device: str | torch.device | None = None,
        **options: Any,
    ) -> TrainingPrecision:
        """Fill what is not given from the session (``%amp`` / ``mpnb.set_mode``, with its
        options) and validate. A mode given by name takes its own defaults and ``options``.

        Raises:
            MpnbError: unknown mode, option or device, or a device the mode does not run on.
        """
        chosen = chosen_mode(mode, session.mode, **options)
        dtype = chosen.autocast_dtype
        settings = session.autocast_settings(dtype, device, enabled=dtype is not None)
        chosen.check(settings.device)
        return cls(chosen, settings.device, settings)

    @property
    def needs_scaler(self) -> bool:
        """Whether the mode scales the loss (fp16's narrow range; bf16 has fp32's)."""
        return self.mode.needs_scaler

    @contextlib.contextmanager
    def math_scope(self) -> Iterator[None]:
        """The mode in force for a block (:meth:`Session.running
        <mpnb.precision.policy.Session.running>`: a model's ``mpnb.autocast()`` follows it),
        with its fp32-math flags (fp32: exact, tf32: reduced).

        The block borrows the session's one fp32-math switch; afterwards the flags are where
        the session wants them, including a wish made during the block (``%tf32 on`` from a
        widget while a fit runs).
        """
        level = self.mode.fp32_math
        with session.running(self.mode):
            if level is None:
                yield
                return
            session.fp32_math.set(backend_for(self.device), level)
            try:
                yield
            finally:
                session.apply_fp32_wish()

    def model_scope(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """What the mode does to ``model`` for a block (fp8: its eligible Linear layers
        converted), put back on any exit; most modes leave the model alone.

        Raises:
            MpnbError: the mode would convert no layer of ``model``, or ``model`` holds the
                layers of another mode (``%amp fp8 --model`` converted them): nothing changed.
        """
        found = mode_found_in(model)
        if found is not None and type(found) is not type(self.mode):
            raise MpnbError(
                f"{type(model).__name__} holds mode {found.name}'s layers (converted by "
                f"`%amp {found.name} --model`, or by you), so it would not train in {self.mode.label}: "
                f"put them back first (`%amp off`), or train in mode {found.name}"
            )
        return self.mode.model_scope(model, self.device)

    def describe(self) -> str:
        """``"bf16 on cpu"``; fp8 says where it is emulated."""
        return self.mode.describe(self.device)
