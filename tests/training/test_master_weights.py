"""Weights that are themselves fp16 or bf16 under mixed precision, said before they bite: fp16
weights under the fp16 loss scaler are refused before training (torch's GradScaler would stop at
the first step with "Attempting to unscale FP16 gradients."), and bf16 weights with no fp32 master
copy draw a notice, once a fit, that updates below bf16's resolution are lost."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from torch import nn

import mpnb
from mpnb.training.master_weights import LOW_PRECISION_WEIGHTS, UnscalableWeightsError
from mpnb.training.step_precision import TrainingPrecision

from .test_training import linear_problem, mse


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def gpt2_batches(count: int = 2) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 96, (4, 16), generator=generator) for _ in range(count)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_torch_itself_refuses_to_unscale_fp16_gradients():
    """What the refusal stands in for, read from torch: the first scaled step of fp16 weights."""
    model = nn.Linear(4, 2).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(3, 4, dtype=torch.float16)).float().sum()
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(optimizer)


def test_an_fp16_gpt2_is_refused_when_the_trainer_is_built_naming_its_parameters_and_the_fix():
    model = tiny_gpt2().half()
    before = state(model)
    with pytest.raises(UnscalableWeightsError) as refused:
        mpnb.Trainer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-4),
            mode="fp16",
            device="cpu",
            dashboard=None,
        )
    message = str(refused.value)
    count = sum(1 for p in model.parameters())
    assert f"{count} parameters (transformer.wte.weight, transformer.wpe.weight, " in message
    assert f"and {count - 3} more) are fp16" in message
    assert "model.float()" in message and "Attempting to unscale FP16 gradients" in message
    assert isinstance(refused.value, mpnb.MpnbError)
    assert unchanged(model, before)


def test_weights_made_fp16_after_the_trainer_was_built_are_refused_at_the_fits_start():
    model = tiny_gpt2()
    trainer = mpnb.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        mode="fp16",
        device="cpu",
        dashboard=None,
    )
    model.half()
    before = state(model)
    with pytest.raises(UnscalableWeightsError, match=r"transformer\.wte\.weight.*model\.float\(\)"):
        trainer.fit(gpt2_batches())
    assert len(trainer.history) == 0 and trainer.history.events == []
    assert unchanged(model, before)
    model.float()  # the fix the error names: the optimizer keeps its parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the first step's overflow, if any
        history = trainer.fit(gpt2_batches())
    assert len(history) == 2 and history.mode == ["fp16", "fp16"]
    assert not unchanged(model, {k: v.float() for k, v in before.items()})


def test_a_hand_loop_is_refused_when_its_amp_step_is_built():
    model = nn.Linear(6, 3).half()
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1)
    with pytest.raises(UnscalableWeightsError, match=r"2 parameters \(weight, bias\) are fp16"):
        mpnb.AmpStep(optimizer, mode="fp16", device="cpu")
    assert optimizer._optimizer_step_post_hooks == {}  # no hook left on the optimizer


def amp_steps(model: nn.Module, amp: mpnb.AmpStep, data: list) -> None:
    for x, y in data:
        with amp.autocast():
            loss = mse(model(x.to(model.weight.dtype)), y)
        amp.backward(loss)
        amp.step(samples=len(x))


def test_a_hand_loop_whose_weights_turn_fp16_later_is_refused_before_torch_raises():
    model, data = linear_problem()
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="fp16", device="cpu")
    model.half()  # after the helper was built: its first step says it, before unscaling
    before = state(model)
    with pytest.raises(
        UnscalableWeightsError, match=r"param_groups\[0\]\[0\].*model\.float"
    ) as refused:
        amp_steps(model, amp, data[:1])
    assert refused.value.__cause__ is None  # mpnb's words first, not torch's translated
    assert unchanged(model, before) and len(amp.history) == 0


def test_torchs_own_refusal_later_in_a_hand_loop_is_explained_too():
    model, data = linear_problem()
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="fp16", device="cpu")
    amp_steps(model, amp, data[:1])
    model.half()
    before = state(model)
    with pytest.raises(UnscalableWeightsError, match=r"2 parameters .* are fp16") as refused:
        amp_steps(model, amp, data[1:2])
    assert isinstance(refused.value.__cause__, ValueError)  # torch's own, kept as the cause
    assert "Attempting to unscale FP16 gradients" in str(refused.value.__cause__)
    assert unchanged(model, before) and len(amp.history) == 1


def test_a_switch_into_fp16_with_fp16_weights_is_refused_and_changes_nothing():
    model = nn.Linear(6, 3).half()
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cpu")
    with pytest.raises(UnscalableWeightsError):
        amp.set_precision(TrainingPrecision.resolve("fp16", "cpu"))
    assert amp.precision.mode.label == "bf16" and not amp.scaler.is_enabled()
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mse,
        mode="bf16",
        device="cpu",
        dashboard=None,
    )
    with pytest.raises(UnscalableWeightsError, match=r"\(weight, bias\)"):
        trainer.use_precision(TrainingPrecision.resolve("fp16", "cpu"))
    assert trainer.mode.label == "bf16" and not trainer.amp.scaler.is_enabled()


def sgd_steps(model: nn.Module, lr: float, steps: int = 5) -> None:
    """Plain SGD on a fixed regression, in the weights' own dtype (no autocast)."""
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 64, generator=generator), torch.randn(32, 64, generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x.to(model.weight.dtype)).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_bf16_linear_does_not_move_at_lr_1e_5_while_its_fp32_copy_does():
    """What the notice says, measured: updates below bf16's resolution are rounded away."""
    torch.manual_seed(0)
    fp32 = nn.Linear(64, 64)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    start32, start16 = fp32.weight.detach().clone(), bf16.weight.detach().clone()
    sgd_steps(fp32, lr=1e-5)
    sgd_steps(bf16, lr=1e-5)
    moved32 = (fp32.weight != start32).float().mean().item()
    moved16 = (bf16.weight != start16).float().mean().item()
    assert moved32 > 0.9 and moved16 == 0.0, (moved32, moved16)


