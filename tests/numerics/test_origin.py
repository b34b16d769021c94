"""Where a step's first inf/NaN appeared, named: a replay of the step that watches every op in
execution order, forward and backward, and leaves the run exactly as it was."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mpnb
import mpnb.examples
from mpnb.numerics.origin import locate_nonfinite
from tests.conformance.models import gpt2_model


def overflowing_gpt2() -> nn.Module:
    """A GPT-2 from a small config whose second block's MLP projection overflows fp16: its input
    grown tenfold and its weights scaled to reach 30000 (still finite in fp16)."""
    model = gpt2_model(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    mlp = model.transformer.h[1].mlp
    with torch.no_grad():
        mlp.c_fc.weight.mul_(10)
        mlp.c_proj.weight.mul_(3e4 / mlp.c_proj.weight.abs().max())
    return model


def gpt2_batches(count: int = 3) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, 96, (4, 16), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return batches


def test_the_first_skipped_step_of_a_gpt2_names_the_projection_that_overflowed():
    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), mode="fp16", device="cpu",
        dashboard=None, init_scale=1.0,
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"collapsed .*\(step 1: float16 overflow first in"):
        history = trainer.fit(gpt2_batches())
    (origin,) = [event for event in history.events if event["kind"] == "origin"]
    assert origin["module"] == "GPT2LMHeadModel.transformer.h.1.mlp.c_proj"
    assert (origin["phase"], origin["op"], origin["problem"]) == (
        "forward",
        "aten.addmm",
        "overflow",
    )
    assert origin["would_be"] > origin["limit"] == 65504 and origin["step"] == 1


class DropoutBatchNormNet(nn.Module):
    """Dropout (random state) and BatchNorm (running statistics) before a block that overflows
    fp16 in backward once the loss is scaled."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.stem(images)).flatten(1))


def bn_run(locate: bool) -> tuple[mpnb.Trainer, torch.Tensor]:
    model = DropoutBatchNormNet()
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.01), nn.functional.cross_entropy,
        mode="fp16", device="cpu", dashboard=None, init_scale=2.0**30, locate_overflow=locate,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 3, 8, 8, generator=generator), torch.randint(0, 10, (16,), generator=generator))
        for _ in range(4)
    ]  # fmt: skip
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer.fit(data)
    return trainer, torch.get_rng_state()


def test_the_replay_leaves_weights_statistics_and_random_state_as_they_would_have_been():
    (located, located_rng), (plain, plain_rng) = bn_run(locate=True), bn_run(locate=False)
    assert located.history.skipped[0] and not plain.history.events
    (origin,) = [event for event in located.history.events if event["kind"] == "origin"]
    # a scale of 2**30 overflows where the loss's gradient is first cast to fp16, outside every
    # module; never in an uninitialised buffer (dropout's empty_like holds whatever memory held)
    assert (origin["phase"], origin["op"], origin["module"]) == ("backward", "aten._to_copy", "")
    assert origin["problem"] == "overflow" and origin["would_be"] > 65504
    for mine, theirs in zip(located.model.state_dict().values(), plain.model.state_dict().values()):
        assert torch.equal(mine, theirs)
    assert located.history.loss == plain.history.loss
    assert torch.equal(located_rng, plain_rng)  # dropout drew the same numbers afterwards
    assert not located.model.stem[0]._forward_hooks and not located.model._forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks


def test_a_bf16_nan_from_a_log_of_a_negative_is_located_in_its_module():
    class Planted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.logs, self.head = nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 2)

        def forward(self, x):
            hidden = self.encoder(x)
            return self.head(torch.log(hidden - 100.0))  # every value negative: NaN

    model = Planted()
    origin = locate_nonfinite(model, lambda: model(torch.randn(4, 8)).sum(), dtype=torch.bfloat16)
    assert (origin.module, origin.op, origin.phase, origin.kind) == (
        "Planted", "aten.log", "forward", "nan"
    )  # fmt: skip
    assert "bfloat16 NaN first in Planted, forward (aten.log)" == str(origin)


