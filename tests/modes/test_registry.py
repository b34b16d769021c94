"""The registry refuses what would make a mode unreachable or ambiguous; a mode's identity is
its class and options; compare and the CLI take modes by label."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mpnb
import mpnb.examples as ex
from mpnb.cli import main
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.precision.modes import Mode, mode_names, parse_mode, register, unregister
from mpnb.precision.modes.matmul_format import MatmulFormat, Threshold
from mpnb.precision.modes.registry import format_mode, matmul_formats, option_specs
from tests.modes.brain16 import Brain16


def _mode(name: str, aliases: tuple[str, ...] = (), **fields) -> type[Mode]:
    namespace = {
        "name": name,
        "aliases": aliases,
        "summary": "a test's mode",
        "__annotations__": {},
    }
    for field, (kind, value) in fields.items():
        namespace["__annotations__"][field] = kind
        namespace[field] = value
    return dataclasses.dataclass(frozen=True, eq=False, repr=False)(
        type("TestMode", (Mode,), namespace)
    )


@pytest.mark.parametrize(
    "name, aliases, words",
    [
        ("bf16", (), "bf16 already names another mode"),
        ("mine", ("half",), "half already names another mode"),
        ("MyMode", (), "'MyMode' cannot name a mode"),
        ("a:b", (), "'a:b' cannot name a mode"),
        ("mine", (" spaced ",), "' spaced ' cannot name a mode"),
        ("status", (), "'status' cannot name a mode"),
    ],
)
def test_register_refuses_a_name_that_is_taken_or_unreachable(name, aliases, words):
    before = mode_names()
    with pytest.raises(MpnbError, match=words):
        register(_mode(name, aliases))
    assert mode_names() == before and parse_mode("bf16").autocast_dtype == torch.bfloat16


def _bf16_format(name: str, **fields) -> MatmulFormat:
    return MatmulFormat(name, Threshold(0.1, 0.0), dtype=torch.bfloat16, **fields)


@pytest.mark.parametrize(
    "formats, words",
    [
        ((_bf16_format("bf16"),), "matmul format 'bf16' is already mode bf16's"),
        ((_bf16_format("nvfp4"),), "matmul format 'nvfp4' is already mode nvfp4's"),
        ((_bf16_format("x"), _bf16_format("x")), "matmul format 'x' is already mode mine's own"),
        ((_bf16_format("My Format"),), "matmul format 'My Format' cannot be typed"),
        (("fp16",), r"matmul_formats takes a tuple of MatmulFormat, got \('fp16',\)"),
        (_bf16_format("x"), "matmul_formats takes a tuple of MatmulFormat"),
        ((_bf16_format("x", trains_as="nosuch"),), "'x' trains_as 'nosuch': unknown mode 'nosuch'"),
        ((_bf16_format("x", trains_as="fp16:fast"),), "trains_as 'fp16:fast': unknown option"),
        ((_bf16_format("x", trains_as="mine:fast"),), "trains_as 'mine:fast': unknown option"),
    ],
)
def test_register_refuses_matmul_formats_it_could_not_serve(formats, words):
    mode = _mode("mine")
    mode.matmul_formats = formats
    before = dict(matmul_formats())
    with pytest.raises(MpnbError, match=words):
        register(mode)
    assert "mine" not in mode_names() and matmul_formats() == before


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"dtype": "bfloat16"}, "dtype takes a floating-point torch.dtype, got 'bfloat16'"),
        ({"dtype": torch.int8}, "dtype takes a floating-point torch.dtype, got torch.int8"),
        ({"dtype": torch.bfloat16, "threshold": (0.1, 0.0)}, r"threshold takes a Threshold"),
        ({}, "give a dtype or a scaled_cast, one of them"),
        ({"dtype": torch.bfloat16, "scaled_cast": print}, "give a dtype or a scaled_cast"),
        ({"scaled_cast": "cast"}, "scaled_cast takes a function"),
    ],
)
def test_a_matmul_format_that_could_not_cast_is_refused_when_made(fields, words):
    fields = {"threshold": Threshold(0.1, 0.0), **fields}
    with pytest.raises(MpnbError, match=words):
        MatmulFormat("x", **fields)


def test_a_mode_whose_format_trains_as_itself_with_an_option_registers():
    mode = _mode("mine", recipe=(str, "plain"))
    mode.matmul_formats = (_bf16_format("mine_fast", trains_as="mine:fast"),)
    register(mode)
    try:
        assert format_mode("mine_fast") == mode(recipe="fast")
    finally:
        unregister("mine")


def test_mpnbs_own_modes_cannot_be_unregistered():
    with pytest.raises(MpnbError, match="fp32 is one of mpnb's own"):
        unregister("fp32")
    register(Brain16)
    unregister("brain16")
    assert "brain16" not in mode_names() and "fp32" in mode_names()


def test_a_users_option_with_choices_is_checked_and_shares_the_flag_with_fp8():
    choosy = _mode(
        "choosy", recipe=(str, dataclasses.field(default="x", metadata={"choices": ("x", "y")}))
    )
    register(choosy)
    try:
        assert parse_mode("choosy:y").recipe == "y"
        with pytest.raises(InvalidChoiceError, match="unknown choosy recipe 'junk'; valid: x, y"):
            parse_mode("choosy:junk")
        assert parse_mode("fp8:rowwise").recipe == "rowwise"  # fp8's own choices are untouched
        recipe = next(spec for spec in option_specs() if spec.name == "recipe")
        assert [mode for mode, _ in recipe.helps] == ["fp8", "choosy"]
    finally:
        unregister("choosy")


def test_a_mode_equals_a_string_only_where_its_label_says_all_its_options():
    fp8, kept = parse_mode("fp8"), parse_mode("fp8", keep="head")
    assert fp8 == "fp8" and kept != "fp8" and kept != fp8
    assert parse_mode("fp16") != "half" and parse_mode("half") == "fp16"  # the label is the name
    assert {fp8: 1}.get("fp8") == 1 and {parse_mode("fp8:rowwise"): 1}["fp8:rowwise"] == 1


def _make_run(mode):
    trainer, train, _ = ex.example_trainer(
        mode, "cpu", model="mlp", widths=(32, 32), dashboard=None
    )
    return trainer, train


def test_compare_takes_mode_objects_by_label_and_refuses_options_a_label_cannot_say():
    comparison = mpnb.compare(
        _make_run, [parse_mode("fp32"), parse_mode("bf16")], steps=1, warmup=0, progress=None
    )
    assert [result.mode for result in comparison.results] == ["fp32", "bf16"]
    with pytest.raises(ValueError, match="cannot say all of Mode.'fp8', keep=.'1',.."):
        mpnb.compare(_make_run, [parse_mode("fp8", keep=["1"])], steps=1, progress=None)
    with pytest.raises(ValueError, match="named twice"):
        mpnb.compare(_make_run, ["fp32", "float32"], steps=1, progress=None)


def test_the_cli_refuses_a_mode_named_twice_before_training(capsys):
    assert main(["compare", "--modes", "fp8,fp8:tensorwise", "--model", "mlp", "--steps", "1"]) == 2
    error = capsys.readouterr().err
    assert "mode 'fp8' is named twice" in error and "Traceback" not in error


def test_the_cli_splits_kept_layers_on_commas(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--mode", "fp8", "--model", "mlp", "--keep", "nothing,else", "--steps", "1", "--out", out]) == 2  # fmt: skip
    assert "keep names no module of DigitsMLP: 'nothing', 'else'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "given, mode", [("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("32-true", "fp32")]
)
def test_a_lightning_precision_setting_as_a_mode_says_which_mode_it_is(given, mode):
    with pytest.raises(InvalidChoiceError) as refused:
        parse_mode(given)
    said = str(refused.value)
    assert said.startswith(f"unknown mode {given!r}; valid: off, fp32")
    assert f"{given!r} is Lightning's precision setting for mode {mode}" in said
    with pytest.raises(InvalidChoiceError) as plain:  # not a setting of Lightning's: no hint
        parse_mode("bf16-true")
    assert "Lightning" not in str(plain.value)


@pytest.mark.parametrize(
    "mode, options, said",
    [
        ("fp8:rowwise", {"recipe": "tensorwise"}, "mode fp8:rowwise already says recipe 'rowwise'"),
        (parse_mode("fp8", keep=["2"]), {"keep": ["4"]}, r"already says keep \('2',\), and keep"),
    ],
)
def test_a_mode_and_a_keyword_that_disagree_are_refused_not_one_silently_kept(mode, options, said):
    with pytest.raises(MpnbError, match=said):
        parse_mode(mode, **options)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))
    with pytest.raises(MpnbError, match=said):
        mpnb.Trainer(
            model, torch.optim.SGD(model.parameters(), 0.1), torch.nn.functional.mse_loss,
            mode=mode, device="cpu", dashboard=None, **options,
        )  # fmt: skip


def test_a_keyword_that_agrees_with_the_mode_or_sets_a_default_option_is_taken():
    assert parse_mode("fp8:rowwise", recipe="ROWWISE") == parse_mode("fp8", recipe="rowwise")
    assert parse_mode(parse_mode("fp8"), keep=["4"]).keep == ("4",)
    assert parse_mode(parse_mode("fp8", keep=["2"]), keep=("2",)).keep == ("2",)
