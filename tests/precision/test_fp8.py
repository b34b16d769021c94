"""Mode fp8: torchao's float8 training layers, emulated on this CPU, always put back.

Compared with torchao's own conversion bit for bit; the model's parameters and state dict are
checked to be the same objects and values before, during and after.
"""

from __future__ import annotations

import io
import logging
import math
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import mpnb
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.numerics.watch import NumericsLog
from mpnb.precision.backends.cpu import CpuBackend
from mpnb.precision.backends.cuda import CudaBackend
from mpnb.precision.backends.hpu import HpuBackend
from mpnb.precision.modes import parse_mode
from mpnb.precision.policy import session
from tests.child_process import child_environment
from tests.conftest import policy_state, run, usage_error

float8 = pytest.importorskip("torchao.float8", reason="mode fp8 needs torchao (mpnb[fp8])")

from mpnb.precision.modes.fp8 import (  # noqa: E402
    Fp8Layers,
    float8_config,
    fp8_hardware,
    fp8_layers,
    fp8_refusal,
    fp8_refusal_for,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 48),
        nn.ReLU(),
        nn.Linear(48, 10),
    )


def forward_backward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_outputs_and_gradients_equal_torchaos_own_conversion_bit_for_bit(recipe):
    ours, theirs = mlp(), mlp()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    float8.convert_to_float8_training(
        theirs,
        module_filter_fn=lambda _, name: name in ("2", "4"),
        config=float8_config(recipe, emulate=True),
    )
    with fp8_layers(ours, recipe=recipe, device="cpu") as layers:
        assert layers.converted == ["2", "4"] and layers.emulated
        out, grads = forward_backward(ours, x)
    expected_out, expected_grads = forward_backward(theirs, x)
    assert torch.equal(out, expected_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
    # and fp8 really ran: the plain model (same weights) computes something else
    plain_out, _ = forward_backward(mlp(), x)
    assert not torch.equal(plain_out, out)


def test_conversion_and_restoration_keep_parameters_and_state_dict():
    model = mlp()
    modules = dict(model.named_modules())
    parameters = {name: p for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with fp8_layers(model, device="cpu"):
        assert [type(model[i]).__name__ for i in (0, 2, 4, 6)] == [
            "Linear",
            "Float8Linear",
            "Float8Linear",
            "Linear",
        ]
        assert {name: p for name, p in model.named_parameters()} == parameters
        assert all(a is b for a, b in zip(model.parameters(), parameters.values(), strict=True))
        assert list(model.state_dict()) == list(state)
    assert all(modules[name] is module for name, module in model.named_modules())
    assert all(type(m) in (nn.Sequential, nn.Linear, nn.ReLU) for m in model.modules())
    assert all(a is b for a, b in zip(model.parameters(), parameters.values(), strict=True))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_restored_after_an_error_inside_the_block_and_hooks_survive():
    model = mlp()
    seen = []
    model[2].register_forward_hook(lambda *_: seen.append("hook"))
    original = model[2]
    with pytest.raises(RuntimeError, match="inside"), fp8_layers(model, device="cpu"):
        assert model[2] is not original
        raise RuntimeError("inside")
    assert model[2] is original
    model(torch.randn(2, 32))
    assert seen == ["hook"]


def test_a_checkpoint_saved_in_fp8_loads_into_the_plain_model_and_back():
    model = mlp()
    with fp8_layers(model, device="cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(8, 32)).float().sum().backward()
        optimizer.step()
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    plain = mlp(seed=5)
    plain.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values())
    )
    back = mlp(seed=6)
    with fp8_layers(back, device="cpu"):
        back.load_state_dict(plain.state_dict())
        assert all(
            torch.equal(a, b)
            for a, b in zip(back.state_dict().values(), plain.state_dict().values())
        )


def test_eligibility_follows_accelerates_default_and_the_users_names():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.Linear(32, 24),  # 24 is not divisible by 16
        nn.Linear(24, 32),
        nn.Linear(32, 32),
        nn.Linear(32, 32),
        nn.Linear(32, 4),
    )
    layers = Fp8Layers(model, keep=["4"], device="cpu")
    assert layers.converted == ["3"]
    assert layers.kept == {
        "0": "the first Linear layer",
        "1": "32x24 is not a multiple of 16",
        "2": "24x32 is not a multiple of 16",
        "4": "kept by name",
        "5": "the last Linear layer",
    }
    attention = nn.Sequential(nn.Linear(32, 32), nn.MultiheadAttention(32, 2), nn.Linear(32, 32))
    assert (
        "its MultiheadAttention uses the weight directly"
        in Fp8Layers(attention, device="cpu").kept.values()
    )


