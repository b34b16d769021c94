"""The what-if: each layer's three matmuls in each format, measured against torchao's casts
called by hand; planted outliers found where they were planted and nowhere else; the advice
proved on a short run; the model, the switches and the hooks as found."""

from __future__ import annotations

import fractions
import functools
import math
import re
import warnings

import pytest
import torch
from torch import nn

import mpnb
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.numerics.whatif import WhatIf, default_thresholds, whatif

pytest.importorskip("torchao")

from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import LinearMMConfig
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import (
    NVFP4Tensor,
    per_tensor_amax_to_scale,
)

FORMATS = ("fp16", "bf16", "fp8", "fp8_rowwise", "mxfp8", "nvfp4")
OUTLIERS = (3, 40)


def _by_hand(
    format: str, tensor: torch.Tensor, gradient: bool, dim: int
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """``tensor`` cast by torchao (or torch) directly, along ``dim``: its elements (times their
    block scale) in float32, and the factor that reads them back (a tensor's or a row's scale)."""
    if format in ("fp16", "bf16"):
        return tensor.to(torch.float16 if format == "fp16" else torch.bfloat16).float(), 1.0
    if format in ("fp8", "fp8_rowwise"):
        rowwise = format == "fp8_rowwise"
        dtype = torch.float8_e5m2 if gradient and not rowwise else torch.float8_e4m3fn
        cast = hp_tensor_to_float8_dynamic(
            tensor,
            dtype,
            LinearMMConfig(),
            scaling_granularity=ScalingGranularity.AXISWISE
            if rowwise
            else ScalingGranularity.TENSORWISE,
            axiswise_dim=(-1 if dim == 1 else 0) if rowwise else None,
            round_scales_to_power_of_2=rowwise,
        )
        return cast._data.float(), 1 / cast._scale
    rows = tensor if dim == 1 else tensor.t()
    block = 32 if format == "mxfp8" else 16
    padded = nn.functional.pad(rows, (0, -rows.shape[1] % block)).contiguous()  # as kernels need
    factor = 1.0
    if format == "mxfp8":
        # as MXFP8Linear casts: each block's scale rounded up (RCEIL)
        mx = MXTensor.to_mx(padded, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        values = mx.dequantize(torch.float32)
    else:
        factor = per_tensor_amax_to_scale(padded.abs().max())
        cast = NVFP4Tensor.to_nvfp4(padded, per_tensor_scale=factor)
        cast.per_tensor_scale = None  # its elements times their block scales only
        values = cast.dequantize(torch.float32)
    values = values[:, : rows.shape[1]]
    return (values if dim == 1 else values.t()), factor


def _product_by_hand(format: str, a: tuple, b: tuple) -> torch.Tensor:
    """``a @ b`` of two operands cast by hand (each ``(values, factor)``), as the format's matmul
    writes it, in torch._scaled_mm's order: accumulated in float32, times the factors (a
    tensor's, a row of a's, a column of b's), rounded once to fp16 (fp16) or bf16 (every other:
    the modes' autocast)."""
    (a_values, a_factor), (b_values, b_factor) = a, b
    written = torch.float16 if format == "fp16" else torch.bfloat16
    reshaped = [f.reshape(shape) if isinstance(f, torch.Tensor) else f
                for f, shape in ((a_factor, (-1, 1)), (b_factor, (1, -1)))]  # fmt: skip
    return ((a_values @ b_values) * reshaped[0] * reshaped[1]).to(written).float()


class Outliers(nn.Module):
    """Multiplies two input channels by 1e5: an outlier feature planted before one layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(x.shape[-1], device=x.device)
        scale[list(OUTLIERS)] = 1e5
        return x * scale


def _planted() -> nn.Module:
    """Four linear layers; the third takes two normalized channels x1e5, its weight / 1e5 on
    them, so the model computes what it would without and only that layer sees the outliers."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.LayerNorm(64),
        Outliers(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    with torch.no_grad():
        model[5].weight[:, list(OUTLIERS)] /= 1e5
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(64, 64, generator=generator), torch.randint(
        0, 10, (64,), generator=generator
    )


@pytest.fixture(scope="module")
def planted() -> WhatIf:
    return whatif(_planted(), _batch(), nn.functional.cross_entropy)


def test_each_error_is_torchaos_cast_applied_by_hand_to_the_recorded_tensors(planted):
    model = _planted()
    recorded: dict[str, dict[str, torch.Tensor]] = {}

    def keep_input(name):
        def hook(module, inputs, output):
            recorded[name] = {"x": inputs[0].detach()}
            output.register_hook(lambda grad: recorded[name].update(dy=grad.detach()))

        return hook

    for name in ("0", "2", "5", "7"):
        model.get_submodule(name).register_forward_hook(keep_input(name))
    x, y = _batch()
    nn.functional.cross_entropy(model(x), y).backward()
    for name, tensors in recorded.items():
        w, x, dy = model.get_submodule(name).weight.detach(), tensors["x"], tensors["dy"]
        matmuls = {
            "forward": ((x, False), (w.t(), False)),
            "input_grad": ((dy, True), (w, False)),
            "weight_grad": ((dy.t(), True), (x, False)),
        }
        for matmul, ((a, a_grad), (b, b_grad)) in matmuls.items():
            if matmul == "input_grad" and not tensors["x"].requires_grad:
                continue  # the first layer's: autograd runs none (pinned below)
            reference = a @ b
            for format in FORMATS:
                cast_a, cast_b = _by_hand(format, a, a_grad, 1), _by_hand(format, b, b_grad, 0)
                product = _product_by_hand(format, cast_a, cast_b)
                expected = (product - reference).norm() / reference.norm()
                expected = float(expected) if torch.isfinite(product).all() else math.inf
                (row,) = [
                    r
                    for r in planted.rows
                    if (r["layer"], r["matmul"], r["format"]) == (name, matmul, format)
                ]
                assert row["rel_error"] == pytest.approx(expected, rel=1e-4), (name, matmul, format)


def test_fp16_overflows_at_the_planted_layer_only_and_the_advice_keeps_it(planted):
    overflowing = {r["layer"] for r in planted.rows if r["format"] == "fp16" and r["overflow"] > 0}
    assert overflowing == {"5"}
    assert planted.recommend("fp16") == ["5"]
    assert planted.recommend("bf16") == []
    for format in ("fp8", "fp8_rowwise", "mxfp8", "nvfp4"):
        assert planted.recommend(format) == ["5"], format


def test_the_advice_goes_straight_into_a_modes_keep(planted):
    model = _planted()
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.functional.cross_entropy,
        mode="fp8",
        keep=planted.recommend("fp8"),
        device="cpu",
        dashboard=None,
    )
    assert trainer.amp.precision.mode.keep == ("5",)


def test_nvfp4_is_worse_than_mxfp8_everywhere(planted):
    error = {(r["layer"], r["matmul"], r["format"]): r["rel_error"] for r in planted.rows}
    pairs = {(layer, matmul) for layer, matmul, _ in error}
    assert len(pairs) == 4 * 3 - 1  # the first layer has no input_grad
    for layer, matmul in pairs:
        assert error[layer, matmul, "nvfp4"] > error[layer, matmul, "mxfp8"], (layer, matmul)


def test_rows_tables_and_shares(planted):
    assert planted.layers == ["0", "2", "5", "7"]
    assert len(planted.rows) == (4 * 3 - 1) * 6  # the first layer: no input_grad
    row = planted.worst("5", "fp16")
    assert row["rel_error"] == math.inf and 0 < row["overflow"] < 1
    assert all(
        0 <= r["underflow"] <= 1 and r["scale_range"][0] <= r["scale_range"][1]
        for r in planted.rows
    )
    assert next(r for r in planted.rows if r["format"] == "mxfp8")["scale_range"][0] < 1
    text = str(planted)
    lines = text.splitlines()  # the table, a blank line, the advice per format with its why
    # and a note: nvfp4 would convert none of its layers, 64 wide (a multiple of 128 it takes)
    assert len(lines) == 1 + len(planted.rows) + 1 + len(planted.formats) + 1
    assert lines[-1].startswith("nvfp4: nvfp4 would convert no layer of Sequential")
    assert lines[-2].startswith("nvfp4: keep 5 (forward rel_error ") and "> 0.3" in lines[-2]
    assert "bf16: keep none" in lines
    html = planted._repr_html_()
    assert "fp16: keep 5" in html and "bf16: keep none" in html
    assert "fp16 keeps 1" in repr(planted)


def test_thresholds_are_the_users_to_set(planted):
    assert planted.thresholds == default_thresholds()
    result = WhatIf(planted.rows, planted.formats)
    result.thresholds["fp16"] = mpnb.numerics.whatif.Threshold(rel_error=1.0, overflow=1.0)
    assert planted.thresholds["fp16"] == default_thresholds()["fp16"]  # each result its own
    result.thresholds["bf16"] = mpnb.numerics.whatif.Threshold(rel_error=0.0, overflow=0.0)
    assert result.recommend("bf16") == result.layers
    assert planted.recommend("bf16") == []


def test_a_convolution_takes_the_torch_dtypes_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 8 * 8, 2))
    batch = (torch.randn(8, 3, 8, 8), torch.randint(0, 2, (8,)))
    result = whatif(model, batch, nn.functional.cross_entropy)
    conv = {(r["matmul"], r["format"]) for r in result.rows if r["layer"] == "0"}
    assert conv == {(m, f) for m in ("forward", "weight_grad") for f in ("fp16", "bf16")}
    row = result.worst("0", "bf16")
    assert 1e-4 < row["rel_error"] < 1e-2
    assert result.worst("0", "fp8") is None


