"""The number formats a what-if measures, each cast by the library that defines it.

``fp16`` and ``bf16`` are torch's dtypes; the scaled formats are torchao's own casts, run on any
device (a CPU included): ``fp8`` is torchao's default float8 recipe (tensorwise scales, e4m3 for
activations and weights, e5m2 for gradients), ``fp8_rowwise`` its ``rowwise`` recipe (one
power-of-two scale per row of the contraction, e4m3 throughout), ``mxfp8`` ``MXTensor.to_mx``
(e4m3 in blocks of 32 with a power-of-two e8m0 scale) and ``nvfp4`` ``NVFP4Tensor.to_nvfp4``
(e2m1 in blocks of 16 with an e4m3 scale, under a per-tensor scale). torchao is imported when a
scaled format is first cast, never on ``import mpnb``.

A matmul ``a @ b`` casts ``a`` along its rows and ``b`` along its columns: the scaling and the
blocks run along the contraction, as torchao's training layers do. A cast hands back the operand
as the format holds it (dequantized to float32) with what it lost: the elements past the
format's largest value (saturated, or inf), the nonzero elements it flushed to zero, and its
scales. A scale here is what an element is multiplied by to read it back (1 for fp16 and bf16).

Example:
    >>> x = torch.tensor([[1.0, 1e5, 1e-9, 0.0]])
    >>> fp16 = cast("fp16", x, "activation", dim=1)
    >>> fp16.values.tolist(), fp16.overflow, fp16.flushed
    ([[1.0, inf, 0.0, 0.0]], 1, 1)
    >>> cast("fp4", x, "activation", dim=1)
    Traceback (most recent call last):
    ...
    mpnb.errors.InvalidChoiceError: unknown format 'fp4'; valid: fp16, bf16, fp8, fp8_rowwise, mxfp8, nvfp4
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mpnb.errors import InvalidChoiceError

__all__: list[str] = []

#: Every format a what-if knows, in the order of its tables.
FORMATS = ("fp16", "bf16", "fp8", "fp8_rowwise", "mxfp8", "nvfp4")
#: The formats that are a torch dtype: they apply to any operation, convolutions included; the
#: scaled ones to the matmuls of linear layers only, as torchao's training layers do.
DTYPE_FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: The formats whose scales follow the axis a matmul sums over (a row's, a block's): a tensor
#: multiplied along another axis is cast again. fp16, bf16 and tensorwise fp8 cast it once.
AXIS_FORMATS = frozenset({"fp8_rowwise", "mxfp8", "nvfp4"})
#: An operand's part in a matmul: the recipes cast gradients to their own element type.
ROLES = ("activation", "weight", "gradient")


@dataclasses.dataclass(frozen=True)
class Operand:
    """One matmul operand as a format holds it.

    Attributes:
        values: the operand read back in float32 (what the format's matmul multiplies).
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


def check_format(name: str) -> str:
    """``name`` if it is a format, else an error naming the valid ones.

    >>> check_format("mxfp8")
    'mxfp8'
    """
    if name not in FORMATS:
        raise InvalidChoiceError("format", name, FORMATS)
    return name


def cast(name: str, tensor: torch.Tensor, role: str, dim: int, zeros: int | None = None) -> Operand:
    """``tensor`` (2-D) in format ``name``, scaled along ``dim`` (the axis the matmul sums over:
    1 for the left operand of ``a @ b``, 0 for the right), as an operand in the part ``role``;
    ``zeros``: its count of zeros, when known.

    Raises:
        InvalidChoiceError: an unknown format or role.
    """
    check_format(name)
    if role not in ROLES:
        raise InvalidChoiceError("role", role, ROLES)
    tensor = tensor.detach().float()
    if zeros is None:
        zeros = tensor.numel() - int(torch.count_nonzero(tensor))
    if name in DTYPE_FORMATS:
        dtype = DTYPE_FORMATS[name]
        limit = _rounding_limit(dtype)
        overflow = _count_past(tensor.abs(), limit) if _largest(tensor) >= limit else 0
        return _operand(tensor, zeros, tensor.to(dtype).float(), overflow, (1.0, 1.0))
    return _operand(tensor, zeros, *_SCALED[name](tensor, role, dim))


def output(name: str, result: torch.Tensor) -> torch.Tensor:
    """A matmul's float32 result as format ``name`` returns it: fp16 and bf16 matmuls write
    their own dtype (an fp16 result past 65504 is inf); torchao's scaled matmuls write the
    high precision they were given. ``result`` is rounded in place.

    >>> output("fp16", torch.tensor([7e4])).tolist(), output("fp8", torch.tensor([7e4])).tolist()
    ([inf], [70000.0])
    """
    dtype = DTYPE_FORMATS.get(check_format(name))
    return result if dtype is None else result.copy_(result.to(dtype))


def _rounding_limit(
    dtype: torch.dtype, largest: float | None = None, bits: int | None = None
) -> float:
    """Where a magnitude stops rounding to the element type's largest value: the largest plus
    half a step at it (fp16: 65520, e4m3: 464). At or past it, the value overflows (inf) or is
    saturated (clamped to the largest); below it, it is only rounded. ``dtype`` gives the
    largest value and mantissa bits, or ``largest`` and ``bits`` do (fp4 has no ``finfo``).

    >>> _rounding_limit(torch.float16), _rounding_limit(torch.float8_e4m3fn), _rounding_limit(None, 6.0, 1)
    (65520.0, 464.0, 7.0)
    """
    if dtype is not None:
        info = torch.finfo(dtype)
        largest, bits = float(info.max), round(-math.log2(info.eps))
    return largest + 2.0 ** (math.floor(math.log2(largest)) - bits - 1)


def _operand(
    tensor: torch.Tensor,
    zeros: int,
    values: torch.Tensor,
    overflow: int,
    scales: tuple[float, float],
) -> Operand:
    """``tensor`` cast to ``values``; a zero stays zero, so the zeros added are the flushed."""
    return Operand(
        values=values,
        overflow=overflow,
        flushed=values.numel() - int(torch.count_nonzero(values)) - zeros,
        elements=tensor.numel(),
        nonzero=tensor.numel() - zeros,
        scales=scales,
    )


def _largest(tensor: torch.Tensor) -> float:
    """The largest magnitude in ``tensor``, from one pass (its smallest and largest values)."""
    low, high = torch.aminmax(tensor)
    return max(-float(low), float(high))


def _count_past(magnitude: torch.Tensor, limit: float | torch.Tensor) -> int:
    """How many of ``magnitude`` are at or past ``limit``."""
    return int(torch.count_nonzero(magnitude >= limit))


def _scale_range(scales: torch.Tensor, amax: torch.Tensor) -> tuple[float, float]:
    """The smallest and largest of ``scales`` where the values they scale are not all zero."""
    used = scales.float()[amax > 0]
    return (float(used.min()), float(used.max())) if used.numel() else (1.0, 1.0)


#: A scaled cast: ``(tensor, role, dim) -> (values, overflow, scale range)``.
_ScaledCast = Callable[[torch.Tensor, str, int], tuple[torch.Tensor, int, tuple[float, float]]]


def _float8_recipe(recipe: str) -> _ScaledCast:
    """A cast by torchao's float8 recipe ``recipe``: its element type for the role, its scaling
    granularity, its scales rounded to powers of two where the recipe rounds them."""

    def cast_float8(tensor: torch.Tensor, role: str, dim: int) -> tuple:
        from torchao.float8.config import Float8LinearConfig, ScalingGranularity
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax, to_fp8_saturated

        config = Float8LinearConfig.from_recipe_name(recipe)
        setting = {
            "activation": config.cast_config_input,
            "weight": config.cast_config_weight,
            "gradient": config.cast_config_grad_output,
        }[role]
        dtype, granularity = setting.target_dtype, setting.scaling_granularity
        amax = tensor_to_amax(
            tensor,
            scaling_granularity=granularity,
            axiswise_dim=dim if granularity is ScalingGranularity.AXISWISE else None,
        )
        multiplier = amax_to_scale(
            amax, dtype, round_scales_to_power_of_2=config.round_scales_to_power_of_2
        )
        scaled = tensor * multiplier
        limit = _rounding_limit(dtype)
        # the scale maps each amax to the largest value: a pass only where rounding passed it
        past = bool((amax * multiplier >= limit).any())
        overflow = _count_past(scaled.abs(), limit) if past else 0
        values = to_fp8_saturated(scaled, dtype).float().div_(multiplier)
        return values, overflow, _scale_range(1 / multiplier, amax)

    return cast_float8


def _blocked(
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, float]], block: int
) -> _ScaledCast:
    """A block-scaled cast along ``dim``. ``quantize`` casts along the last dimension and hands
    back the values, one scale a block and where its element type stops rounding to its largest
    value (:func:`_rounding_limit`); a ``dim`` of 0 is
    cast transposed, and a contraction that is no multiple of the block is padded with zeros,
    as the kernels need."""

    def cast_blocked(tensor: torch.Tensor, role: str, dim: int) -> tuple:
        rows = tensor if dim == 1 else tensor.t()
        length = rows.shape[1]
        padding = -length % block
        padded = (F.pad(rows, (0, padding)) if padding else rows).contiguous()
        values, scales, limit = quantize(padded)
        blocks = padded.reshape(len(padded), -1, block)
        scales = scales.float().reshape(blocks.shape[:2])
        low, high = torch.aminmax(blocks, dim=-1)
        amax = torch.maximum(-low, high)
        past = bool((amax >= limit * scales).any())  # a block's largest first: most pass none
        overflow = _count_past(blocks.abs(), limit * scales.unsqueeze(-1)) if past else 0
        values = values[:, :length] if padding else values
        scale_range = _scale_range(scales, amax)
        return (values if dim == 1 else values.t()), overflow, scale_range

    return cast_blocked


def _mxfp8(padded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, get_fp_scale

    mx = MXTensor.to_mx(padded, torch.float8_e4m3fn, 32)
    limit = _rounding_limit(torch.float8_e4m3fn)
    return mx.dequantize(torch.float32), get_fp_scale(mx.scale), limit


def _nvfp4(padded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    from torchao.prototype.mx_formats.constants import F4_E2M1_MAX
    from torchao.prototype.mx_formats.mx_tensor import MBITS_F4_E2M1
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    per_tensor = per_tensor_amax_to_scale(torch.tensor(_largest(padded)))  # no |x| copy
    nv = NVFP4Tensor.to_nvfp4(padded, per_tensor_scale=per_tensor)
    limit = _rounding_limit(None, F4_E2M1_MAX, MBITS_F4_E2M1)
    return nv.dequantize(torch.float32), nv.get_hp_scales(), limit


_SCALED: dict[str, _ScaledCast] = {
    "fp8": _float8_recipe("tensorwise"),
    "fp8_rowwise": _float8_recipe("rowwise"),
    "mxfp8": _blocked(_mxfp8, 32),
    "nvfp4": _blocked(_nvfp4, 16),
}
