"""The module probe: its hooks read a call's gradient and never change it."""

from __future__ import annotations

import torch
from torch import nn

from mpnb.numerics.probe import ModuleProbe


def _gradients(on_output, on_gradient=None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with ModuleProbe(model, ["0", "2"], on_output, on_gradient):
        model(torch.randn(3, 4)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_function_of_the_calls_gradient_reads_it_and_never_replaces_it():
    plain = _gradients(lambda *call: None)
    seen = []

    def on_output(name, module, inputs, output):
        return lambda grad: seen.append(name) or grad * 0  # returns a tensor: must be ignored

    assert all(torch.equal(a, b) for a, b in zip(_gradients(on_output), plain, strict=True))
    assert seen == ["2", "0"]


def test_the_by_name_gradient_callback_reads_it_and_never_replaces_it():
    plain = _gradients(lambda *call: None)
    seen = []

    def on_gradient(name, grad):
        seen.append(name)
        return grad * 0

    gradients = _gradients(lambda *call: None, on_gradient)
    assert all(torch.equal(a, b) for a, b in zip(gradients, plain, strict=True))
    assert seen == ["2", "0"]