def test_gpt2_with_planted_outlier_features_finds_the_planted_layers():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        n_positions=32,
        vocab_size=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    planted = {"transformer.h.1.mlp.c_fc": "transformer.h.1.ln_2", "lm_head": "transformer.ln_f"}
    with torch.no_grad():
        for layer, norm in planted.items():
            # outlier features after the norm, the consuming weight scaled down: the same model
            norm = model.get_submodule(norm)
            norm.weight[list(OUTLIERS)] *= 1e5
            norm.bias[list(OUTLIERS)] *= 1e5
            weight = model.get_submodule(layer).weight
            if layer == "lm_head":  # tied to the token embedding: untie it first
                model.lm_head.weight = nn.Parameter(weight.detach().clone())
                weight = model.lm_head.weight
                weight[:, list(OUTLIERS)] /= 1e5
            else:  # transformers' Conv1D: (in, out)
                weight[list(OUTLIERS), :] /= 1e5
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    result = whatif(model, {"input_ids": ids, "labels": ids})
    assert "transformer.h.0.attn.c_attn" in result.layers and "lm_head" in result.layers
    for format in ("fp16", "mxfp8"):
        assert result.recommend(format) == list(planted), format
    assert result.recommend("bf16") == []
    # fp8's and nvfp4's layers replace nn.Linear alone: GPT-2's Conv1D layers would train in
    # bf16, so they are not measured in those formats, and the modes would convert no layer
    conv1d = [name for name in result.layers if name != "lm_head"]
    for format in ("fp8", "fp8_rowwise", "nvfp4"):
        assert all(result.worst(name, format) is None for name in conv1d), format
        assert result.recommend(format) == ["lm_head"], format
        assert "Conv1D layers (GPT-2's) are not torch.nn.Linear" in result.unconverted[format]
    assert set(result.unconverted) == {"fp8", "fp8_rowwise", "nvfp4"}
    assert "fp8: keep lm_head" in str(result) and "would train in it (below)" in str(result)
    assert "fp8, fp8_rowwise: fp8 would convert no layer of GPT2LMHeadModel" in str(result)


def test_model_switches_and_hooks_are_as_found_even_on_error():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    rng = torch.get_rng_state()
    whatif(model, (x, y), nn.functional.cross_entropy, formats=["bf16", "fp8"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training and not torch.is_autocast_enabled("cpu")

    def broken(output, target):
        raise RuntimeError("a loss that fails")

    with pytest.raises(RuntimeError, match="a loss that fails"):
        whatif(model, (x, y), broken)
    assert all(not m._forward_hooks for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_names_are_refused_with_the_valid_ones(planted):
    with pytest.raises(InvalidChoiceError, match="unknown format 'int4'; valid: fp16, bf16, fp8"):
        whatif(_planted(), _batch(), nn.functional.cross_entropy, formats=["int4"])
    with pytest.raises(InvalidChoiceError, match="unknown format 'int8'"):
        planted.recommend("int8")
    result = WhatIf([r for r in planted.rows if r["format"] == "bf16"], ["bf16"])
    with pytest.raises(
        MpnbError, match="format 'fp8' was not measured; this what-if measured bf16"
    ):
        result.recommend("fp8")
    with pytest.raises(MpnbError, match="has no layer a format applies to"):
        whatif(
            nn.Sequential(nn.ReLU()), (torch.randn(2, 2), torch.randn(2, 2)), nn.functional.mse_loss
        )


def test_the_formats_asked_for_are_each_named_once_and_at_least_one(planted):
    model, batch, loss = _planted(), _batch(), nn.functional.cross_entropy
    result = whatif(model, batch, loss, formats=["bf16", "fp16", "bf16"])
    assert result.formats == ("bf16", "fp16") and len(result.rows) == 2 * (3 * 4 - 1)
    with pytest.raises(MpnbError, match=r"formats=\[\] names no format; valid: fp16, bf16"):
        whatif(model, batch, loss, formats=[])
    with pytest.raises(InvalidChoiceError, match="unknown formats 3; valid: fp16"):
        whatif(model, batch, loss, formats=3)
    with pytest.raises(InvalidChoiceError, match=r"unknown format \['fp16'\]; valid: fp16"):
        whatif(model, batch, loss, formats=[["fp16"]])


def test_a_threshold_taken_away_is_asked_for_by_name(planted):
    result = WhatIf(planted.rows, planted.formats)
    del result.thresholds["fp8"]
    with pytest.raises(
        MpnbError, match=r"no threshold for format 'fp8': set result.thresholds\['fp8'\]"
    ):
        result.recommend("fp8")


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"rel_error": math.nan, "overflow": 0.0}, "rel_error=nan"),
        ({"rel_error": "0.1", "overflow": 0.0}, "rel_error='0.1'"),
        ({"rel_error": 0.1, "overflow": None}, "overflow=None"),
        ({"rel_error": 0.1, "overflow": -0.5}, "overflow=-0.5"),
        ({"rel_error": 0.1, "overflow": True}, "overflow=True"),
        ({"rel_error": 0.1, "overflow": 0.0, "underflow": math.nan}, "underflow=nan"),
        ({"rel_error": 10**400, "overflow": 0.0}, "(401 characters)"),  # past float's range
    ],
)
def test_a_threshold_that_is_not_a_number_at_least_zero_is_refused(planted, fields, named):
    # NaN compares false: every layer would pass it, and the advice would be to keep none
    from mpnb.numerics.whatif import Threshold

    with pytest.raises(MpnbError, match=re.escape(f"{named}): a threshold is a number")):
        Threshold(**fields)
    assert (
        Threshold(rel_error=math.inf, overflow=0, underflow=None).passed(planted.rows[0]) is False
    )
    exact = Threshold(rel_error=fractions.Fraction(1, 10**6), overflow=0)  # read as a float
    assert exact.rel_error == 1e-6 and isinstance(exact.overflow, float)
    result = WhatIf(planted.rows, planted.formats)
    result.thresholds["fp16"] = exact
    assert "fp16: keep " in str(result) and "fp16: keep" in result._repr_html_()


