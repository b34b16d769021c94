"""Trainer's options are in its signature, and the loss scaler can be given whole as a GradScaler
(as Lightning's precision plugin takes one) instead of its four settings."""

from __future__ import annotations

import inspect

import pytest
import torch

import mpnb
from mpnb.errors import MpnbError
from mpnb.training.amp_step import AmpStep
from mpnb.training.step_precision import TrainingPrecision

from .test_training import linear_problem as linear_batches
from .test_training import mse


def linear_problem(steps: int = 3):
    """:func:`tests.training.test_training.linear_problem` with its SGD optimizer."""
    model, data = linear_batches(steps=steps)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), data


def test_a_trainer_given_a_grad_scaler_trains_with_that_scaler():
    model, optimizer, data = linear_problem()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = mpnb.Trainer(
        model, optimizer, mse, mode="fp16", device="cpu", dashboard=None, scaler=scaler
    )
    history = trainer.fit(data)
    assert trainer.amp.scaler is scaler
    assert history.loss_scale[0] == 256.0 and len(history) == 3


def test_the_old_scaler_keywords_still_set_the_scale():
    model, optimizer, data = linear_problem()
    trainer = mpnb.Trainer(
        model, optimizer, mse, mode="fp16", device="cpu", dashboard=None, init_scale=2.0**10
    )
    assert trainer.fit(data).loss_scale[0] == 1024.0
    assert trainer.amp.scaler.get_growth_interval() == 2000  # the others keep GradScaler's defaults


def test_a_scaler_and_a_scaler_keyword_together_are_refused_naming_both():
    model, optimizer, _ = linear_problem()
    with pytest.raises(MpnbError, match="scaler=.*init_scale=.*growth_interval="):
        mpnb.Trainer(
            model,
            optimizer,
            mse,
            mode="fp16",
            device="cpu",
            dashboard=None,
            scaler=torch.amp.GradScaler("cpu"),
            init_scale=2.0**8,
            growth_interval=10,
        )


def test_an_enabled_scaler_is_refused_in_a_mode_without_loss_scaling():
    model, optimizer, _ = linear_problem()
    with pytest.raises(MpnbError, match="'bf16'"):
        AmpStep(optimizer, mode="bf16", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    assert AmpStep(optimizer, mode="bf16", device="cpu", scaler=disabled).scaler is disabled


def test_a_disabled_scaler_is_refused_in_fp16():
    model, optimizer, _ = linear_problem()
    with pytest.raises(MpnbError, match="enabled"):
        AmpStep(
            optimizer, mode="fp16", device="cpu", scaler=torch.amp.GradScaler("cpu", enabled=False)
        )


def test_a_scaler_for_another_device_is_refused():
    model, optimizer, _ = linear_problem()
    with pytest.raises(MpnbError, match="'xpu'.*'cpu'"):
        AmpStep(
            optimizer, mode="fp16", device="cpu", scaler=torch.amp.GradScaler("xpu", enabled=False)
        )


def test_a_given_scaler_comes_back_after_a_switch_to_bf16_and_back():
    model, optimizer, _ = linear_problem()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    amp = AmpStep(optimizer, mode="fp16", device="cpu", scaler=scaler)
    amp.set_precision(TrainingPrecision.resolve("bf16", "cpu"))
    assert not amp.scaler.is_enabled()
    amp.set_precision(TrainingPrecision.resolve("fp16", "cpu"))
    assert amp.scaler is scaler


def test_every_trainer_option_is_in_its_signature_with_amp_steps_default():
    trainer_parameters = inspect.signature(mpnb.Trainer).parameters
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in trainer_parameters.values())
    for name, parameter in inspect.signature(AmpStep).parameters.items():
        if name in trainer_parameters and name != "optimizer":
            assert trainer_parameters[name].default == parameter.default, name
    assert {
        "scheduler",
        "accumulate",
        "clip_grad_norm",
        "record_grad_norm",
        "scaler",
        "init_scale",
    } <= set(trainer_parameters)
