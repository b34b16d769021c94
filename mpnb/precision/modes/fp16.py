"""Mode ``fp16``: autocast to float16, with loss scaling.

Example:
    >>> import torch
    >>> from mpnb.precision.modes import parse_mode
    >>> fp16 = parse_mode("half")
    >>> fp16.autocast_dtype, fp16.needs_scaler, fp16.lightning_precision
    (torch.float16, True, '16-mixed')
    >>> fp16.slow_reason(torch.nn.Conv2d(1, 1, 3), torch.device("cpu"))
    'fp16 convolutions have no fast CPU kernels'
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mpnb.precision.backends import Backend
from mpnb.precision.modes.base import Mode
from mpnb.precision.modes.matmul_format import MatmulFormat, Threshold
from mpnb.precision.modes.registry import register

__all__: list[str] = []


@register
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Fp16(Mode):
    """Eligible ops in float16 under autocast, the rest in fp32. fp16's range ends at 65504, so
    the loss is scaled (torch's ``GradScaler``) and a step whose gradients overflow is skipped."""

    name = "fp16"
    aliases = ("float16", "half")
    summary = "autocast to float16; eligible ops run in fp16, the rest in fp32"
    autocast_dtype = torch.float16
    needs_scaler = True
    #: fp16 rounds ordinary tensors' products by ~3e-4; any element past 65504 is inf
    matmul_formats = (
        MatmulFormat("fp16", Threshold(rel_error=0.01, overflow=0.0), dtype=torch.float16),
    )

    def notes(self, backend: Backend) -> list[str]:
        return [
            "fp16 training needs loss scaling: mpnb.Trainer and mpnb.AmpStep scale the loss "
            "themselves; in your own loop, torch.amp.GradScaler"
        ]

    def slow_reason(self, model: nn.Module, device: torch.device) -> str | None:
        has_convolutions = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
        if device.type == "cpu" and has_convolutions:
            return "fp16 convolutions have no fast CPU kernels"
        return super().slow_reason(model, device)