def test_a_gradient_taken_inside_the_loss_is_not_the_one_measured():
    """A physics-informed loss differentiates the model's output by its input inside the
    loss (torch.autograd.grad): the output's hook fires there too, before the loss's own
    backward; the layers are measured with the loss's gradient, once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))
    points = torch.randn(64, 2, requires_grad=True)

    def physics(u, _):
        (du,) = torch.autograd.grad(u.sum(), points, create_graph=True)
        return ((du[:, 1] - 0.1 * du[:, 0]) ** 2).mean() + (u**2).mean()

    result = whatif(model, (points, None), physics, formats=["bf16", "fp8"])
    # the last layer's output gets the same gradient from (u**2).mean() alone (the inner
    # gradient's graph reaches the weights, not u): its rows are that loss's rows
    plain = whatif(model, (points, None), lambda u, _: (u**2).mean(), formats=["bf16", "fp8"])
    last = [r for r in result.rows if r["layer"] == "2"]
    assert last == [r for r in plain.rows if r["layer"] == "2"] and len(last) == 6
    assert {r["matmul"] for r in result.rows if r["layer"] == "0"} == {
        "forward", "input_grad", "weight_grad"
    }  # fmt: skip
    assert all(not m._forward_hooks for m in model.modules())


def test_the_pass_writes_no_gradient_outside_the_model():
    """A measurement has no side effects: a batch that needs gradients (a saliency map, an
    adversarial input) and a loss with parameters of its own keep the .grad they had."""

    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.temperature = nn.Parameter(torch.ones(()))

        def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(out / self.temperature, target)

    model, loss = _planted(), Tempered()
    x, y = _batch()
    x.requires_grad_()
    x.grad = torch.full_like(x, 7.0)  # a gradient the caller holds
    result = whatif(model, (x, y), loss, formats="bf16")
    assert torch.equal(x.grad, torch.full_like(x, 7.0)) and loss.temperature.grad is None
    assert all(p.grad is None for p in model.parameters())
    assert {"input_grad"} <= {r["matmul"] for r in result.rows if r["layer"] == "0"}


def test_a_model_whose_layers_a_mode_swapped_already_is_refused():
    # torchao's float8 layers subclass nn.Linear and keep fp32 weights: measured as they are,
    # the fp32 reference would carry fp8's own rounding
    model = _planted()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with mpnb.fp8_layers(model, device="cpu"):
        with pytest.raises(MpnbError, match=r"layer '2' is Float8Linear already \(mode fp8\)"):
            whatif(model, _batch(), nn.functional.cross_entropy, formats="bf16")
    assert whatif(model, _batch(), nn.functional.cross_entropy, formats="bf16").rows
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_all_zero_operand_adds_no_scale_to_its_rows_range():
    # an all-zero tensor has no scale: the (1, 1) it reports is no scale an operand has
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    batch = (torch.zeros(16, 64), torch.randn(16, 64))
    result = whatif(model, batch, nn.functional.mse_loss, formats=["fp8", "mxfp8"])
    from mpnb.numerics import formats

    weight = model[0].weight.detach()
    for format in ("fp8", "mxfp8"):
        (forward,) = [r for r in result.rows if (r["matmul"], r["format"]) == ("forward", format)]
        alone = formats.cast(format, weight, "weight", dim=1).scales  # as forward casts it
        assert forward["scale_range"] == pytest.approx(alone), format


def test_the_pass_runs_every_matmul_a_step_runs_and_puts_outside_gradients_back():
    """The backward is a training step's: a soft prompt before a frozen layer gets its
    gradient through that layer (its input_grad runs), a reentrant checkpoint that takes only
    the batch reaches its layers; the gradients it leaves outside the model (the prompt, a
    closure's parameter) are put back, the same tensors."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    prompt = torch.randn(5, 8, requires_grad=True)
    held = torch.zeros_like(prompt)
    prompt.grad = held
    temperature = nn.Parameter(torch.tensor(2.0))
    loss = lambda out, target: nn.functional.cross_entropy(out / temperature, target)  # noqa: E731
    result = whatif(model, (prompt, torch.randint(0, 4, (5,))), loss, formats="bf16")
    assert {r["matmul"] for r in result.rows if r["layer"] == "0"} == {"forward", "input_grad"}
    assert prompt.grad is held and not held.any() and temperature.grad is None
    model.requires_grad_(False)  # nothing in the model trains: the prompt alone
    whatif(model, (prompt, torch.randint(0, 4, (5,))), loss, formats="bf16")
    assert prompt.grad is held and not held.any() and temperature.grad is None

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inner = lambda y: self.b(torch.relu(self.a(y)))  # noqa: E731
            return checkpoint(inner, x, use_reentrant=True)

    x = torch.randn(4, 8, requires_grad=True)  # as torch asks of a reentrant checkpoint
    net = Checkpointed()
    result = whatif(net, (x, torch.randn(4, 8)), nn.functional.mse_loss, formats="bf16")
    assert {(r["layer"], r["matmul"]) for r in result.rows} == {
        (layer, matmul) for layer in "ab" for matmul in ("forward", "input_grad", "weight_grad")
    }
    assert x.grad is None and all(p.grad is None for p in net.parameters())


def test_a_layer_fed_the_batch_has_no_input_grad_row_as_autograd_runs_none(planted):
    # the first layer's input needs no gradient: training never multiplies its output's
    # gradient by its weight, so no error there may make recommend() keep it
    first = {(r["matmul"], r["format"]) for r in planted.rows if r["layer"] == "0"}
    second = {(r["matmul"], r["format"]) for r in planted.rows if r["layer"] == "2"}
    assert {matmul for matmul, _ in first} == {"forward", "weight_grad"}
    assert {matmul for matmul, _ in second} == {"forward", "input_grad", "weight_grad"}
    x, y = _batch()
    fed = whatif(_planted(), (x.requires_grad_(), y), nn.functional.cross_entropy, formats="bf16")
    assert "input_grad" in {r["matmul"] for r in fed.rows if r["layer"] == "0"}


@pytest.mark.parametrize(
    "returned, shown",
    [
        (
            lambda t: (t[:1], 0, (1.0, 1.0)),
            r"\(a torch.float32 tensor shaped \(1, 64\), 0, \(1.0, 1.0\)\)",
        ),
        (
            lambda t: (t.int(), 0, (1.0, 1.0)),
            r"\(a torch.int32 tensor shaped \(64, 64\), 0,",
        ),
        (
            lambda t: (t, 0, (1.0, 1.0), torch.ones(3)),
            r"\(a torch.float32 tensor shaped \(64, 64\), 0, \(1.0, 1.0\), a torch.float32 tensor shaped \(3,\)\)",
        ),
        (lambda t: (t, -1, (1.0, 1.0)), r"\(a torch.float32 tensor shaped \(64, 64\), -1,"),
        # a share where a count belongs: int() would read it as no overflow
        (lambda t: (t, 0.5, (1.0, 1.0)), r"\(a torch.float32 tensor shaped \(64, 64\), 0.5,"),
        (lambda t: (t, 0, 1.0), r"\(a torch.float32 tensor shaped \(64, 64\), 0, 1.0\)"),
        (lambda t: t, r"a torch.float32 tensor shaped \(64, 64\);"),
    ],
)
def test_a_scaled_cast_that_returns_something_else_is_named(monkeypatch, returned, shown):
    from mpnb.precision.modes import registry
    from mpnb.precision.modes.matmul_format import MatmulFormat, Threshold

    mode = type(registry.find_mode("nvfp4"))
    shaky = MatmulFormat("shaky", Threshold(0.3, 0.0), scaled_cast=lambda t, role, dim: returned(t))
    monkeypatch.setattr(mode, "matmul_formats", (*mode.matmul_formats, shaky))
    model = _planted()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MpnbError) as raised:
        whatif(model, _batch(), nn.functional.cross_entropy, formats=["shaky"])
    said = str(raised.value)
    assert said.startswith("the scaled cast of matmul format 'shaky' returned "), said
    assert (
        re.search(shown, said)
        and "a cast returns (values shaped (64, 64) in a floating-point dtype" in said
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(
        not m._forward_hooks and p.grad is None
        for m in model.modules()
        for p in m.parameters(recurse=False)
    )


@pytest.mark.parametrize(
    "factor, follows_axis, said",
    [
        (lambda t: torch.ones(len(t)), True, r"shaped \(64, 1\) for dim=1"),
        (lambda t: torch.ones(len(t), 1), False, r"follows_axis=True"),
        (lambda t: torch.full((1,), math.nan), False, r"finite and nonzero"),
        (lambda t: torch.zeros(()), False, r"finite and nonzero"),
    ],
)
def test_a_scaled_casts_factor_in_another_layout_or_not_finite_is_refused(
    monkeypatch, factor, follows_axis, said
):
    # a factor per row is laid along the rows (keepdim), and only a cast made per axis may
    # have one: a cast made once is used along the other axis too
    from mpnb.precision.modes import registry
    from mpnb.precision.modes.matmul_format import MatmulFormat, Threshold

    mode = type(registry.find_mode("nvfp4"))
    cast = lambda t, role, dim: (t, 0, (1.0, 1.0), factor(t if dim == 1 else t.t()))  # noqa: E731
    odd = MatmulFormat("odd", Threshold(0.3, 0.0), scaled_cast=cast, follows_axis=follows_axis)
    monkeypatch.setattr(mode, "matmul_formats", (*mode.matmul_formats, odd))
    model = _planted()
    with pytest.raises(MpnbError, match=said) as raised:
        whatif(model, _batch(), nn.functional.cross_entropy, formats=["odd"])
    assert "matmul format 'odd'" in str(raised.value)
    assert all(not m._forward_hooks for m in model.modules())


def _make_run(mode):
    torch.manual_seed(0)
    model = _planted()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # SGD: the 1e5 columns blow up
    trainer = mpnb.Trainer(
        model, optimizer, nn.functional.cross_entropy, mode=mode, device="cpu", dashboard=None
    )
    x, y = _batch()
    return trainer, [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]


def test_prove_trains_the_advice_beside_bf16_and_reports_the_gap(planted):
    proof = planted.prove(_make_run, "fp8", steps=4)
    assert proof.keep == ["5"] and proof.mode == "fp8"
    assert len(proof.losses) == len(proof.bf16_losses) == 4
    assert math.isfinite(proof.gap) and proof.spread >= 0
    assert "loss gap" in str(proof) and "keeping 5" in str(proof)
    fp16 = planted.prove(_make_run, "fp16", steps=2)
    assert fp16.keep == ["5"] and math.isfinite(fp16.gap)
    with pytest.raises(MpnbError, match="mode nvfp4 is not available on cpu"):
        planted.prove(_make_run, "nvfp4", steps=2)


def test_prove_runs_the_format_first_so_a_refusal_costs_no_bf16_run(planted):
    asked = []

    def make_run(mode):
        asked.append(str(mode))
        return _make_run(mode)

    with pytest.raises(MpnbError, match="fp8 would convert no layer of Sequential: keep names"):
        mpnb.numerics.format_proof.prove(["2", "5"], make_run, "fp8", steps=2)
    assert asked == ["fp8"]


@pytest.mark.parametrize(
    "built, said",
    [
        (lambda mode: "bf16", r"the run built for mode fp8 \(keep 5\) trains in bf16"),
        (lambda mode: "fp8", r"the run built for mode fp8 \(keep 5\) trains in fp8"),
        (lambda mode: getattr(mode, "name", mode), "the run built for mode fp8 .*trains in fp8"),
    ],
)
def test_prove_refuses_a_run_built_in_another_mode_than_it_was_given(planted, built, said):
    """A make_run that ignores its mode (or drops the keep it carries) would prove a format
    that never ran: refused before a step, as compare refuses it."""
    trained = []

    def make_run(mode):
        trainer, data = _make_run(built(mode))
        trainer.fit = lambda *a, **k: trained.append(mode)
        return trainer, data

    with pytest.raises(MpnbError, match=said):
        planted.prove(make_run, "fp8", steps=2)
    assert trained == []


def test_prove_refuses_one_model_for_both_runs(planted):
    """The bf16 run would start where the format's run left the weights."""
    model, data = _planted(), _make_run("bf16")[1]

    def make_run(mode):
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        trainer = mpnb.Trainer(
            model, optimizer, nn.functional.cross_entropy, mode=mode, device="cpu", dashboard=None
        )
        return trainer, data

    with pytest.raises(MpnbError, match="share one model: build a fresh model"):
        planted.prove(make_run, "fp16", steps=2)


def test_a_model_given_second_and_a_mode_without_formats_are_named():
    batch = _batch()
    with pytest.raises(
        MpnbError, match="whatif takes the model .* first, then its batch; got a tuple"
    ):
        whatif(batch, _planted())
    with pytest.raises(
        InvalidChoiceError,
        match="unknown format 'tf32'; valid: fp16, .* Mode tf32 declares no matmul format",
    ):
        whatif(_planted(), batch, nn.functional.cross_entropy, formats=["tf32"])


def test_it_holds_one_layers_casts_at_a_time(monkeypatch):
    """Every tensor a cast made for a layer is gone before the next layer is measured: beyond
    the pass itself, one layer's operands and products at a time."""
    import gc
    import weakref

    from mpnb.numerics import formats, layer_matmuls

    made: list[tuple[str, weakref.ref]] = []  # (layer, a cast's values)
    measuring: list[str] = []
    alive_at_start: dict[str, int] = {}
    cast, layer = formats.cast, layer_matmuls.LayerMatmuls.layer

    def recorded_cast(*args, **kwargs):
        operand = cast(*args, **kwargs)
        made.append((measuring[-1], weakref.ref(operand.values)))
        return operand

    def measured_layer(self, name, *args):
        gc.collect()
        alive_at_start[name] = sum(1 for _, values in made if values() is not None)
        measuring.append(name)
        return layer(self, name, *args)

    monkeypatch.setattr(formats, "cast", recorded_cast)
    monkeypatch.setattr(layer_matmuls.LayerMatmuls, "layer", measured_layer)
    whatif(_planted(), _batch(), nn.functional.cross_entropy)
    assert measuring == ["7", "5", "2", "0"]  # as the gradients arrive
    # each layer: once per format, or per axis (the first layer's weight and gradient on one)
    assert len(made) == 3 * (3 + 3 + 3 + 6 + 6 + 6) + (3 + 3 + 3 + 4 + 4 + 4)
    assert alive_at_start == {"7": 0, "5": 0, "2": 0, "0": 0}


@pytest.mark.parametrize(
    "format, layers",
    [
        ("fp8", mpnb.fp8_layers),
        ("fp8_rowwise", functools.partial(mpnb.fp8_layers, recipe="rowwise")),
        ("mxfp8", mpnb.mx_layers),
    ],
)
def test_each_error_is_what_the_modes_own_layer_makes(format, layers):
    # the prediction against the thing predicted: torchao's layer (emulated on a CPU, fp32 in
    # and out) multiplying the same input, weight and output gradient as the what-if's pass,
    # its products written in bf16 as the mode's autocast writes them
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    x, y = torch.randn(40, 64), torch.randn(40, 64)  # 40 rows: the weight's gradient is padded
    result = whatif(model, (x, y), nn.functional.mse_loss, formats=[format])
    predicted = {r["matmul"]: r["rel_error"] for r in result.rows if r["layer"] == "1"}
    h = model[0](x).detach().requires_grad_()
    out = model[1](h)
    (dy,) = torch.autograd.grad(nn.functional.mse_loss(model[2](out), y), out)
    weight = model[1].weight.detach()
    reference = {
        "forward": h.detach() @ weight.t(),
        "input_grad": dy @ weight,
        "weight_grad": dy.t() @ h.detach(),
    }
    with layers(model, device="cpu") as swapped:
        assert swapped.converted == ["1"]
        made = model[1](h) - model[1].bias
        made.backward(dy)
    measured = {"forward": made.detach(), "input_grad": h.grad, "weight_grad": model[1].weight.grad}
    for matmul, value in measured.items():
        value = value.bfloat16().float()
        error = float((value - reference[matmul]).norm() / reference[matmul].norm())
        assert predicted[matmul] == pytest.approx(error, rel=1e-3), (matmul, predicted, error)


@pytest.mark.parametrize("format, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_each_dtype_formats_error_is_what_autocast_makes(format, dtype):
    # a linear layer under torch's CPU autocast: operands in the dtype, output in the dtype
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    x, y = torch.randn(40, 64), torch.randn(40, 64)
    result = whatif(model, (x, y), nn.functional.mse_loss, formats=[format])
    predicted = {r["matmul"]: r["rel_error"] for r in result.rows if r["layer"] == "1"}
    h = model[0](x).detach().requires_grad_()
    out = model[1](h)
    (dy,) = torch.autograd.grad(nn.functional.mse_loss(model[2](out), y), out)
    weight = model[1].weight.detach().requires_grad_()
    reference = {
        "forward": h.detach() @ weight.detach().t(),
        "input_grad": dy @ weight.detach(),
        "weight_grad": dy.t() @ h.detach(),
    }
    with torch.autocast("cpu", dtype=dtype):
        made = nn.functional.linear(h, weight)
    made.backward(dy.to(dtype))
    measured = {"forward": made.detach(), "input_grad": h.grad, "weight_grad": weight.grad}
    for matmul, value in measured.items():
        error = float((value.float() - reference[matmul]).norm() / reference[matmul].norm())
        assert predicted[matmul] == pytest.approx(error, rel=1e-3), (matmul, predicted, error)


class _Unused(nn.Module):
    """Layer ``b``'s output is multiplied by zero: its output's gradient is all zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)  # b's input needs a gradient: both its gradient matmuls run
        return self.c(hidden + 0 * self.b(hidden))


def test_an_all_zero_gradient_is_exact_in_every_format():
    """Zeros are held exactly by every format: torchao's NVFP4 cast divides by a per-tensor
    scale of zero there, which must not read as an error of inf and a negative underflow."""
    torch.manual_seed(0)
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    result = whatif(_Unused(), batch, nn.functional.cross_entropy)
    zero_gradient = [
        row for row in result.rows if row["layer"] == "b" and row["matmul"] != "forward"
    ]
    assert len(zero_gradient) == 2 * len(FORMATS)
    for row in zero_gradient:  # the other operand (the weight, the input) may still flush
        assert (row["rel_error"], row["overflow"]) == (0.0, 0.0), row
        assert 0.0 <= row["underflow"] < 1.0, row
    (forward,) = [
        row
        for row in result.rows
        if (row["layer"], row["matmul"], row["format"]) == ("b", "forward", "nvfp4")
    ]
    assert ("b" in result.recommend("nvfp4")) == default_thresholds()["nvfp4"].passed(forward)


@pytest.mark.parametrize("magnitude", [1e-23, 1e-40, 1e20, 1e30])
def test_the_relative_error_holds_at_magnitudes_whose_squares_float32_cannot(magnitude):
    """A float32 norm squares its values: below ~1e-19 the squares flush (an error of 0 read as
    exact), above ~1e19 they overflow (inf read as an overflow of the format)."""
    from mpnb.numerics.layer_matmuls import relative_error

    generator = torch.Generator().manual_seed(0)
    value, reference = torch.randn(2, 64, generator=generator, dtype=torch.float64)
    expected = float((value - reference).norm() / reference.norm())
    scaled = relative_error((value * magnitude).float(), (reference * magnitude).float())
    assert scaled == pytest.approx(expected, rel=1e-3 if magnitude > 1e-38 else 0.2)
    assert relative_error(torch.zeros(8), torch.full((8,), magnitude)) == 1.0


def test_an_fp16_product_flushed_whole_reads_as_an_error_of_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    result = whatif(model, batch, lambda out, target: 1e-22 * nn.functional.mse_loss(out, target))
    (row,) = [
        r
        for r in result.rows
        if (r["layer"], r["matmul"], r["format"]) == ("2", "weight_grad", "fp16")
    ]
    # every gradient element is below fp16's smallest subnormal: flushed, the product with them
    assert row["underflow"] > 0 and row["rel_error"] == 1.0


def _small() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, (torch.randn(16, 32), torch.randn(16, 4))


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_it_measures_when_called_where_gradients_are_off(context):
    model, batch = _small()
    with context():
        result = whatif(model, batch, nn.functional.mse_loss, ["bf16"])
        assert torch.is_grad_enabled() is False  # the caller's setting, as found
    assert result.layers == ["0", "2"]


@pytest.mark.parametrize(
    "loss_fn, said",
    [
        (lambda out, target: nn.functional.mse_loss(out, target).detach(), "does not require grad"),
        (
            lambda out, target: nn.functional.mse_loss(out, target, reduction="none"),
            "single number",
        ),
        (lambda out, target: float(nn.functional.mse_loss(out, target)), "must be a tensor"),
    ],
)
def test_a_loss_backward_cannot_take_is_named_in_mpnbs_words(loss_fn, said):
    model, batch = _small()
    with pytest.raises(MpnbError, match=said):
        whatif(model, batch, loss_fn, ["bf16"])


def test_a_frozen_model_is_named_in_mpnbs_words():
    model, batch = _small()
    model.requires_grad_(False)
    with pytest.raises(MpnbError, match="does not require grad"):
        whatif(model, batch, nn.functional.mse_loss, ["bf16"])
    assert not any(p.requires_grad for p in model.parameters())


class _SidePass(nn.Module):
    """Layer ``a`` runs twice: trained on inputs x1e5 (fp16 overflows there), then once more
    under no_grad on ordinary inputs (a side pass: a metric, a teacher)."""

    def __init__(self, side_rows: int) -> None:
        super().__init__()
        self.a, self.b, self.side_rows = nn.Linear(32, 32), nn.Linear(32, 4), side_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x * 1e5)))
        with torch.no_grad():
            self.a(x[: self.side_rows])
        return out


@pytest.mark.parametrize("side_rows", [5, 16])
def test_a_call_under_no_grad_is_not_paired_with_a_trained_calls_gradient(side_rows):
    torch.manual_seed(0)
    batch = (torch.randn(16, 32), torch.randn(16, 4))
    result = whatif(_SidePass(side_rows), batch, nn.functional.mse_loss, ["fp16"])
    (forward,) = [r for r in result.rows if (r["layer"], r["matmul"]) == ("a", "forward")]
    assert forward["overflow"] > 0 and result.recommend("fp16") == ["a"]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_pass_not_finite_in_fp32_is_named_not_blamed_on_every_format(bad):
    model, (x, y) = _small()
    x[0, 0] = bad
    with pytest.raises(MpnbError, match="not finite in fp32"):
        whatif(model, (x, y), nn.functional.mse_loss)


def test_a_layer_whose_fp32_product_is_not_finite_is_named():
    """The loss can stay finite past a layer whose product is not (a mask that drops it)."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.a(x)
            return self.b(torch.where(torch.isfinite(hidden), hidden, 0.0))

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    x[0, 0] = math.inf
    with pytest.raises(MpnbError, match="layer 'a'.*not finite in fp32"):
        whatif(Masked(), (x, torch.randn(4, 2)), nn.functional.mse_loss, ["bf16"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_model_held_in_low_precision_is_refused_with_the_way_to_measure_it(dtype):
    model, (x, y) = _small()
    model.to(dtype)
    with pytest.raises(MpnbError, match=rf"{dtype}.*'0.weight'.*\.float\(\)"):
        whatif(model, (x.to(dtype), y.to(dtype)), nn.functional.mse_loss)
    assert model[0].weight.dtype == dtype


def test_scaled_formats_asked_of_a_convolution_model_say_they_apply_to_linear_layers():
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Conv1d(4, 2, 3))
    batch = (torch.randn(4, 2, 10), torch.randn(4, 2, 6))
    with pytest.raises(MpnbError, match=r"mxfp8, nvfp4 apply to none of .* \(Conv1d\).*fp16, bf16"):
        whatif(model, batch, nn.functional.mse_loss, ["mxfp8", "nvfp4"])
    transformers = pytest.importorskip("transformers")
    conv1d = nn.Sequential(transformers.pytorch_utils.Conv1D(8, 8))  # GPT-2's linear kind
    with pytest.raises(MpnbError, match=r"fp8 apply to none of Sequential's layers .*\(Conv1D\)"):
        whatif(conv1d, (torch.randn(4, 8), torch.randn(4, 8)), nn.functional.mse_loss, ["fp8"])


def test_a_frozen_layers_forward_is_measured_as_training_would_run_it():
    """A frozen layer gets no gradient, but autocast still runs its forward in the format."""
    model, batch = _small()
    with torch.no_grad():
        model[0].weight.mul_(1e5)  # its outputs reach ~1e5: past fp16
    model[0].requires_grad_(False)
    result = whatif(model, batch, nn.functional.mse_loss, ["fp16", "bf16"])
    assert result.layers == ["0", "2"]
    frozen = {(r["matmul"], r["format"]): r for r in result.rows if r["layer"] == "0"}
    assert sorted(frozen) == [("forward", "bf16"), ("forward", "fp16")]
    x = batch[0]
    reference = x @ model[0].weight.detach().t()
    by_hand = (x.half().float() @ model[0].weight.detach().half().float().t()).half().float()
    assert not torch.isfinite(by_hand).all() and frozen["forward", "fp16"]["rel_error"] == math.inf
    assert frozen["forward", "bf16"]["rel_error"] == pytest.approx(
        float(
            (x.bfloat16().float() @ model[0].weight.detach().bfloat16().float().t())
            .bfloat16()
            .float()
            .sub(reference)
            .norm()
            / reference.norm()
        ),
        rel=1e-4,
    )
    assert result.recommend("fp16") == ["0"]
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad


def test_linear_layers_the_pass_never_called_are_named_as_unmeasured():
    """nn.MultiheadAttention multiplies by its out_proj's weight without calling the module; a
    layer given its input as a keyword hands a forward hook no input: neither can be measured,
    and the result says so rather than leave them out in silence."""

    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(input=x))

    torch.manual_seed(0)
    result = whatif(Keyword(), (torch.randn(4, 8), torch.randn(4, 2)), nn.functional.mse_loss)
    assert result.layers == ["b"] and result.unmeasured == ["a"]
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    batch = (torch.randn(2, 5, 16), torch.randn(2, 5, 16))
    result = whatif(layer, batch, nn.functional.mse_loss, ["bf16"])
    assert result.unmeasured == ["self_attn.out_proj"]
    assert "not measured: self_attn.out_proj" in str(result)
    assert "not measured: self_attn.out_proj" in result._repr_html_()


def test_a_spectral_norm_layers_power_iteration_buffers_are_left_as_found():
    # reading a parametrized weight in train mode runs spectral_norm's power iteration, which
    # moved its _u and _v buffers (by up to 7e-3) before the pass that puts them back began
    torch.manual_seed(0)
    normed = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), normed, nn.ReLU(), nn.Linear(8, 2))
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    whatif(model, (torch.randn(4, 8), torch.randint(0, 2, (4,))), nn.functional.cross_entropy)
    assert before and all(torch.equal(b, before[n]) for n, b in model.named_buffers())


