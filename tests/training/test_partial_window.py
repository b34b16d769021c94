"""An accumulation window that the data ends before it fills (an epoch of 7 batches with
``accumulate=3``) is stepped at the epoch's end, as the mean of the batches it has (as
transformers does; Lightning steps the sum over ``accumulate``). Its gradients are never carried
into the next epoch or fit, so a checkpoint saved in between loses none of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpnb

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
        for _ in range(count)
    ]


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
    assert torch.equal(run.model.weight, reference.weight) and torch.equal(
        run.model.bias, reference.bias
    )
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
    assert (
        torch.equal(second.model.weight, unbroken.model.weight)
        and second.history.step == unbroken.history.step
    )


def test_amp_step_finish_window_steps_an_open_window_and_nothing_else():
    net = model()
    amp = mpnb.AmpStep(
        torch.optim.SGD(net.parameters(), lr=0.1), mode="bf16", device="cpu", accumulate=4
    )
    assert amp.finish_window() is False and len(amp.history) == 0  # no window open: nothing to step
    data = batches(2)
    for inputs, targets in data:
        amp.train_step(lambda x=inputs, y=targets: nn.functional.mse_loss(net(x), y), samples=8)
    assert not amp.between_steps
    assert amp.finish_window() is True and amp.between_steps and len(amp.history) == 1
    reference, losses = by_hand([data], "bf16", accumulate=4)
    assert torch.equal(net.weight, reference.weight) and torch.equal(net.bias, reference.bias)
    assert amp.history.loss == pytest.approx(losses, rel=1e-5)


def test_a_failure_after_the_short_windows_update_does_not_train_its_batches_again():
    """A generator's batches are kept for the next fit only while their window has not stepped:
    a failing optimizer post-hook at the epoch's short window left its batch to be trained twice."""
    data = batches(7)
    reference = trainer(accumulate=3)
    reference.fit(iter(data))
    run = trainer(accumulate=3)
    calls = []

    def failing_third_step(*_):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("post-step hook failed")

    run.optimizer.register_step_post_hook(failing_third_step)
    stream = iter(data)
    with pytest.raises(RuntimeError, match="post-step hook failed"):
        run.fit(stream)
    run.fit(stream)
    assert run.history.step == [1, 2, 3] and torch.equal(run.model.weight, reference.model.weight)


def amp_with_window(accumulate: int, good: int) -> tuple[mpnb.AmpStep, nn.Module]:
    net = model()
    amp = mpnb.AmpStep(
        torch.optim.SGD(net.parameters(), lr=0.1), mode="bf16", device="cpu", accumulate=accumulate
    )
    for inputs, targets in batches(good):
        amp.train_step(lambda x=inputs, y=targets: nn.functional.mse_loss(net(x), y))
    return amp, net


def test_finish_window_retried_after_a_failed_optimizer_step_rescales_once():
    amp, net = amp_with_window(accumulate=3, good=2)
    failures = ["transient"]

    def fails_once(*_):
        if failures:
            raise RuntimeError(failures.pop())

    handle = amp.optimizer.register_step_pre_hook(fails_once)
    with pytest.raises(RuntimeError, match="transient"):
        amp.finish_window()
    assert amp.finish_window() is True
    handle.remove()
    reference, _ = by_hand([batches(2)], "bf16", accumulate=3)
    assert torch.equal(net.weight, reference.weight) and torch.equal(net.bias, reference.bias)


def test_a_window_with_a_backward_that_failed_half_way_is_never_stepped():
    amp, net = amp_with_window(accumulate=3, good=1)
    inputs, targets = batches(2)[1]

    def failing_backward():
        hidden = net(inputs)
        hidden.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("backward failed")))
        return nn.functional.mse_loss(hidden, targets)

    with pytest.raises(RuntimeError, match="backward failed"):
        amp.train_step(failing_backward)
    weight = net.weight.detach().clone()
    for end_the_window in (amp.finish_window, amp.step):
        with pytest.raises(RuntimeError, match="discard_window"):
            end_the_window()
    assert torch.equal(net.weight, weight) and len(amp.history) == 0
    amp.discard_window()
    assert amp.between_steps and all(p.grad is None for p in net.parameters())


def test_a_backward_after_one_that_failed_half_way_is_refused_until_the_window_is_discarded():
    """The partial gradients of the failed backward stay in the window: a later backward that
    finishes does not make the window steppable."""
    amp, net = amp_with_window(accumulate=3, good=1)
    inputs, targets = batches(2)[1]
    hidden = net(inputs)
    hidden.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("backward failed")))
    with pytest.raises(RuntimeError, match="backward failed"):
        amp.backward(nn.functional.mse_loss(hidden, targets))
    weight = net.weight.detach().clone()
    with pytest.raises(RuntimeError, match="failed half-way.*discard_window"):
        amp.backward(nn.functional.mse_loss(net(inputs), targets))
    with pytest.raises(RuntimeError, match="failed half-way.*discard_window"):
        amp.train_step(lambda: nn.functional.mse_loss(net(inputs), targets))
    with pytest.raises(RuntimeError, match="discard_window"):
        amp.step()
    assert torch.equal(net.weight, weight) and len(amp.history) == 0
    amp.discard_window()
    assert amp.train_step(lambda: nn.functional.mse_loss(net(inputs), targets)) is False


def test_a_window_rescaled_for_a_failed_step_takes_no_more_micro_batches():
    amp, net = amp_with_window(accumulate=3, good=2)
    handle = amp.optimizer.register_step_pre_hook(
        lambda *_: (_ for _ in ()).throw(RuntimeError("optimizer failed"))
    )
    with pytest.raises(RuntimeError, match="optimizer failed"):
        amp.finish_window()
    handle.remove()
    inputs, targets = batches(3)[2]
    with pytest.raises(RuntimeError, match="rescaled to the mean of its 2 micro-batches"):
        amp.train_step(lambda: nn.functional.mse_loss(net(inputs), targets))
    assert amp.finish_window() is True and len(amp.history) == 1
    reference, _ = by_hand([batches(2)], "bf16", accumulate=3)
    assert torch.equal(net.weight, reference.weight)
