"""A failure mid-step leaves the run exact: a window whose backward or optimizer step fails
before the update is dropped and trained again by the next fit (under a loss scaler, unscaled
once); a step whose failure comes after the update is counted and its batches never trained
again; a generator's batches read for a failed window are kept for the next fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpnb
import mpnb.examples as ex
from mpnb.training.telemetry import Sink

from .test_training import linear_problem, mse

SMALL = {"widths": (4, 8), "batch_size": 128, "dashboard": None}


def failing_backward(model: nn.Module, on_call: int) -> list[int]:
    """Make the first conv's weight gradient raise on its ``on_call``-th backward, after the
    classifier's gradients were already accumulated (backward runs from the output back)."""
    calls: list[int] = []

    def hook(grad):
        calls.append(1)
        if len(calls) == on_call:
            raise RuntimeError("injected failure in backward")
        return grad

    model.features[0].weight.register_hook(hook)
    return calls


def build(optimizer="sgd", seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(6, 3)
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    }
    return model, make[optimizer](model.parameters())


def unbroken(data, mode="fp16", optimizer="sgd", **options):
    model, opt = build(optimizer)
    mpnb.Trainer(model, opt, mse, mode=mode, device="cpu", dashboard=None, **options).fit(data)
    return model


def fails_once(on_call: int, message: str):
    calls = []

    def hook(*args):
        calls.append(1)
        if len(calls) == on_call:
            raise RuntimeError(message)

    return hook


# -- a failure before the update: the window is dropped and trained again -----------------------


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_failure_inside_backward_drops_the_window_and_the_resumed_run_is_exact(accumulate):
    full, train, _ = ex.example_trainer("bf16", "cpu", accumulate=accumulate, **SMALL)
    full.fit(train)

    trainer, _, _ = ex.example_trainer("bf16", "cpu", accumulate=accumulate, **SMALL)
    failing_backward(
        trainer.model, on_call=2 * accumulate + 1
    )  # the first backward of the third window
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(train)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert len(trainer.history) == 2 and trainer.position[1] == 2 * accumulate
    trainer.fit(train)
    assert trainer.history.step == full.history.step
    for mine, theirs in zip(trainer.model.parameters(), full.model.parameters()):
        assert torch.equal(mine, theirs)


def test_a_failure_in_the_optimizer_step_before_it_updates_drops_the_window():
    model, data = linear_problem(steps=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = mpnb.Trainer(model, optimizer, mse, mode="bf16", device="cpu", dashboard=None)
    real_step, calls = optimizer.step, []

    def step_failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("optimizer failed")
        return real_step(*args, **kwargs)

    optimizer.step = step_failing_once
    with pytest.raises(RuntimeError, match="optimizer failed"):
        trainer.fit(data)
    assert (
        all(p.grad is None for p in model.parameters())
        and trainer.position[1] == 1
        and len(trainer.history) == 1
    )


@pytest.mark.parametrize("options", [{}, {"clip_grad_norm": 1.0}], ids=["plain", "clipped"])
def test_an_fp16_optimizer_step_that_fails_after_unscaling_is_retried_exactly(options):
    _, data = linear_problem(steps=6)
    reference = unbroken(data, init_scale=1024.0, **options)
    model, opt = build()
    opt.register_step_pre_hook(fails_once(2, "transient failure"))
    trainer = mpnb.Trainer(
        model, opt, mse, mode="fp16", device="cpu", dashboard=None, init_scale=1024.0, **options
    )
    with pytest.raises(RuntimeError, match="transient failure"):
        trainer.fit(data)
    history = trainer.fit(data)
    assert history.step == list(range(1, 7)) and history.skipped_steps == []
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)


# -- a failure after the update: the step counts ------------------------------------------------