def test_bad_input_names_the_value_and_changes_nothing():
    model = mlp()
    with pytest.raises(
        InvalidChoiceError, match="unknown fp8 recipe 'blockwise'; valid: tensorwise, rowwise"
    ):
        fp8_layers(model, recipe="blockwise", device="cpu")
    with pytest.raises(MpnbError, match="fp8 keep names no module of Sequential: 'lm_head'"):
        fp8_layers(model, keep=["lm_head"], device="cpu")
    with pytest.raises(
        MpnbError,
        match="would convert no layer of Sequential .0: the first Linear layer; 1: the last",
    ):
        fp8_layers(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), device="cpu").convert()
    assert all(type(m) in (nn.Sequential, nn.Linear, nn.ReLU) for m in model.modules())


def test_hardware_real_emulated_or_refused_with_the_reason():
    assert fp8_hardware("cpu") == "emulated" and fp8_refusal(CpuBackend()) == ""
    assert "no fp8 training on a" in fp8_refusal(HpuBackend())
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in fp8_refusal(CudaBackend())
        assert parse_mode("fp8").support(torch.device("cuda")).startswith("no: no CUDA GPU")
    assert "compute capability 8.9 or newer" in fp8_refusal_for((8, 6), "RTX 3090")
    assert fp8_refusal_for((8, 9), "L4") == fp8_refusal_for((10, 0), "B200") == ""


def test_trainer_converts_for_each_fit_and_puts_the_model_back():
    model = mlp()
    layers = [model[i] for i in (0, 2, 4, 6)]
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    trainer = mpnb.Trainer(
        model,
        torch.optim.Adam(model.parameters(), 1e-3),
        nn.functional.cross_entropy,
        mode="fp8",
        device="cpu",
        dashboard=None,
    )
    assert "emulated: numerics only, no speed-up" in trainer.describe()
    history = trainer.fit(data)
    assert history.mode == ["fp8"] * 4 and all(math.isfinite(loss) for loss in history.loss)
    assert [model[i] for i in (0, 2, 4, 6)] == layers

    def failing(model, batch):
        assert type(model[2]).__name__ == "Float8Linear"
        raise RuntimeError("the model failed")

    trainer.step_fn, trainer.loss_fn = failing, None
    with pytest.raises(RuntimeError, match="the model failed"):
        trainer.fit(data)
    assert [model[i] for i in (0, 2, 4, 6)] == layers


