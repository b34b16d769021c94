"""An accumulation window that the data ends before it fills (an epoch of 7 batches with
``accumulate=3``) is stepped at the epoch's end, as the mean of the batches it has, as Lightning
and transformers step theirs. Before, its gradients were carried into the next epoch or fit
without a word, and a checkpoint saved in between dropped them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpnb

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(count)]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 3)


def by_hand(windows: list[list], mode: str, accumulate: int) -> tuple[nn.Module, list[float]]:
    """The torch.amp recipe as a loop writes it that learns a window is short only when the data
    ends: each batch's loss divided by ``accumulate``, then a short window's gradients multiplied by
    ``accumulate / count``, which makes them the mean of its batches."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=mode == "fp16")
    losses = []
    for window in windows:
        window_loss = 0.0
        for inputs, targets in window:
            with torch.autocast("cpu", dtype=DTYPES[mode]):
                loss = nn.functional.mse_loss(net(inputs), targets)
            scaler.scale(loss / accumulate).backward()
            window_loss += loss.item()
        if len(window) < accumulate:
            for param in net.parameters():
                param.grad.mul_(accumulate / len(window))
        losses.append(window_loss / len(window))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return net, losses


def trainer(accumulate: int, mode: str = "bf16") -> mpnb.Trainer:
    net = model()
    return mpnb.Trainer(
        net, torch.optim.SGD(net.parameters(), lr=0.1), nn.functional.mse_loss, mode=mode, device="cpu",
        dashboard=None, accumulate=accumulate,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_the_short_last_window_of_each_epoch_is_stepped_as_the_mean_of_its_batches(mode):
    data = batches(7)
    run = trainer(accumulate=3, mode=mode)
    history = run.fit(data, epochs=2)
    assert history.step == [1, 2, 3, 4, 5, 6] and history.epoch == [0, 0, 0, 1, 1, 1]
    assert run.amp.between_steps and all(p.grad is None for p in run.model.parameters())
    windows = [data[0:3], data[3:6], data[6:7]] * 2  # no window spans two epochs
    reference, losses = by_hand(windows, mode, accumulate=3)
    assert torch.equal(run.model.weight, reference.weight) and torch.equal(run.model.bias, reference.bias)
    assert history.loss == pytest.approx(losses, rel=1e-5)


def test_a_run_saved_after_a_short_window_resumes_exactly(tmp_path):
    data = batches(5)
    unbroken = trainer(accumulate=2)
    unbroken.fit(data, epochs=2)
    first = trainer(accumulate=2)
    first.fit(data)
    first.save(tmp_path / "run.pt")
    second = trainer(accumulate=2)
    second.load(tmp_path / "run.pt")
    second.fit(data)
    assert torch.equal(second.model.weight, unbroken.model.weight) and second.history.step == unbroken.history.step


def test_amp_step_finish_window_steps_an_open_window_and_nothing_else():
    net = model()
    amp = mpnb.AmpStep(torch.optim.SGD(net.parameters(), lr=0.1), mode="bf16", device="cpu", accumulate=4)
    assert amp.finish_window() is False and len(amp.history) == 0  # no window open: nothing to step
    data = batches(2)
    for inputs, targets in data:
        amp.train_step(lambda x=inputs, y=targets: nn.functional.mse_loss(net(x), y), samples=8)
    assert not amp.between_steps
    assert amp.finish_window() is True and amp.between_steps and len(amp.history) == 1
    reference, losses = by_hand([data], "bf16", accumulate=4)
    assert torch.equal(net.weight, reference.weight) and torch.equal(net.bias, reference.bias)
    assert amp.history.loss == pytest.approx(losses, rel=1e-5)
