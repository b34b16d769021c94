"""A sixth mode that lives only in the tests: bf16 autocast under another name.

It is what a contributor writes to add a mode: one class over the base, one registration call.
Its matmul format (bfloat16 under its own name) is what a contributor writes to add a format.
"""

from __future__ import annotations

import dataclasses

import torch

from mpnb.precision.modes import Mode
from mpnb.precision.modes.matmul_format import MatmulFormat, Threshold


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Brain16(Mode):
    """bf16 autocast, named for the format's origin (Google Brain's floating point)."""

    name = "brain16"
    aliases = ("brainfloat",)
    summary = "autocast to bfloat16 under another name (a mode defined in the tests)"
    autocast_dtype = torch.bfloat16
    matmul_formats = (
        MatmulFormat("brain16", Threshold(rel_error=0.02, overflow=0.0), dtype=torch.bfloat16),
    )