def _llama(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def test_a_small_transformer_trains_in_fp8_within_tolerance_of_bf16():
    tokens = (torch.arange(32).repeat(4, 1) * 3 + torch.arange(4)[:, None]) % 128
    data = [{"input_ids": tokens, "labels": tokens}] * 6
    losses = {}
    for mode in ("bf16", "fp8"):
        model = _llama()
        trainer = mpnb.Trainer(
            model,
            torch.optim.AdamW(model.parameters(), 3e-3),
            mode=mode,
            device="cpu",
            dashboard=None,
        )
        losses[mode] = trainer.fit(data).loss
    assert losses["fp8"][-1] < losses["fp8"][0] - 0.2  # it learns
    assert all(abs(a - b) / b < 0.02 for a, b in zip(losses["fp8"], losses["bf16"], strict=True)), (
        losses
    )


def test_gpt2_is_refused_with_the_reason():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=64,
        n_layer=1,
        n_head=4,
        vocab_size=128,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(MpnbError, match="Conv1D layers .GPT-2's. are not torch.nn.Linear"):
        fp8_layers(model, device="cpu").convert()


def test_compiled_model_trains_in_fp8():
    model = mlp()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    with fp8_layers(model, device="cpu"):
        compiled = torch.compile(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
        out.float().pow(2).mean().backward()
        eager, _ = forward_backward(model, x)
    assert torch.allclose(out.float(), eager.float(), rtol=0.02, atol=0.02)
    assert type(model[2]) is nn.Linear


def test_the_magic_converts_a_named_model_until_the_mode_changes(ip, capsys):
    run(
        ip,
        "net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))",
    )
    run(ip, "%amp fp8 --model net --recipe rowwise --device cpu")
    printed = capsys.readouterr().out
    assert (
        "net: fp8 (rowwise, emulated: numerics only, no speed-up): 1 of 3 Linear layers" in printed
    )
    assert run(ip, "type(net[1]).__name__, net(torch.randn(2, 16)).dtype") == (
        "Float8Linear",
        torch.bfloat16,
    )
    assert "emulated: numerics only, no speed-up" in str(mpnb.status())
    run(ip, "%amp bf16")
    assert run(ip, "type(net[1]).__name__") == "Linear"
    run(ip, "%amp fp8 --model net")
    ip.run_line_magic("unload_ext", "mpnb")
    assert run(ip, "type(net[1]).__name__") == "Linear"


def test_the_magic_refuses_bad_fp8_input_and_changes_nothing(ip):
    run(
        ip,
        "net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))",
    )
    run(ip, "%amp bf16")
    before = policy_state()
    for line, words in (
        ("%amp fp8 --recipe blockwise", "unknown fp8 recipe 'blockwise'"),
        ("%amp fp8 --model nothing", "--model names no variable: 'nothing'"),
        ("%amp fp8 --model net --keep head", "fp8 keep names no module of Sequential: 'head'"),
        ("%amp fp8 --model linear", "fp8 would convert no layer"),
        ("%amp bf16 --recipe rowwise", "option of mode bf16 'recipe'; valid: none. Mode fp8 takes"),
        ("%amp bf16 --model net", "mode bf16 changes no model"),
    ):
        assert words in usage_error(ip, line)
        assert policy_state() == before
    assert run(ip, "type(net[1]).__name__") == "Linear"


def test_devices_have_an_fp8_column_and_compare_reports_no_emulated_speedup():
    report = mpnb.devices(check=False)
    assert report["cpu"].layer_modes == (
        "fp8: emulated: numerics only, no speed-up; mxfp8: emulated: numerics only, no speed-up; "
        "nvfp4: no: NVFP4 training needs an NVIDIA Blackwell GPU (compute capability 10.0+, B200 "
        "or B300) with triton; this is a CPU"
    )
    assert "cpu layer modes: fp8: emulated" in report.to_text()  # below the table, wrapped
    from mpnb.analysis.results import Comparison, ModeResult
    from mpnb.training.history import History

    def result(mode, seconds):
        history = History()
        history.extend({"step": [1, 2, 3], "loss": [1.0] * 3, "step_time": [seconds] * 3})
        verdict = parse_mode(mode).compare_verdict(torch.device("cpu"))
        return ModeResult(mode, history, blocks=[(0, 3)], verdict=verdict)

    comparison = Comparison([result("fp32", 0.01), result("fp8", 0.002)], 3, 0)
    row = comparison.rows()[1]
    assert row["speedup_verdict"] == "emulated: numerics only, no speed-up"
    assert math.isnan(row["speedup_vs_fp32"])
    assert "5.00x" not in str(comparison) and "emulated: numerics only" in str(comparison)


_WITHOUT_TORCHAO = """
import sys
sys.modules["torchao"] = None  # as if torchao were not installed
import torch, mpnb
from IPython.core.interactiveshell import InteractiveShell
from mpnb.precision.policy import session
ip = InteractiveShell.instance()
ip.run_line_magic("load_ext", "mpnb")
ip.run_line_magic("amp", "bf16")
result = ip.run_cell("%amp fp8")
print("ERROR:", result.error_in_exec)
print("MODE:", session.mode.label)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
try:
    mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mode="fp8", device="cpu")
except mpnb.MpnbError as error:
    print("TRAINER:", error)
print("DEVICES:", mpnb.devices(check=False)["cpu"].layer_modes)
"""


def test_without_torchao_the_mode_says_how_to_install_it_and_changes_nothing():
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_WITHOUT_TORCHAO)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=child_environment(),
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "ERROR: mode fp8 needs torchao, which is not installed" in out
    assert "pip install 'mpnb[fp8]'" in out.split("MODE:")[0]
    assert "MODE: bf16" in out
    assert "TRAINER: mode fp8 needs torchao" in out
    assert (
        "DEVICES: fp8: emulated: numerics only, no speed-up (needs pip install 'mpnb[fp8]')" in out
    )


def test_import_mpnb_does_not_import_torchao():
    code = "import sys, mpnb; mpnb.set_mode('bf16'); print('torchao' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.stdout.strip() == "False", result.stderr


def test_a_cast_after_torchaos_first_import_leaves_the_loggers_alone(monkeypatch):
    # quieting torchao's import sets logger levels, and each setLevel clears the cache of every
    # logger the process has (hundreds with transformers): once per cast, it cost a what-if 14%
    from mpnb.numerics import formats

    x = torch.randn(32, 64)
    formats.cast("nvfp4", x, "activation", dim=1)  # imports what the casts need
    levels_set = []
    monkeypatch.setattr(logging.Logger, "setLevel", lambda logger, level: levels_set.append(level))
    for name in ("fp8", "fp8_rowwise", "mxfp8", "nvfp4"):
        formats.cast(name, x, "activation", dim=1)
    assert levels_set == []


def test_a_torchao_module_blocked_in_sys_modules_is_missing_not_none(monkeypatch):
    from mpnb.precision.modes.layer_swap import import_torchao

    monkeypatch.setitem(sys.modules, "torchao.float8.config", None)
    with pytest.raises(MpnbError, match="mode fp8 needs torchao, which is not installed"):
        import_torchao("torchao.float8.config", "fp8")


def test_session_fp8_is_reset_with_the_session():
    mpnb.set_mode("fp8", "cpu", recipe="rowwise", keep=["1"])
    assert session.mode == parse_mode("fp8:rowwise", keep="1")
    assert session.mode != "fp8:rowwise" and "fp8 on this CPU is emulated" in " ".join(
        session.warnings()
    )
    session.reset()
    assert session.mode == "off" and session.mode == parse_mode("off")


def four_layer_mlp() -> nn.Sequential:
    """Layers 1 and 2 are eligible for fp8 (the first and last stay in high precision)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4))


def watched_fp8_fit(model: nn.Module, batches: int, every: int) -> NumericsLog:
    """``batches`` batches of 16 through ``model`` in fp8 (lr 0: the weights stay as planted),
    the numerics watched every ``every`` steps; the watch's log."""
    x = torch.randn(16 * batches, 16)
    data = [(x[i : i + 16], torch.randn(16, 4)) for i in range(0, 16 * batches, 16)]
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), 0.0),
        nn.functional.mse_loss,
        mode="fp8",
        device="cpu",
        dashboard=None,
        watch_numerics=every,
    )
    trainer.fit(data)
    return trainer.numerics


