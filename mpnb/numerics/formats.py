"""An operand in a matmul format, as the what-if measures it: the values and what they lost.

The formats are the registered modes' own: each mode's module declares how its format casts
(:mod:`mpnb.precision.modes.matmul_format`; the registry gathers them,
:func:`~mpnb.precision.modes.registry.matmul_formats`). torchao is imported when a scaled format
is first cast, never on ``import mpnb``.

A cast hands back the operand as the format holds it (its values, exact in their dtype, and
their factor: see :mod:`~mpnb.precision.modes.matmul_format`) with what it lost: the elements
past the format's largest value (saturated, or inf), the nonzero elements it flushed to zero,
and its scales.

Example:
    >>> x = torch.tensor([[1.0, 1e5, 1e-9, 0.0]])
    >>> fp16 = cast("fp16", x, "activation", dim=1)
    >>> fp16.values.tolist(), fp16.overflow, fp16.flushed
    ([[1.0, inf, 0.0, 0.0]], 1, 1)
    >>> cast("int4", x, "activation", dim=1)
    Traceback (most recent call last):
    ...
    mpnb.errors.InvalidChoiceError: unknown format 'int4'; valid: fp16, bf16, fp8, fp8_rowwise, mxfp8, nvfp4
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.precision.modes.matmul_format import ROLES
from mpnb.precision.modes.registry import (
    find_format,
    format_mode,
    matmul_formats,
    parse_mode,
    split_names,
)

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class Operand:
    """One matmul operand as a format holds it.

    Attributes:
        values: what the format's matmul multiplies, exact in their dtype (bf16 for float8's
            and fp4's elements and block scales).
        factor: what ``values`` are multiplied by to read the operand back (None: 1): one number,
            or one per row of a left operand (per column of a right one), applied to the product.
        overflow: elements at their scale past what rounds to the format's largest value
            (saturated, or inf).
        flushed: nonzero elements that became zero.
        elements: the operand's elements; ``nonzero``: those that are not zero.
        scales: the smallest and the largest scale of its nonzero elements ((1, 1) unscaled).
    """

    values: torch.Tensor
    overflow: int
    flushed: int
    elements: int
    nonzero: int
    scales: tuple[float, float]
    factor: torch.Tensor | None = None

    def read_back(self) -> torch.Tensor:
        """The operand in float32, as the format holds it: its values times its factor (a
        factor along rows is laid along the rows it was cast over: ``dim=1`` a column vector).

        >>> cast("fp8", torch.tensor([[1.0, 256.0]]), "activation", dim=1).read_back().tolist()
        [[1.0, 256.0]]
        """
        values = self.values.float()
        return values if self.factor is None else values * self.factor


def format_names() -> tuple[str, ...]:
    """Every format a what-if knows, in the order of its tables (the registered modes' formats).

    >>> format_names()
    ('fp16', 'bf16', 'fp8', 'fp8_rowwise', 'mxfp8', 'nvfp4')
    """
    return tuple(matmul_formats())


def chosen_formats(formats: object) -> tuple[str, ...]:
    """The formats a what-if is asked for: every one for None, one name (or torch dtype), or
    names (in order, each once).

    >>> chosen_formats(None)[:2], chosen_formats("bf16"), chosen_formats(["nvfp4", "bf16", "nvfp4"])
    (('fp16', 'bf16'), ('bf16',), ('nvfp4', 'bf16'))
    >>> chosen_formats([])
    Traceback (most recent call last):
    ...
    mpnb.errors.MpnbError: formats=[] names no format; valid: fp16, bf16, fp8, fp8_rowwise, mxfp8, nvfp4
    """
    if formats is None:
        return format_names()
    if isinstance(formats, torch.dtype):  # one format, as recommend and worst take it
        formats = [formats]
    names = split_names([formats]) if isinstance(formats, str) else formats
    if not isinstance(names, Iterable) or isinstance(names, (bytes, dict)):
        raise InvalidChoiceError(
            "formats", formats, format_names(), "Give a name or a list of names."
        )
    chosen = tuple(dict.fromkeys(check_format(name) for name in names))
    if not chosen:
        raise MpnbError(f"formats={formats!r} names no format; valid: {', '.join(format_names())}")
    return chosen


def check_format(name: str | torch.dtype) -> str:
    """The format ``name`` names, else an error naming the valid ones: a format's name in any
    case, or what names the mode that trains in it (an alias, a torch dtype, a label such as
    ``"fp8:rowwise"``), as ``Trainer(mode=...)`` takes it.

    >>> check_format("mxfp8"), check_format("BFloat16"), check_format(torch.float16), check_format("fp8:rowwise")
    ('mxfp8', 'bf16', 'fp16', 'fp8_rowwise')
    """
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    if not isinstance(name, str):
        raise InvalidChoiceError("format", name, format_names())
    formats = matmul_formats()
    lowered = name.strip().lower()
    if lowered in formats:
        return lowered
    try:
        mode = parse_mode(lowered)
    except MpnbError:  # no mode either: the format's own error below
        mode = None
    if mode is not None:
        trained = next((found for found in formats if format_mode(found) == mode), None)
        if trained is not None:
            return trained
    find_format(name)  # no such format: its error, naming the valid ones
    return name


def zeros_in(tensor: torch.Tensor) -> int:
    """How many elements of ``tensor`` are zero (``-0.0`` too; NaN, inf and subnormals are not).

    Counted over the tensor as booleans: the count ``torch.count_nonzero`` gives of the values,
    which on a CPU takes 4x as long over float32 (0.65 against 0.15 ms a million elements; a
    what-if counts every operand of every format).

    >>> zeros_in(torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-45]))
    2
    """
    return tensor.numel() - int(torch.count_nonzero(tensor.bool()))


def cast(name: str, tensor: torch.Tensor, role: str, dim: int, zeros: int | None = None) -> Operand:
    """``tensor`` (2-D) in format ``name``, scaled along ``dim`` (the axis the matmul sums over:
    1 for the left operand of ``a @ b``, 0 for the right), as an operand in the part ``role``;
    ``zeros``: its count of zeros, when known.

    Raises:
        InvalidChoiceError: an unknown format or role.
    """
    matmul_format = find_format(name)
    if role not in ROLES:
        raise InvalidChoiceError("role", role, ROLES)
    tensor = tensor.detach().float()
    if zeros is None:
        zeros = zeros_in(tensor)
    values, overflow, scales, factor = matmul_format.cast(tensor, role, dim)
    return Operand(
        values=values,
        overflow=overflow,
        # a zero stays zero, so the zeros added are the flushed
        flushed=zeros_in(values) - zeros,
        elements=tensor.numel(),
        nonzero=tensor.numel() - zeros,
        scales=scales,
        factor=factor,
    )
