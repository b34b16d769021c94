"""Mode ``bf16``: autocast to bfloat16 (fp32's range: no loss scaling).

Example:
    >>> from mpnb.precision.modes import parse_mode
    >>> bf16 = parse_mode("bfloat16")
    >>> bf16.autocast_dtype, bf16.needs_scaler, bf16.training_arguments(on_cuda=False)
    (torch.bfloat16, False, {'bf16': True, 'fp16': False, 'tf32': None})
"""

from __future__ import annotations

import dataclasses

import torch

from mpnb.precision.modes.base import Mode
from mpnb.precision.modes.matmul_format import MatmulFormat, Threshold
from mpnb.precision.modes.registry import register

__all__: list[str] = []


@register
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Bf16(Mode):
    """Eligible ops in bfloat16 under autocast, the rest in fp32. bf16 keeps fp32's exponent
    range, so the loss needs no scaling; where a CPU has no bf16 units it is emulated (slow)."""

    name = "bf16"
    aliases = ("bfloat16",)
    summary = "autocast to bfloat16; eligible ops run in bf16, the rest in fp32"
    autocast_dtype = torch.bfloat16
    #: bf16 rounds ordinary tensors' products by ~2.5e-3 and has fp32's range
    matmul_formats = (
        MatmulFormat("bf16", Threshold(rel_error=0.02, overflow=0.0), dtype=torch.bfloat16),
    )