def test_the_numerics_watch_names_the_fp8_layer_whose_values_flush():
    model = four_layer_mlp()
    with (
        torch.no_grad()
    ):  # layer 1's input: one feature 1e7 times the rest, an outlier fp8 cannot span
        model[0].weight.copy_(torch.eye(32, 16))
        model[0].weight[0, 0] = 1e7
        model[0].bias.zero_()
    log = watched_fp8_fit(model, batches=4, every=2)
    assert log.steps == [2, 4] and log.fp8_modules == ["1", "2"]
    assert log.fp8_amax["1"][0] > 1e6 and log.fp8_flushed["1"][0] > 0.25  # input: 15 of 16
    assert log.fp8_flushed["2"][0] < 0.01 and log.fp8_saturated["1"] == [0.0, 0.0]
    assert math.isnan(log.fp8_amax["0"][0])
    assert "fp8 flushed" in str(log).splitlines()[0]


def test_the_watch_gives_the_inputs_and_the_weights_flushed_shares_apart():
    """With an outlier feature 1e7 times the rest, 15 of the 16 input features of layer 1
    flush in e4m3 (about 15/16 of its nonzero input values) and none of its weights: each share
    is of its own tensor's values, not the two mixed by element count."""
    model = four_layer_mlp()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(32, 16))
        model[0].weight[0, 0] = 1e7
        model[0].bias.zero_()
    log = watched_fp8_fit(model, batches=1, every=1)
    assert log.fp8_flushed["1"][0] == pytest.approx(15 / 16)
    assert log.fp8_weight_flushed["1"][0] < 0.01 and log.fp8_weight_saturated["1"][0] == 0.0
    header = str(log).splitlines()[0]
    assert "fp8 flushed (input / weight)" in header


def test_the_numerics_watch_names_the_fp8_layer_whose_gradients_flush_in_e5m2():
    model = four_layer_mlp()
    with torch.no_grad():  # layer 2's output gradient: one feature 1e12 times the other three
        model[3].weight.copy_(torch.eye(4, 32))
        model[3].weight[0, 0] = 1e12
    log = watched_fp8_fit(model, batches=2, every=1)
    assert log.fp8_modules == ["1", "2"]
    # e5m2 spans about 7e9 below its amax-made scale: 1e-12 of the amax flushes, 3 of 4 nonzero
    assert log.fp8_grad_flushed["2"] == [pytest.approx(0.75, abs=0.01)] * 2
    assert max(log.fp8_grad_flushed["1"]) < 0.01  # layer 2's weights mix the feature into all
    assert math.isnan(log.fp8_grad_flushed["0"][0])  # kept in high precision: not measured
    assert "fp8 gradient flushed" in str(log).splitlines()[0]