def test_a_step_that_stays_finite_has_no_origin():
    model = nn.Linear(4, 2)
    assert locate_nonfinite(model, lambda: model(torch.ones(3, 4)).sum(), scale=2.0**16) is None
    assert model.weight.grad is None


def gpt2_trainer() -> mpnb.Trainer:
    model = overflowing_gpt2()
    return mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), mode="fp16", device="cpu",
        dashboard=None, init_scale=1.0,
    )  # fmt: skip


def test_the_named_module_kept_in_fp32_stops_the_skips_from_the_next_step_of_the_same_fit():
    trainer = gpt2_trainer()

    def remedy_once_named():  # between steps, as a dashboard button's click is delivered
        origins = [e for e in trainer.history.events if e["kind"] == "origin"]
        if origins and not trainer._instruments.kept:
            trainer.keep_in_fp32(origins[0]["module"])

    trainer.control.pollers.append(remedy_once_named)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = trainer.fit(gpt2_batches(5))
    assert history.skipped == [True, False, False, False, False]
    switch = next(e for e in history.events if e["kind"] == "switch")
    assert switch["module"] == "transformer.h.1.mlp.c_proj" and switch["step"] == 2
    # the remedy lasted the fit: the module is as it was, and the next fit skips again
    trainer.control.pollers.remove(remedy_once_named)
    assert "forward" not in vars(trainer.model.transformer.h[1].mlp.c_proj)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert trainer.fit(gpt2_batches(1)).skipped[-1]