def test_a_failure_after_the_update_counts_the_step_and_never_trains_its_batch_again():
    _, data = linear_problem(steps=4)
    reference = unbroken(data, mode="fp32", optimizer="adam")
    model, opt = build("adam")
    opt.register_step_post_hook(fails_once(2, "logging hook failed"))
    trainer = mpnb.Trainer(model, opt, mse, mode="fp32", device="cpu", dashboard=None)
    with pytest.raises(RuntimeError, match="logging hook failed"):
        trainer.fit(data)
    assert (
        trainer.history.step == [1, 2] and trainer.position[1] == 2
    )  # step 2 happened: its batch is behind us
    trainer.fit(data)
    assert trainer.history.step == [1, 2, 3, 4] and opt.state[model.weight]["step"].item() == 4
    assert torch.equal(model.weight, reference.weight)


def test_a_failing_scheduler_or_sink_after_the_update_still_records_the_step():
    _, data = linear_problem(steps=3)
    model, opt = build()

    class FailingStepLR(torch.optim.lr_scheduler.StepLR):
        def step(self, epoch=None):
            if self.last_epoch >= 0:  # any step after the one it takes when built
                raise RuntimeError("the scheduler failed")
            super().step(epoch)

    trainer = mpnb.Trainer(
        model, opt, mse, mode="bf16", device="cpu", dashboard=None, scheduler=FailingStepLR(opt, 1)
    )
    with pytest.raises(RuntimeError, match="the scheduler failed"):
        trainer.fit(data)
    assert trainer.history.step == [1] and trainer.amp.between_steps and trainer.position[1] == 1


# -- a failure with a generator: batches already read are kept ----------------------------------


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_error_with_a_generator_keeps_the_windows_batches_for_the_next_fit(accumulate):
    _, data = linear_problem(steps=8)
    reference = unbroken(iter(data), mode="bf16", accumulate=accumulate)
    model, opt = build()
    calls = []

    def failing_once(output, target):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("bad batch")
        return mse(output, target)

    trainer = mpnb.Trainer(
        model, opt, failing_once, mode="bf16", device="cpu", dashboard=None, accumulate=accumulate
    )
    stream = iter(data)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit(stream)
    trainer.fit(stream)
    assert len(trainer.history) == 8 // accumulate
    assert torch.equal(model.weight, reference.weight)


def test_an_error_while_a_generators_window_is_replayed_keeps_the_batches_not_yet_replayed():
    """Fails on batch 2 of the first window, then on batch 1 of its replay: batch 2, read before and
    not yet replayed, is still trained in that window, and every later window keeps its batches."""
    _, data = linear_problem(steps=9)
    reference = unbroken(iter(data), mode="bf16", accumulate=3)
    model, opt = build()
    calls = []

    def failing_twice(output, target):
        calls.append(1)
        if len(calls) in (2, 3):
            raise RuntimeError("bad batch")
        return mse(output, target)

    trainer = mpnb.Trainer(
        model, opt, failing_twice, mode="bf16", device="cpu", dashboard=None, accumulate=3
    )
    stream = iter(data)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="bad batch"):
            trainer.fit(stream)
    trainer.fit(stream)
    assert len(trainer.history) == 3
    assert torch.equal(model.weight, reference.weight)


class InterruptedOnce(Sink):
    """A dashboard whose first drawing is interrupted (a Ctrl-C while it draws)."""

    def __init__(self):
        self.updates = 0

    def update(self, history):
        self.updates += 1
        if self.updates == 1:
            raise KeyboardInterrupt


def test_a_sink_interrupted_in_the_last_flush_is_detached_with_the_fits_instruments():
    _, data = linear_problem(steps=3)
    model, opt = build()
    sink = InterruptedOnce()
    trainer = mpnb.Trainer(model, opt, mse, mode="bf16", device="cpu", dashboard=sink)
    attached = list(trainer.amp.recorder.sinks)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data)
    assert trainer.history.step == [1, 2, 3] and trainer.ended == "interrupted"
    assert list(trainer.amp.recorder.sinks) == attached  # none of the fit's left on
    trainer.fit(data, epochs=1, max_steps=trainer.amp.steps + 3)
    assert trainer.history.step == [1, 2, 3, 4, 5, 6]
    assert sink.updates == 2  # the next fit's one flush, drawn once