def test_a_hand_loop_with_ampstep_and_fp8_layers():
    model = mlp()
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="fp8", device="cpu")
    with mpnb.fp8_layers(model, device="cpu"):
        for _ in range(2):
            with amp.autocast():
                out = model(torch.randn(8, 32))
            amp.backward(out.float().pow(2).mean())
            amp.step(samples=8)
    assert out.dtype is torch.bfloat16 and amp.history.mode == ["fp8", "fp8"]
    assert type(model[2]) is nn.Linear


def test_mpnb_train_in_fp8_on_the_example_mlp(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpnb",
            *"train --mode fp8 --model mlp --steps 2 --device cpu".split(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=child_environment(),
    )
    assert result.returncode == 0, result.stderr
    assert "fp8 is emulated here (numerics only, no speed-up)" in result.stdout
    assert "DigitsMLP, fp8 on cpu (emulated: numerics only, no speed-up)" in result.stdout


_ACCELERATE_FP8 = """
import warnings
import torch
from torch import nn
from accelerate import Accelerator
from accelerate.utils import AORecipeKwargs
from mpnb.integrations.accelerate import watch

accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()], cpu=True)
torch.manual_seed(0)
widths = {widths}
model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = accelerator.prepare(model, optimizer)
with warnings.catch_warnings(record=True) as caught, watch(accelerator, model, optimizer, dashboard=None) as recorder:
    warnings.simplefilter("always")
    for _ in range(2):
        with accelerator.autocast():
            loss = model(torch.randn(8, widths[0])).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        recorder.record(loss, batch=torch.ones(8))
print("LAYERS:", [type(m).__name__ for m in model.modules()][1:])
print("MODES:", recorder.history.mode)
print("NOTICES:", [str(w.message) for w in caught if "asked for" in str(w.message)])
"""


@pytest.mark.parametrize(
    "widths, layers, mode, notice",
    [
        ((32, 64, 64, 16), ["Linear", "Float8Linear", "Linear"], "fp8", None),
        (
            (32, 64, 16),
            ["Linear", "Linear"],
            "bf16",
            "Accelerate was asked for fp8 but trains in bf16",
        ),
    ],
)
def test_accelerate_fp8_is_read_from_the_layers_that_run(widths, layers, mode, notice):
    """Each case in its own process: Accelerate fixes mixed_precision for a process."""
    pytest.importorskip("accelerate")
    result = subprocess.run(
        [sys.executable, "-c", _ACCELERATE_FP8.format(widths=widths)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=child_environment(),
    )
    assert result.returncode == 0, result.stderr
    assert f"LAYERS: {layers}" in result.stdout
    assert f"MODES: {[mode, mode]}" in result.stdout
    notices = result.stdout.split("NOTICES:")[1]
    assert (notice in notices) if notice else notices.strip() == "[]", result.stdout


def _layer_kinds(model: nn.Module, seen: dict[str, object]) -> None:
    """Note the class and recipe of each layer at the first training forward pass."""

    def note(module, _):
        if not seen:
            for name, layer in module.named_children():
                recipe = getattr(getattr(layer, "config", None), "cast_config_input", None)
                granularity = getattr(getattr(recipe, "scaling_granularity", None), "name", None)
                seen[name] = (type(layer).__name__, granularity)

    model.register_forward_pre_hook(note)


def _fp8_trainer(**options) -> tuple[mpnb.Trainer, list]:
    model = mlp()
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
    trainer = mpnb.Trainer(
        model,
        torch.optim.Adam(model.parameters(), 1e-3),
        nn.functional.cross_entropy,
        device="cpu",
        dashboard=None,
        **options,
    )
    return trainer, [(x[i : i + 16], y[i : i + 16]) for i in (0, 16)]


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "fp8", "recipe": "rowwise", "keep": ["4"]},
        {"mode": "fp8:rowwise", "keep": ["4"]},
        {"mode": parse_mode("fp8", recipe="rowwise", keep=["4"])},
    ],
    ids=["keywords", "label", "mode object"],
)
def test_the_trainer_takes_fp8s_recipe_and_kept_layers(options):
    trainer, data = _fp8_trainer(**options)
    seen: dict[str, object] = {}
    _layer_kinds(trainer.model, seen)
    history = trainer.fit(data)
    assert seen["2"] == ("Float8Linear", "AXISWISE")  # rowwise: one scale per row
    assert seen["4"][0] == "Linear"  # kept by name
    assert history.mode == ["fp8:rowwise"] * 2 and trainer.mode.keep == ("4",)