def test_a_session_reset_mid_fit_undoes_the_remedy_from_the_next_step():
    """A reset of the session (``%unload_ext mpnb`` and the switches' reset) puts every switch
    back, the remedy included: the module runs in fp16 again, and the step after skips again."""
    from mpnb.precision.policy import session

    trainer = gpt2_trainer()

    def remedy_then_reset():  # between steps, as clicks are delivered
        origins = [e for e in trainer.history.events if e["kind"] == "origin"]
        if origins and trainer.amp.steps == 1:
            trainer.keep_in_fp32(origins[0]["module"])
        if trainer.amp.steps == 3:
            session.reset()

    trainer.control.pollers.append(remedy_then_reset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = trainer.fit(gpt2_batches(5))
    assert history.skipped == [True, False, False, True, True]
    undone = [e for e in history.events if e["kind"] == "switch"][-1]
    assert undone["step"] == 4 and undone["message"] == (
        "transformer.h.1.mlp.c_proj runs under autocast again (the session was reset)"
    )
    assert not trainer._instruments.kept
    assert "forward" not in vars(trainer.model.transformer.h[1].mlp.c_proj)


def test_a_module_name_that_is_not_there_is_refused_with_the_closest_names():
    trainer = gpt2_trainer()
    with pytest.raises(
        mpnb.MpnbError,
        match=r"no module named 'transformer.h.1.mlp.cproj'; closest: transformer.h.1.mlp.c_proj",
    ):
        trainer.keep_in_fp32("transformer.h.1.mlp.cproj")
    assert not trainer.history.events and not trainer._instruments.kept


def test_a_t5_overflow_is_named_in_its_feed_forward_not_where_t5_makes_infs_on_purpose():
    """T5 in fp16 with its feed-forward scaled up (transformers' known T5 fp16 overflow). T5's
    attention takes the log of 0 to bucket relative positions and masks the -inf away: a value
    that stays inside its module is no origin."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))

    def loss():
        return model(input_ids=ids, labels=ids).loss

    assert locate_nonfinite(model, loss, dtype=torch.float16) is None  # as built: finite
    feed_forward = model.encoder.block[1].layer[1].DenseReluDense
    with torch.no_grad():
        feed_forward.wi.weight.mul_(30)
        feed_forward.wo.weight.mul_(3e4 / feed_forward.wo.weight.abs().max())
    origin = locate_nonfinite(model, loss, dtype=torch.float16)
    assert origin.module == "T5ForConditionalGeneration.encoder.block.1.layer.1.DenseReluDense.wo"
    assert (origin.phase, origin.op, origin.kind) == ("forward", "aten.mm", "overflow")


def test_a_batchnorm_resnets_planted_overflow_is_named_in_its_convolution_not_its_batchnorm():
    """A BatchNorm ResNet in fp16 whose second block's second convolution overflows: the origin
    is that convolution, not the BatchNorm that receives its infs and normalises them to NaN."""
    from tests.conformance.models import SmallResNet

    torch.manual_seed(0)
    model = SmallResNet()
    with torch.no_grad():
        model.layers[1].conv2.weight.mul_(3e5)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.01), nn.functional.cross_entropy,
        mode="fp16", device="cpu", dashboard=None, init_scale=1.0,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(4, 3, 16, 16, generator=generator),
        torch.randint(0, 10, (4,), generator=generator),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = trainer.fit([batch])
    (origin,) = [event for event in history.events if event["kind"] == "origin"]
    assert origin["module"] == "SmallResNet.layers.1.conv2"
    assert (origin["phase"], origin["problem"]) == ("forward", "overflow")
    assert history.skipped == [True]


class LogOfNegatives(nn.Module):
    """A module that makes NaN where its inputs are negative (a planted bf16 NaN)."""

    def forward(self, x):
        return torch.log(x)


def test_a_bf16_fits_nan_loss_is_followed_to_the_module_and_op_that_make_it():
    """bf16 has no scaler and skips nothing: the first NaN loss, seen at a flush, has the next
    step watched as it trains, which names the log that makes the NaN (its input stayed finite)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogOfNegatives(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].bias.fill_(-10.0)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=lambda m, b: m(b).float().mean(),
        mode="bf16", device="cpu", dashboard=None, flush_every=1,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = trainer.fit([torch.ones(8, 4)] * 4)
    (origin,) = [event for event in history.events if event["kind"] == "origin"]
    assert origin["step"] == 2 and "watched after step 1's loss was nan" in origin["message"]
    assert (origin["module"], origin["op"], origin["problem"]) == (
        "Sequential.1",
        "aten.log",
        "nan",
    )
    assert torch._C._len_torch_dispatch_stack() == 0


def replay_failing_run(error: BaseException) -> tuple[mpnb.Trainer, BaseException | None]:
    """An fp16 fit of one overflowing step whose loss function raises ``error`` on its second
    call: the first skip's replay."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    calls = 0

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise error
        return nn.functional.mse_loss(out, target)

    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.01), loss_fn, mode="fp16", dashboard=None
    )
    overflowing = (torch.full((3, 4), 1e4), torch.zeros(3, 2))
    raised = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit([overflowing, (torch.randn(3, 4), torch.zeros(3, 2))])
        except BaseException as caught:  # what reached the caller, an interrupt too
            raised = caught
    return trainer, raised


def test_a_replay_that_fails_is_noted_and_the_fit_goes_on_with_every_row():
    trainer, raised = replay_failing_run(RuntimeError("out of memory in the replay"))
    assert raised is None
    assert trainer.history.step == [1, 2]
    assert trainer.history.skipped == [True, False]
    origin_notes = [e["message"] for e in trainer.history.events if e["kind"] == "origin"]
    assert len(origin_notes) == 1
    assert "replay" in origin_notes[0] and "out of memory in the replay" in origin_notes[0]
    assert torch._C._len_torch_dispatch_stack() == 0  # the replay left nothing on


def test_an_interrupt_in_the_replay_ends_the_fit_with_the_skipped_steps_row_kept():
    trainer, raised = replay_failing_run(KeyboardInterrupt())
    assert isinstance(raised, KeyboardInterrupt)
    assert trainer.amp.steps == 1
    assert trainer.history.step == [1]
    assert trainer.history.skipped == [True]


def test_an_overflow_in_the_models_own_forward_is_remedied_inside_the_model_not_at_the_loss():
    """An op of the top-level forward overflows before any loss: casting the loss up cannot
    help; the whole model in fp32 (its name is "") or bf16 can."""
    from mpnb.numerics.origin import Origin

    own = Origin("W", "aten.mul", "forward", "overflow", "float16", 1e7, 65504.0)
    assert (
        own.remedy()
        == 'trainer.keep_in_fp32("") (the whole model: the op is in its own forward), or train in bf16'
    )
    outside = Origin("", "aten.mse_loss", "forward", "overflow", "float16", 1e7, 65504.0)
    assert outside.remedy().startswith("compute the loss in fp32")


def test_a_skip_the_loss_scale_alone_made_is_said_to_be_loss_scaling_at_work():
    # init_scale=2**24: the first skip's remedy read "compute the loss in fp32 ... or train in
    # bf16", where the loss's gradient is 0.014 and only the scale takes it past 65504
    trainer, train, _ = mpnb.examples.example_trainer(
        "fp16", model="mlp", init_scale=2.0**24, dashboard=None
    )
    history = trainer.fit(train, max_steps=2)
    (first,) = [event for event in history.events if event["kind"] == "origin"]
    assert first["scale"] == 2.0**24 and first["phase"] == "backward"
    assert (
        "remedy: none: the loss scale (16777216) alone takes these gradients past"
        in (first["message"])
    )
    assert "GradScaler halves it at each skipped step" in first["remedy"]
    assert "init_scale=2097152" in first["remedy"]
    # an overflow the unscaled values make too is the model's, whatever the scale
    from mpnb.numerics.origin import Origin

    own = Origin("M.fc", "aten.mm", "backward", "overflow", "float16", 1e12, 65504.0, scale=1024.0)
    assert own.remedy() == 'trainer.keep_in_fp32("fc")'


def test_a_nan_float32_makes_itself_is_remedied_at_its_op_and_the_trainer_is_named():
    # a bf16 Trainer's NaN loss from a log of a negative read "remedy:
    # callback.keep_in_fp32("feat.0")": no callback in a Trainer, and fp32 makes the NaN too
    from mpnb.numerics.instruments import fit_instruments
    from mpnb.numerics.origin import NextStepsLocator

    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.feat = nn.Linear(4, 1), nn.Sequential(Log())

        def forward(self, x):
            return self.head(x) + self.feat(x - 10.0).sum(1, keepdim=True)

    torch.manual_seed(0)
    model = Net()
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.01), lambda out, target: out.sum(),
        mode="bf16", device="cpu", dashboard=None, flush_every=1,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = trainer.fit([(torch.ones(2, 4), torch.zeros(2, 1))] * 6)
    (origin,) = [event for event in history.events if event["kind"] == "origin"]
    assert origin["dtype"] == "float32" and origin["op"] == "aten.log"
    assert origin["remedy"].startswith("fix the computation: aten.log makes it in float32 itself")
    owners = {
        replays: next(
            i.owner
            for i in fit_instruments(model, "cpu", replays=replays)
            if isinstance(i, NextStepsLocator)
        )
        for replays in (True, False)
    }
    assert owners == {True: "trainer", False: "callback"}


def test_an_overflow_in_a_loss_that_is_a_module_is_outside_every_module_of_the_model():
    # named "BigLoss" (the loss module's class, as if it were the model's root), with the
    # remedy trainer.keep_in_fp32("") for the whole model, which keep_in_fp32 then refused
    class BigLoss(nn.Module):
        def forward(self, out, target):
            return (out * 1e5).float().sum()  # its gradient, 1e5, is past fp16's range unscaled

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.b(self.a(x)) * 1e-3

    torch.manual_seed(0)
    model = Net()
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.0), BigLoss(), mode="fp16",
        init_scale=1.0, device="cpu", dashboard=None,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = trainer.fit([(torch.ones(2, 4), torch.zeros(2, 1))] * 2)
    origin = next(event for event in history.events if event["kind"] == "origin")
    assert origin["module"] == "" and "outside every module (the loss?)" in origin["message"]
    assert origin["remedy"].startswith("compute the loss in fp32")
