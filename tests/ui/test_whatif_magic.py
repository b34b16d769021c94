"""``%whatif`` through a real InteractiveShell: the same result as ``mpnb.whatif``, a Trainer's
last batch, and bad input said as a UsageError naming what is valid."""

from __future__ import annotations

import pytest

from mpnb.numerics.whatif import WhatIf
from tests.conftest import run, usage_error

pytest.importorskip("torchao")

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
batch = (torch.randn(32, 8), torch.randint(0, 2, (32,)))
loss_fn = torch.nn.functional.cross_entropy
"""


def test_whatif_on_a_model_and_batch_is_mpnb_whatif(ip):
    run(ip, SETUP)
    result = run(ip, "%whatif model batch --loss loss_fn --formats fp16 bf16")
    assert isinstance(result, WhatIf)
    assert result.layers == ["0", "2"] and result.formats == ("fp16", "bf16")
    direct = run(
        ip,
        "mpnb_direct = __import__('mpnb').whatif(model, batch, loss_fn, ['fp16', 'bf16'])\nmpnb_direct",
    )
    assert [r["rel_error"] for r in result.rows] == [r["rel_error"] for r in direct.rows]
    assert "fp16: keep none" in result._repr_html_()


def test_whatif_on_a_trainer_takes_its_last_batch(ip):
    run(
        ip,
        SETUP
        + "import mpnb\ntrainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, device='cpu', dashboard=None)",
    )
    assert "has taken no batch yet" in usage_error(ip, "%whatif trainer")
    run(ip, "_ = trainer.fit([batch], max_steps=1)")
    result = run(ip, "%whatif trainer --formats bf16")
    assert result.layers == ["0", "2"]


def test_bad_input_names_the_valid_values(ip):
    run(ip, SETUP)
    assert "unknown format 'int4'; valid: fp16, bf16, fp8" in usage_error(
        ip, "%whatif model batch --loss loss_fn --formats int4"
    )
    assert "cannot read 'nothing'" in usage_error(ip, "%whatif nothing batch")
    assert "give a batch after the model" in usage_error(ip, "%whatif model")


def test_a_loss_given_with_a_trainer_is_refused_not_ignored(ip):
    run(
        ip,
        SETUP
        + "import mpnb\ntrainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, device='cpu', dashboard=None)\n"
        + "_ = trainer.fit([batch], max_steps=1)",
    )
    said = usage_error(ip, "%whatif trainer --loss loss_fn")
    assert "--loss" in said and "trainer's own loss" in said


def test_a_batch_written_as_an_expression_with_spaces_is_one_argument(ip):
    run(ip, SETUP + "x, y = batch")
    result = run(ip, "%whatif model (x, y) --loss loss_fn --formats bf16")
    named = run(ip, "%whatif model batch --loss loss_fn --formats bf16")
    assert [r["rel_error"] for r in result.rows] == [r["rel_error"] for r in named.rows]
    result = run(ip, "%whatif model [x[:16], y[:16]] --loss loss_fn --formats bf16")
    assert result.layers == ["0", "2"]
    said = usage_error(ip, "%whatif model (x, y --loss loss_fn")  # never closed: all of it
    assert "cannot read '(x, y --loss loss_fn'" in said