def test_a_trainer_without_a_mode_takes_the_sessions_with_its_options_a_named_mode_its_own():
    mpnb.set_mode("fp8", "cpu", recipe="rowwise", keep=["4"])
    assert _fp8_trainer()[0].mode == parse_mode("fp8:rowwise", keep=["4"])
    assert _fp8_trainer(keep=["2"])[0].mode == parse_mode("fp8:rowwise", keep=["2"])
    assert _fp8_trainer(mode="fp8")[0].mode == parse_mode("fp8")  # what compare's "fp8" row is


def test_options_a_mode_does_not_take_are_refused_by_the_trainer():
    with pytest.raises(InvalidChoiceError, match="option of mode bf16 'recipe'"):
        _fp8_trainer(mode="bf16", recipe="rowwise")


def test_amp_passes_recipe_and_keep_to_the_sessions_mode(ip):
    run(ip, "%amp fp8 --recipe rowwise --keep 4,5 --keep 6")
    assert session.mode == parse_mode("fp8", recipe="rowwise", keep=("4", "5", "6"))
    assert (
        "fp8",
        "torchao rowwise, emulated: numerics only, no speed-up; kept in bf16 by name: 4, 5, 6",
    ) in (mpnb.status().rows())


def test_the_panel_shows_fp8s_options_and_drives_them():
    from mpnb.ui.widgets.panel import ControlPanel

    panel = ControlPanel()
    try:
        recipe, keep = panel.mode_options["fp8"]["recipe"], panel.mode_options["fp8"]["keep"]
        assert recipe.layout.display == "none"  # mode off takes no recipe
        keep.value = "lm_head, h.11"
        panel.mode.value = "fp8"
        assert recipe.layout.display is None and session.mode.keep == ("lm_head", "h.11")
        recipe.value = "rowwise"
        assert session.mode == parse_mode("fp8", recipe="rowwise", keep=("lm_head", "h.11"))
        panel.mode.value = "bf16"
        assert session.mode == "bf16" and recipe.layout.display == "none"
    finally:
        panel.close()


def test_the_cli_passes_recipe_and_keep(tmp_path, capsys):
    from mpnb.cli import main

    out = tmp_path / "run"
    assert main(["train", "--mode", "fp8", "--model", "mlp", "--recipe", "rowwise", "--steps", "2", "--out", str(out)]) == 0  # fmt: skip
    assert "fp8:rowwise on cpu (emulated" in capsys.readouterr().out


def test_compare_has_a_row_per_mode_and_recipe():
    def make_run(mode):
        trainer, data = _fp8_trainer(mode=mode)
        return trainer, data

    comparison = mpnb.compare(
        make_run, ["fp32", "fp8", "fp8:rowwise"], steps=2, warmup=0, progress=None
    )
    rows = {row["mode"]: row for row in comparison.rows()}
    assert list(rows) == ["fp32", "fp8", "fp8:rowwise"]
    assert rows["fp8:rowwise"]["speedup_verdict"] == "emulated: numerics only, no speed-up"


class _RefusesFloat8(nn.Sequential):
    """A model whose container refuses a float8 layer in its third slot: torchao's conversion
    fails there, after it swapped the layers before it."""

    def __setattr__(self, name, value):
        if name == "4" and type(value).__name__ == "Float8Linear":
            raise KeyboardInterrupt  # as if the user pressed Stop during the conversion
        super().__setattr__(name, value)


def test_a_conversion_stopped_half_way_puts_every_layer_back():
    torch.manual_seed(0)
    layers = [
        nn.Linear(16, 32),
        nn.Linear(32, 32),
        nn.Linear(32, 32),
        nn.Linear(32, 32),
        nn.Linear(32, 4),
    ]
    model = _RefusesFloat8(*[layer for pair in zip(layers, [nn.ReLU()] * 5) for layer in pair][:-1])
    originals = list(model)
    with pytest.raises(KeyboardInterrupt):
        fp8_layers(model, device="cpu").convert()
    assert list(model) == originals and all(a is b for a, b in zip(model, originals))
    with pytest.raises(KeyboardInterrupt):
        mpnb.set_mode("fp8", "cpu", model=model)
    assert all(a is b for a, b in zip(model, originals)) and session.mode == "off"