def test_a_layer_with_no_weight_element_multiplies_nothing_and_is_left_out():
    """A zero-width Linear (a head sized by a config to zero) makes no product to measure."""

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kept, self.empty = nn.Linear(8, 4), nn.Linear(8, 0)
            self.into_empty = nn.Linear(0, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.kept(x), self.empty(x)], dim=1) + self.into_empty(x[:, :0])

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: initializing zero-element tensors is a no-op
        model = Branches()
    result = whatif(model, (torch.randn(4, 8), torch.randn(4, 4)), nn.functional.mse_loss, ["bf16"])
    assert result.layers == ["kept"] and result.unmeasured == []


def test_the_fp32_reference_is_computed_in_exact_fp32_math_whatever_the_session_holds():
    """A session in mode tf32 (or a user's set_float32_matmul_precision) computes fp32 matmuls
    with reduced math (TF32, oneDNN's bf16): the reference would carry errors of ~1e-3, as
    large as bf16's own."""
    from mpnb.precision.fp32math import Fp32MathSnapshot

    model, batch = _small()
    seen = []

    def loss_fn(out, target):
        seen.append(torch.get_float32_matmul_precision())
        return nn.functional.mse_loss(out, target)

    found = Fp32MathSnapshot.capture()
    torch.set_float32_matmul_precision("medium")
    try:
        before = Fp32MathSnapshot.capture()
        whatif(model, batch, loss_fn, ["bf16"])
        assert seen == ["highest"]
        assert Fp32MathSnapshot.capture() == before
    finally:
        found.restore()


