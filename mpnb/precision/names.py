"""The names mpnb accepts for autocast dtypes, and the fp32-math levels.

Example:
    >>> parse_dtype("half"), parse_dtype(torch.bfloat16)
    (torch.float16, torch.bfloat16)
    >>> Fp32Math("reduced")
    <Fp32Math.REDUCED: 'reduced'>
"""

from __future__ import annotations

import enum

import torch

from mpnb.errors import InvalidChoiceError

__all__: list[str] = []  # mpnb.precision lists Fp32Math


class Fp32Math(str, enum.Enum):
    """How float32 matmuls and convolutions compute internally: exact, or with reduced-precision
    math (TF32 on NVIDIA GPUs, oneDNN's bf16 math on CPUs).

    Example:
        >>> from mpnb.precision.modes import parse_mode
        >>> parse_mode("fp32").fp32_math, parse_mode("tf32").fp32_math
        (<Fp32Math.EXACT: 'exact'>, <Fp32Math.REDUCED: 'reduced'>)
    """

    EXACT = "exact"
    REDUCED = "reduced"


_DTYPE_ALIASES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

DTYPE_NAMES = ("bf16", "fp16")


def parse_dtype(value: str | torch.dtype, hint: str = "") -> torch.dtype:
    """Return the autocast dtype named by ``value``: float16 or bfloat16. ``hint``: said after
    the valid names when ``value`` is none of them (what a caller knows it may mean).

    Raises:
        InvalidChoiceError: ``value`` is not a dtype autocast can lower to.

    Example:
        >>> parse_dtype("fp32")
        Traceback (most recent call last):
        ...
        mpnb.errors.InvalidChoiceError: unknown autocast dtype 'fp32'; valid: bf16 (bfloat16), fp16 (float16, half). For fp32, turn autocast off (--off, or enabled=False).
    """
    if isinstance(value, torch.dtype):
        if value in (torch.float16, torch.bfloat16):
            return value
    else:
        dtype = _DTYPE_ALIASES.get(str(value).strip().lower())
        if dtype is not None:
            return dtype
    if _means_fp32(value):
        hint = "For fp32, turn autocast off (--off, or enabled=False)."
    raise InvalidChoiceError(
        "autocast dtype", value, ["bf16 (bfloat16)", "fp16 (float16, half)"], hint
    )


def _means_fp32(value: object) -> bool:
    return value is torch.float32 or str(value).strip().lower() in (
        "fp32",
        "float32",
        "float",
        "tf32",
    )
