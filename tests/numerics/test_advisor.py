"""The numerics advisor finds planted fp16 problems and stays quiet on a benign model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mpnb
from mpnb.numerics.limits import FP16_LARGEST_FINITE


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


BATCH = (torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 4)


def test_planted_activation_overflow_is_reported_with_bf16_or_fp32_list_advice():
    model = mlp()
    with torch.no_grad():
        model[0].weight.mul_(1e5)  # activations far beyond fp16's 65504
    report = mpnb.advise(model, BATCH, F.cross_entropy, device="cpu")
    assert report.fp16_overflow[0] == "0" and report.rows[0].max_activation > FP16_LARGEST_FINITE
    assert math.isinf(report.rows[0].output_error["fp16"]) and math.isfinite(
        report.rows[0].output_error["bf16"]
    )
    assert any(
        line.startswith("fp16 overflow in 0 (Linear)") and "bf16" in line and "FP32 list" in line
        for line in report.advice
    )
    assert report.recommended_dtype == "bf16"


def test_planted_gradient_underflow_is_reported_as_fixed_by_loss_scaling():
    report = mpnb.advise(mlp(), BATCH, lambda out, y: F.cross_entropy(out, y) * 1e-9, device="cpu")
    assert report.underflow == ["0", "1", "2"] and report.rows[0].underflow_share > 0.5
    assert any(
        "gradient underflow in 2" in line and "loss scaling" in line for line in report.advice
    )
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
    assert largest * report.init_scale <= FP16_LARGEST_FINITE
    assert any("would overflow on the first step" in line for line in report.advice)


def test_views():
    report = mpnb.advise(mlp(), BATCH, F.cross_entropy, device="cpu")
    assert str(report).splitlines()[0].startswith("module") and "<table>" in report._repr_html_()
    figure = report.figure()
    assert list(figure.data[0].y) == ["0", "1", "2"] and len(figure.data[0].x) == 5


def _bn_dropout_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.Dropout(0.5),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )


def test_the_model_and_torchs_random_state_are_left_exactly_as_found():
    model = _bn_dropout_model()
    model[4].eval()  # a mixed train/eval model: each flag must come back as it was
    F.cross_entropy(model(BATCH[0]), BATCH[1]).backward()  # the user's own gradients
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    mpnb.advise(model, BATCH, F.cross_entropy, device="cpu")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items()), (
        "buffers or weights changed"
    )
    assert [m.training for m in model] == [True, True, True, True, False]
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert torch.equal(torch.get_rng_state(), rng)


def test_every_pass_draws_the_same_dropout_masks_so_the_report_is_repeatable():
    model = _bn_dropout_model()
    first = mpnb.advise(model, BATCH, F.cross_entropy, device="cpu")
    second = mpnb.advise(model, BATCH, F.cross_entropy, device="cpu")
    assert [r.values() for r in first.rows] == [r.values() for r in second.rows]
    dropout = next(r for r in first.rows if r.kind == "Dropout")
    assert dropout.output_error["bf16"] < 0.02, "different masks per pass read as a 100% error"


def test_gpt2s_low_precision_error_is_the_real_one_not_dropout_noise():
    transformers = __import__("pytest").importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)  # dropout 0.1 everywhere, in training mode
    ids = torch.randint(0, 96, (2, 12))
    report = mpnb.advise(
        model, (ids, ids), lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    )
    errors = [r.output_error["fp16"] for r in report.rows if math.isfinite(r.output_error["fp16"])]
    assert errors and max(errors) < 0.05, max(errors)


def test_non_persistent_buffers_come_back_too():
    model = _bn_dropout_model()
    model.register_buffer("calls", torch.zeros(()), persistent=False)
    model.register_forward_hook(lambda module, inputs, output: module.calls.add_(1) and None)
    mpnb.advise(model, BATCH, F.cross_entropy, device="cpu")
    assert model.calls.item() == 0


def test_a_backward_the_caller_built_before_still_runs_after():
    model = _bn_dropout_model().eval()
    pending = F.cross_entropy(model(BATCH[0]), BATCH[1])
    mpnb.advise(model, BATCH, F.cross_entropy, device="cpu")
    pending.backward()  # no "modified by an inplace operation"
    assert all(p.grad is not None for p in model.parameters())


def test_a_model_spread_over_devices_is_refused_before_anything_moves():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, device="meta"), torch.nn.Linear(8, 4))
    weight = model[1].weight.clone()
    with pytest.raises(mpnb.MpnbError, match="meta.*cpu|cpu.*meta"):
        mpnb.advise(model, BATCH, F.cross_entropy, device="cpu")
    assert model[1].weight.device.type == "cpu" and torch.equal(model[1].weight, weight)


class _Recurrent(torch.nn.Module):
    """A GRU (a leaf module that returns a tuple) and a linear head."""

    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(8, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.gru(x)[0].mean(1))


def test_advise_reads_the_same_modules_as_the_numerics_watch_tuple_outputs_included():
    from mpnb.numerics.watch import NumericsWatch

    model = _Recurrent()
    batch = (torch.randn(4, 5, 8), torch.randint(0, 2, (4,)))
    advice = mpnb.advise(model, batch, torch.nn.functional.cross_entropy, device="cpu")
    watch = NumericsWatch(model, 1)
    assert [row.module for row in advice.rows] == watch.log.modules == ["gru", "head"]
    gru = advice.rows[0]
    assert gru.max_activation > 0 and gru.max_gradient > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_callers_autocast_reaches_no_pass(dtype):
    """A notebook session in %amp bf16 runs each cell under autocast: each of advise's passes
    must be in its own precision, the backward too (it crashed with mixed dtypes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    plain = mpnb.advise(model, batch, F.cross_entropy)
    with torch.autocast("cpu", dtype=dtype):
        under = mpnb.advise(model, batch, F.cross_entropy)
    assert str(under) == str(plain)


def test_a_compiled_model_is_advised_under_its_own_layer_names():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    compiled = torch.compile(model, backend="eager")
    compiled(batch[0])
    assert [row.module for row in mpnb.advise(compiled, batch, F.cross_entropy).rows] == [
        "0",
        "1",
        "2",
    ]


def test_a_model_that_computes_its_own_loss_is_advised_from_a_dict_batch():
    # as the Trainer and whatif take a Hugging Face model: no loss_fn, the batch as keywords
    from tests.conformance.models import gpt2_model

    model = gpt2_model(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    report = mpnb.advise(model, {"input_ids": ids, "labels": ids}, device="cpu")
    assert report.recommended_dtype in ("bf16", "fp16")
    assert any(row.module.endswith("mlp.c_fc") for row in report.rows)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_loss_not_finite_in_fp32_is_said_not_reported_as_a_clean_bill(bad):
    # the advice read "No fp16 overflow or gradient underflow found on this batch."
    from mpnb.errors import MpnbError

    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with pytest.raises(MpnbError, match=rf"the loss is {bad:g} in fp32"):
        mpnb.advise(torch.nn.Linear(6, 3), (x, y), lambda o, t: F.cross_entropy(o, t) * bad)


def test_advise_runs_inside_a_no_grad_block_as_it_does_outside():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    batch = (torch.randn(8, 6), torch.randint(0, 3, (8,)))
    outside = mpnb.advise(model, batch, F.cross_entropy)
    with torch.no_grad():
        inside = mpnb.advise(model, batch, F.cross_entropy)
        assert not torch.is_grad_enabled()  # the caller's block is as it was after advise
    assert torch.is_grad_enabled()
    assert [row.module for row in inside.rows] == [row.module for row in outside.rows]
    assert inside.advice == outside.advice


def test_a_model_that_is_one_layer_is_named_as_the_model_in_the_advice():
    # the advice read "fp16 overflow in  (Linear)"
    model = torch.nn.Linear(6, 3)
    with torch.no_grad():
        model.weight.mul_(1e5)
    report = mpnb.advise(model, (torch.randn(8, 6), torch.randint(0, 3, (8,))), F.cross_entropy)
    assert report.fp16_overflow == [""]  # its name as named_modules and keep_in_fp32 give it
    assert any(line.startswith("fp16 overflow in (the model) (Linear)") for line in report.advice)


def test_a_batch_on_the_meta_device_is_named_before_the_pass():
    # met torch's "Cannot copy out of meta tensor; no data!" from inside the pass
    from mpnb.errors import MpnbError

    batch = (torch.randn(8, 6).to("meta"), torch.randint(0, 3, (8,)).to("meta"))
    with pytest.raises(MpnbError, match=r"meta device \(shaped \(8, 6\)\).*advise measures"):
        mpnb.advise(torch.nn.Linear(6, 3), batch, F.cross_entropy)


def test_a_frozen_model_or_a_loss_of_several_values_is_refused_in_mpnbs_words():
    # torch's "element 0 of tensors does not require grad" came out of the reference pass
    from mpnb.errors import MpnbError

    model = mlp()
    model.requires_grad_(False)
    with pytest.raises(MpnbError, match="the loss does not require grad"):
        mpnb.advise(model, BATCH, F.cross_entropy)
    with pytest.raises(MpnbError, match=r"a single number, got a tensor of shape \(32,\)"):
        mpnb.advise(mlp(), BATCH, lambda o, t: F.cross_entropy(o, t, reduction="none"))
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())


@pytest.mark.parametrize("with_loss_fn", [True, False])
def test_data_given_for_a_batch_is_named_with_the_line_that_takes_one(with_loss_fn):
    # a DataLoader read "each batch must be an (inputs, targets) pair ... leave loss_fn out",
    # and without loss_fn met torch's "linear(): argument 'input' must be Tensor, not DataLoader"
    from mpnb.errors import MpnbError

    x, y = BATCH
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    loss_fn = F.cross_entropy if with_loss_fn else None
    for call in (mpnb.advise, mpnb.whatif):
        with pytest.raises(MpnbError, match=r"takes one batch, not the data \(a DataLoader\): "
                           r"batch = next\(iter\(data\)\)"):  # fmt: skip
            call(mlp(), loader, loss_fn)


def test_a_weight_gradient_past_fp16s_range_is_an_fp16_overflow_in_its_module():
    # activations of 4 and output gradients of 1000, but a weight gradient of 6.4e7: fp16's
    # backward made an inf weight gradient at scale 1, and advise said "No fp16 overflow"
    model = torch.nn.Sequential(torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e-3)
        model[0].bias.zero_()
    batch = (torch.full((64, 4), 1000.0), torch.zeros(64, 1))
    report = mpnb.advise(model, batch, lambda out, target: 1000.0 * (out - target).sum())
    assert report.fp16_overflow == ["0"]
    assert any(
        line.startswith("fp16 overflow in 0 (Linear): values reach 6.4e+07")
        for line in report.advice
    )
    assert "No fp16 overflow" not in " ".join(report.advice)
