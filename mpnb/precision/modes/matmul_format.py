"""A number format a mode's matmuls multiply in: declared once, in the mode's own module.

A mode lists its formats in :attr:`Mode.matmul_formats <mpnb.precision.modes.base.Mode>` (fp16
mode: ``fp16``; fp8 mode: ``fp8`` and ``fp8_rowwise``, one a recipe), and the registry gathers
them (:func:`~mpnb.precision.modes.registry.matmul_formats`): the what-if
(:mod:`mpnb.numerics.whatif`) measures every registered format, recommends by its threshold and
proves the advice in the mode that trains in it. A new format is a new mode's module, or a new
entry in an existing mode's ``matmul_formats``: nothing else changes.

A format holds how an operand is cast (a torch dtype, or a scaled cast by the library that
defines the format: no format is written by hand), whether its scales follow the axis a matmul
sums over, the threshold past which a layer should stay in higher precision, and the mode that
trains in it.

A matmul ``a @ b`` casts ``a`` along its rows (``dim=1``) and ``b`` along its columns
(``dim=0``): the scaling and the blocks run along the contraction, as torchao's training
layers do. A cast hands back the operand as the format holds it, how many of its elements are
past the format's largest value (saturated, or inf), the range of its scales, and a factor: the
operand is its values times the factor (None: 1), the factor one number or one per row the
matmul does not sum over (shaped ``(rows, 1)`` along ``dim=1``, ``(1, columns)`` along
``dim=0``; only a format that ``follows_axis`` casts per axis may have one), so that a product
can be taken of the values and scaled after (as ``torch._scaled_mm`` does). The values come in a
dtype they are exact in (bf16 for float8's and fp4's elements and their block scales, half the
bytes of float32): :meth:`MatmulFormat.product` multiplies them there where that gives the same
product faster (:func:`multiplies_faster`, measured), in float32 elsewhere. A scale is what an
element is multiplied by to read it back (1 for fp16 and bf16).

A format's matmul writes its dtype (fp16, bf16); a scaled format's writes
:attr:`MatmulFormat.writes`, the dtype its mode runs the layer in (bf16: the mode's autocast):
accumulated in float32, times the factors, rounded once, in ``torch._scaled_mm``'s order.

Example:
    >>> fp16 = MatmulFormat("fp16", Threshold(rel_error=0.01, overflow=0.0), dtype=torch.float16)
    >>> values, overflow, scales, factor = fp16.cast(torch.tensor([[1.0, 1e5, 1e-9]]), "activation", dim=1)
    >>> values.tolist(), overflow, scales, factor
    ([[1.0, inf, 0.0]], 1, (1.0, 1.0), None)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mpnb.errors import MpnbError, quoted

__all__: list[str] = []

#: An operand's part in a matmul: the recipes cast gradients to their own element type.
ROLES = ("activation", "weight", "gradient")

#: An operand as a format holds it: its values, the count of its elements past the largest
#: value, its scale range, and its factor (the operand is values x factor; None: 1).
Cast = tuple[torch.Tensor, int, tuple[float, float], "torch.Tensor | None"]
#: A scaled cast: ``(tensor, role, dim) -> (values, overflow, scale range[, factor])``.
ScaledCast = Callable[[torch.Tensor, str, int], tuple]


@dataclasses.dataclass(frozen=True)
class Threshold:
    """When a layer cannot take a format: any of its matmuls past one of these (None: not
    looked at).

    Attributes:
        rel_error: relative error of the product against fp32.
        overflow: share of the operands' elements past the format's largest value.
        underflow: share of their nonzero elements flushed to zero.

    Example:
        >>> Threshold(rel_error=0.05, overflow=0.0).passed({"rel_error": 0.2, "overflow": 0.0, "underflow": 0.5})
        True
    """

    rel_error: float
    overflow: float
    underflow: float | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "underflow":
                continue
            number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            try:
                value = float(value) if number else math.nan
            except OverflowError:  # an int past float's range
                value = math.nan
            if math.isnan(value) or value < 0:
                # NaN compares false: a layer past it would never be kept, all converted
                raise MpnbError(
                    f"Threshold({field.name}={quoted(getattr(self, field.name))}): a threshold is a "
                    "number, 0 or more "
                    f"(inf: never past it){'; or None: not looked at' if field.name == 'underflow' else ''}"
                )
            if field.name != "rel_error" and 1 < value < math.inf:  # 5 meant as 5%: never past
                raise MpnbError(
                    f"Threshold({field.name}={quoted(getattr(self, field.name))}): {field.name} "
                    "is a share, from 0 to 1 (0.05 for 5%), or inf: never past it"
                )
            object.__setattr__(self, field.name, value)  # a float: a Fraction prints with :g too

    def passed(self, row: dict[str, Any]) -> bool:
        """``row`` (one of :attr:`WhatIf.rows <mpnb.numerics.whatif.WhatIf>`) is past this threshold."""
        return (
            row["rel_error"] > self.rel_error
            or row["overflow"] > self.overflow
            or (self.underflow is not None and row["underflow"] > self.underflow)
        )


@dataclasses.dataclass(frozen=True)
class MatmulFormat:
    """A format a matmul's operands can be cast to, as a mode's layers would cast them.

    Attributes:
        name: the format's name in the what-if's tables (``"fp8_rowwise"``).
        threshold: the default threshold of ``recommend`` (a few times what the format does to
            ordinary tensors: past it, a layer holds values the format cannot).
        dtype: a torch dtype the operands are rounded to: the format applies to any operation,
            convolutions included, and its matmul writes that dtype.
        scaled_cast: or a scaled cast (``(tensor, role, dim) -> (values, overflow, scale
            range[, factor])``, see the module's docstring) by the format's own library:
            applies to linear layers' matmuls, as torchao's training layers do. It reads
            ``tensor`` and never changes it (the pass's own tensors: the other formats read
            them after it).
        writes: what a scaled format's matmul writes: the dtype its mode runs the layer in
            (bf16 under the mode's autocast); float32 by default.
        follows_axis: the scales follow the axis the matmul sums over (a row's, a block's): a
            tensor multiplied along another axis is cast again.
        trains_as: the mode that trains in the format, as ``parse_mode`` reads it
            (``"fp8:rowwise"``); empty: the mode that declares it.
        unavailable: says why the cast cannot run on this machine (its library is not
            installed), or an empty string where it can; None: it always can.
    """

    name: str
    threshold: Threshold
    dtype: torch.dtype | None = None
    scaled_cast: ScaledCast | None = None
    follows_axis: bool = False
    trains_as: str = ""
    writes: torch.dtype = torch.float32
    unavailable: Callable[[], str] | None = None

    def __post_init__(self) -> None:
        said = f"matmul format {self.name!r}"
        if not isinstance(self.name, str):
            raise MpnbError(f"{said}: its name is a string, got a {type(self.name).__name__}")
        if not isinstance(self.threshold, Threshold):
            raise MpnbError(
                f"{said}: threshold takes a Threshold(rel_error=..., overflow=..., underflow=...), "
                f"got {self.threshold!r}"
            )
        if (self.dtype is None) == (self.scaled_cast is None):
            raise MpnbError(f"{said}: give a dtype or a scaled_cast, one of them")
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise MpnbError(f"{said}: dtype takes a floating-point torch.dtype, got {self.dtype!r}")
        if self.scaled_cast is not None and not callable(self.scaled_cast):
            raise MpnbError(
                f"{said}: scaled_cast takes a function (tensor, role, dim) -> (values, overflow, "
                f"scale range), got {self.scaled_cast!r}"
            )

    def why_unavailable(self) -> str:
        """Why this format cannot be cast on this machine, or an empty string where it can.

        >>> MatmulFormat("bf16", Threshold(0.02, 0.0), dtype=torch.bfloat16).why_unavailable()
        ''
        """
        return self.unavailable() if self.unavailable is not None else ""

    @property
    def any_operation(self) -> bool:
        """Whether the format applies beyond linear layers (a dtype: convolutions too)."""
        return self.dtype is not None

    def cast(self, tensor: torch.Tensor, role: str, dim: int) -> Cast:
        """``tensor`` (2-D float32) in this format, scaled along ``dim``, as an operand in the
        part ``role``: its values (exact in their dtype), its elements past the largest value,
        its scale range, its factor (None: 1)."""
        if self.scaled_cast is not None:
            return self._checked(self.scaled_cast(tensor, role, dim), tensor, dim)
        limit = rounding_limit(self.dtype)
        overflow = count_past(tensor.abs(), limit) if largest_magnitude(tensor) >= limit else 0
        return tensor.to(self.dtype), overflow, (1.0, 1.0), None

    def _checked(self, cast: object, tensor: torch.Tensor, dim: int) -> Cast:
        """What a scaled cast returned, if it is what a cast returns (no pass over the values)."""
        # a factor per row: one for each row the matmul does not sum over, laid along them
        per_row = (tensor.shape[0], 1) if dim == 1 else (1, tensor.shape[1])
        try:
            values, overflow, (low, high), *rest = cast  # type: ignore[misc]
            factor = rest[0] if rest else None
            overflow = operator.index(overflow)  # a count: a share such as 0.5 is refused
            fits = (
                len(rest) <= 1
                and isinstance(values, torch.Tensor)
                and values.shape == tensor.shape
                and values.dtype.is_floating_point
                and 0 <= overflow <= tensor.numel()
                and (
                    factor is None
                    or isinstance(factor, torch.Tensor)
                    and factor.dtype == torch.float32
                    and (factor.numel() == 1 or tuple(factor.shape) == per_row)
                )
            )
            scales = (float(low), float(high))
        except (TypeError, ValueError):
            fits = False
        said = f"the scaled cast of matmul format {self.name!r} returned {_shown(cast)}"
        if not fits:
            raise MpnbError(
                f"{said}; a cast returns (values shaped {tuple(tensor.shape)} in a floating-point "
                "dtype, the count of its elements past the largest value, (smallest scale, "
                "largest scale)) and, optionally, a float32 factor: one value, or one per row "
                f"the matmul does not sum over, shaped {per_row} for dim={dim}"
            )
        if factor is not None and factor.numel() > 1 and not self.follows_axis:
            raise MpnbError(
                f"{said}: a factor per row, but the format does not declare follows_axis=True, "
                "so its cast would be used along the other axis too; declare it"
            )
        if factor is not None and not bool((torch.isfinite(factor) & (factor != 0)).all()):
            raise MpnbError(f"{said}: its factor must be finite and nonzero")
        return values, overflow, scales, factor

    @property
    def written(self) -> torch.dtype:
        """The dtype this format's matmul writes: its dtype, or :attr:`writes`."""
        return self.dtype if self.dtype is not None else self.writes

    def product(
        self,
        multiply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        a: tuple[torch.Tensor, torch.Tensor | None],
        b: tuple[torch.Tensor, torch.Tensor | None],
    ) -> torch.Tensor:
        """``multiply(a, b)`` of two operands in this format (each ``(values, factor)``, the values
        as :meth:`multiplicand` prepared them, ``a``'s factor along the product's rows, ``b``'s
        along its columns), in float32, as the format's matmul writes it (``torch._scaled_mm``'s
        order): accumulated in float32, times the factors, rounded once to :attr:`written` (an
        fp16 result past 65504 is inf).

        Where both operands were left in the written dtype (their factors powers of two, their
        magnitudes in range, the dtype faster here: :meth:`multiplicand`), they are multiplied
        in it: the same product up to the order of its sums. Elsewhere in float32.

        >>> bf16 = MatmulFormat("bf16", Threshold(0.02, 0.0), dtype=torch.bfloat16)
        >>> a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [4.0]])
        >>> bf16.product(torch.matmul, (a, None), (b, torch.tensor([0.5]))).tolist()
        [[5.5]]
        """
        (a_values, a_factor), (b_values, b_factor) = a, b
        native = a_values.dtype == b_values.dtype == self.written
        if not native:
            a_values, b_values = a_values.float(), b_values.float()
        result = multiply(a_values, b_values).float()
        for factor, shape in ((a_factor, (-1, 1)), (b_factor, (1, -1))):
            if factor is not None:
                result = result.mul_(factor.reshape(shape))
        return result if native else result.copy_(result.to(self.written))

    def multiplicand(self, values: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
        """An operand's ``values`` in the dtype :meth:`product` multiplies them in: their own
        where it is the written dtype, their ``factor`` is a power of two (or None), their
        nonzero magnitudes are at least 2**-62 and that dtype multiplies faster on the device,
        summing in float32 (:func:`sums_in_low_precision`); float32 elsewhere. Then the product
        is the same up to the order of its sums: the values are exact there, a power of two
        moves no rounding, and no product of two of them falls below float32's normal range
        (where a CPU's bf16 matmul flushes it to zero). Each operand is prepared once, when it
        is cast.

        >>> bf16 = MatmulFormat("bf16", Threshold(0.02, 0.0), dtype=torch.bfloat16)
        >>> bf16.multiplicand(torch.ones(2, dtype=torch.bfloat16), torch.tensor(0.3)).dtype
        torch.float32
        """
        native = (
            values.dtype == self.written
            and (factor is None or _powers_of_two(factor))
            and multiplies_faster(values.dtype, values.device)
            and not sums_in_low_precision(values.dtype, values.device)
            and _products_stay_normal(values)
        )
        return values if native else values.float()


def sums_in_low_precision(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a matmul in ``dtype`` on ``device`` may sum its products in that dtype rather
    than in float32: on CUDA, where torch lets cuBLAS do so for bf16 and fp16 unless
    ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` (``fp16_``) is off
    (both are on by default). A CPU's bf16 matmul sums in float32.

    >>> sums_in_low_precision(torch.bfloat16, torch.device("cpu"))
    False
    """
    if device.type != "cuda":
        return False
    flags = torch.backends.cuda.matmul
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    return name is not None and bool(
        getattr(flags, f"allow_{name}_reduced_precision_reduction", True)
    )


def _products_stay_normal(values: torch.Tensor) -> bool:
    """Whether every product of two nonzero magnitudes like these stays in float32's normal
    range (each at least 2**-62): a CPU's bf16 matmul flushes the products below it to zero,
    which a float32 accumulation keeps (a layer whose figure would otherwise read 1.0). Read as
    the largest of 2**-62 / magnitude (a zero's inf left out), a division and a reduction: 0.35
    ms a million bf16 values, where a masked minimum takes 1.75."""
    if not values.numel():
        return True
    limit = torch.tensor(2.0**-62, dtype=values.dtype, device=values.device)
    ratio = torch.div(limit, values.abs())  # a true division: no reciprocal that overflows
    return float(torch.nan_to_num(ratio, nan=0.0, posinf=0.0).amax()) <= 1.0


def _powers_of_two(factor: torch.Tensor) -> bool:
    """Whether every value of ``factor`` is a power of two (a scaling that moves no rounding)."""
    return bool((torch.frexp(factor).mantissa.abs() == 0.5).all())


@functools.cache
def multiplies_faster(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a matmul in ``dtype`` takes less time than in float32 on ``device``: measured
    once (a 256x512 by 512x512 product, the fastest of three runs each), not read from a
    capability flag. On this project's 2-core CPU with bf16 units: bf16 2.3x faster, fp16 4x
    slower (no fp16 units: converted element by element).

    >>> multiplies_faster(torch.float32, torch.device("cpu"))
    False
    """
    if dtype == torch.float32:
        return False
    module = torch.get_device_module(device.type) if device.type != "cpu" else None
    settle = getattr(module, "synchronize", lambda: None)
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=generator), torch.randn(512, 512, generator=generator)

    def fastest(kind: torch.dtype) -> float:
        left, right = a.to(device, kind), b.to(device, kind)
        times = []
        for _ in range(4):  # the first warms up
            settle()
            start = time.perf_counter()
            left @ right
            settle()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    try:
        return fastest(dtype) < fastest(torch.float32)
    except (RuntimeError, TypeError):  # no matmul in that dtype there
        return False


def _shown(value: object) -> str:
    """A cast's return, in short: tensors by their shape."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor shaped {tuple(value.shape)}"
    if isinstance(value, tuple):
        return f"({', '.join(_shown(item) for item in value)})"
    return repr(value)[:80]


def rounding_limit(
    dtype: torch.dtype | None, largest: float | None = None, bits: int | None = None
) -> float:
    """Where a magnitude stops rounding to the element type's largest value: the largest plus
    half a step at it (fp16: 65520, e4m3: 464). At or past it, the value overflows (inf) or is
    saturated (clamped to the largest); below it, it is only rounded. ``dtype`` gives the
    largest value and mantissa bits, or ``largest`` and ``bits`` do (fp4 has no ``finfo``).

    >>> rounding_limit(torch.float16), rounding_limit(torch.float8_e4m3fn), rounding_limit(None, 6.0, 1)
    (65520.0, 464.0, 7.0)
    """
    if dtype is not None:
        info = torch.finfo(dtype)
        largest, bits = float(info.max), round(-math.log2(info.eps))
    return largest + 2.0 ** (math.floor(math.log2(largest)) - bits - 1)


def largest_magnitude(tensor: torch.Tensor) -> float:
    """The largest magnitude in ``tensor``, from one pass (its smallest and largest values)."""
    low, high = torch.aminmax(tensor)
    return max(-float(low), float(high))


def count_past(magnitude: torch.Tensor, limit: float | torch.Tensor) -> int:
    """How many of ``magnitude`` are at or past ``limit``."""
    return int(torch.count_nonzero(magnitude >= limit))


def scale_range(scales: torch.Tensor, amax: torch.Tensor) -> tuple[float, float]:
    """The smallest and largest of ``scales`` where the values they scale are not all zero."""
    used = scales.float()[amax > 0]
    return (float(used.min()), float(used.max())) if used.numel() else (1.0, 1.0)


def byte_table(decode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """What ``decode`` reads each of the 256 byte values as, a row each: a format's own
    decoding run once over every code, so that :func:`read_bytes` reads a tensor of them back by
    lookup. On a CPU torch converts a float8 byte to float32 one element at a time (1.6 ms a
    million) and torchao unpacks fp4 in a dozen passes (7.7 ms); a lookup takes 0.6-0.7 ms and
    gives the same values, since each is the decoding of its code. The table is bf16 where every
    value is exact in it (float8's and fp4's are: half the bytes to read back), else float32.

    >>> table = byte_table(lambda codes: codes.view(torch.float8_e4m3fn).float())
    >>> table.shape, table.dtype, table[0x38].item(), table[0x7E].item()
    (torch.Size([256, 1]), torch.bfloat16, 1.0, 448.0)
    """
    codes = torch.arange(256, dtype=torch.uint8)
    table = decode(codes).float().reshape(256, -1)
    narrow = table.bfloat16()
    exact = torch.equal(narrow.float().isnan(), table.isnan()) and bool(
        (narrow.float() == table)[~table.isnan()].all()
    )
    return narrow if exact else table


@functools.cache
def dtype_table(dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """:func:`byte_table` of a one-byte torch ``dtype`` (a float8), by torch's own conversion,
    on ``device`` (default the CPU; kept there, not copied at each read)."""
    table = byte_table(lambda codes: codes.view(dtype).float())
    return table if device is None else table.to(device)


def read_bytes(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``codes`` (one byte an element: a float8 tensor, or packed uint8) read back in the
    table's dtype through ``table`` (:func:`byte_table`): each byte becomes its row, the rows
    laid along the last dimension.

    >>> read_bytes(torch.tensor([[1.0, -448.0]]).to(torch.float8_e4m3fn), dtype_table(torch.float8_e4m3fn))
    tensor([[   1., -448.]], dtype=torch.bfloat16)
    """
    index = codes.contiguous().view(torch.uint8).reshape(-1).int()
    table = table.to(codes.device)  # (a no-op: the table is there)
    # each row gathered as one wide element: a 1-D gather takes half the time of one over rows
    # (0.6 against 1.2 ms a million bytes, a row of one bf16; more with a row of two)
    wide = _WIDE.get(table.shape[1] * table.element_size())
    if wide is None:  # a row no integer type is as wide as: gathered row by row
        values = table.index_select(0, index)
    else:
        values = table.contiguous().view(wide).reshape(-1).index_select(0, index).view(table.dtype)
    if codes.dim() == 0:
        return values.reshape(()) if table.shape[1] == 1 else values.reshape(-1)
    return values.reshape(*codes.shape[:-1], codes.shape[-1] * table.shape[1])


#: An integer dtype as wide as a table's row, by its bytes.
_WIDE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def blocked_cast(
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, float, Any]], block: int
) -> ScaledCast:
    """A block-scaled cast along ``dim``. ``quantize`` casts along the last dimension and hands
    back the values, one scale a block, where its element type stops rounding to its largest
    value (:func:`rounding_limit`) and the factor of the whole tensor (None: 1; the values times
    it are the operand); a ``dim`` of 0 is cast transposed, and a contraction that is no multiple
    of the block is padded with zeros, as the kernels need."""

    def cast_blocked(tensor: torch.Tensor, role: str, dim: int) -> tuple:
        rows = tensor if dim == 1 else tensor.t()
        length = rows.shape[1]
        padding = -length % block
        padded = (F.pad(rows, (0, padding)) if padding else rows).contiguous()
        values, scales, limit, factor = quantize(padded)
        blocks = padded.reshape(len(padded), -1, block)
        scales = scales.float().reshape(blocks.shape[:2])
        magnitude = blocks.abs()  # (a reduction over short blocks: aminmax is 5x slower)
        amax = magnitude.amax(dim=-1)
        past = bool((amax >= limit * scales).any())  # a block's largest first: most pass none
        overflow = count_past(magnitude, limit * scales.unsqueeze(-1)) if past else 0
        values = values[:, :length] if padding else values
        values = values if dim == 1 else values.t()
        return values, overflow, scale_range(scales, amax), factor

    return cast_blocked
