"""Mode ``fp32``: autocast off, exact fp32 math in matmuls and convolutions.

Example:
    >>> from mpnb.precision.modes import parse_mode
    >>> fp32 = parse_mode("float32")
    >>> fp32.fp32_math, fp32.with_fp32_math(reduced=True), fp32.with_fp32_math(reduced=False)
    (<Fp32Math.EXACT: 'exact'>, Mode('tf32'), Mode('fp32'))
"""

from __future__ import annotations

import dataclasses

from mpnb.precision.modes.base import Fp32Math, Mode
from mpnb.precision.modes.registry import parse_mode, register

__all__: list[str] = []


@register
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Fp32(Mode):
    """Full fp32: autocast off, and the reduced-precision fp32 math flags off (TF32 on GPUs,
    oneDNN's bf16 math on CPUs). It owns the ``%tf32`` switch: turning it on moves to tf32."""

    name = "fp32"
    aliases = ("float32", "float")
    summary = "autocast off; fp32 matmuls and convolutions use exact fp32 math"
    fp32_math = Fp32Math.EXACT
    reference = True  # compare's speedups are over fp32

    def with_fp32_math(self, reduced: bool) -> Mode | None:
        return parse_mode("tf32") if reduced else self
