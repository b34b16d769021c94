"""Modes mxfp8 and nvfp4: torchao's MX layers, emulated on this CPU and always put back; NVFP4
refused here with the hardware it needs and what runs instead.

The first loss of a fit is compared with torchao's own ``MXFP8Linear`` put in by hand; the
model's modules, parameters and state dict are checked to be the same objects and values after.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mpnb
from mpnb.errors import MpnbError
from mpnb.precision.modes import parse_mode
from mpnb.precision.policy import session
from tests.conftest import policy_state, run
from tests.precision.test_fp8 import mlp  # 32-64-64-48-10: layer 4 is no multiple of 32

pytest.importorskip("torchao.prototype.mx_formats", reason="mode mxfp8 needs torchao (mpnb[fp8])")

from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
from torchao.quantization.quantize_.common.kernel_preference import (
    KernelPreference,
)

from mpnb.precision.modes.mxfp8 import MxLayers


def batches(count: int = 3, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator))
        for _ in range(count)
    ]


def by_hand(model: nn.Sequential, names: list[str]) -> nn.Sequential:
    """A bf16 copy of ``model`` with torchao's MXFP8Linear (emulated) put in by hand at ``names``:
    what mode mxfp8's bf16 autocast and MX layers compute."""
    copied = copy.deepcopy(model).to(torch.bfloat16)
    for name in names:
        linear = copied.get_submodule(name)
        layer = MXFP8Linear(
            linear.in_features,
            linear.out_features,
            kernel_preference=KernelPreference.EMULATED,
            dtype=torch.bfloat16,
        )
        layer.load_state_dict(linear.state_dict())
        setattr(copied, name, layer)
    return copied


def test_the_first_loss_equals_torchaos_mx_layers_put_in_by_hand():
    model, data = mlp(), batches()
    x, y = data[0]
    expected = nn.functional.cross_entropy(by_hand(model, ["2"])(x.bfloat16()).float(), y)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy,
        mode="mxfp8", device="cpu", dashboard=None,
    )  # fmt: skip
    history = trainer.fit(data)
    assert history.loss[0] == pytest.approx(float(expected), rel=1e-6)
    assert history.mode == ["mxfp8"] * 3


def test_modules_and_parameters_are_the_originals_after_a_fit_and_the_weights_moved():
    model = mlp()
    modules, parameters = list(model.modules()), list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy,
        mode="mxfp8", device="cpu", dashboard=None,
    )  # fmt: skip
    seen = []
    model[2].register_forward_hook(lambda module, *_: seen.append(type(module).__name__))
    trainer.fit(batches())
    assert seen == ["MXFP8Linear"] * 3  # a user's hook on the layer fires on torchao's layer
    assert all(a is b for a, b in zip(model.modules(), modules, strict=True))
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))
    assert model.state_dict().keys() == before.keys()
    assert not torch.equal(model[2].weight, before["2.weight"])


def test_the_fits_first_lines_and_the_history_say_which_layers_were_converted_and_why_kept(
    capsys,
):
    model = mlp()
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy,
        mode="mxfp8", device="cpu", dashboard="text",
    )  # fmt: skip
    history = trainer.fit(batches(1))
    printed = capsys.readouterr().out
    assert "mxfp8 (emulated: numerics only, no speed-up): 1 of 4 Linear layers" in printed
    assert "converted: 2" in printed
    assert "4 (64x48 is not a multiple of 32)" in printed
    assert "0 (the first Linear layer)" in printed and "6 (the last Linear layer)" in printed
    assert history.meta["layers"][1:] == [
        "converted: 2",
        "kept in bf16: 0 (the first Linear layer), 4 (64x48 is not a multiple of 32), "
        "6 (the last Linear layer)",
    ]


def test_a_checkpoint_saved_in_the_mode_loads_into_the_plain_model(tmp_path):
    model = mlp()
    with mpnb.mx_layers(model, device="cpu"):
        assert type(model[2]).__name__ == "MXFP8Linear"
        torch.save(model.state_dict(), tmp_path / "mx.pt")
    plain = mlp(seed=5)
    plain.load_state_dict(torch.load(tmp_path / "mx.pt", weights_only=True))  # strict
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))


def test_the_layers_come_back_after_an_error_in_the_block():
    model = mlp()
    layer = model[2]
    with pytest.raises(RuntimeError, match="boom"), mpnb.mx_layers(model, device="cpu"):
        raise RuntimeError("boom")
    assert model[2] is layer


def test_keep_is_honoured_and_an_unknown_name_changes_nothing():
    model = mlp()
    layers = MxLayers(model, keep=["2"], device="cpu")
    assert layers.kept["2"] == "kept by name" and layers.converted == []
    with pytest.raises(MpnbError, match="mxfp8 would convert no layer"):
        layers.convert()
    with pytest.raises(MpnbError, match="mxfp8 keep names no module of Sequential: 'head'"):
        MxLayers(model, keep=["head"], device="cpu")
    assert type(model[2]) is nn.Linear


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_a_gpt2_trains_in_mxfp8_through_its_conv1d_layers_and_is_given_back():
    model = _gpt2()
    modules = list(model.modules())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 128, (4, 32), generator=generator)),
             "labels": ids} for _ in range(4)]  # fmt: skip
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), 1e-3), mode="mxfp8", device="cpu",
        dashboard=None,
    )  # fmt: skip
    history = trainer.fit(data)
    assert history.meta["layers"][0].endswith("7 of 9 Linear layers")  # Conv1D layers included
    assert "transformer.h.0.attn.c_attn (the first Linear layer)" in history.meta["layers"][2]
    assert all(map(torch.isfinite, map(torch.tensor, history.loss)))
    assert all(a is b for a, b in zip(model.modules(), modules, strict=True))
    moved = model.transformer.h[1].mlp.c_fc.weight
    assert not torch.equal(moved, before["transformer.h.1.mlp.c_fc.weight"])


