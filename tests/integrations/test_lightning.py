"""MpnbCallback inside a real Lightning Trainer on CPU."""

from __future__ import annotations

import statistics
import time
import warnings

import pytest
import torch
from torch import nn

import mpnb

L = pytest.importorskip("lightning", reason="the lightning extra: pip install 'mpnb[lightning]'")

from mpnb.errors import InvalidChoiceError  # noqa: E402
from mpnb.integrations.lightning import MpnbCallback, precision  # noqa: E402
from tests.integrations.sinks import StopAt  # noqa: E402


class Classifier(L.LightningModule):
    """A small MLP; keeps every loss its training_step returned."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.losses: list[float] = []

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self.net(inputs), targets)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(96, 16, generator=generator), torch.randint(0, 4, (96,), generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=8)


def quiet_trainer(*callbacks, **options) -> L.Trainer:
    """A CPU Lightning Trainer with ``callbacks`` and nothing else: no logger, checkpoints or bars."""
    return L.Trainer(
        accelerator="cpu",
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def fit(
    callback,
    setting: str = "32-true",
    max_steps: int = 5,
    module=None,
    validation=None,
    **trainer_options,
):
    """Fit ``module`` (a fresh Classifier by default); returns the trainer, the module and mpnb's warnings."""
    torch.manual_seed(0)
    module = module if module is not None else Classifier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet_trainer(callback, precision=setting, max_steps=max_steps, **trainer_options)
        trainer.fit(module, loader(), validation)
    fit.caught = [w for w in caught if str(w.message).startswith("mpnb:")]
    return trainer, module, [str(w.message) for w in fit.caught]


def test_bf16_mixed_rows_hold_the_training_steps_losses():
    callback = MpnbCallback(dashboard=None)
    trainer, module, said = fit(callback, "bf16-mixed")
    history = callback.history
    assert len(history) == trainer.global_step == 5
    assert history.loss == pytest.approx(module.losses, rel=1e-6)
    assert history.mode == ["bf16"] * 5 and history.lr == [0.1] * 5
    assert history.samples_per_s[-1] == pytest.approx(8 / history.step_time[-1])
    assert said == []


def test_accumulated_batches_make_one_row_with_their_mean_loss():
    callback = MpnbCallback(dashboard=None)
    trainer, module, _ = fit(callback, "bf16-mixed", max_steps=3, accumulate_grad_batches=2)
    assert len(callback.history) == trainer.global_step == 3
    pairs = [sum(module.losses[i : i + 2]) / 2 for i in range(0, 6, 2)]
    assert callback.history.loss == pytest.approx(pairs, rel=1e-6)


def test_16_mixed_on_cpu_is_recorded_as_the_bf16_lightning_runs_with_a_warning():
    callback = MpnbCallback(dashboard=None, precision="16-mixed")
    trainer, _, said = fit(callback, "16-mixed", max_steps=2)
    assert trainer.precision == "bf16-mixed"  # Lightning's own rewrite
    assert callback.history.mode == ["bf16", "bf16"]
    assert said == [
        "mpnb: Lightning was asked for fp16 but trains in bf16 (read from autocast and the weights during the forward pass)"
    ]
    assert [e["kind"] for e in callback.history.events] == ["run", "precision_mismatch"]


def test_stop_ends_training_at_the_next_step():
    callback = MpnbCallback(dashboard=None, flush_every=1)
    callback.telemetry.recorder.attach(StopAt(callback, 2))
    trainer, module, _ = fit(callback, "bf16-mixed", max_steps=10)
    assert trainer.global_step == len(callback.history) == 2
    assert len(module.losses) == 2
    assert not callback.telemetry.running


