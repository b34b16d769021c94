"""A loss or an argument a fit cannot use is a clear error, raised before anything changes: a
loss that is not a tensor, not one number or not differentiable; a model output with no loss;
data that is not batches; a fractional number of epochs or micro-batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import mpnb
from mpnb.errors import MpnbError

from .test_training import linear_problem, mse


def test_a_one_element_output_that_is_not_0_dim_is_not_taken_for_a_loss():
    model = nn.Linear(4, 1)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), mode="fp32", device="cpu", dashboard=None
    )
    with pytest.raises(MpnbError, match=r"returned a tensor of shape \(1, 1\) with no loss"):
        trainer.fit([torch.randn(1, 4)])


@pytest.mark.parametrize(
    "step_fn, message",
    [
        (lambda m, b: m(b).sum().item(), "the loss must be a tensor, got float"),
        (lambda m, b: None, "the loss must be a tensor, got NoneType"),
        (lambda m, b: m(b), r"single number, got a tensor of shape \(2, 1\)"),
        (lambda m, b: m(b).sum().detach(), "does not require grad"),
        (lambda m, b: (m(b).sum(), 1), "the loss must be a tensor, got tuple"),
        # backward would take its real part alone
        (lambda m, b: m(b).sum() * 1j, "must be a real number, got a torch.complex64"),
    ],
)
def test_a_loss_that_cannot_train_is_a_clear_error_and_changes_nothing(step_fn, message):
    model = nn.Linear(4, 1)
    weight = model.weight.detach().clone()
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), 0.1),
        step_fn=step_fn,
        mode="fp32",
        device="cpu",
        dashboard=None,
    )
    with pytest.raises(MpnbError, match=message):
        trainer.fit([torch.randn(2, 4)])
    assert (
        torch.equal(model.weight, weight)
        and trainer.amp.between_steps
        and model.weight.grad is None
    )


def test_bad_fit_arguments_are_refused():
    model, data = linear_problem(steps=2)
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), 0.1),
        mse,
        mode="fp32",
        device="cpu",
        dashboard=None,
    )
    with pytest.raises(MpnbError, match="data must be an iterable of batches .* got NoneType"):
        trainer.fit(None)
    with pytest.raises(ValueError, match="epochs must be a whole number >= 1, got 1.5"):
        trainer.fit(data, epochs=1.5)
    with pytest.raises(
        ValueError,
        match=r"accumulate must be a whole number >= 1 \(micro-batches an optimizer step\), got 1.5",
    ):
        mpnb.AmpStep(trainer.optimizer, accumulate=1.5)
    assert len(trainer.history) == 0


@pytest.mark.parametrize("taker", ["Trainer", "whatif"])
def test_a_loss_class_given_for_a_loss_is_named_with_the_instance_to_pass(taker):
    # a class is callable: called with (outputs, targets) it fails inside torch, far away
    model = nn.Linear(4, 2)
    with pytest.raises(MpnbError, match=r"got the class CrossEntropyLoss.*CrossEntropyLoss\(\)"):
        if taker == "Trainer":
            optimizer = torch.optim.SGD(model.parameters(), 0.1)
            mpnb.Trainer(model, optimizer, nn.CrossEntropyLoss, device="cpu", dashboard=None)
        else:
            batch = (torch.randn(3, 4), torch.tensor([0, 1, 0]))
            mpnb.whatif(model, batch, nn.CrossEntropyLoss)


def test_arguments_in_the_wrong_place_are_named_in_one_line_with_the_order():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(MpnbError) as swapped:
        mpnb.Trainer(model, mse, optimizer, device="cpu", dashboard=None)
    said = str(swapped.value)
    assert "\n" not in said and "Trainer(model, optimizer, loss_fn)" in said
    with pytest.raises(MpnbError, match=r"optimizer takes a torch.optim.Optimizer .*the class SGD"):
        mpnb.Trainer(model, torch.optim.SGD, mse, device="cpu", dashboard=None)
    trainer = mpnb.Trainer(model, optimizer, mse, device="cpu", dashboard=None)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with pytest.raises(ValueError) as tensors:
        trainer.fit(x, y)  # the scikit-learn habit: x and y, where fit takes batches
    said = str(tensors.value)
    assert "\n" not in said and "a Tensor shaped (8, 2)" in said and "fit([(x, y)])" in said


def test_a_torch_dtype_names_its_mode_as_it_names_autocasts_dtype():
    model = nn.Linear(4, 2)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), mse,
        mode=torch.bfloat16, device="cpu", dashboard=None,
    )  # fmt: skip
    assert trainer.mode.name == "bf16"
    with pytest.raises(mpnb.InvalidChoiceError, match="unknown mode 'float8_e4m3fn'; valid: off"):
        mpnb.Trainer(model, torch.optim.SGD(model.parameters()), mse, mode=torch.float8_e4m3fn)


class ScalerUpdateInterrupted(torch.amp.GradScaler):
    """A real GradScaler whose first update() is interrupted halfway (a Ctrl-C inside it)."""

    interrupted = False

    def update(self, new_scale=None):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        super().update(new_scale)


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("init_scale", 0, "init_scale must be a number above"),
        ("init_scale", -1.0, "init_scale must be a number above"),
        ("init_scale", float("nan"), "init_scale must be a number above"),
        ("init_scale", float("inf"), "init_scale must be a number above"),
        ("growth_factor", 0.5, "growth_factor must be a number above 1"),
        ("backoff_factor", 1.5, "backoff_factor must be a number above .* and below 1"),
        ("growth_interval", 1.5, r"growth_interval must be a whole number above 0 .*, got 1.5"),
        ("growth_interval", -5, r"growth_interval must be a whole number above 0 .*, got -5"),
        ("min_scale", "a", r"min_scale must be a number above 0 .*, got 'a'"),
        ("clip_grad_norm", "1", r"clip_grad_norm must be a number above 0 .*, got '1'"),
        ("flush_every", 2.5, r"flush_every must be a whole number above 0 .*, got 2.5"),
        ("record_grad_norm", "no", "record_grad_norm must be True or False, got 'no'"),
        ("locate_overflow", "no", "locate_overflow must be True or False, got 'no'"),
        ("scheduler", "cosine", "scheduler must be a learning-rate scheduler .* got 'cosine'"),
    ],
)
def test_a_bad_trainer_option_is_refused_when_the_trainer_is_built(option, value, message):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(MpnbError, match=message):
        mpnb.Trainer(model, optimizer, mse, mode="fp16", dashboard=None, **{option: value})
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_a_scheduler_of_another_optimizer_is_refused():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    other = torch.optim.SGD(nn.Linear(4, 2).parameters(), 0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(other, 1)
    with pytest.raises(MpnbError, match="the scheduler steps another optimizer"):
        mpnb.Trainer(model, optimizer, mse, dashboard=None, scheduler=scheduler)


def test_a_given_scaler_with_a_growth_interval_torch_cannot_use_is_refused():
    model = nn.Linear(4, 2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1.5)
    with pytest.raises(MpnbError, match="growth_interval must be a whole number above 0"):
        mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="fp16",
                     dashboard=None, scaler=scaler)  # fmt: skip


def test_a_module_name_that_is_no_string_is_refused_by_keep_in_fp32():
    model = nn.Sequential(nn.Linear(4, 2))
    trainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, dashboard=None)
    with pytest.raises(MpnbError, match="keep_in_fp32 takes a module's name.*got 0"):
        trainer.keep_in_fp32(0)


@pytest.mark.parametrize("value", ["off", 2, None])
def test_tf32_takes_only_true_or_false_and_changes_nothing_otherwise(value):
    before = torch.get_float32_matmul_precision()
    with pytest.raises(MpnbError, match=f"tf32 must be True or False, got {value!r}"):
        mpnb.tf32(value)
    assert torch.get_float32_matmul_precision() == before


def test_an_interrupted_scaler_update_leaves_the_next_fit_able_to_step():
    model, data = linear_problem(steps=2)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="fp16", dashboard=None,
        scaler=ScalerUpdateInterrupted("cpu"),
    )  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data)
    assert trainer.history.step == [1]
    history = trainer.fit(data)
    assert history.step == [1, 2]  # torch refused it: "step() has already been called"


@pytest.mark.parametrize(
    "option, value",
    [
        ("init_scale", np.float32(1024)),
        ("init_scale", np.int64(1024)),
        ("init_scale", torch.tensor(1024.0)),
        ("growth_interval", np.int64(100)),
        ("growth_factor", np.float32(2)),
        ("clip_grad_norm", np.float32(1.0)),
        ("clip_grad_norm", math.inf),  # torch's way to measure the norm without clipping
        ("flush_every", np.int64(4)),
        ("record_grad_norm", np.bool_(True)),
        ("record_grad_norm", 1),
    ],
)
def test_numbers_and_flags_torch_takes_are_taken(option, value):
    model, data = linear_problem(steps=2)
    trainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="fp16",
                           dashboard=None, **{option: value})  # fmt: skip
    assert trainer.fit(data).step == [1, 2]


@pytest.mark.parametrize(
    "option, value",
    [
        ("init_scale", 1e-50),  # 0 in float32: weights trained to NaN
        ("init_scale", 1e39),  # inf in float32
        ("init_scale", 2**1024),  # no float at all
        ("backoff_factor", 1e-50),  # one skip and the scale is 0
        ("growth_factor", 1e300),
        ("growth_interval", 2**70),
    ],
)
def test_scaler_settings_outside_float32_are_refused(option, value):
    model = nn.Linear(4, 2)
    with pytest.raises(MpnbError, match=f"{option} must be a "):
        mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="fp16",
                     dashboard=None, **{option: value})  # fmt: skip


def test_a_float_subclass_is_judged_by_its_value_not_its_comparisons():
    class AlwaysBigger(float):
        def __gt__(self, other):
            return True

        def __lt__(self, other):
            return True

    model = nn.Linear(4, 2)
    with pytest.raises(MpnbError, match="init_scale must be a number above"):
        mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="fp16",
                     dashboard=None, init_scale=AlwaysBigger(-5.0))  # fmt: skip


def test_a_used_scaler_whose_scale_underflowed_is_refused_naming_its_scale():
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict({**scaler.state_dict(), "scale": 0.0})
    model = nn.Linear(4, 2)
    with pytest.raises(
        MpnbError, match="scale must be a number above .*the scaler's loss scale now"
    ):
        mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="fp16",
                     dashboard=None, scaler=scaler)  # fmt: skip


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda o: torch.optim.lr_scheduler.StepLR, "scheduler must be a learning-rate scheduler"),
        (lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o), r"step\(\) needs metrics"),
    ],
)
def test_a_scheduler_mpnb_cannot_step_is_refused(make, message):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(MpnbError, match=message):
        mpnb.Trainer(model, optimizer, mse, dashboard=None, scheduler=make(optimizer))


def test_an_optimizer_whose_step_needs_a_closure_is_refused():
    model = nn.Linear(4, 2)
    with pytest.raises(MpnbError, match=r"LBFGS.step\(\) needs closure"):
        mpnb.Trainer(model, torch.optim.LBFGS(model.parameters()), mse, dashboard=None)


def test_dashboard_false_means_no_dashboard(capsys):
    model, data = linear_problem(steps=2)
    trainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, dashboard=False)
    trainer.fit(data)
    assert trainer.dashboard is None and capsys.readouterr().out == ""


def test_keep_in_fp32_takes_the_list_the_advice_gives_and_checks_every_name_first():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    trainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="bf16",
                           dashboard=None)  # fmt: skip
    _, data = linear_problem(steps=2)

    def kept_in_the_next_fit():
        events = trainer.fit(data).events
        return [e["message"] for e in events if e["message"].endswith("(autocast off inside it)")]

    with pytest.raises(MpnbError, match="no module named '9'"):
        trainer.keep_in_fp32(["0", "9"])
    assert kept_in_the_next_fit() == []  # the good name was not kept either
    assert trainer.keep_in_fp32(["0", "2"]) == ["0", "2"]
    assert len(kept_in_the_next_fit()) == 2


def test_keep_as_an_option_of_an_autocast_mode_points_to_keep_in_fp32():
    model = nn.Linear(6, 3)
    with pytest.raises(MpnbError, match=r"trainer.keep_in_fp32\(names\)"):
        mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="bf16",
                     keep=["0"], dashboard=None)  # fmt: skip


def test_every_bad_count_is_an_mpnb_error_that_except_mpnberror_catches():
    model, data = linear_problem(steps=2)
    trainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, dashboard=None)
    for bad in (lambda: trainer.fit(data, epochs=0), lambda: trainer.fit(data, max_steps=-1),
                lambda: mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse,
                                     accumulate=0)):  # fmt: skip
        with pytest.raises(MpnbError):
            bad()


@pytest.mark.parametrize("off", [False, 0, np.False_])
def test_dashboard_false_set_after_construction_means_no_dashboard(off, capsys):
    model, data = linear_problem(steps=2)
    trainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, dashboard="text")
    trainer.dashboard = off
    trainer.fit(data)
    assert capsys.readouterr().out == ""


def test_keep_in_fp32_takes_any_iterable_of_names():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    trainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="bf16",
                           dashboard=None)  # fmt: skip
    assert trainer.keep_in_fp32(name for name in ["0", "2"]) == ["0", "2"]


@pytest.mark.parametrize("count", [np.int64(2), np.int32(2), torch.tensor(2)])
def test_counts_take_numpy_and_one_element_integer_tensors_as_the_numbers_they_are(count):
    model, data = linear_problem(steps=3)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    amp = mpnb.AmpStep(optimizer, accumulate=count)
    assert amp.accumulate == 2 and type(amp.accumulate) is int
    trainer = mpnb.Trainer(model, optimizer, mse, device="cpu", dashboard=None)
    trainer.fit(data, epochs=count, max_steps=count)
    assert len(trainer.history) == 2
    result = mpnb.compare(
        lambda mode: (
            mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mse, mode=mode,
                         device="cpu", dashboard=None),
            data,
        ),
        modes=["fp32"], steps=count, warmup=count - 1, block=count, progress=None,
    )  # fmt: skip
    assert result.steps == 2 and type(result.steps) is int


@pytest.mark.parametrize("given", [2.0, 0, -1, True, "2", torch.tensor([2, 2]), np.float64(2)])
def test_a_count_that_is_not_a_whole_number_above_zero_is_refused_naming_it(given):
    model, data = linear_problem(steps=2)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(MpnbError, match=r"accumulate must be a whole number >= 1 \(micro-batches"):
        mpnb.AmpStep(optimizer, accumulate=given)
    trainer = mpnb.Trainer(model, optimizer, mse, device="cpu", dashboard=None)
    with pytest.raises(MpnbError, match="epochs must be a whole number >= 1, got "):
        trainer.fit(data, epochs=given)
    assert len(trainer.history) == 0


def test_amp_step_refuses_a_history_or_sink_that_is_not_one_when_built():
    model, _ = linear_problem(steps=1)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(MpnbError, match="history takes an mpnb History .*, got list"):
        mpnb.AmpStep(optimizer, mode="bf16", device="cpu", history=[])
    with pytest.raises(MpnbError, match="sinks take mpnb Sink objects .*, got int 1"):
        mpnb.AmpStep(optimizer, mode="bf16", device="cpu", sinks=[1])


@pytest.mark.parametrize("samples", ["8", -1, 2.5])
def test_a_micro_batchs_examples_must_be_a_count(samples):
    model, data = linear_problem(steps=1)
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), 0.1), mode="bf16", device="cpu")
    x, y = data[0]
    with pytest.raises(MpnbError, match="samples must be a whole number >= 0 .*examples"):
        amp.train_step(lambda: mse(model(x), y), samples=samples)
    assert amp.train_step(lambda: mse(model(x), y), samples=np.int64(8))  # a numpy count


def test_watch_numerics_and_locate_overflow_are_refused_as_mpnb_errors_by_the_loops():
    from mpnb.integrations.loop_telemetry import LoopTelemetry

    with pytest.raises(MpnbError, match="watch_numerics must be True or a whole number"):
        LoopTelemetry("test", dashboard=None, watch_numerics=0)
    with pytest.raises(MpnbError, match="locate_overflow must be True or False"):
        LoopTelemetry("test", dashboard=None, locate_overflow="x")


@pytest.mark.parametrize("taker", ["Trainer", "whatif"])
def test_a_loss_fn_that_cannot_take_outputs_and_targets_is_refused_at_once(taker):
    # met at the first step as Python's "takes 1 positional argument but 2 were given"
    model = nn.Linear(4, 2)
    batch = (torch.randn(3, 4), torch.randn(3, 2))

    def loss_of(output):
        return output.float().pow(2).mean()

    with pytest.raises(MpnbError) as refused:
        if taker == "Trainer":
            optimizer = torch.optim.SGD(model.parameters(), 0.1)
            mpnb.Trainer(model, optimizer, loss_of, device="cpu", dashboard=None)
        else:
            mpnb.whatif(model, batch, loss_of)
    said = str(refused.value)
    assert "loss_of(output)" in said and "loss_fn(outputs, targets)" in said
    assert "step_fn" in said if taker == "Trainer" else "step_fn" not in said
    # what can take both stays taken: defaults, *args, a loss module, a builtin-backed partial
    for fine in (
        lambda output, target, weight=None: output.float().sub(target).pow(2).mean(),
        lambda *parts: parts[0].float().sub(parts[1]).pow(2).mean(),
        nn.MSELoss(),
        mse,
    ):
        mpnb.whatif(model, batch, fine, formats="bf16")


def test_ampstep_given_the_model_first_says_it_takes_the_optimizer_alone():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(MpnbError) as refused:
        mpnb.AmpStep(model, optimizer)
    said = str(refused.value)
    assert "AmpStep(optimizer, mode=...)" in said and "Linear" in said
    with pytest.raises(MpnbError, match=r"options by name.*AmpStep\(optimizer, mode='bf16'\)"):
        mpnb.AmpStep(optimizer, "bf16")


def test_the_loops_take_counts_as_the_trainer_does_numpy_integers_included():
    from mpnb.integrations.loop_telemetry import LoopTelemetry
    from mpnb.numerics.watch import NumericsWatch

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    said = {}
    for taker in ("Trainer", "loop"):
        with pytest.raises(MpnbError) as refused:
            if taker == "Trainer":
                mpnb.Trainer(model, optimizer, mse, dashboard=None, flush_every=2.5)
            else:
                LoopTelemetry("test", dashboard=None, flush_every=2.5)
        said[taker] = str(refused.value)
    assert said["Trainer"] == said["loop"]  # one wording for one option
    loop = LoopTelemetry("test", dashboard=None, flush_every=np.int64(8))
    assert type(loop.recorder.flush_every) is int and loop.recorder.flush_every == 8
    assert NumericsWatch.check_every(np.int64(50)) == 50
    assert type(NumericsWatch.check_every(np.int64(50))) is int
    with pytest.raises(MpnbError, match="watch_numerics must be True or a whole number"):
        NumericsWatch.check_every(np.float64(50.0))


def test_one_batch_given_to_fit_for_its_data_is_named():
    # fit((x, y)) trained on x then y as batches: "each batch must be an (inputs, targets) pair,
    # got a tensor of shape (32, 8)", naming nothing of the mistake
    model = torch.nn.Linear(8, 2)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), torch.nn.functional.cross_entropy,
        mode="fp32", device="cpu", dashboard=None,
    )  # fmt: skip
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    with pytest.raises(
        MpnbError, match=r"fit takes an iterable of batches: for one batch, fit\(\[\(x, y\)\]\)"
    ):
        trainer.fit((x, y))


def test_a_backward_of_the_loss_itself_before_an_ampstep_step_is_named():
    # "AmpStep.step() called with no backward(loss) since the previous step" hid the mistake
    from mpnb.training import AmpStep

    model = torch.nn.Linear(4, 1)
    amp = AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="fp16", device="cpu")
    with amp.autocast():
        loss = model(torch.ones(8, 4)).float().mean()
    loss.backward()
    with pytest.raises(RuntimeError, match=r"call amp.backward\(loss\), not loss.backward\(\)"):
        amp.step()
