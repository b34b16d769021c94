"""The scaled formats' casts read their elements back by lookup; the values are the libraries'."""

from __future__ import annotations

import math

import pytest
import torch

from mpnb.precision.modes.matmul_format import dtype_table, read_bytes

pytest.importorskip("torchao")

from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import (
    NVFP4Tensor,
    per_tensor_amax_to_scale,
)

from mpnb.precision.modes.mxfp8 import _mxfp8_quantize
from mpnb.precision.modes.nvfp4 import _nvfp4_quantize


def _hard_tensors() -> list[torch.Tensor]:
    """Magnitudes over 60 octaves, signs, zeros, exact block maxima and a row of zeros."""
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(64, 256, generator=generator) * torch.logspace(-30, 30, 256)
    spread[::7, ::5] = 0.0
    spread[3] = 0.0
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4] * 2)
    return [spread, torch.randn(128, 512, generator=generator), -ties, ties * 448.0]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_float8_code_reads_back_as_torch_converts_it(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16)
    expected = codes.float()
    read = read_bytes(
        codes, dtype_table(dtype)
    ).float()  # (in bf16: every float8 value is exact there)
    assert torch.equal(read.isnan(), expected.isnan())
    assert torch.equal(read.nan_to_num(), expected.nan_to_num())


def test_mxfp8_values_are_torchaos_dequantize_bit_for_bit():
    for tensor in _hard_tensors():
        values, scales, _, factor = _mxfp8_quantize(tensor)
        cast = MXTensor.to_mx(tensor, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        assert factor is None
        assert torch.equal(values.float(), cast.dequantize(torch.float32))
        assert scales.numel() == tensor.numel() // 32


def test_nvfp4_values_are_torchaos_dequantize_to_its_last_rounding():
    # elements times their e4m3 block scale, exact in bf16, times the per-tensor scale: torchao
    # multiplies the two scales first, so the one float32 rounding may fall elsewhere
    for tensor in _hard_tensors():
        values, scales, _, factor = _nvfp4_quantize(tensor)
        per_tensor = per_tensor_amax_to_scale(tensor.abs().max())
        cast = NVFP4Tensor.to_nvfp4(tensor, per_tensor_scale=per_tensor)
        assert values.dtype == torch.bfloat16 and torch.equal(factor, per_tensor.reshape(()))
        expected = cast.dequantize(torch.float32)
        assert torch.equal(values == 0, expected == 0)
        torch.testing.assert_close(values.float() * factor, expected, rtol=2**-23, atol=0)
        assert torch.equal(scales, cast.get_hp_scales())


@pytest.mark.parametrize("largest", [0.0, 1e-44, 1e-40, 1e-37, 7e-36, 1e-30])
def test_nvfp4_casts_a_tiny_tensor_with_shares_and_errors_that_make_sense(largest):
    """torchao's per-tensor scale (amax / 2688) is 0 below an amax of ~3.8e-42 and its
    reciprocal inf below ~7.9e-36: the cast must still hold or flush the values, never
    scramble them or count padding as overflow."""
    from mpnb.numerics import formats

    base = torch.randn(4, 35, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tensor = (base / base.abs().max() * largest).float()
    operand = formats.cast("nvfp4", tensor, "gradient", dim=1)
    assert torch.isfinite(operand.read_back()).all()
    assert operand.overflow == 0
    assert 0 <= operand.flushed <= operand.nonzero
    assert all(math.isfinite(scale) for scale in operand.scales)
    if operand.nonzero:
        read = operand.read_back().double()
        error = (read - tensor.double()).norm() / tensor.double().norm()
        assert error <= 1.0  # at worst flushed (1.0); a normal tensor errs ~0.09
        if largest >= 1e-37:  # normal fp32 values: rounded as at any magnitude
            assert error < 0.2


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_a_table_of_any_row_width_reads_bytes_back_as_its_rows(width):
    # a contributor's decode may give several values a byte, in float32: 4-16 bytes a row
    from mpnb.precision.modes.matmul_format import byte_table, read_bytes

    table = byte_table(lambda codes: codes.float().unsqueeze(1) / 3 + torch.arange(width))
    codes = torch.tensor([[0, 7], [255, 3]], dtype=torch.uint8)
    expected = table[codes.long()].reshape(2, 2 * width)
    assert torch.equal(read_bytes(codes, table), expected)


def test_codes_of_any_shape_read_back_in_that_shape():
    table = dtype_table(torch.float8_e4m3fn)
    for shape in [(0, 32), (3, 0), (2, 3, 4), ()]:
        codes = torch.ones(shape).to(torch.float8_e4m3fn)
        assert read_bytes(codes, table).shape == codes.shape
    pairs = torch.zeros(4, 0, dtype=torch.uint8)  # packed fp4: two values a byte
    assert read_bytes(pairs, torch.zeros(256, 2)).shape == (4, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_are_counted_as_torch_counts_them(dtype):
    from mpnb.numerics.formats import zeros_in

    values = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    values[values.abs() < 0.3] = 0.0
    values[0, :6] = torch.tensor([-0.0, math.nan, math.inf, -math.inf, 1e-45, 1e-8])
    values = values.to(dtype)
    assert zeros_in(values) == values.numel() - int(torch.count_nonzero(values))
    assert zeros_in(torch.zeros(0)) == 0


@pytest.mark.parametrize("name", ["bf16", "fp8_rowwise", "mxfp8"])
def test_a_product_taken_in_bf16_is_the_float32_product_rounded_to_bf16(name):
    """Where bf16 multiplies faster, a format whose values are exact in bf16 and whose factors
    are powers of two multiplies in bf16: the same product as in float32, then rounded."""
    from mpnb.numerics import formats
    from mpnb.precision.modes.matmul_format import multiplies_faster
    from mpnb.precision.modes.registry import find_format

    if not multiplies_faster(torch.bfloat16, torch.device("cpu")):
        pytest.skip("bf16 multiplies no faster than fp32 on this CPU: no product is taken in bf16")
    generator = torch.Generator().manual_seed(0)
    a = formats.cast(name, torch.randn(96, 256, generator=generator), "activation", dim=1)
    b = formats.cast(name, torch.randn(256, 64, generator=generator), "weight", dim=0)
    matmul_format = find_format(name)
    a_values, b_values = (matmul_format.multiplicand(o.values, o.factor) for o in (a, b))
    assert a_values.dtype == b_values.dtype == torch.bfloat16  # to be multiplied there
    in_bf16 = matmul_format.product(torch.matmul, (a_values, a.factor), (b_values, b.factor))
    in_fp32 = matmul_format.product(
        torch.matmul, (a.values.float(), a.factor), (b.values.float(), b.factor)
    )
    # the accumulation order may tip a rounding to the neighbouring bf16 value, no further
    differs = in_bf16 != in_fp32
    assert differs.float().mean() < 0.02
    step = (in_fp32.abs() * 2.0**-7)[differs]
    assert ((in_bf16 - in_fp32).abs()[differs] <= step).all()


def test_values_whose_products_fall_below_float32s_normal_range_multiply_in_float32():
    """bf16's matmul on a CPU flushes products below float32's smallest normal (1.2e-38) that a
    float32 accumulation keeps: an operand that small is multiplied in float32."""
    from mpnb.precision.modes.registry import find_format

    generator = torch.Generator().manual_seed(0)
    a = (torch.randn(32, 64, generator=generator) * 3e-20).bfloat16()
    b = (torch.randn(64, 16, generator=generator) * 3e-20).bfloat16()
    bf16 = find_format("bf16")
    a, b = bf16.multiplicand(a, None), bf16.multiplicand(b, None)
    assert a.dtype == b.dtype == torch.float32
    product = bf16.product(torch.matmul, (a, None), (b, None))
    expected = (a.float() @ b.float()).bfloat16().float()
    assert product.abs().max() > 0
    torch.testing.assert_close(product, expected, rtol=2**-7, atol=0)


def test_an_all_zero_mxfp8_block_leaves_the_operand_in_bf16():
    # its scale is e8m0's smallest (2**-127), outside the range where e4m3 times a scale is
    # exact in bf16; its values are zeros, exact at any scale
    tensor = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    tensor[1, :32] = 0.0
    values, _, _, _ = _mxfp8_quantize(tensor)
    assert values.dtype == torch.bfloat16
    cast = MXTensor.to_mx(tensor, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(values.float(), cast.dequantize(torch.float32))


def test_a_cuda_product_sums_in_float32_only_with_cublas_reduced_reductions_off():
    # cuBLAS may sum bf16 and fp16 products in their own precision unless told not to: the
    # what-if's products are accumulated in float32, so such a device multiplies in float32
    from mpnb.precision.modes.matmul_format import sums_in_low_precision

    flags = torch.backends.cuda.matmul
    found = (
        flags.allow_bf16_reduced_precision_reduction,
        flags.allow_fp16_reduced_precision_reduction,
    )
    try:
        flags.allow_bf16_reduced_precision_reduction = True
        flags.allow_fp16_reduced_precision_reduction = False
        cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
        assert sums_in_low_precision(torch.bfloat16, cuda)
        assert not sums_in_low_precision(torch.float16, cuda)
        assert not sums_in_low_precision(torch.bfloat16, cpu)
    finally:
        (
            flags.allow_bf16_reduced_precision_reduction,
            flags.allow_fp16_reduced_precision_reduction,
        ) = found