def test_mxfp8_is_reached_from_the_magic_the_panel_and_compare(ip):
    run(ip, "%amp mxfp8 --keep 4")
    assert session.mode == parse_mode("mxfp8", keep=["4"])
    assert ("mxfp8", "emulated: numerics only, no speed-up; kept in bf16 by name: 4") in (
        mpnb.status().rows()
    )
    run(ip, "%amp off")

    def make_run(mode):
        model = mlp()
        trainer = mpnb.Trainer(
            model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy,
            mode=mode, device="cpu", dashboard=None,
        )  # fmt: skip
        return trainer, batches(2)

    comparison = mpnb.compare(make_run, ["fp32", "fp8", "mxfp8"], steps=2, warmup=0, progress=None)
    rows = {row["mode"]: row for row in comparison.rows()}
    assert list(rows) == ["fp32", "fp8", "mxfp8"]
    assert rows["mxfp8"]["speedup_verdict"] == "emulated: numerics only, no speed-up"

    from mpnb.ui.widgets.panel import ControlPanel

    panel = ControlPanel()
    try:
        panel.mode_options["mxfp8"]["keep"].value = "4"
        panel.mode.value = "mxfp8"
        assert session.mode == parse_mode("mxfp8", keep=["4"])
    finally:
        panel.close()


def test_nvfp4_on_this_cpu_is_refused_with_the_hardware_and_the_alternative_and_changes_nothing():
    model = mlp()
    before = policy_state()
    with pytest.raises(MpnbError) as refused:
        mpnb.Trainer(
            model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy,
            mode="nvfp4", device="cpu",
        )  # fmt: skip
    message = str(refused.value)
    assert "NVIDIA Blackwell GPU (compute capability 10.0+" in message
    assert "mode mxfp8" in message and "mpnb.whatif" in message
    with pytest.raises(MpnbError, match="Blackwell"):
        mpnb.set_mode("nvfp4", "cpu")
    assert policy_state() == before and type(model[2]) is nn.Linear
    assert parse_mode("nvfp4").support(torch.device("cpu")).startswith("no: NVFP4 training needs")


def test_the_cli_trains_mxfp8_and_refuses_nvfp4_in_one_line(tmp_path, capsys):
    from mpnb.cli import main

    args = ["train", "--model", "mlp", "--steps", "2", "--out"]
    assert main([*args[:1], "--mode", "mxfp8", *args[1:], str(tmp_path / "mx")]) == 0
    printed = capsys.readouterr().out
    assert "mxfp8 on cpu (emulated" in printed and "converted: layers.3" in printed
    assert main([*args[:1], "--mode", "nvfp4", *args[1:], str(tmp_path / "nv")]) != 0
    assert "Blackwell" in capsys.readouterr().err


def test_the_memory_account_counts_the_mx_copies_and_scales_of_the_converted_weights():
    from mpnb.analysis.memory import memory

    def make_run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
            nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10),
        )  # fmt: skip
        trainer = mpnb.Trainer(
            model, torch.optim.AdamW(model.parameters()), nn.functional.cross_entropy,
            mode=mode, device="cpu", dashboard=None,
        )  # fmt: skip
        return trainer, [(torch.randn(64, 256), torch.randint(0, 10, (64,)))]

    report = memory(make_run, ["bf16", "mxfp8"], measure=False)
    bf16, mx = (report.result(mode).categories["weight copies"] for mode in ("bf16", "mxfp8"))
    converted = 2 * 512 * 512  # layers 2 and 4: one byte an element in e4m3, a scale per 32
    assert mx - bf16 >= converted + converted // 32


def test_the_numerics_watch_shows_an_mx_layers_block_scales_spread_where_fp8_would_flush():
    """An outlier feature 1e7 times the rest at layer 1's input: MX gives its block its own
    scale (the range of block scales shows it; only the outlier's 31 neighbours flush), where
    fp8's one scale a tensor flushes the rest of the input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(64))
        model[0].weight[0, 0] = 1e7
        model[0].bias.zero_()
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 64, generator=generator), torch.randint(0, 4, (32,), generator=generator))
            for _ in range(2)]  # fmt: skip
    logs = {}
    for mode in ("fp8", "mxfp8"):
        copied = copy.deepcopy(model)
        trainer = mpnb.Trainer(
            copied, torch.optim.SGD(copied.parameters(), 0.0),
            nn.functional.cross_entropy, mode=mode, device="cpu", dashboard=None,
            watch_numerics=1,
        )  # fmt: skip
        trainer.fit(data)
        logs[mode] = trainer.numerics
    mx, fp8 = logs["mxfp8"], logs["fp8"]
    assert mx.fp8_modules == ["1", "2"] and mx.block_modules == ["1", "2"]
    assert min(mx.block_scale_range["1"]) >= 20  # 1e7 against ~1: about 23 powers of two
    assert max(mx.block_scale_range["2"]) < min(mx.block_scale_range["1"]) - 5
    assert 0 < max(mx.fp8_flushed["1"]) < min(fp8.fp8_flushed["1"]) / 2
    assert "block-scale range" in str(mx).splitlines()[0] and fp8.block_modules == []
