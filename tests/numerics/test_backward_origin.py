"""Overflows made in backward, located: in a module's own backward under a ReLU that shares its
tensor, in a parameter's gradient only, and in a parent's own op (GPT-2's attention matmul).

Each planted case is checked against an independent reference built here from plain torch
hooks: per module, whether its parameters' gradients or its input gradients are the first
non-finite ones, in the order autograd computes them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpnb
from mpnb.numerics.origin import locate_nonfinite
from tests.conformance.models import gpt2_model


def first_nonfinite_parameter_gradient(model: nn.Module, loss: torch.Tensor) -> str:
    """The reference: the module whose parameter gradient autograd makes non-finite first
    (hooks on every parameter, in the order they fire), by name."""
    order: list[str] = []
    handles = [
        parameter.register_hook(
            lambda grad, name=name: order.append(name) if not torch.isfinite(grad).all() else None
        )
        for name, parameter in model.named_parameters()
    ]
    try:
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return order[0].rpartition(".")[0] if order else ""


def test_an_overflow_in_a_modules_backward_is_named_there_not_at_the_relu_sharing_its_tensor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    model[2].weight.data.mul_(1e3)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    origin = locate_nonfinite(
        model, lambda: F.cross_entropy(model(x), y), dtype=torch.float16, scale=2.0**16
    )
    assert origin is not None and origin.phase == "backward" and origin.kind == "overflow"
    assert origin.module == "Sequential.2", str(origin)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    reference = first_nonfinite_parameter_gradient(model, loss.float() * 2.0**16)
    assert reference in ("0", "2")  # the inf reaches layer 0's gradients through layer 2's


def test_an_overflow_in_a_parameters_gradient_only_is_named_in_its_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    x, y = torch.randn(32, 64) * 30, torch.randint(0, 4, (32,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    assert first_nonfinite_parameter_gradient(model, loss.float() * 2.0**16) == "1"
    origin = locate_nonfinite(
        model, lambda: F.cross_entropy(model(x), y), dtype=torch.float16, scale=2.0**16
    )
    assert origin is not None, "the replay must see the parameter gradient's overflow"
    assert origin.module == "Sequential.1" and origin.phase == "backward", str(origin)
    assert origin.kind == "overflow"


class Scores(nn.Module):
    """Attention scores as GPT-2's attention makes them: two projections (children) and the
    parent's own ops between them (a matmul of the two, then one with a mixing matrix of its
    own), which no child's hook surrounds."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key = nn.Linear(16, 16), nn.Linear(16, 16)
        self.mix = nn.Parameter(torch.eye(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.query(x) @ self.key(x).transpose(-1, -2)) @ self.mix


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.scores, self.head = nn.Linear(8, 16), Scores(), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scores(self.embed(x)))


def test_an_overflow_in_a_parents_own_backward_op_is_named_in_the_parent():
    torch.manual_seed(0)
    model = Net()
    scores = model.scores
    with torch.no_grad():  # tiny queries through a large mix: finite forward, a large gradient
        scores.query.weight.mul_(1e-4)
        scores.query.bias.mul_(1e-4)
        scores.mix.mul_(1e4)
    x, y = torch.randn(4, 12, 8), torch.randint(0, 3, (4, 12))

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    # the reference: the same ops by hand, gradients kept: the parent's product is the first
    # tensor of the backward whose gradient is not finite
    with torch.autocast("cpu", dtype=torch.float16):
        hidden = model.embed(x)
        product = scores.query(hidden) @ scores.key(hidden).transpose(-1, -2)
        out = product @ scores.mix
        product.retain_grad(), out.retain_grad()
        reference = F.cross_entropy(model.head(out).flatten(0, 1), y.flatten())
    assert torch.isfinite(reference)
    (reference.float() * 2.0**12).backward()
    assert torch.isfinite(out.grad).all() and not torch.isfinite(product.grad).all()
    model.zero_grad(set_to_none=True)

    origin = locate_nonfinite(model, loss, dtype=torch.float16, scale=2.0**12)
    assert origin is not None, "the backward overflows"
    assert (origin.module, origin.phase, origin.op) == ("Net.scores", "backward", "aten.mm"), str(
        origin
    )


def test_a_gpt2_backward_overflow_is_named_where_the_scaled_gradient_first_leaves_fp16():
    model = gpt2_model(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    origin = locate_nonfinite(
        model, lambda: model(input_ids=ids, labels=ids).loss, dtype=torch.float16, scale=2.0**20
    )
    assert str(origin).startswith("float16 overflow first in GPT2LMHeadModel.lm_head, backward")


def test_a_cast_that_overflows_names_the_module_that_made_the_values_and_its_remedy():
    """BERT's LayerNorm with its gain scaled: its fp32 output fits fp32, and overflows only
    when the next Linear casts it to fp16. The origin names the LayerNorm as the producer."""
    from tests.conformance.models import bert_model

    model = bert_model(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    norm = model.bert.encoder.layer[1].attention.output.LayerNorm
    with torch.no_grad():
        norm.weight.mul_(1e5)
    generator = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 96, (4, 16), generator=generator), torch.tensor([0, 1, 2, 0])
    with torch.autocast("cpu", dtype=torch.float16):  # the reference: the LayerNorm's own output
        made = []
        handle = norm.register_forward_hook(lambda m, i, out: made.append(out.detach()))
        model(input_ids=ids, labels=labels)
        handle.remove()
    assert made[0].dtype == torch.float32 and torch.isfinite(made[0]).all()
    assert made[0].abs().max() > 65504  # too large for fp16, made here
    origin = locate_nonfinite(
        model, lambda: model(input_ids=ids, labels=labels).loss, dtype=torch.float16
    )
    prefix = "BertForSequenceClassification.bert.encoder.layer.1."
    assert origin.module == prefix + "intermediate.dense" and origin.op == "aten._to_copy"
    assert origin.producer == prefix + "attention.output.LayerNorm"
    assert origin.producer_max == pytest.approx(float(made[0].abs().max()), rel=1e-3)
    assert "keep_in_fp32" not in origin.remedy()
    assert "attention.output.LayerNorm into fp16's range" in origin.remedy()


def test_the_first_skip_prints_where_and_what_to_call_in_a_script(capsys):
    from tests.numerics.test_origin import gpt2_batches, overflowing_gpt2

    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), mode="fp16", device="cpu",
        dashboard="text", init_scale=1.0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = trainer.fit(gpt2_batches(2))
    (origin,) = [e for e in history.events if e["kind"] == "origin"]
    call = 'trainer.keep_in_fp32("transformer.h.1.mlp.c_proj")'
    assert origin["remedy"] == call and origin["message"].endswith(f"remedy: {call}")
    printed = capsys.readouterr().out.splitlines()
    said = [i for i, line in enumerate(printed) if line.startswith("mpnb: step 1 skipped")]
    finished = next(i for i, line in enumerate(printed) if line.startswith("finished"))
    assert said and said[0] < finished  # printed as it happened, before the fit's summary
    assert "(aten.addmm): " in printed[said[0]] and call in printed[said[0]]