def test_a_model_on_meta_or_split_across_devices_is_named_in_the_what_ifs_words():
    model, batch = _small()
    with pytest.raises(MpnbError, match="meta device.*load its weights"):
        whatif(model.to("meta"), batch, nn.functional.mse_loss)
    model, batch = _small()
    model[2].to("meta")
    with pytest.raises(MpnbError, match=r"on one device; its tensors are on cpu, meta"):
        whatif(model, batch, nn.functional.mse_loss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_callers_autocast_does_not_reach_the_pass_or_the_measures(dtype):
    """A notebook session in %amp bf16 runs each cell under autocast: the backward, where the
    matmuls are measured, must stay fp32 too (bf16's errors read 0 under bf16 autocast)."""
    model, batch = _small()
    plain = whatif(model, batch, nn.functional.mse_loss, ["fp16", "bf16"])
    with torch.autocast("cpu", dtype=dtype):
        under = whatif(model, batch, nn.functional.mse_loss, ["fp16", "bf16"])
        assert torch.is_autocast_enabled("cpu")
    assert [r["rel_error"] for r in under.rows] == [r["rel_error"] for r in plain.rows]


@pytest.mark.parametrize("loss_fn", [3, "cross_entropy", torch.zeros(1)])
def test_a_loss_fn_that_is_no_function_is_refused_by_name(loss_fn):
    model, batch = _small()
    with pytest.raises(MpnbError, match=r"loss_fn takes a function.*got"):
        whatif(model, batch, loss_fn)


def test_a_batch_made_under_inference_mode_is_measured():
    model, _ = _small()
    with torch.inference_mode():
        batch = (torch.randn(16, 32), torch.randn(16, 4))
    result = whatif(model, batch, nn.functional.mse_loss, ["bf16"])
    assert result.layers == ["0", "2"]
    assert batch[0].is_inference()


def test_prove_refuses_a_module_or_a_data_iterator_shared_by_both_runs(planted):
    """As compare refuses them: the bf16 run would train the backbone the format's run left,
    or on the batches it left."""
    backbone = _planted()[0]  # built once, outside make_run

    def sharing_a_module(mode):
        trainer, data = _make_run(mode)
        trainer.model[0] = backbone
        trainer.optimizer.add_param_group({"params": backbone.parameters()})
        return trainer, data

    with pytest.raises(MpnbError, match=r"share the parameter '0.weight' \(a module built once"):
        planted.prove(sharing_a_module, "fp8", steps=1)
    x, y = _batch()
    batches = iter([(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)])

    def sharing_an_iterator(mode):
        return _make_run(mode)[0], batches

    with pytest.raises(MpnbError, match="share one data iterator"):
        planted.prove(sharing_an_iterator, "fp8", steps=1)


def test_prove_takes_one_name_or_none_and_refuses_anything_else():
    from mpnb.numerics.format_proof import prove

    assert prove("5", _make_run, "fp16", steps=1).keep == ["5"]
    assert prove(None, _make_run, "fp16", steps=1).keep == []
    with pytest.raises(MpnbError, match=r"keep takes layer names.*got 5"):
        prove([5], _make_run, "fp16", steps=1)


def test_a_proof_over_no_step_is_refused_and_a_short_one_says_so():
    from mpnb.numerics.format_proof import prove

    def empty_run(mode):
        return _make_run(mode)[0], []

    with pytest.raises(MpnbError, match="trained no step.*data"):
        prove([], empty_run, "fp16", steps=3)

    def one_pass(mode):  # a generator of 4 batches: it cannot be cycled
        trainer, data = _make_run(mode)
        return trainer, iter(data)

    short = prove([], one_pass, "fp16", steps=10)
    assert len(short.losses) == 4 and "of the 10 asked" in str(short)


def test_the_proofs_share_has_the_sign_of_its_gap_for_negative_losses():
    from mpnb.numerics.format_proof import Proof

    proof = Proof("fp16", "fp16", [], [-0.8, -0.8], [-1.0, -1.0])
    assert proof.gap == pytest.approx(0.2) and "+20.0% of bf16's mean loss" in str(proof)


@pytest.mark.parametrize("steps", [1, 2])
def test_a_proof_of_one_difference_says_it_cannot_tell_not_a_gap(steps):
    # a 0.1% difference on one step read "spread 0, standard error 0): a gap"
    from mpnb.numerics.format_proof import Proof

    proof = Proof("fp8", "fp8", [], [1.0, 1.001][:steps], [1.0, 1.0][:steps])
    assert math.isnan(proof.spread) and math.isnan(proof.standard_error)
    assert not proof.shows_gap
    assert "too few steps to tell a gap from the noise" in str(proof)
    assert "a gap;" not in str(proof) and "spread n/a" in str(proof)


def test_a_proof_whose_run_went_inf_still_reads():
    from mpnb.numerics.format_proof import Proof

    proof = Proof("fp16", "fp16", [], [1.0, math.inf, math.nan], [1.0, 0.9, 0.8])
    assert math.isnan(proof.spread) and "loss gap" in str(proof)


def test_thresholds_changed_freely_never_break_the_result_on_show(planted):
    result = WhatIf(planted.rows, planted.formats)
    del result.thresholds["bf16"]
    result.thresholds["fp16"] = 0.01  # not a Threshold
    assert "bf16 no threshold" in repr(result) and "fp16 no threshold" in repr(result)
    shown = result._repr_html_()
    assert "bf16: no threshold" in shown and "fp16: no threshold" in shown
    result.figure()
    assert result.worst("0", "bf16")["format"] == "bf16"
    with pytest.raises(MpnbError, match=r"thresholds\['fp16'\] takes a Threshold.*got 0.01"):
        result.recommend("fp16")
    with pytest.raises(MpnbError, match=r"no threshold for format 'bf16'"):
        result.recommend("bf16")


def test_a_compiled_model_is_measured_eagerly_under_its_own_names():
    """torch.compile'd code runs no module hooks the pass adds after it was traced: the pass
    runs compiled modules eagerly (the same weights and the same products), and a model
    compiled whole is named as the module it wraps."""
    model, batch = _small()
    eager = whatif(model, batch, nn.functional.mse_loss, ["fp16", "bf16"])
    compiled = torch.compile(model, backend="eager")
    compiled(batch[0])  # traced before the what-if, as a user's model is
    result = whatif(compiled, batch, nn.functional.mse_loss, ["fp16", "bf16"])
    assert result.layers == ["0", "2"] and result.unmeasured == []
    assert [r["rel_error"] for r in result.rows] == [r["rel_error"] for r in eager.rows]
    model[2] = torch.compile(model[2], backend="eager")  # a block compiled inside the model
    model(batch[0])
    assert whatif(model, batch, nn.functional.mse_loss, ["fp16"]).unmeasured == []


def test_a_model_that_is_one_layer_is_advised_by_a_name_keep_takes():
    """nn.Linear as the whole model: its layer is the model itself, named '' as named_modules
    names it; keep_in_fp32('') runs the whole model in fp32, as keeping its only layer means."""
    torch.manual_seed(0)
    batch = (torch.randn(16, 16) * 1e5, torch.randn(16, 16))
    result = whatif(nn.Linear(16, 16), batch, nn.functional.mse_loss, ["fp16", "bf16"])
    assert result.layers == [""] and result.recommend("fp16") == [""]
    assert "(the model)" in str(result) and "(the model)" in result._repr_html_()

    def make_run(mode):
        torch.manual_seed(0)
        model = nn.Linear(16, 16)
        trainer = mpnb.Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=1e-12),
            nn.functional.mse_loss,
            mode=mode,
            device="cpu",
            dashboard=None,
        )
        return trainer, [batch, batch]

    proof = result.prove(make_run, "fp16", steps=2)
    assert proof.keep == [""] and all(math.isfinite(loss) for loss in proof.losses)
    trainer, data = make_run("fp16")
    assert trainer.keep_in_fp32("") == ""
    history = trainer.fit(data, max_steps=1)
    assert any("Linear runs in fp32" in event["message"] for event in history.events)


