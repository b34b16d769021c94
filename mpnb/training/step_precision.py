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

import torch

from mpnb.precision.autocast_settings import AutocastSettings
from mpnb.precision.backends import backend_for
from mpnb.precision.fp8 import EMULATED, Fp8Layers, check_fp8
from mpnb.precision.modes import Mode, parse_mode
from mpnb.precision.policy import session

__all__ = ["TrainingPrecision"]


@dataclasses.dataclass(frozen=True)
class TrainingPrecision:
    """A validated mode and device, and what they mean for a training step.

    Attributes:
        mode: fp16 / bf16 autocast the forward pass; fp32 / tf32 set the fp32-math flags for
            the run; off runs in fp32 and touches no flag; fp8 converts the model's eligible
            Linear layers (:meth:`model_scope`) and autocasts the rest to bf16.
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
        cls, mode: str | Mode | None = None, device: str | torch.device | None = None
    ) -> TrainingPrecision:
        """Fill what is not given from the session (``%amp`` / ``mpnb.set_mode``) and validate.

        Raises:
            MpnbError: unknown mode or device, or a dtype the device cannot autocast to.
        """
        chosen = session.mode if mode is None else parse_mode(mode)
        dtype = chosen.autocast_dtype
        settings = session.autocast_settings(dtype, device, enabled=dtype is not None)
        if chosen is Mode.FP8:
            check_fp8(settings.device)
        return cls(chosen, settings.device, settings)

    @property
    def needs_scaler(self) -> bool:
        """Only fp16 needs loss scaling; bf16 has fp32's range."""
        return self.mode is Mode.FP16

    @contextlib.contextmanager
    def math_scope(self) -> Iterator[None]:
        """Set the mode's fp32-math flags (fp32: exact, tf32: reduced) for a block.

        The block borrows the session's one fp32-math switch; afterwards the flags are where
        the session wants them, including a wish made during the block (``%tf32 on`` from a
        widget while a fit runs).
        """
        level = self.mode.fp32_math
        if level is None:
            yield
            return
        session.fp32_math.set(backend_for(self.device), level)
        try:
            yield
        finally:
            session.apply_fp32_wish()

    @contextlib.contextmanager
    def model_scope(self, model: torch.nn.Module) -> Iterator[None]:
        """Fp8: the model's eligible Linear layers converted for a block (with the session's
        recipe and kept layers), put back on any exit. Other modes leave the model alone.

        Raises:
            MpnbError: fp8 would convert no layer of ``model`` (nothing changed).
        """
        if self.mode is not Mode.FP8:
            yield
            return
        with Fp8Layers(model, recipe=session.fp8_recipe, keep=session.fp8_keep, device=self.device):
            yield

    def describe(self) -> str:
        """``"bf16 on cpu"``; fp8 says where it is emulated."""
        if self.mode is Mode.FP8 and backend_for(self.device).fp8_training() == "emulated":
            return f"fp8 on {self.device} ({EMULATED})"
        return f"{self.mode.value} on {self.device}"
