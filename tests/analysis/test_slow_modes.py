"""Slow modes said up front: the estimate is measured on a copy, and the run is untouched."""

from __future__ import annotations

import torch

import mpnb.examples as ex
from mpnb.analysis.slow_modes import slow_mode_notice, slow_reason


def test_the_estimate_leaves_the_model_and_the_random_state_as_they_were():
    trainer, train, _ = ex.example_trainer("fp16", "cpu", widths=(4, 8), dashboard=None)
    weights = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    torch.manual_seed(7)
    random_state = torch.random.get_rng_state()
    notice = slow_mode_notice(trainer, next(iter(train)), steps=3000)
    assert (
        notice.startswith("fp16 convolutions have no fast CPU kernels: about ")
        and "3000 steps take about" in notice
    )
    assert torch.equal(torch.random.get_rng_state(), random_state)
    assert all(
        torch.equal(value, weights[name]) for name, value in trainer.model.state_dict().items()
    )
    assert all(p.grad is None for p in trainer.model.parameters())


def test_modes_that_are_not_slow_here_say_nothing():
    for mode, model in (("bf16", "cnn"), ("fp32", "cnn"), ("fp16", "mlp")):
        trainer, train, _ = ex.example_trainer(mode, "cpu", model=model, dashboard=None)
        assert (
            slow_reason(trainer) is None
            and slow_mode_notice(trainer, next(iter(train)), 10) is None
        )
