"""Precision modes and the names mpnb accepts for them and for autocast dtypes.

A mode is what a whole session runs in: ``off`` (mpnb leaves torch alone), ``fp32``
(autocast off, exact fp32 math), ``tf32`` (autocast off, reduced-precision fp32 math),
``fp16`` and ``bf16`` (autocast in that dtype), ``fp8`` (eligible Linear layers through torchao's
float8 training, the rest under bf16 autocast; see :mod:`mpnb.precision.fp8`).

Example:
    >>> from mpnb.precision.modes import Mode, parse_mode, parse_dtype
    >>> parse_mode("bfloat16") is Mode.BF16
    True
    >>> parse_dtype("half")
    torch.float16
"""

from __future__ import annotations

import enum

import torch

from mpnb.errors import InvalidChoiceError

__all__ = ["Mode", "Fp32Math"]


class Fp32Math(str, enum.Enum):
    """How float32 matmuls and convolutions compute internally.

    Example:
        >>> Mode.FP32.fp32_math, Mode.TF32.fp32_math
        (<Fp32Math.EXACT: 'exact'>, <Fp32Math.REDUCED: 'reduced'>)
        >>> Fp32Math("reduced") is Fp32Math.REDUCED
        True
    """

    EXACT = "exact"
    REDUCED = "reduced"


class Mode(str, enum.Enum):
    """A session precision mode.

    Example:
        >>> mode = Mode("bf16")
        >>> mode.autocast_dtype, mode.fp32_math
        (torch.bfloat16, None)
        >>> Mode.FP16.summary
        'autocast to float16; eligible ops run in fp16, the rest in fp32'
        >>> [mode.value for mode in Mode]
        ['off', 'fp32', 'tf32', 'fp16', 'bf16', 'fp8']
        >>> Mode.FP8.autocast_dtype  # what runs outside the fp8 layers
        torch.bfloat16
    """

    OFF = "off"
    FP32 = "fp32"
    TF32 = "tf32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast runs in under this mode, or None when autocast is off."""
        return {Mode.FP16: torch.float16, Mode.BF16: torch.bfloat16, Mode.FP8: torch.bfloat16}.get(
            self
        )

    @property
    def fp32_math(self) -> Fp32Math | None:
        """The fp32-math level this mode sets, or None when the mode leaves it as it is."""
        return {Mode.FP32: Fp32Math.EXACT, Mode.TF32: Fp32Math.REDUCED}.get(self)

    @property
    def summary(self) -> str:
        """One line that says what the mode does."""
        return _MODE_SUMMARIES[self]


_MODE_SUMMARIES = {
    Mode.OFF: "mpnb changes nothing: torch's own defaults and your settings apply",
    Mode.FP32: "autocast off; fp32 matmuls and convolutions use exact fp32 math",
    Mode.TF32: "autocast off; fp32 matmuls and convolutions use reduced-precision math (TF32 on GPUs)",
    Mode.FP16: "autocast to float16; eligible ops run in fp16, the rest in fp32",
    Mode.BF16: "autocast to bfloat16; eligible ops run in bf16, the rest in fp32",
    Mode.FP8: "eligible Linear layers' matmuls in fp8 (torchao float8 training), the rest under bf16 autocast",
}

_MODE_ALIASES = {
    "off": Mode.OFF,
    "fp32": Mode.FP32,
    "float32": Mode.FP32,
    "float": Mode.FP32,
    "tf32": Mode.TF32,
    "fp16": Mode.FP16,
    "float16": Mode.FP16,
    "half": Mode.FP16,
    "bf16": Mode.BF16,
    "bfloat16": Mode.BF16,
    "fp8": Mode.FP8,
    "float8": Mode.FP8,
}

_DTYPE_ALIASES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

MODE_NAMES = tuple(mode.value for mode in Mode)
DTYPE_NAMES = ("bf16", "fp16")


def parse_mode(value: str | Mode) -> Mode:
    """Return the mode named by ``value`` (a Mode, or a name or alias in any case).

    Raises:
        InvalidChoiceError: ``value`` names no mode.

    Example:
        >>> parse_mode("HALF")
        <Mode.FP16: 'fp16'>
    """
    if isinstance(value, Mode):
        return value
    mode = _MODE_ALIASES.get(str(value).strip().lower())
    if mode is None:
        raise InvalidChoiceError(
            "mode", value, MODE_NAMES, "Aliases: float32, float16/half, bfloat16, float8."
        )
    return mode


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Return the autocast dtype named by ``value``: float16 or bfloat16.

    Raises:
        InvalidChoiceError: ``value`` is not a dtype autocast can lower to.

    Example:
        >>> parse_dtype(torch.bfloat16)
        torch.bfloat16
    """
    if isinstance(value, torch.dtype):
        if value in (torch.float16, torch.bfloat16):
            return value
    else:
        dtype = _DTYPE_ALIASES.get(str(value).strip().lower())
        if dtype is not None:
            return dtype
    hint = "For fp32, turn autocast off (--off, or enabled=False)." if _means_fp32(value) else ""
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