def _made_in_backward_by(module: nn.Module, run_backward) -> bool:
    """The reference from a plain full backward hook on ``module``: its output gradients finite,
    its input gradients not: the inf was made in its own backward."""
    seen = []
    handle = module.register_full_backward_hook(
        lambda m, grad_in, grad_out: seen.append(
            (
                all(torch.isfinite(g).all() for g in grad_out if g is not None),
                all(torch.isfinite(g).all() for g in grad_in if g is not None),
            )
        )
    )
    try:
        run_backward()
    finally:
        handle.remove()
    return seen == [(True, False)]


def test_a_berts_classifier_and_a_cnns_head_are_named_for_their_own_backward_overflows():
    """The classifier's weights x1e3: its backward (gradient times those weights) overflows fp16
    at a scale of 2**16; in BERT's classifier, and in the head of the example CNN."""
    import mpnb.examples as ex
    from tests.conformance.models import bert_model

    generator = torch.Generator().manual_seed(0)
    ids, labels = (
        torch.randint(0, 96, (8, 16), generator=generator),
        torch.tensor([0, 1, 2] * 2 + [0, 1]),
    )
    bert = bert_model(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    cnn = ex.DigitsCNN()
    images, digits = (
        torch.randn(32, 1, 8, 8, generator=generator),
        torch.randint(0, 10, (32,), generator=generator),
    )
    cases = [
        (bert, bert.classifier, lambda: bert(input_ids=ids, labels=labels).loss),
        (cnn, cnn.classifier, lambda: F.cross_entropy(cnn(images), digits)),
    ]
    for model, head, loss in cases:
        with torch.no_grad():
            head.weight.mul_(1e3)

        def run_backward(loss=loss, model=model):
            with torch.autocast("cpu", dtype=torch.float16):
                value = loss()
            (value.float() * 2.0**16).backward()
            model.zero_grad(set_to_none=True)

        assert _made_in_backward_by(head, run_backward)
        origin = locate_nonfinite(model, loss, dtype=torch.float16, scale=2.0**16)
        assert origin.phase == "backward" and origin.kind == "overflow", str(origin)
        assert origin.module == f"{type(model).__name__}.classifier", str(origin)


#: A GPT-2 whose second MLP takes planted outliers, its fp16 remedies for them applied: its next
#: overflow is made in backward by c_proj's matmul, on the very tensor the Dropout (p=0) after
#: it returned unchanged. Prints the module the first skip names.
_PASS_THROUGH_CHILD = """
import warnings
import torch, transformers
from torch import nn
import mpnb
warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = transformers.GPT2LMHeadModel(config)
model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
with torch.no_grad():
    for norm in (model.transformer.h[1].ln_2, model.transformer.ln_f):
        norm.weight[[3, 40]] *= 1e5
    model.transformer.h[1].mlp.c_fc.weight[[3, 40], :] /= 1e5
    model.lm_head.weight[:, [3, 40]] /= 1e5
ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
trainer = mpnb.Trainer(model, torch.optim.AdamW(model.parameters(), 1e-3), None, mode="fp16",
                       dashboard=None)
trainer.keep_in_fp32(["transformer.h.1.mlp.c_fc", "lm_head"])
trainer.fit([{"input_ids": ids, "labels": ids}] * 2)
from mpnb.numerics.origin import ORIGIN_KIND
print([e["module"] for e in trainer.history.events if e.get("kind") == ORIGIN_KIND][0])
"""


def test_a_backward_overflow_is_named_in_the_matmuls_module_not_a_dropout_passing_its_tensor():
    # the module running an op was the deepest the tracker held open, of two as deep the first
    # in its set's order: by string hashes, c_proj in some processes and the Dropout in others
    import subprocess
    import sys

    from tests.child_process import child_environment

    children = [
        subprocess.Popen(
            [sys.executable, "-c", _PASS_THROUGH_CHILD],
            env=child_environment(PYTHONHASHSEED=str(seed)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2, 3, 4)
    ]
    named = []
    for child in children:
        out, err = child.communicate(timeout=240)
        assert child.returncode == 0, err[-2000:]
        named.append(out.strip().splitlines()[-1])
    assert named == ["GPT2LMHeadModel.transformer.h.1.mlp.c_proj"] * 4, named
