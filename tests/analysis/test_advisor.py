"""The numerics advisor finds planted fp16 problems and stays quiet on a benign model."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import mpnb
from mpnb.analysis.advisor import FP16_MAX


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


BATCH = (torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 4)


def test_planted_activation_overflow_is_reported_with_bf16_or_fp32_list_advice():
    model = mlp()
    with torch.no_grad():
        model[0].weight.mul_(1e5)  # activations far beyond fp16's 65504
    report = mpnb.advise(model, BATCH, F.cross_entropy, device="cpu")
    assert report.fp16_overflow[0] == "0" and report.rows[0].max_activation > FP16_MAX
    assert math.isinf(report.rows[0].output_error["fp16"]) and math.isfinite(report.rows[0].output_error["bf16"])
    assert any(
        line.startswith("fp16 overflow in 0 (Linear)") and "bf16" in line and "FP32 list" in line
        for line in report.advice
    )
    assert report.recommended_dtype == "bf16"


def test_planted_gradient_underflow_is_reported_as_fixed_by_loss_scaling():
    report = mpnb.advise(mlp(), BATCH, lambda out, y: F.cross_entropy(out, y) * 1e-9, device="cpu")
    assert report.underflow == ["0", "1", "2"] and report.rows[0].underflow_share > 0.5
    assert any("gradient underflow in 2" in line and "loss scaling" in line for line in report.advice)
    assert not report.fp16_overflow


def test_a_benign_model_gets_no_warning_and_a_safe_init_scale():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    report = mpnb.advise(model, BATCH, F.cross_entropy, device="cpu")
    assert not report.fp16_overflow and not report.underflow
    assert "No fp16 overflow or gradient underflow" in report.advice[1]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and all(
        p.grad is None for p in model.parameters()
    )
    assert all(row.output_error["bf16"] < 0.05 for row in report.rows)


def test_large_gradients_get_an_init_scale_that_avoids_the_first_step_overflow():
    report = mpnb.advise(mlp(), BATCH, lambda out, y: F.cross_entropy(out, y) * 1e3, device="cpu")
    assert report.init_scale < 2.0**16
    largest = max(r.max_gradient for r in report.rows)
    assert largest * report.init_scale <= FP16_MAX
    assert any("would overflow on the first step" in line for line in report.advice)


def test_views():
    report = mpnb.advise(mlp(), BATCH, F.cross_entropy, device="cpu")
    assert str(report).splitlines()[0].startswith("module") and "<table>" in report._repr_html_()
    figure = report.figure()
    assert list(figure.data[0].y) == ["0", "1", "2"] and len(figure.data[0].x) == 5
