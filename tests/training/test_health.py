"""A run that diverges or whose loss scale collapses is reported, once, with advice that fits its
mode, and can stop the fit (that fit only: the next one is watched afresh). Skipped steps are
counted from what the optimizer did, down to a loss scale of 0 and a fused optimizer's own skips."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import mpnb

from .test_training import linear_problem, mse


def poisoned_loss(bad_from: int):
    """mse, but NaN from the ``bad_from``-th call on (what a diverging bf16 run gives)."""
    calls = []

    def loss_fn(output, target):
        calls.append(1)
        loss = mse(output, target)
        return loss * math.nan if len(calls) >= bad_from else loss

    return loss_fn


def trainer_with(loss_fn, mode="bf16", steps=12, **options):
    model, data = linear_problem(steps=steps)
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn,
        mode=mode,
        device="cpu",
        dashboard=None,
        **options,
    )
    return trainer, data


def test_a_nan_loss_in_bf16_warns_once_is_an_event_and_the_summary_says_nan():
    trainer, data = trainer_with(poisoned_loss(bad_from=4), flush_every=5)
    with pytest.warns(RuntimeWarning, match="loss is nan at step 4") as caught:
        history = trainer.fit(data)
    assert len([w for w in caught if "loss is nan" in str(w.message)]) == 1
    assert len(history) == 12  # "warn" trains on
    # the next flush (step 5's) arms the locator: step 6, watched, finds NaN already in the weights
    assert [(e["kind"], e["step"]) for e in history.events] == [("nonfinite", 4), ("origin", 6)]
    summary = history.summary()
    assert (
        math.isnan(summary["final_loss"]) and summary["alarms"] and "step 4" in summary["alarms"][0]
    )
    assert ("alarm", summary["alarms"][0]) in history.summary_rows()


def test_on_nonfinite_stop_ends_the_fit_after_the_bad_step_and_keeps_the_history():
    trainer, data = trainer_with(poisoned_loss(bad_from=4), on_nonfinite="stop")
    with pytest.warns(RuntimeWarning, match="stopping: on_nonfinite='stop'"):
        history = trainer.fit(data)
    assert history.step == [1, 2, 3, 4]
    assert [e["kind"] for e in history.events] == ["nonfinite", "stop"]


def test_on_nonfinite_ignore_records_without_warning():
    trainer, data = trainer_with(poisoned_loss(bad_from=2), on_nonfinite="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = trainer.fit(data)
    assert len(history) == 12 and [e["kind"] for e in history.events] == ["nonfinite"]


def test_a_collapsing_fp16_scale_is_reported_and_overflow_skips_alone_are_not():
    always_inf = lambda output, target: mse(output, target) * math.inf  # noqa: E731
    trainer, data = trainer_with(always_inf, mode="fp16", steps=24, init_scale=2.0**4)
    with pytest.warns(RuntimeWarning, match="loss scale collapsed to 0.5 at step 6"):
        history = trainer.fit(data)
    assert history.skipped_steps == list(range(1, 25))
    # scales 16, 8, 4, 2, 1, 0.5; skipped inf losses are no alarm; the first skip's origin named
    assert [(e["kind"], e["step"]) for e in history.events] == [("origin", 1), ("collapse", 6)]
    assert (
        "(step 1: float32 overflow first outside every module (the loss?), forward (aten.mul))"
        in (history.events[1]["message"])
    )
    assert math.isnan(history.summary()["final_loss"])  # no step was taken


def test_healthy_fp16_overflows_raise_no_alarm():
    model, data = linear_problem(steps=10)
    calls = []

    def overflow_twice(output, target):
        calls.append(1)
        return mse(output, target) * (math.inf if len(calls) in (3, 7) else 1.0)

    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        overflow_twice,
        mode="fp16",
        device="cpu",
        dashboard=None,
        init_scale=2.0**8,
        locate_overflow=False,  # the loss counts its calls: a replay of step 3 would call it again
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = trainer.fit(data)
    assert (
        history.skipped_steps == [3, 7]
        and history.events == []
        and math.isfinite(history.summary()["final_loss"])
    )


def test_the_live_dashboard_marks_alarms():
    from mpnb.ui.plots.figure import dashboard_figure

    trainer, data = trainer_with(poisoned_loss(bad_from=3), on_nonfinite="ignore")
    figure = dashboard_figure(trainer.fit(data))
    texts = [annotation.text for annotation in figure.layout.annotations]
    assert any("loss is nan at step 3" in text for text in texts)


def test_nan_weights_show_as_a_nonfinite_loss_on_the_next_step():
    model, data = linear_problem(steps=6)
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mse,
        mode="bf16",
        device="cpu",
        dashboard=None,
        on_nonfinite="stop",
    )
    trainer.fit(data, max_steps=2)
    with torch.no_grad():
        nn.init.constant_(model.weight, math.nan)
    with pytest.warns(RuntimeWarning, match="loss is nan at step 3"):
        history = trainer.fit(data)
    assert history.step == [1, 2, 3]


def test_on_nonfinite_stop_rearms_for_each_fit():
    model, data = linear_problem(steps=6)
    data[1] = (data[1][0], torch.full_like(data[1][1], math.nan))
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mse,
        mode="fp32",
        device="cpu",
        dashboard=None,
        on_nonfinite="stop",
    )
    with pytest.warns(RuntimeWarning, match="loss is nan at step 2"):
        assert trainer.fit(data).step == [1, 2]
    _, fresh = linear_problem(seed=1, steps=3)
    model.reset_parameters()
    assert trainer.fit(fresh).step == [
        1,
        2,
        3,
    ]  # trains again (from where the stopped epoch was), no stale stop


def test_the_advice_fits_the_mode():
    model, data = linear_problem(steps=3)
    data[0] = (data[0][0], torch.full_like(data[0][1], math.nan))
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), 0.1),
        mse,
        mode="bf16",
        device="cpu",
        dashboard=None,
        on_nonfinite="ignore",
    )
    message = trainer.fit(data).events[0]["message"]
    assert "loss is nan at step 1" in message and "try bf16" not in message


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


def test_a_step_whose_gradient_norm_is_zero_is_an_alarm_reported_once():
    """Weights that do not move, whatever the cause (here a loss that does not depend on them)."""
    trainer, data = trainer_with(
        lambda output, target: (output * 0).sum(), record_grad_norm=True, on_nonfinite="ignore"
    )
    history = trainer.fit(data)
    (alarm,) = [e for e in history.events if e["kind"] == "zero_gradients"]
    assert alarm["step"] == 1 and alarm["message"].startswith("gradient norm 0 at step 1")
    assert history.summary()["alarms"] == [alarm["message"]]


def test_a_scale_below_1_is_the_alarm_naming_where_the_overflow_began_and_what_to_call():
    """A GPT-2 whose MLP projection overflows fp16 at every scale: 2 and 1 skip (no alarm yet, 1
    is not below 1), 0.5 is the collapse, said with the located origin and its remedy."""
    from tests.numerics.test_origin import gpt2_batches, overflowing_gpt2

    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        mode="fp16",
        device="cpu",
        dashboard=None,
        init_scale=2.0,
    )
    with pytest.warns(RuntimeWarning, match="loss scale collapsed to 0.5 at step 3") as caught:
        history = trainer.fit(gpt2_batches(4))
    assert history.loss_scale == [2.0, 1.0, 0.5, 0.25] and all(history.skipped)
    (collapse,) = [e for e in history.events if e["kind"] == "collapse"]
    assert collapse["step"] == 3
    assert (
        "(step 1: float16 overflow first in GPT2LMHeadModel.transformer.h.1.mlp.c_proj"
        in (collapse["message"])
    )
    assert collapse["message"].endswith(
        'remedy: trainer.keep_in_fp32("transformer.h.1.mlp.c_proj")'
    )
    assert len([w for w in caught if "collapsed" in str(w.message)]) == 1
