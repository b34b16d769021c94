import pytest
import torch

from mpnb.errors import InvalidChoiceError
from mpnb.precision.modes import Fp32Math, Mode, parse_dtype, parse_mode


@pytest.mark.parametrize(
    "name, mode",
    [
        ("fp32", Mode.FP32),
        ("float32", Mode.FP32),
        ("TF32", Mode.TF32),
        ("half", Mode.FP16),
        ("float16", Mode.FP16),
        ("bfloat16", Mode.BF16),
        (" bf16 ", Mode.BF16),
        ("off", Mode.OFF),
        (Mode.FP16, Mode.FP16),
    ],
)
def test_mode_names_and_aliases(name, mode):
    assert parse_mode(name) is mode


def test_unknown_mode_names_the_value_and_the_valid_ones():
    with pytest.raises(InvalidChoiceError) as error:
        parse_mode("fp4")
    assert "'fp4'" in str(error.value)
    assert "off, fp32, tf32, fp16, bf16, fp8" in str(error.value)


def test_modes_carry_their_autocast_dtype_and_fp32_math():
    assert [m.autocast_dtype for m in Mode] == [
        None,
        None,
        None,
        torch.float16,
        torch.bfloat16,
        torch.bfloat16,
    ]
    assert Mode.FP32.fp32_math is Fp32Math.EXACT and Mode.TF32.fp32_math is Fp32Math.REDUCED
    assert Mode.BF16.fp32_math is None


@pytest.mark.parametrize(
    "name, dtype",
    [("bf16", torch.bfloat16), ("half", torch.float16), (torch.float16, torch.float16)],
)
def test_dtype_names(name, dtype):
    assert parse_dtype(name) is dtype


@pytest.mark.parametrize("bad", ["fp32", torch.float32, "int8", torch.float64, ""])
def test_dtypes_autocast_cannot_lower_to_are_rejected(bad):
    with pytest.raises(InvalidChoiceError, match="bf16 .bfloat16., fp16"):
        parse_dtype(bad)


def test_fp32_as_autocast_dtype_says_to_turn_autocast_off():
    with pytest.raises(InvalidChoiceError, match="turn autocast off"):
        parse_dtype("fp32")