def test_a_weight_normed_linear_is_kept_with_the_reason():
    model = mlp()
    nn.utils.parametrizations.weight_norm(model[4])
    layers = Fp8Layers(model, device="cpu")
    assert layers.converted == ["2"] and "parametrized" in layers.kept["4"]
    with layers:
        assert type(model[4]).__name__ == "ParametrizedLinear"


@pytest.mark.parametrize("mode", ["fp8", "mxfp8"])
def test_a_linear_registered_under_two_names_is_kept_and_said_not_half_converted(mode):
    # the same Linear at positions 2 and 4: swapped at "2" only, "4" ran the plain Linear while
    # the report said "converted: 2, 6"; keep=["4"] was refused as naming no module
    shared = nn.Linear(32, 32)
    model = nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), shared, nn.ReLU(), shared, nn.ReLU(),
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2),
    )  # fmt: skip
    layers = parse_mode(mode).layer_swap(model, torch.device("cpu"))
    assert layers.converted == ["6"] and "also registered as 4" in layers.kept["2"]
    with layers:
        assert model[2] is shared and model[4] is shared
    kept = parse_mode(mode, keep=["4"]).layer_swap(model, torch.device("cpu"))
    assert kept.converted == ["6"] and "also registered as 4" in kept.kept["2"]


def test_hooks_on_a_converted_layer_still_fire_and_come_off_with_their_handle():
    model = mlp()
    calls = []
    handle = model[2].register_forward_hook(lambda *_: calls.append("forward"))
    with fp8_layers(model, device="cpu"):
        model(torch.randn(4, 32))
        handle.remove()
        model(torch.randn(4, 32))
    model(torch.randn(4, 32))
    assert calls == ["forward"] and not model[2]._forward_hooks


def test_a_model_held_in_fp8_is_refused_by_a_trainer_of_another_mode_or_recipe():
    model = mlp()
    mpnb.set_mode("fp8", "cpu", model=model)
    data = [(torch.randn(8, 32), torch.randint(0, 10, (8,)))]
    for mode, words in (("fp32", "holds mode fp8's layers"), ("fp8:rowwise", "recipe tensorwise")):
        trainer = mpnb.Trainer(
            model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy,
            mode=mode, device="cpu", dashboard=None,
        )  # fmt: skip
        with pytest.raises(MpnbError, match=words):
            trainer.fit(data)
        assert type(model[2]).__name__ == "Float8Linear"  # still held, as it was
    session.reset()
    assert type(model[2]) is nn.Linear


def test_a_refused_hold_leaves_the_session_and_the_held_model_as_they_were(ip):
    run(ip, "net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))")  # fmt: skip
    run(ip, "%amp fp8 --model net")
    before = (session.mode, run(ip, "type(net[1]).__name__"), session.held.describe())
    assert "keep names no module" in usage_error(ip, "%amp fp8 --model net --keep nothing")
    assert (session.mode, run(ip, "type(net[1]).__name__"), session.held.describe()) == before
    assert "model" in dict(mpnb.status().rows())  # the status names the held model


def test_a_refused_switch_during_a_fit_leaves_the_fit_in_its_mode():
    trainer, data = _fp8_trainer(mode="fp8")
    switched = []

    def loss(model, batch):
        if not switched:  # between steps, as a panel click lands
            switched.append(True)
            mpnb.set_mode(
                "fp8", "cpu", keep=["0", "2", "4", "6"]
            )  # every Linear kept: nothing to convert
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    trainer.step_fn, trainer.loss_fn = loss, None
    history = trainer.fit(data * 2)
    assert any("mode not switched" in event["message"] for event in history.events)
    assert trainer.mode == "fp8" and history.mode == ["fp8"] * 4


def test_keep_takes_names_only():
    for bad in (5, [5], [""], b"ab", {"a": 1}):
        with pytest.raises(MpnbError, match="keep takes"):
            parse_mode("fp8", keep=bad)


def test_the_panels_options_keep_a_held_model_held_and_empty_means_the_default():
    from mpnb.ui.widgets.panel import ControlPanel

    model = mlp()
    mpnb.set_mode("fp8", "cpu", model=model)
    panel = ControlPanel()
    try:
        panel.mode_options["fp8"]["recipe"].value = "rowwise"
        assert session.mode == "fp8:rowwise" and type(model[2]).__name__ == "Float8Linear"
        assert session.held is not None and "rowwise" in session.held.describe()
        panel.mode_options["fp8"]["keep"].value = " "
        assert session.mode.keep == () and panel.message_view.value == ""
    finally:
        panel.close()
    session.reset()
    assert type(model[2]) is nn.Linear