class StopAtStep(L.Callback):
    """Presses mpnb's Stop from another callback's on_train_batch_end, after mpnb's own has run."""

    def __init__(self, mpnb_callback: MpnbCallback, step: int) -> None:
        self.mpnb_callback, self.step = mpnb_callback, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.mpnb_callback.control.stop()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_stop_pressed_after_mpnbs_hook_ran_still_ends_training_at_that_step(accumulate):
    """Stop reaches Lightning when it is pressed, not at mpnb's next hook: the step it was pressed
    in is the last, whatever the order of the callbacks."""
    callback = MpnbCallback(dashboard=None)
    trainer = quiet_trainer(
        callback,
        StopAtStep(callback, 2),
        precision="bf16-mixed",
        max_steps=10,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(Classifier(), loader())
    assert trainer.global_step == len(callback.history) == 2
    assert not callback.telemetry.running and not callback.control.on_state


def test_an_exception_in_training_takes_the_hooks_off():
    class Failing(Classifier):
        def training_step(self, batch, batch_index):
            if batch_index == 2:
                raise ValueError("broken batch")
            return super().training_step(batch, batch_index)

    callback = MpnbCallback(dashboard=None)
    module = Failing()
    trainer = quiet_trainer(callback, max_steps=5)
    with pytest.raises(ValueError, match="broken batch"):
        trainer.fit(module, loader())
    assert len(callback.history) == 2 and callback.history.mode == ["fp32", "fp32"]
    assert not callback.telemetry.running
    assert not any(m._forward_pre_hooks for m in module.modules())
    assert not trainer.optimizers[0]._optimizer_step_post_hooks


def test_precision_strings_follow_the_session_and_refuse_what_lightning_lacks():
    from mpnb.precision.policy import session

    assert precision("fp16") == "16-mixed"
    session.set_mode("bf16", "cpu")
    assert precision() == "bf16-mixed"
    with pytest.raises(InvalidChoiceError, match="'off'"):
        precision("off")
    session.set_mode("off")
    assert precision() == "32-true"  # the session changes nothing: Lightning's own default


def test_a_part_filled_last_window_records_the_mean_of_its_own_batches():
    """12 batches, accumulating 5: windows of 5, 5 and 2; Lightning divides the last by 5 too."""
    callback = MpnbCallback(dashboard=None)
    trainer, module, _ = fit(
        callback, "bf16-mixed", max_steps=-1, max_epochs=1, accumulate_grad_batches=5
    )
    assert len(callback.history) == trainer.global_step == 3
    windows = [module.losses[0:5], module.losses[5:10], module.losses[10:12]]
    assert callback.history.loss == pytest.approx([sum(w) / len(w) for w in windows], rel=1e-5)


@pytest.mark.parametrize(
    ("setting", "name"), [("bf16-true", "bf16-true"), ("32-true", "fp32"), ("64-true", "fp64")]
)
def test_true_precisions_are_recorded_from_the_weights_without_a_warning(setting, name):
    callback = MpnbCallback(dashboard=None)
    _, _, said = fit(callback, setting, max_steps=2)
    assert callback.history.mode == [name, name] and said == []


def test_an_unknown_precision_setting_is_refused_when_the_callback_is_made():
    with pytest.raises(InvalidChoiceError, match="'bf16-mixd'.*bf16-mixed"):
        MpnbCallback(dashboard=None, precision="bf16-mixd")


class Manual(Classifier):
    """Manual optimization, a GAN's shape: the first optimizer steps ``first_steps`` times in every
    ``every``-th batch, a second one (with ``optimizers=2``) once in every batch. Returns the last
    loss, or None with ``returns_loss=False``."""

    def __init__(
        self, optimizers: int = 1, first_steps: int = 1, every: int = 1, returns_loss: bool = False
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.optimizer_count, self.first_steps, self.every, self.returns_loss = (
            optimizers,
            first_steps,
            every,
            returns_loss,
        )

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        optimizers = self.optimizers() if self.optimizer_count > 1 else [self.optimizers()]
        plan = [(optimizers[0], self.first_steps if batch_index % self.every == 0 else 0)]
        plan += [(optimizer, 1) for optimizer in optimizers[1:]]
        for optimizer, steps in plan:
            for _ in range(steps):
                loss = nn.functional.cross_entropy(self.net(inputs), targets)
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
        return loss if self.returns_loss else None

    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.1) for _ in range(self.optimizer_count)]