def _rows_of(result: WhatIf, layer: str, format: str = "fp16") -> dict[str, dict]:
    return {r["matmul"]: r for r in result.rows if (r["layer"], r["format"]) == (layer, format)}


def test_a_first_layer_with_a_parametrized_weight_gets_its_gradient_rows():
    torch.manual_seed(0)
    first = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16, bias=False))
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(16, 1))
    result = whatif(model, (torch.randn(8, 16), torch.randn(8, 1)), nn.functional.mse_loss)
    assert sorted(_rows_of(result, "0")) == ["forward", "weight_grad"]  # fed the batch


def test_each_gradient_is_paired_with_its_own_call_when_another_call_is_detached():
    """The second call's output is detached: no gradient comes to it, and the first call's
    gradient must meet the first call's input (a raw shape error before, or the x1e5 input)."""

    class Target(nn.Module):
        def __init__(self, rows: int) -> None:
            super().__init__()
            self.fc, self.rows = nn.Linear(8, 16), rows

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            target = self.fc(x[: self.rows] * 1e5).detach()  # a target, not trained
            return self.fc(x) + 0 * target.sum()

    torch.manual_seed(0)
    batch = (torch.randn(16, 8), torch.randn(16, 16))
    for rows in (4, 16):
        rows_of = _rows_of(whatif(Target(rows), batch, nn.functional.mse_loss, ["fp16"]), "fc")
        assert rows_of["weight_grad"]["overflow"] == 0 and math.isfinite(
            rows_of["weight_grad"]["rel_error"]
        )
        assert rows_of["forward"]["overflow"] > 0  # the detached call's forward ran in fp16 too


