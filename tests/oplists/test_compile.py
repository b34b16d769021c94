"""torch.compile follows the op lists: a list change takes effect at the next call of compiled code."""

from __future__ import annotations

import pytest
import torch

import mpnb
from mpnb.oplists import OpLists


class Block(torch.nn.Module):
    """Linear, LayerNorm and softmax: ops torch lowers, keeps, and leaves alone on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.linear(x)
        return hidden, torch.softmax(self.norm(hidden), -1)


def _under_autocast(model):
    def run(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    return run


def _dtypes(outputs):
    return [t.dtype for t in outputs]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_code_follows_every_list_change(backend):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(4, 8)
    eager = _under_autocast(model)
    compiled = torch.compile(_under_autocast(model), backend=backend)

    def agree(expected_dtypes):
        assert _dtypes(eager(x)) == expected_dtypes  # the lists as torch runs them, uncompiled
        result = compiled(x)
        assert _dtypes(result) == expected_dtypes
        torch.testing.assert_close(result, eager(x), atol=2e-2, rtol=2e-2)

    try:
        agree([torch.bfloat16, torch.bfloat16])
        mpnb.set_oplists(OpLists.of(fp32=["linear", "softmax"]))
        agree([torch.float32, torch.float32])
        mpnb.set_oplists(OpLists.of(fp32=["softmax"]))
        agree([torch.bfloat16, torch.float32])
        mpnb.set_oplists(OpLists())
        agree([torch.bfloat16, torch.bfloat16])
        with mpnb.autocast("bf16", device="cpu", fp32=["linear"]):
            agree([torch.float32, torch.float32])
        agree([torch.bfloat16, torch.bfloat16])  # the block's lists do not outlive it
    finally:
        mpnb.set_oplists(OpLists())
        torch.compiler.reset()