def _converted_lines(lines) -> list[str]:
    return [line.strip() for line in lines if line.strip().startswith(("converted", "kept"))]


@pytest.mark.parametrize("keep", [[], ["2"]])
def test_the_trainer_and_the_magic_convert_the_same_layers_for_a_recipe_and_keep(ip, keep):
    ip.user_ns["net"] = mlp()
    run(ip, "%amp fp8 --model net --recipe rowwise" + "".join(f" --keep {k}" for k in keep))
    by_magic = _converted_lines(value for _, value in mpnb.status().rows())
    run(ip, "%amp off")
    trainer, data = _fp8_trainer(mode="fp8", recipe="rowwise", keep=keep)
    by_trainer = _converted_lines(trainer.fit(data).meta["layers"])
    assert by_magic == by_trainer
    assert by_trainer[0] == ("converted: 4" if keep else "converted: 2, 4")


def test_the_cli_converts_the_layers_the_trainer_does(tmp_path, capsys):
    from mpnb.cli import main
    from mpnb.examples import DigitsMLP

    net = DigitsMLP()  # the CLI's --model mlp
    trainer = mpnb.Trainer(
        net, torch.optim.SGD(net.parameters(), 0.1), nn.functional.cross_entropy, mode="fp8",
        recipe="rowwise", device="cpu", dashboard=None,
    )  # fmt: skip
    history = trainer.fit([(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))])
    args = ["train", "--mode", "fp8", "--recipe", "rowwise", "--model", "mlp", "--steps", "1"]
    assert main([*args, "--out", str(tmp_path / "cli")]) == 0
    by_cli = _converted_lines(capsys.readouterr().out.splitlines())
    assert (
        by_cli
        == _converted_lines(history.meta["layers"])
        == [
            "converted: layers.3",
            "kept in bf16: layers.1 (the first Linear layer), layers.5 (the last Linear layer)",
        ]
    )


def test_keep_naming_a_module_that_holds_no_linear_layer_is_refused_naming_its_kind():
    """A name one off in a Sequential (a ReLU) would keep nothing, without a word."""
    model = mlp()
    with pytest.raises(
        MpnbError,
        match=r"fp8 keep names '1' \(ReLU\), which holds no Linear layer fp8 could convert; "
        "its Linear layers: 0, 2, 4, 6",
    ):
        fp8_layers(model, keep=["2", "1"], device="cpu")
    with pytest.raises(MpnbError, match=r"names '1' \(ReLU\), which holds no Linear layer"):
        mpnb.Trainer(
            model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.mse_loss,
            mode="fp8", keep=["1"], device="cpu", dashboard=None,
        ).fit([(torch.randn(4, 32), torch.randn(4, 10))], max_steps=1)  # fmt: skip
    assert all(type(m) in (nn.Sequential, nn.Linear, nn.ReLU) for m in model.modules())
    wrapped = nn.Sequential(mlp())  # a module that holds Linear layers is a name to keep
    assert fp8_layers(wrapped, keep=["0"], device="cpu").keep == ("0",)


def test_a_model_whose_linear_layers_are_only_the_first_and_last_is_told_why_not_sizes():
    # the advice was "a model with Linear layers whose sizes are multiples of 16", which
    # resizing cannot satisfy: the mode keeps its first and last Linear layers itself
    with pytest.raises(MpnbError) as refused:
        fp8_layers(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), device="cpu").convert()
    said = str(refused.value)
    assert "keeps the first and the last Linear layer" in said and "multiples" not in said
    odd = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 10), nn.Linear(10, 16), nn.Linear(16, 4))
    with pytest.raises(MpnbError, match="whose sizes are multiples of 16"):
        fp8_layers(odd, device="cpu").convert()  # layers between them, of sizes it cannot take


def test_a_keep_that_names_no_module_lists_the_closest_names_or_the_layers():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    with pytest.raises(
        MpnbError,
        match=r"keep names no module of Sequential: 'layer2'; its Linear layers: 0, 2, 3$",
    ):
        fp8_layers(model, keep=["layer2"], device="cpu")
    pytest.importorskip("transformers")
    from tests.conformance.models import gpt2_model

    with pytest.raises(MpnbError, match=r"'lm-head'; closest: lm_head"):
        fp8_layers(gpt2_model(), keep=["lm-head"], device="cpu")