def test_a_layer_whose_forward_runs_without_gradients_is_measured_not_called_unmeasured():
    class NoGradLinear(nn.Linear):
        @torch.no_grad()
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(NoGradLinear(16, 16), nn.Linear(16, 2))
    with torch.no_grad():
        model[0].weight.mul_(1e5)
    result = whatif(model, (torch.randn(8, 16), torch.randn(8, 2)), nn.functional.mse_loss)
    assert result.unmeasured == [] and sorted(_rows_of(result, "0")) == ["forward"]
    assert "0" in result.recommend("fp16")  # its forward overflows fp16 (and so does 1's input)


def test_a_frozen_layer_behind_a_trainable_one_has_no_weight_gradient_row():
    """A LoRA model's base layers: frozen, behind trainable ones, their gradient flows through
    them (input_grad) but training computes no weight gradient for them."""
    model, batch = _small()
    model[2].requires_grad_(False)
    result = whatif(model, batch, nn.functional.mse_loss, ["fp16"])
    assert sorted(_rows_of(result, "2")) == ["forward", "input_grad"]
    assert sorted(_rows_of(result, "0")) == ["forward", "weight_grad"]  # fed the batch


def test_a_frozen_weight_with_a_trainable_bias_has_no_weight_gradient_row():
    """BitFit: only the biases train; a layer's weight gradient is a matmul training never
    runs, so it may not make recommend() keep the layer."""
    model, batch = _small()
    for layer in (model[0], model[2]):
        layer.weight.requires_grad_(False)
    result = whatif(model, batch, nn.functional.mse_loss, ["fp16"])
    assert sorted(_rows_of(result, "2")) == ["forward", "input_grad"]
    assert sorted(_rows_of(result, "0")) == ["forward"]


def test_keeping_the_model_itself_in_a_format_with_a_keep_option_says_what_it_means():
    from mpnb.numerics.format_proof import configuration

    with pytest.raises(MpnbError, match=r"the model itself.*fp8 would train none of it"):
        configuration("fp8", [""])
    assert configuration("fp16", [""])[1] == [""]  # keep_in_fp32('') runs it in fp32


_WITHOUT_TORCHAO = """
import sys
sys.modules["torchao"] = None  # as if torchao were not installed
import torch, mpnb
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
batch = (torch.randn(8, 16), torch.randint(0, 2, (8,)))
result = mpnb.whatif(model, batch, nn.functional.cross_entropy)
print("FORMATS:", ",".join(result.formats))
print(str(result).splitlines()[-1])
for call in (lambda: result.recommend("fp8"),
             lambda: mpnb.whatif(model, batch, nn.functional.cross_entropy, formats=["bf16", "mxfp8"])):
    try:
        call()
    except mpnb.MpnbError as error:
        print("REFUSED:", error)
"""