def test_manual_optimization_without_a_returned_loss_is_recorded_as_unknown_loss():
    callback = MpnbCallback(dashboard=None, on_nonfinite="stop")
    trainer, _, said = fit(callback, max_steps=3, module=Manual())
    assert trainer.global_step == len(callback.history) == 3
    assert (
        callback.history.loss_missing == [True] * 3 and callback.history.summary()["alarms"] == []
    )
    assert len(said) == 1 and "no loss" in said[0]
    assert fit.caught[0].filename == __file__  # the warning points here, not at mpnb


def test_validation_during_training_is_left_out_of_step_times_and_epochs_are_recorded():
    class SlowValidation(Classifier):
        def validation_step(self, batch, batch_index):
            time.sleep(0.1)

    callback = MpnbCallback(dashboard=None)
    fit(
        callback, max_steps=-1, module=SlowValidation(), validation=loader(), max_epochs=2, limit_train_batches=4,
        val_check_interval=2, limit_val_batches=3, num_sanity_val_steps=0,
    )  # fmt: skip
    history = callback.history
    assert len(history) == 8 and history.epoch == [0, 0, 0, 0, 1, 1, 1, 1]
    after_validation = [
        history.step_time[i] for i in (2, 4, 6)
    ]  # steps 3, 5 and 7 follow validations
    others = statistics.median(history.step_time[i] for i in (1, 3, 5, 7))
    assert max(after_validation) < others + 0.15, history.step_time  # each validation slept 0.3 s


def test_a_second_optimizer_is_said_to_go_unrecorded():
    callback = MpnbCallback(dashboard=None)
    _, _, said = fit(callback, max_steps=4, module=Manual(optimizers=2))
    assert any("2 optimizers" in message and "first one only" in message for message in said), said
    assert len(callback.history) == 2  # Lightning counts both optimizers' steps: 4 steps, 2 batches


def fp16_with_scaler() -> L.pytorch.plugins.precision.MixedPrecision:
    """Lightning's fp16 AMP plugin with a real GradScaler, on the CPU (``"16-mixed"`` becomes bf16 there)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))


class StepsOfFirstOptimizer(L.Callback):
    """The truth: the first optimizer's real steps, counted by a hook of its own."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.steps = 0
        self.handle = trainer.optimizers[0].register_step_post_hook(
            lambda *_: setattr(self, "steps", self.steps + 1)
        )

    def on_train_end(self, trainer, pl_module) -> None:
        self.handle.remove()


@pytest.mark.parametrize(
    ("optimizers", "first_steps", "every"),
    [(2, 1, 1), (1, 2, 1), (2, 1, 2)],
    ids=["gan-shape", "two-steps-a-batch", "first-every-second-batch"],
)
def test_manual_optimization_records_each_step_of_the_first_optimizer_and_no_false_skip(
    optimizers, first_steps, every
):
    """Under a GradScaler with no overflow: one row per real step of the first optimizer, none skipped
    (the second optimizer's hooks once reset the first one's watch: every row read as skipped)."""
    callback, truth = MpnbCallback(dashboard=None), StepsOfFirstOptimizer()
    trainer = quiet_trainer(
        callback, truth, plugins=[fp16_with_scaler()], max_epochs=1, limit_train_batches=4
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Manual(optimizers, first_steps, every, returns_loss=True), loader())
    history = callback.history
    assert truth.steps == 4 * first_steps // every
    assert len(history) == truth.steps and history.skipped_steps == []
    assert history.loss_scale == [1024.0] * truth.steps


