"""What code running inside a fit (model code, a loss function, a poller) does to it: a scoped
switch in model code holds for its block only and never changes the fit's mode; a deliberate
session change is followed from the next step; a fit started inside a running fit is refused,
and the outer fit goes on undisturbed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpnb
from mpnb.errors import MpnbError

from .test_training import linear_problem, mse


class ScopedSwitches(nn.Module):
    """Model code that uses mpnb's scoped switches around part of its forward pass."""

    def __init__(self, switch) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.switch = switch
        self.matmul_precision_after: list[str] = []

    def forward(self, x):
        with self.switch():
            hidden = self.linear(x)
        self.matmul_precision_after.append(torch.get_float32_matmul_precision())
        return hidden


@pytest.mark.parametrize(
    "switch",
    [
        lambda: mpnb.tf32(False),
        lambda: mpnb.autocast("bf16", device="cpu"),
        lambda: mpnb.autocast(enabled=False),
    ],
    ids=["tf32(False)", "autocast(bf16)", "autocast(off)"],
)
@pytest.mark.parametrize("mode", ["bf16", "tf32"])
def test_a_scoped_switch_in_model_code_never_changes_the_trainers_mode(switch, mode):
    _, data = linear_problem(steps=4)
    model = ScopedSwitches(switch)
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mse,
        mode=mode,
        device="cpu",
        dashboard=None,
    )
    before = torch.get_float32_matmul_precision()
    history = trainer.fit(data)
    assert history.mode == [mode] * 4 and history.events == []
    if mode == "tf32":  # the fit's reduced fp32 math is back after each scoped block
        assert model.matmul_precision_after == ["medium"] * 4
    assert torch.get_float32_matmul_precision() == before


def test_a_deliberate_session_change_during_a_fit_is_still_followed():
    _, data = linear_problem(steps=4)
    model = nn.Linear(6, 3)
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mse,
        mode="bf16",
        device="cpu",
        dashboard=None,
    )
    trainer.control.pollers.append(
        lambda: mpnb.set_mode("fp32", device="cpu") if trainer.amp.steps == 2 else None
    )
    try:
        history = trainer.fit(data)
    finally:
        mpnb.set_mode("off")
    assert history.mode == ["bf16", "bf16", "fp32", "fp32"]


def test_a_fit_started_inside_a_running_fit_is_refused_and_the_outer_fit_is_undisturbed():
    _, data = linear_problem(steps=4)
    inner_model = nn.Linear(6, 3)
    inner = mpnb.Trainer(
        inner_model,
        torch.optim.SGD(inner_model.parameters(), lr=0.1),
        mse,
        mode="fp32",
        device="cpu",
        dashboard=None,
    )
    refusals, precision = [], []

    def loss_starting_a_fit(output, target):
        try:
            inner.fit(data)
        except MpnbError as error:
            refusals.append(str(error))
        precision.append(torch.get_float32_matmul_precision())
        return mse(output, target)

    model = nn.Linear(6, 3)
    outer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_starting_a_fit,
        mode="tf32",
        device="cpu",
        dashboard=None,
    )
    history = outer.fit(data)
    assert len(refusals) == 4 and "another fit is running on this thread" in refusals[0]
    assert precision == ["medium"] * 4 and history.mode == ["tf32"] * 4 and len(history) == 4
    assert (
        len(inner.history) == 0 and inner.fit(data).mode == ["fp32"] * 4
    )  # usable once the outer fit ended
