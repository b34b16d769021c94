"""What only a CUDA GPU can show: no per-step host-device syncs in a whole Trainer fit, bf16 refused
where the GPU has none, op lists on the CUDA autocast key, per-mode peak memory from the
allocator, the live dashboard during a GPU fit. Each test skips with the reason without a GPU.

Written before any GPU ran them (the session that wrote them had none); their CPU-runnable
halves (op lists, the dashboard) were run on the CPU with the device swapped.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mpnb
from mpnb.errors import DeviceUnavailableError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def mlp(width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def batches(count: int, size: int = 256, width: int = 1024) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    return [
        (
            torch.randn(size, width, device="cuda", generator=generator),
            torch.randint(0, 10, (size,), device="cuda", generator=generator),
        )
        for _ in range(count)
    ]


def syncs_in_a_fit(steps: int) -> int:
    model = mlp().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # skips on the device: no sync
    trainer = mpnb.Trainer(
        model, optimizer, nn.functional.cross_entropy, mode="fp16", device="cuda", dashboard=None, flush_every=1000
    )
    data = batches(steps)
    trainer.fit(data[:2])  # lazy initialisation (cuBLAS, the allocator, the scaler) may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(data, epochs=1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(warning.message) for warning in caught)


def test_a_trainer_fit_syncs_with_the_device_per_fit_not_per_step():
    # the end of a fit reads the telemetry once; more steps must not add a single sync
    assert syncs_in_a_fit(10) == syncs_in_a_fit(40)


def test_bf16_is_refused_where_the_gpu_has_none_and_nothing_changes(monkeypatch):
    before = mpnb.get_mode()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    model = mlp()
    with pytest.raises(DeviceUnavailableError, match="bf16"):
        mpnb.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cuda", dashboard=None)
    assert mpnb.get_mode() == before


def test_op_lists_act_on_the_cuda_autocast_key_and_reset_puts_torchs_rules_back():
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    previous = mpnb.get_oplists()
    mpnb.set_oplists(mpnb.OpLists.of(fp32=["mm"]))
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.mm(a, b).dtype == torch.float32
    finally:
        mpnb.set_oplists(previous)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.mm(a, b).dtype == torch.bfloat16


def peak_of_a_fit(mode: str) -> tuple[float, float]:
    model = mlp(2048).cuda()
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=1e-3), nn.functional.cross_entropy, mode=mode, device="cuda",
        dashboard=None,
    )  # fmt: skip
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(batches(4, size=8192, width=2048))
    return max(trainer.history.memory_peak), max(trainer.history.memory_reserved)


def test_each_modes_peak_memory_comes_from_the_allocator_and_bf16_activations_take_less():
    fp32_peak, fp32_reserved = peak_of_a_fit("fp32")
    bf16_peak, _ = peak_of_a_fit("bf16")
    assert fp32_reserved >= fp32_peak > 0  # the caching allocator's own figures, not the process's
    assert bf16_peak < fp32_peak


def test_the_live_dashboard_draws_during_a_gpu_fit():
    from mpnb.ui.plots.live import LiveDashboard

    dashboard = LiveDashboard("gpu fit", min_interval=0.0)
    model = mlp().cuda()
    trainer = mpnb.Trainer(
        model, torch.optim.Adam(model.parameters(), 1e-3), nn.functional.cross_entropy, mode="bf16", device="cuda",
        dashboard=dashboard, flush_every=4,
    )  # fmt: skip
    trainer.fit(batches(20))
    assert dashboard.redraws >= 2
    loss_trace = dashboard.figure.data[0]
    assert len(loss_trace.x) > 0 and all(value == value for value in loss_trace.y)