class Skipping(Classifier):
    """Overflows at its 3rd batch; returns no loss at its 5th (Lightning then skips the optimizer)."""

    def training_step(self, batch, batch_index):
        loss = super().training_step(batch, batch_index)
        if batch_index == 2:
            return loss * float("inf")
        return None if batch_index == 4 else loss


def test_a_step_lightning_skips_for_want_of_a_loss_is_not_recorded_as_an_overflow():
    callback = MpnbCallback(dashboard=None)
    trainer = quiet_trainer(callback, plugins=[fp16_with_scaler()], max_steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Skipping(), loader())
    history = callback.history
    assert len(history) == 6 and history.skipped_steps == [3]  # the overflow only
    assert history.loss_missing == [False, False, False, False, True, False]
    assert history.loss_scale == [1024.0] * 3 + [512.0] * 3  # the one backoff, at the overflow


def test_a_stop_pressed_inside_an_accumulation_window_ends_training_as_lightnings_own_stop_does():
    """Lightning stops after the running batch and drops the unfinished window: the step before is
    the last, and the rows say so, whichever callback pressed Stop first."""

    class StopInStep3(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 4:  # the first of step 3's two batches
                callback.control.stop()

    for order in ("mpnb first", "mpnb last"):
        callback = MpnbCallback(dashboard=None)
        callbacks = (
            [callback, StopInStep3()] if order == "mpnb first" else [StopInStep3(), callback]
        )
        trainer = quiet_trainer(*callbacks, max_steps=10, accumulate_grad_batches=2)
        trainer.fit(Classifier(), loader())
        assert trainer.global_step == len(callback.history) == 2, order
        assert not callback.telemetry.running


class FirstOptimizerOnlyInEpoch0(Manual):
    batches = 0

    def training_step(self, batch, batch_index):
        self.first_steps = 1 if self.current_epoch == 0 else 0
        self.batches += 1
        return super().training_step(batch, batch_index)


def test_stop_reaches_lightning_when_the_first_optimizer_no_longer_steps():
    class StopAtEpoch1(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.current_epoch == 1 and batch_idx == 2:
                callback.control.stop()

    callback = MpnbCallback(dashboard=None)
    trainer = quiet_trainer(callback, StopAtEpoch1(), max_epochs=5, limit_train_batches=6)
    module = FirstOptimizerOnlyInEpoch0(optimizers=2)
    trainer.fit(module, loader())
    assert (
        trainer.should_stop and module.batches == 6 + 3
    )  # Lightning stopped after the batch Stop was pressed in
    assert len(callback.history) == 6  # the first optimizer's steps, all in epoch 0


def test_a_batch_cut_short_by_on_train_batch_start_is_not_counted_into_the_next_step():
    class EndEpochAtBatch3(Classifier):
        def on_train_batch_start(self, batch, batch_index):
            return -1 if batch_index == 3 else None

    callback = MpnbCallback(dashboard=None)
    fit(callback, max_steps=-1, module=EndEpochAtBatch3(), max_epochs=2)
    history = callback.history
    assert len(history) == 6 and history.epoch == [0, 0, 0, 1, 1, 1]
    assert [
        rate * time for rate, time in zip(history.samples_per_s, history.step_time)
    ] == pytest.approx([8] * 6)


def test_validation_inside_an_accumulation_window_keeps_the_windows_own_time_and_leaves_its_own_out():
    """Validation every 2 batches, steps of 4: the batches before it belong to the step's time."""

    class Slow(Classifier):
        def training_step(self, batch, batch_index):
            time.sleep(0.05)
            return super().training_step(batch, batch_index)

        def validation_step(self, batch, batch_index):
            time.sleep(0.1)

    callback = MpnbCallback(dashboard=None)
    fit(
        callback, max_steps=2, module=Slow(), validation=loader(), accumulate_grad_batches=4, val_check_interval=2,
        limit_val_batches=3, num_sanity_val_steps=0,
    )  # fmt: skip
    history = callback.history
    assert len(history) == 2
    for step_time, rate in zip(history.step_time, history.samples_per_s):
        assert 0.2 <= step_time < 0.2 + 0.25, (
            history.step_time
        )  # 4 batches of 50 ms; each validation slept 0.3 s
        assert rate == pytest.approx(32 / step_time)


class Float8Classifier(L.LightningModule):
    """Lightning's torchao pattern: the Linear layers converted to float8 training in
    ``configure_model`` (emulated on a CPU), the first and last kept, as torchao's examples do."""

    layer = "Float8Linear"

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
        self.ran: set[str] = set()

    def configure_model(self) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        last = str(len(self.net) - 1)
        convert_to_float8_training(
            self.net,
            config=Float8LinearConfig(emulate=True),
            module_filter_fn=lambda module, name: (
                name not in ("0", last)
                and module.in_features % 16 == 0
                and module.out_features % 16 == 0
            ),
        )
        for module in self.net:
            module.register_forward_pre_hook(lambda m, args: self.ran.add(type(m).__name__))

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        return nn.functional.cross_entropy(self.net(inputs).float(), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MxClassifier(Float8Classifier):
    """The same pattern with MXFP8: the Linear layers swapped in ``configure_model`` by
    ``mpnb.mx_layers`` (torchao's MXFP8Linear, emulated on a CPU)."""

    layer = "MXFP8Linear"

    def configure_model(self) -> None:
        layers = mpnb.mx_layers(self.net, device="cpu")
        if layers.converted:
            layers.convert()
        for module in self.net:
            module.register_forward_pre_hook(lambda m, args: self.ran.add(type(m).__name__))


@pytest.mark.parametrize(
    "classifier, widths, asked, mode, notice",
    [
        (Float8Classifier, (32, 64, 64, 16), None, "fp8", None),  # bf16-mixed + float8 layers
        (Float8Classifier, (32, 64, 64, 16), "fp8", "fp8", None),
        (
            Float8Classifier,
            (32, 64, 16),
            "fp8",
            "bf16",
            "asked for fp8 but trains in bf16: no layer",
        ),
        (MxClassifier, (32, 64, 64, 16), "mxfp8", "mxfp8", None),
        (MxClassifier, (32, 64, 64, 16), None, "mxfp8", None),  # bf16-mixed + MX layers
        (
            MxClassifier,
            (32, 48, 16),
            "mxfp8",
            "bf16",
            "asked for mxfp8 but trains in bf16: no layer",
        ),
    ],
)
def test_layers_converted_in_configure_model_are_read_as_their_mode(
    classifier, widths, asked, mode, notice
):
    pytest.importorskip("torchao.float8", reason="fp8 and mxfp8 need torchao (mpnb[fp8])")
    callback = MpnbCallback(dashboard=None, precision=asked)
    module = classifier(widths)
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(24, 32, generator=generator), torch.randint(0, 16, (24,), generator=generator)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet_trainer(callback, precision="bf16-mixed", max_steps=3)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    said = [str(w.message) for w in caught if str(w.message).startswith("mpnb:")]
    assert callback.history.mode == [mode] * 3
    assert (classifier.layer in module.ran) == (mode != "bf16")
    if notice is None:
        assert said == []
    else:
        assert len(said) == 1 and notice in said[0]
        assert [e["kind"] for e in callback.history.events][-1] == "precision_mismatch"


def test_a_fit_resumed_from_a_checkpoint_numbers_its_steps_on(tmp_path):
    trainer, _, _ = fit(MpnbCallback(dashboard=None), "bf16-mixed", max_steps=3)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    resumed = MpnbCallback(dashboard=None)
    again = quiet_trainer(resumed, precision="bf16-mixed", max_steps=5)
    again.fit(Classifier(), loader(), ckpt_path=tmp_path / "step3.ckpt")
    assert resumed.history.step == [4, 5] and again.global_step == 5