def bf16_trainer(lr: float = 1e-5) -> tuple[mpnb.Trainer, list]:
    model, data = linear_problem(steps=4)
    model.to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    trainer = mpnb.Trainer(model, optimizer, mse, mode="bf16", device="cpu", dashboard=None)
    return trainer, data


def test_bf16_weights_under_bf16_autocast_draw_a_notice_once_a_fit():
    trainer, data = bf16_trainer()
    before = state(trainer.model)
    with pytest.warns(RuntimeWarning, match=r"2 parameters \(weight, bias\) are bf16") as caught:
        trainer.fit(data)
    said = [w for w in caught if "no fp32 master copy" in str(w.message)]
    assert len(said) == 1
    message = str(said[0].message)
    assert "8 significant bits" in message and "about 1/256 of its weight" in message
    assert "model.float()" in message
    assert unchanged(trainer.model, before)  # what it says: at lr 1e-5 no bf16 weight moved
    with pytest.warns(RuntimeWarning, match="no fp32 master copy"):
        history = trainer.fit(data)
    notices = [e for e in history.events if e["kind"] == LOW_PRECISION_WEIGHTS]
    assert [e["step"] for e in notices] == [0, 4]  # each fit's, at its start


def test_fp32_master_weights_and_plain_bf16_training_draw_no_notice():
    model, data = linear_problem(steps=2)
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mse,
        mode="bf16",
        device="cpu",
        dashboard=None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trainer.fit(data).events == []
    model.to(torch.bfloat16)  # autocast off: training in the weights' own dtype is the choice made
    data = [(x.to(torch.bfloat16), y) for x, y in data]
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mse,
        mode="fp32",
        device="cpu",
        dashboard=None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trainer.fit(data).events == []


def test_a_hand_loop_gets_the_notice_at_its_first_step_once():
    model, data = linear_problem(steps=3)
    model.to(torch.bfloat16)
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=1e-5), mode="bf16", device="cpu")
    with pytest.warns(RuntimeWarning, match="no fp32 master copy") as caught:
        for x, y in data:
            with amp.autocast():
                loss = mse(model(x), y)
            amp.backward(loss)
            amp.step(samples=len(x))
    assert len([w for w in caught if "no fp32 master copy" in str(w.message)]) == 1
    assert [e["kind"] for e in amp.history.events] == [LOW_PRECISION_WEIGHTS]
