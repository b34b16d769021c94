"""Real fp8 on a GPU with fp8 tensor cores: torchao's layers run torch._scaled_mm, and a
transformer block of d_model 4096 trains faster in fp8 than in bf16.

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
    x = torch.randn(TOKENS, D_MODEL, device="cuda")
    data = [(x, torch.randn(TOKENS, D_MODEL, device="cuda"))] * 8
    trainer.fit(data[:3])  # warm-up
    trainer.fit(data)
    return statistics.median(trainer.history.step_time[-len(data) :])


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


def test_fp8_steps_are_faster_than_bf16_on_a_large_block():
    bf16, fp8 = _median_step("bf16"), _median_step("fp8")
    print(f"d_model {D_MODEL}: bf16 {bf16 * 1e3:.2f} ms, fp8 {fp8 * 1e3:.2f} ms, {bf16 / fp8:.2f}x")
    assert fp8 < bf16
