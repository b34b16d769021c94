"""Mode ``tf32``: autocast off, reduced-precision math in fp32 matmuls and convolutions.

Example:
    >>> import torch
    >>> from mpnb.precision.modes import parse_mode
    >>> tf32 = parse_mode("tf32")
    >>> tf32.fp32_math, tf32.with_fp32_math(reduced=False)
    (<Fp32Math.REDUCED: 'reduced'>, Mode('fp32'))
    >>> tf32.compare_verdict(torch.device("cpu")) in ("", "no effect on this hardware")  # measured
    True
"""

from __future__ import annotations

import dataclasses

import torch

from mpnb.precision.backends import backend_for
from mpnb.precision.modes.base import NO_EFFECT, Fp32Math, Mode
from mpnb.precision.modes.registry import parse_mode, register

__all__: list[str] = []


@register
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Tf32(Mode):
    """fp32 tensors, reduced-precision math inside matmuls and convolutions: TF32 on NVIDIA GPUs
    from Ampere on, oneDNN's bf16 math on CPUs with AMX. Measured, not assumed: where it changes
    nothing, compare says so. It owns the ``%tf32`` switch: turning it off moves to fp32."""

    name = "tf32"
    summary = (
        "autocast off; fp32 matmuls and convolutions use reduced-precision math (TF32 on GPUs)"
    )
    fp32_math = Fp32Math.REDUCED

    def with_fp32_math(self, reduced: bool) -> Mode | None:
        return self if reduced else parse_mode("fp32")

    def compare_verdict(self, device: torch.device) -> str:
        return "" if backend_for(device).has_fast_fp32_math() else NO_EFFECT
