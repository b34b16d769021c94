"""Real fp8 on a GPU with fp8 tensor cores: torchao's layers run torch._scaled_mm, and a
Trainer's fp8 step on a transformer block of d_model 4096 costs what torchao's own costs.

Skipped without a CUDA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell): elsewhere fp8
is emulated (tests/precision/test_fp8.py checks its numerics on a CPU).
"""

from __future__ import annotations

import statistics

import pytest
import torch
from torch import nn

import mpnb

pytest.importorskip("torchao.float8", reason="mode fp8 needs torchao (mpnb[fp8])")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU of compute capability 8.9+ (fp8 tensor cores)",
)

D_MODEL, FFN, TOKENS = 4096, 16384, 8192


class Block(nn.Module):
    """A pre-norm transformer MLP block between an input and an output projection: the first
    and last Linear layers stay in bf16, the block's two large ones go to fp8."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_MODEL, D_MODEL)
        self.norm = nn.LayerNorm(D_MODEL)
        self.up = nn.Linear(D_MODEL, FFN)
        self.down = nn.Linear(FFN, D_MODEL)
        self.out = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.down(nn.functional.gelu(self.up(self.norm(h))))
        return self.out(h)


def _median_step(mode: str) -> float:
    """The median step of a Trainer fit in ``mode``, after a warm-up fit."""
    torch.manual_seed(0)
    model = Block().cuda()
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-4),
        nn.functional.mse_loss,
        mode=mode,
        device="cuda",
        dashboard=None,
    )
    data = _batches()
    trainer.fit(data[:3])  # warm-up
    trainer.fit(data)
    return statistics.median(trainer.history.step_time[-len(data) :])


def _median_step_by_hand() -> float:
    """The same fp8 steps written with torchao alone: its converter on the block's two large
    layers, bf16 autocast, SGD; each step timed by CUDA events."""
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model = Block().cuda()
    convert_to_float8_training(model, module_filter_fn=lambda _m, name: name in ("up", "down"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    times = []
    for index, (x, y) in enumerate(_batches() * 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        end.record()
        torch.cuda.synchronize()
        if index >= 3:  # warm-up, as the Trainer's
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(TOKENS, D_MODEL, device="cuda")
    return [(x, torch.randn(TOKENS, D_MODEL, device="cuda"))] * 8


def test_real_fp8_layers_run_scaled_mm():
    model = Block().cuda()
    with (
        mpnb.fp8_layers(model, device="cuda") as layers,
        torch.autocast("cuda", dtype=torch.bfloat16),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile,
    ):
        assert not layers.emulated and layers.converted == ["up", "down"]
        model(torch.randn(256, D_MODEL, device="cuda")).float().sum().backward()
    ran = {event.name for event in profile.events()}
    assert "aten::_scaled_mm" in ran
    assert type(model.up) is nn.Linear


def test_a_trainer_fp8_step_costs_what_torchaos_own_fp8_step_costs():
    """mpnb adds nothing to torchao's float8 layers. Whether they beat bf16 depends on the
    width and on torch.compile (eager casts cost more than they save up to width 8192 on an
    H100): benchmarks/fp8_speed.py measures that, and the docs report it."""
    trainer, by_hand = _median_step("fp8"), _median_step_by_hand()
    bf16 = _median_step("bf16")
    print(
        f"d_model {D_MODEL}: bf16 {bf16 * 1e3:.2f} ms, fp8 Trainer {trainer * 1e3:.2f} ms, "
        f"fp8 torchao by hand {by_hand * 1e3:.2f} ms"
    )
    assert trainer < 1.1 * by_hand


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_trainer_given_a_recipe_and_kept_layers_runs_them_on_the_gpu(recipe):
    """The mode's options reach torchao from the Trainer: ``recipe`` picks the scaling, ``keep``
    leaves a layer in bf16, and the converted layer runs torch._scaled_mm."""
    model = Block().cuda()
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-4),
        nn.functional.mse_loss,
        mode="fp8",
        recipe=recipe,
        keep=["down"],
        device="cuda",
        dashboard=None,
    )
    seen = {}

    def note(module, _):
        seen.setdefault("classes", {n: type(m).__name__ for n, m in module.named_children()})

    model.register_forward_pre_hook(note)
    x = torch.randn(256, D_MODEL, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        history = trainer.fit([(x, torch.randn(256, D_MODEL, device="cuda"))] * 2)
    assert seen["classes"]["up"] == "Float8Linear" and seen["classes"]["down"] == "Linear"
    assert "aten::_scaled_mm" in {event.name for event in profile.events()}
    assert history.mode == [trainer.mode.label] * 2 and type(model.up) is nn.Linear
