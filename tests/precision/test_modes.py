import pytest
import torch

from mpnb.errors import InvalidChoiceError
from mpnb.precision.modes import Fp32Math, mode_names, parse_mode
from mpnb.precision.names import parse_dtype


@pytest.mark.parametrize(
    "name, mode",
    [
        ("fp32", "fp32"),
        ("float32", "fp32"),
        ("TF32", "tf32"),
        ("half", "fp16"),
        ("float16", "fp16"),
        ("bfloat16", "bf16"),
        (" bf16 ", "bf16"),
        ("off", "off"),
        ("float8", "fp8"),
        (parse_mode("fp16"), "fp16"),
    ],
)
def test_mode_names_and_aliases(name, mode):
    assert parse_mode(name).name == mode and parse_mode(name) == parse_mode(mode)


def test_unknown_mode_names_the_value_and_the_valid_ones():
    with pytest.raises(InvalidChoiceError) as error:
        parse_mode("int4")
    assert "'int4'" in str(error.value)
    assert "off, fp32, tf32, fp16, bf16, fp8, mxfp8, nvfp4" in str(error.value)


def test_modes_carry_their_autocast_dtype_and_fp32_math():
    modes = [parse_mode(name) for name in mode_names()]
    assert [m.autocast_dtype for m in modes] == [
        None,
        None,
        None,
        torch.float16,
        torch.bfloat16,
        torch.bfloat16,  # fp8, mxfp8 and nvfp4: what runs outside their layers
        torch.bfloat16,
        torch.bfloat16,
    ]
    assert parse_mode("fp32").fp32_math is Fp32Math.EXACT
    assert parse_mode("tf32").fp32_math is Fp32Math.REDUCED
    assert parse_mode("bf16").fp32_math is None
    assert [m.needs_scaler for m in modes] == [
        False,
        False,
        False,
        True,
        False,
        False,
        False,
        False,
    ]


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


def test_a_mode_equals_its_label_and_a_mode_of_the_same_options():
    rowwise = parse_mode("fp8", recipe="rowwise")
    assert rowwise == "fp8:rowwise" and rowwise == parse_mode("fp8:rowwise")
    assert rowwise != parse_mode("fp8") and parse_mode("fp8") == "fp8"
    assert hash(rowwise) == hash("fp8:rowwise")
    assert parse_mode("bf16") != parse_mode("fp16") and parse_mode("bf16") != "bfloat16x"


def test_an_option_a_mode_does_not_take_names_the_modes_that_take_it():
    with pytest.raises(InvalidChoiceError) as error:
        parse_mode("bf16", keep=["head"])
    assert "'keep'" in str(error.value) and "Mode fp8 takes recipe, keep" in str(error.value)
    with pytest.raises(InvalidChoiceError, match="unknown fp8 recipe 'delayed'"):
        parse_mode("fp8:delayed")
    with pytest.raises(InvalidChoiceError, match="option of mode fp16"):
        parse_mode("fp16:fast")


def test_options_left_as_none_keep_their_defaults():
    assert parse_mode("fp8", recipe=None, keep=None) == parse_mode("fp8")
    assert parse_mode("fp8", keep="lm_head").keep == ("lm_head",)