def test_without_torchao_the_default_formats_are_those_that_run_and_the_rest_are_named():
    """whatif(model, batch, loss) on a plain install (no torchao): fp16 and bf16 measured, the
    scaled formats named with the install command; asked for by name, refused before the pass."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCHAO], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "FORMATS: fp16,bf16"
    assert lines[1] == (
        "formats not measured: fp8, fp8_rowwise, mxfp8, nvfp4 (needs torchao, which is not "
        "installed: pip install 'mpnb[fp8]')"
    )
    assert lines[2] == (
        "REFUSED: format 'fp8' was not measured: it needs torchao, which is not installed: "
        "pip install 'mpnb[fp8]'"
    )
    assert lines[3].startswith("REFUSED: format mxfp8 needs torchao") and lines[3].endswith(
        "(formats that run here: fp16, bf16)"
    )


def _lazy() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 4))


def _made_in_inference_mode() -> nn.Module:
    with torch.inference_mode():
        return nn.Sequential(nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 4))


def _pair(rows: int = 4, features: int = 32, dtype: torch.dtype = torch.float32) -> tuple:
    return torch.randn(rows, features, dtype=dtype), torch.randn(rows, 4)


@pytest.mark.parametrize(
    "make_model, batch, said",
    [
        (lambda: _small()[0].double(), _pair(), r"holds torch.float64 weights \('0.weight'\)"),
        (
            lambda: _small()[0],
            _pair(rows=0),
            r"batch holds no sample \(a tensor shaped \(0, 32\)\)",
        ),
        (
            lambda: _small()[0],
            (torch.randn(3, 32), torch.randn(0, 4)),  # an inconsistent pair, not the first
            r"batch holds no sample \(a tensor shaped \(0, 4\)\)",
        ),
        (_lazy, _pair(), r"'0.weight' is not made yet"),
        (_made_in_inference_mode, _pair(), r"'0.weight' was made under torch.inference_mode"),
    ],
)
def test_a_model_or_batch_that_cannot_make_the_fp32_pass_is_named(make_model, batch, said):
    model = make_model()
    with pytest.raises(MpnbError, match=said):
        whatif(model, batch, nn.functional.mse_loss, formats="bf16")


def test_float64_targets_from_numpy_are_measured_as_a_fit_trains_on_them():
    model, (x, y) = _small()
    result = whatif(model, (x, y.double()), nn.functional.mse_loss, formats="bf16")
    assert len(result.rows) == 5  # two layers, the first with no input_grad


def test_arguments_in_the_wrong_order_are_named_with_the_order(planted):
    with pytest.raises(MpnbError, match=r"make_run takes a function.*got a str 'fp16'.*"
                       r"result.prove\(make_run, format, steps\)"):  # fmt: skip
        planted.prove("fp16", _make_run)
    with pytest.raises(MpnbError, match=r"the arguments go whatif\(model, batch, loss_fn\)"):
        whatif(_planted(), nn.functional.cross_entropy, _batch())


def test_prove_cycles_a_short_dataset_as_compare_does(planted):
    def two_batches(mode):
        trainer, data = _make_run(mode)
        return trainer, data[:2]

    proof = planted.prove(two_batches, "fp16", steps=5)
    assert len(proof.losses) == len(proof.bf16_losses) == 5
    assert "the data ended" not in str(proof)


@pytest.mark.parametrize(
    "call",
    [
        lambda model: mpnb.whatif(model, torch.randn(8, 16), nn.functional.cross_entropy),
        lambda model: mpnb.whatif(model, (torch.randn(8, 16), torch.randint(0, 4, (8,)))),
        lambda model: mpnb.advise(model, torch.randn(8, 16), nn.functional.cross_entropy),
    ],
)
def test_a_batch_the_loss_cannot_use_is_explained_without_an_option_whatif_lacks(call):
    """whatif and advise take no step_fn: their advice offers loss_fn alone."""
    with pytest.raises(MpnbError) as refused:
        call(nn.Sequential(nn.Linear(16, 4)))
    said = str(refused.value)
    assert "loss_fn" in said and "step_fn" not in said


def test_layers_called_with_their_input_as_a_keyword_are_named_when_none_was_measured():
    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(16, 4)

        def forward(self, x):
            return self.inner(input=x)

    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    with pytest.raises(MpnbError, match=r"called inner with no input tensor .*input=x"):
        whatif(Keyword(), batch, nn.functional.cross_entropy, ["bf16"])


@pytest.mark.parametrize(
    "x, said",
    [
        (torch.randn(8, 16, device="meta"), r"a tensor on the meta device \(shaped \(8, 16\)\)"),
        (
            torch.randn(8, 16).bfloat16(),
            r"inputs hold a bfloat16 tensor \(shaped \(8, 16\)\).*x.float\(\)",
        ),
        (torch.randn(8, 16).double(), r"a float64 tensor"),
    ],
)
def test_a_batch_the_fp32_pass_cannot_run_on_is_named_before_the_pass(x, said):
    model = nn.Sequential(nn.Linear(16, 4))
    with pytest.raises(MpnbError, match=said):
        whatif(model, (x, torch.randint(0, 4, (8,))), nn.functional.cross_entropy, ["bf16"])
    assert not any(m._forward_hooks for m in model.modules())


def test_a_proof_keeping_a_model_that_is_one_layer_names_it_as_the_tables_do():
    proof = mpnb.numerics.format_proof.Proof("fp16", "fp16", [""], [1.0, 0.9], [1.0, 0.8])
    assert "(fp16, keeping (the model))" in str(proof)


@pytest.mark.parametrize("fields", [{"overflow": 5}, {"overflow": 0.0, "underflow": 1.5}])
def test_a_share_threshold_above_one_is_refused_as_a_percentage_mistaken(fields):
    """overflow=5 meant as 5% would never be passed: every layer converted."""
    from mpnb.numerics.whatif import Threshold

    with pytest.raises(MpnbError, match=r"a share, from 0 to 1 \(0.05 for 5%\), or inf"):
        Threshold(rel_error=0.1, **fields)
    assert Threshold(rel_error=2.0, overflow=1.0, underflow=math.inf).underflow == math.inf


def test_formats_take_the_spellings_modes_take(planted):
    """A case, an alias, a torch dtype, a mode's label and commas name formats as they name
    modes in Trainer(mode=...) and compare."""
    from mpnb.numerics.formats import chosen_formats

    assert chosen_formats(["BF16", "half", torch.bfloat16, "fp8:rowwise", "fp4"]) == (
        "bf16", "fp16", "fp8_rowwise", "nvfp4",
    )  # fmt: skip
    assert chosen_formats("bf16,fp8") == chosen_formats(["bf16", "fp8"]) == ("bf16", "fp8")
    assert chosen_formats(torch.bfloat16) == ("bf16",)  # one dtype, as recommend takes it
    assert planted.recommend("FP16") == planted.recommend("fp16") == ["5"]
    assert planted.worst("5", "float16") == planted.worst("5", "fp16")
    with pytest.raises(InvalidChoiceError, match="unknown format 'int4'; valid: fp16, bf16"):
        chosen_formats(["int4"])


def test_thresholds_set_whole_take_a_mapping_and_refuse_anything_else(planted):
    result = WhatIf(planted.rows, planted.formats)
    with pytest.raises(MpnbError, match="thresholds takes a mapping of format -> Threshold"):
        result.thresholds = None
    assert result.recommend("fp16") == ["5"]  # unchanged by the refusal
    result.thresholds = {"fp16": planted.thresholds["fp16"]}
    assert result.recommend("fp16") == ["5"]
    with pytest.raises(MpnbError, match="no threshold for format 'bf16'"):
        result.recommend("bf16")


def test_a_proof_says_whether_its_gap_stands_out_of_the_step_noise():
    from mpnb.numerics.format_proof import Proof

    bf16 = [1.0, 0.9, 0.8, 0.7, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35]
    noise = [0.01, -0.01, 0.012, -0.008, 0.01]
    within = Proof("fp8", "fp8", [], bf16, bf16[:5] + [b + n for b, n in zip(bf16[5:], noise)])
    behind = Proof(
        "fp8", "fp8", ["2"], bf16[:5] + [b + 0.05 + n for b, n in zip(bf16[5:], noise)], bf16
    )
    assert not within.shows_gap and behind.shows_gap
    assert "no gap beyond the noise" in str(within) and "no layer of the advice" in str(within)
    assert ", a gap;" in str(behind) and "keeping 2" in str(behind)
    assert math.isclose(behind.standard_error, behind.spread / math.sqrt(5))
    diverged = Proof("fp8", "fp8", [], bf16[:9] + [math.inf], bf16)
    assert diverged.shows_gap and "not finite" in str(diverged)
