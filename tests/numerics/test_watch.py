"""The numerics watch: each leaf module's largest activation and gradient, fp16-underflow share
and non-finite count on sampled steps, exact, hooked only while a sampled step runs, the
training itself unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import mpnb
from mpnb.numerics.watch import NumericsLog
from tests.numerics.test_origin import gpt2_batches, overflowing_gpt2


def linear_run(watch_numerics, mode="bf16", lr=0.0, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=lr), nn.functional.mse_loss, mode=mode,
        device="cpu", dashboard=None, watch_numerics=watch_numerics, **options,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
    return trainer, batch


def test_the_sampled_values_are_those_of_the_step_computed_by_hand():
    trainer, batch = linear_run(watch_numerics=2)
    log = trainer.fit([batch] * 4, epochs=1) and trainer.numerics
    assert log.steps == [2, 4] and log.modules == ["0", "1"]
    # the same step by hand (lr=0: the weights never move)
    model = trainer.model
    inputs, targets = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model[0](inputs)
        hidden.retain_grad()
        output = model[1](hidden)
        output.retain_grad()
        loss = nn.functional.mse_loss(output, targets)
    loss.backward()
    model.zero_grad(set_to_none=True)
    for name, tensor in (("0", hidden), ("1", output)):
        assert log.activation_max[name] == [tensor.abs().max().float().item()] * 2
        assert log.gradient_max[name] == pytest.approx([tensor.grad.abs().max().item()] * 2)
        assert log.nonfinite[name] == [0.0, 0.0]


def test_fp16_gradients_are_read_unscaled():
    trainer, batch = linear_run(watch_numerics=1, mode="fp16", init_scale=2.0**10)
    reference, _ = linear_run(watch_numerics=1, mode="bf16")
    trainer.fit([batch], epochs=1)
    reference.fit([batch], epochs=1)
    scaled, plain = trainer.numerics.gradient_max["1"][0], reference.numerics.gradient_max["1"][0]
    assert scaled == pytest.approx(plain, rel=0.02)


def test_watching_changes_nothing_in_the_run_and_leaves_no_hook():
    watched, batch = linear_run(watch_numerics=1, lr=0.1)
    plain, _ = linear_run(watch_numerics=None, lr=0.1)
    watched.fit([batch] * 5, epochs=1)
    plain.fit([batch] * 5, epochs=1)
    assert watched.history.loss == plain.history.loss
    assert all(
        torch.equal(a, b) for a, b in zip(watched.model.parameters(), plain.model.parameters())
    )
    assert all(not module._forward_hooks for module in watched.model.modules())
    assert plain.numerics is None


def test_an_error_mid_step_leaves_no_hook():
    trainer, batch = linear_run(watch_numerics=1)

    def failing(output, target):
        raise RuntimeError("loss failed")

    trainer.loss_fn = failing
    with pytest.raises(RuntimeError, match="loss failed"):
        trainer.fit([batch], epochs=1)
    assert all(not module._forward_hooks for module in trainer.model.modules())


def test_the_gpt2_projection_that_overflows_heads_the_watch_and_the_heatmap():
    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), mode="fp16", device="cpu",
        dashboard=None, init_scale=1.0, watch_numerics=1, locate_overflow=False,
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="collapsed"):
        trainer.fit(gpt2_batches(2))
    log = trainer.numerics
    first_row = str(log).splitlines()[1]
    assert first_row.startswith("transformer.h.1.mlp.c_proj ")
    assert log.nonfinite["transformer.h.1.mlp.c_proj"][0] > 0
    figure = log.figure()
    assert list(figure.data[0].y) == log.ran  # the modules called as modules


def test_a_bad_sampling_interval_is_refused_with_the_value():
    with pytest.raises(
        ValueError, match="watch_numerics must be True or a whole number of steps >= 1, got 0.5"
    ):
        linear_run(watch_numerics=0.5)


def test_a_module_that_made_infs_reads_as_having_no_headroom_not_infinite_headroom():
    log = NumericsLog(["proj", "head"], limit=65504.0)
    log.add(1, [[math.inf, 12.0, 0.0, 0.0], [3.0, 0.0, 0.0, 1.0]])  # proj: its values inf
    proj, head = str(log).splitlines()[1:]
    assert proj.split()[:3] == ["proj", "inf", "none"] and proj.split()[-1] == "12"
    assert head.split()[2] == "2.18e+04x"


def test_the_watch_is_on_by_default_every_200th_step_and_densely_after_a_skip():
    from mpnb.numerics.watch import DENSE_STEPS, NumericsWatch

    assert NumericsWatch.check_every(True) == 200
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="True or a whole number of steps >= 1, got 0"):
        mpnb.Trainer(linear, torch.optim.SGD(linear.parameters()), dashboard=None, watch_numerics=0)
    from tests.conformance.models import gpt2_model

    model = gpt2_model(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    trainer = mpnb.Trainer(  # a scale of 2**40 overflows the first backward only
        model, torch.optim.SGD(model.parameters(), lr=1e-4), mode="fp16", device="cpu",
        dashboard=None, init_scale=2.0**40, backoff_factor=2.0**-30, flush_every=1,
        locate_overflow=False,
    )  # fmt: skip
    history = trainer.fit(gpt2_batches(12))
    assert history.skipped_steps == [1]
    assert trainer.numerics.steps == list(range(2, 2 + DENSE_STEPS))  # after the skip, densely
    off = mpnb.Trainer(linear, torch.optim.SGD(linear.parameters()), watch_numerics=False)
    assert off.numerics is None


def test_a_watch_that_sampled_no_step_says_why_instead_of_an_empty_table():
    model = torch.nn.Linear(4, 2)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
        mode="bf16", device="cpu", dashboard=None,
    )  # fmt: skip
    trainer.fit([(torch.randn(8, 4), torch.randn(8, 2))] * 3)  # short and clean: none sampled
    shown = str(trainer.numerics)
    assert trainer.numerics.steps == [] and "no step sampled" in shown and "module" not in shown
    assert "watch_numerics=1" in shown


def test_a_module_called_twice_is_measured_over_both_calls():
    # the second call's figures replaced the first's: a Linear whose first call reached 4e5
    # (past fp16) read 0.004, sorted as the module furthest from trouble
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            big = self.lin(x * 1e5)
            return self.head(big + self.lin(big * 0.0 + 1e-3))

    torch.manual_seed(0)
    model = Twice()
    with torch.no_grad():
        model.lin.weight.fill_(1.0)
        model.lin.bias.zero_()
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.0), nn.MSELoss(),
        mode="fp32", device="cpu", dashboard=None, watch_numerics=1,
    )  # fmt: skip
    trainer.fit([(torch.ones(2, 4), torch.zeros(2, 1))], max_steps=1)
    assert trainer.numerics.activation_max["lin"] == [4e5]
    report = mpnb.advise(model, (torch.ones(2, 4), torch.zeros(2, 1)), nn.MSELoss())
    assert [row.max_activation for row in report.rows if row.module == "lin"] == [4e5]
