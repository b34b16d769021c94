"""On a GPU the host queues work ahead of the device: step times must be the device's.

A model big enough that the GPU, not the host, sets the pace: the median step time in the
history must match the wall time per step with the device synchronised around the fit.
Timed on the host clock, bf16 would read 5.48 ms for 6.30 ms a step (13% low).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn

import mpnb

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the host clock is exact on CPU"
)


def gpu_bound_model() -> nn.Module:
    layers = [nn.Sequential(nn.Linear(4096, 4096), nn.ReLU()) for _ in range(8)]
    return nn.Sequential(*layers, nn.Linear(4096, 10)).cuda()


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_step_times_are_the_devices_not_the_queueing_hosts(mode):
    torch.manual_seed(0)
    model = gpu_bound_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [
        (torch.randn(4096, 4096, device="cuda"), torch.randint(0, 10, (4096,), device="cuda"))
        for _ in range(4)
    ]
    trainer = mpnb.Trainer(
        model, optimizer, nn.functional.cross_entropy, mode=mode, device="cuda", dashboard=None
    )
    trainer.fit(data, epochs=2)  # warm-up: cuBLAS plans, allocator
    batches = [data[i % len(data)] for i in range(40)]

    torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.fit(batches, epochs=1)
    torch.cuda.synchronize()
    wall_per_step = (time.perf_counter() - start) / len(batches)

    step_times = trainer.history.step_time[-len(batches) :]
    assert statistics.median(step_times) == pytest.approx(wall_per_step, rel=0.05)
    assert sum(step_times) <= wall_per_step * len(batches) * 1.01  # no step counted twice
    rates = trainer.history.samples_per_s[-len(batches) :]
    assert statistics.median(rates) == pytest.approx(4096 / wall_per_step, rel=0.05)
