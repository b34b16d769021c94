"""fabric_telemetry in a real Lightning Fabric loop on CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning", reason="the lightning extra: pip install 'mpnb[lightning]'")

from mpnb.integrations.lightning import fabric_telemetry  # noqa: E402


def batches(count: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
        for _ in range(count)
    ]


def fabric_loop(precision: str, accumulate: int = 1, told: str | None = None):
    """Train a small MLP through Fabric, ``accumulate`` micro-batches a step, recording with mpnb;
    returns the history, each micro-batch's loss, and the optimizer's real step count."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    real_steps = []
    handle = optimizer.optimizer.register_step_post_hook(lambda *_: real_steps.append(1))
    losses = []
    with fabric_telemetry(fabric, model, optimizer, dashboard=None, precision=told) as recorder:
        for index, batch in enumerate(batches()):
            ends_step = (index + 1) % accumulate == 0
            with fabric.no_backward_sync(model, enabled=not ends_step):
                loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
            if ends_step:
                optimizer.step()
                optimizer.zero_grad()
            recorder.record(loss, batch, ends_step=ends_step)
    handle.remove()
    return recorder.history, losses, len(real_steps)


def test_bf16_mixed_rows_are_fabrics_steps_with_their_losses():
    history, losses, steps = fabric_loop("bf16-mixed")
    assert len(history) == steps == 6
    assert history.loss == pytest.approx(losses, rel=1e-6) and history.mode == ["bf16"] * 6


def test_accumulated_micro_batches_make_one_row_a_step_with_their_mean_loss():
    history, losses, steps = fabric_loop("bf16-mixed", accumulate=2)
    assert len(history) == steps == 3
    assert history.loss == pytest.approx([sum(losses[i : i + 2]) / 2 for i in (0, 2, 4)], rel=1e-6)
    assert history.samples_per_s[0] == pytest.approx(16 / history.step_time[0])


def test_16_mixed_on_cpu_is_recorded_as_the_bf16_fabric_runs_and_said_when_asked_for():
    for told, said_by_mpnb in [(None, False), ("16-mixed", True)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history, _, _ = fabric_loop("16-mixed", told=told)
        said = [str(w.message) for w in caught if str(w.message).startswith("mpnb:")]
        assert history.mode == ["bf16"] * 6
        assert (
            any("asked for fp16" in message and "bf16" in message for message in said)
            is said_by_mpnb
        ), said
