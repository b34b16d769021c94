"""Training stays exact under faults: a backward that fails half-way, scoped switches inside
model code, a loss scale that underflows to 0, a fit started inside a fit, a bad checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import mpnb
import mpnb.examples as ex
from mpnb.errors import MpnbError

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


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_failure_inside_backward_drops_the_window_and_the_resumed_run_is_exact(accumulate):
    full, train, _ = ex.example_trainer("bf16", "cpu", accumulate=accumulate, **SMALL)
    full.fit(train)

    trainer, _, _ = ex.example_trainer("bf16", "cpu", accumulate=accumulate, **SMALL)
    failing_backward(trainer.model, on_call=2 * accumulate + 1)  # the first backward of the third window
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(train)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert len(trainer.history) == 2 and trainer._batch == 2 * accumulate
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
    assert all(p.grad is None for p in model.parameters()) and trainer._batch == 1 and len(trainer.history) == 1


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
    [lambda: mpnb.tf32(False), lambda: mpnb.autocast("bf16", device="cpu"), lambda: mpnb.autocast(enabled=False)],
    ids=["tf32(False)", "autocast(bf16)", "autocast(off)"],
)
@pytest.mark.parametrize("mode", ["bf16", "tf32"])
def test_a_scoped_switch_in_model_code_never_changes_the_trainers_mode(switch, mode):
    _, data = linear_problem(steps=4)
    model = ScopedSwitches(switch)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), mse, mode=mode, device="cpu", dashboard=None
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
        model, torch.optim.SGD(model.parameters(), lr=0.1), mse, mode="bf16", device="cpu", dashboard=None
    )
    trainer.control.pollers.append(lambda: mpnb.set_mode("fp32", device="cpu") if trainer.amp.steps == 2 else None)
    try:
        history = trainer.fit(data)
    finally:
        mpnb.set_mode("off")
    assert history.mode == ["bf16", "bf16", "fp32", "fp32"]


def test_skips_are_counted_from_what_the_optimizer_did_even_with_a_zero_loss_scale():
    model, data = linear_problem(steps=12)
    amp = mpnb.AmpStep(
        torch.optim.SGD(model.parameters(), lr=0.1),
        mode="fp16",
        device="cpu",
        init_scale=2.0**-146,
        growth_interval=1000,
        flush_every=4,
    )
    weights = model.weight.detach().clone()
    history = run_every_step_overflowing(model, data, amp)
    assert history.loss_scale[-1] == 0.0 and history.loss_scale.count(0.0) >= 8
    assert history.skipped_steps == list(range(1, 13))
    assert torch.equal(weights, model.weight)


def run_every_step_overflowing(model, data, amp):
    for x, y in data:
        with amp.autocast():
            loss = mse(model(x), y) * math.inf
        amp.backward(loss)
        amp.step()
    return amp.close()


def test_a_fused_optimizer_that_skips_inside_its_step_is_counted_as_skipped():
    model, data = linear_problem(steps=6)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    amp = mpnb.AmpStep(optimizer, mode="fp16", device="cpu", init_scale=1024.0, flush_every=2)
    for step, (x, y) in enumerate(data, start=1):
        with amp.autocast():
            loss = mse(model(x), y)
        amp.backward(loss * math.inf if step in (2, 5) else loss)
        amp.step()
    assert amp.close().skipped_steps == [2, 5]


def test_a_fit_started_inside_a_running_fit_is_refused_and_the_outer_fit_is_undisturbed():
    _, data = linear_problem(steps=4)
    inner_model = nn.Linear(6, 3)
    inner = mpnb.Trainer(
        inner_model, torch.optim.SGD(inner_model.parameters(), lr=0.1), mse, mode="fp32", device="cpu", dashboard=None
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
    assert len(inner.history) == 0 and inner.fit(data).mode == ["fp32"] * 4  # usable once the outer fit ended


# -- checkpoints: validated first, applied all or nothing ---------------------------------------


def trained(seed: int = 0, optimizer: str = "adam", widths=(4, 8)):
    trainer, train, _ = ex.example_trainer("fp16", "cpu", seed=seed, widths=widths, batch_size=128, dashboard=None)
    if optimizer == "sgd":
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
        trainer.amp = mpnb.AmpStep(trainer.optimizer, mode="fp16", device="cpu")
    trainer.fit(train, max_steps=3)
    return trainer, train


def state_of(trainer) -> dict:
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": repr(trainer.optimizer.state_dict()),
        "amp": repr(trainer.amp.state_dict()),
        "position": (trainer._epoch, trainer._batch, trainer._end_epoch),
        "history": trainer.history.to_dict(),
    }


def assert_unchanged(trainer, before: dict) -> None:
    after = state_of(trainer)
    assert after.keys() == before.keys()
    for key in before["model"]:
        assert torch.equal(after["model"][key], before["model"][key])
    assert {k: v for k, v in after.items() if k != "model"} == {k: v for k, v in before.items() if k != "model"}


def test_loading_another_models_checkpoint_names_the_mismatch_and_changes_nothing(tmp_path):
    other, _ = trained(widths=(8, 16))
    other.save(tmp_path / "wide.pt")
    trainer, _ = trained(seed=1)
    before = state_of(trainer)
    with pytest.raises(MpnbError, match=r"wide\.pt.*features\.0\.weight.*shape") as refused:
        trainer.load(tmp_path / "wide.pt")
    assert "nothing was loaded" in str(refused.value)
    assert_unchanged(trainer, before)


def test_loading_an_sgd_checkpoint_into_an_adam_trainer_is_refused_and_the_next_fit_works(tmp_path):
    sgd, _ = trained(optimizer="sgd")
    sgd.save(tmp_path / "sgd.pt")
    trainer, train = trained(seed=1)
    before = state_of(trainer)
    with pytest.raises(MpnbError, match=r"sgd\.pt.*SGD.*Adam"):
        trainer.load(tmp_path / "sgd.pt")
    assert_unchanged(trainer, before)
    assert len(trainer.fit(train, max_steps=2)) == 5


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_checkpoint_is_an_mpnb_error_naming_the_file(tmp_path, damage):
    trainer, _ = trained()
    trainer.save(tmp_path / "run.pt")
    data = (tmp_path / "run.pt").read_bytes()
    damaged = {"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\x00not a checkpoint" * 40}[damage]
    (tmp_path / "bad.pt").write_bytes(damaged)
    before = state_of(trainer)
    with pytest.raises(MpnbError, match=r"bad\.pt"):
        trainer.load(tmp_path / "bad.pt")
    assert_unchanged(trainer, before)


def test_a_checkpoint_whose_history_or_scaler_is_broken_changes_nothing(tmp_path):
    trainer, _ = trained()
    trainer.save(tmp_path / "run.pt")
    state = torch.load(tmp_path / "run.pt", weights_only=True)
    state["history"]["columns"]["loss"] = [0.5]  # one loss for three steps
    torch.save(state, tmp_path / "history.pt")
    state = torch.load(tmp_path / "run.pt", weights_only=True)
    state["amp"]["scaler"] = {"scale": "big"}
    torch.save(state, tmp_path / "scaler.pt")
    other, _ = trained(seed=1)
    before = state_of(other)
    for name in ("history.pt", "scaler.pt"):
        with pytest.raises(MpnbError, match=name.replace(".", r"\.")):
            other.load(tmp_path / name)
        assert_unchanged(other, before)


def test_a_failure_while_applying_a_checkpoint_puts_everything_back(tmp_path, monkeypatch):
    source, _ = trained()
    source.save(tmp_path / "run.pt")
    trainer, _ = trained(seed=1)
    before = state_of(trainer)

    def failing(state):
        raise RuntimeError("scaler state rejected")

    monkeypatch.setattr(trainer.amp, "load_state_dict", failing)  # fails after model and optimizer were loaded
    with pytest.raises(RuntimeError, match="scaler state rejected"):
        trainer.load(tmp_path / "run.pt")
    monkeypatch.undo()
    assert_unchanged(trainer, before)
