"""MpnbCallback inside a real transformers.Trainer: a GPT-2 from a small config, on CPU."""

from __future__ import annotations

import statistics
import time
import warnings

import pytest
import torch

pytest.importorskip(
    "transformers", reason="the transformers extra: pip install 'mpnb[transformers]'"
)
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from transformers import Trainer, TrainingArguments

from mpnb.errors import InvalidChoiceError
from mpnb.integrations.transformers import MpnbCallback, precision_args
from tests.conformance.models import gpt2_model
from tests.integrations.sinks import StopAt


def token_data(count: int = 64, length: int = 12) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 96, (count, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def train(
    callback,
    mode: str,
    tmp_path,
    max_steps: int = 6,
    accumulate: int = 1,
    data=None,
    trainer=Trainer,
    also=(),
    **options,
):
    compute_metrics = options.pop("compute_metrics", None)
    args = TrainingArguments(
        str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=accumulate,
        max_steps=max_steps,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **precision_args(mode),
        **options,
    )
    trainer = trainer(
        model=gpt2_model(),
        args=args,
        train_dataset=data or token_data(),
        eval_dataset=token_data(16),
        callbacks=[callback, *also],
        compute_metrics=compute_metrics,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if str(w.message).startswith("mpnb:")]
    return trainer, said


def logged(trainer, key: str) -> list[float]:
    return [
        entry[key]
        for entry in trainer.state.log_history
        if key in entry and "train_runtime" not in entry
    ]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_bf16_rows_are_the_trainers_own_steps_losses_and_learning_rates(tmp_path, accumulate):
    callback = MpnbCallback(dashboard=None)
    trainer, said = train(callback, "bf16", tmp_path, accumulate=accumulate)
    history = callback.history
    assert len(history) == trainer.state.global_step == 6
    assert history.loss == pytest.approx(logged(trainer, "loss"), rel=1e-6)
    assert history.lr == pytest.approx(logged(trainer, "learning_rate"), rel=1e-9)
    assert history.mode == ["bf16"] * 6
    assert history.loss_scale == [1.0] * 6 and history.skipped_steps == []
    assert all(rate > 0 for rate in history.samples_per_s)
    assert history.samples_per_s[-1] == pytest.approx(8 * accumulate / history.step_time[-1])
    assert said == []


def test_fp16_on_cpu_is_reported_as_what_really_runs(tmp_path):
    callback = MpnbCallback(dashboard=None)
    trainer, said = train(callback, "fp16", tmp_path, max_steps=3)
    observed = callback.history.mode[
        0
    ]  # read from autocast, whatever this transformers version does on CPU
    assert callback.history.mode == [observed] * 3
    assert callback.history.loss == pytest.approx(logged(trainer, "loss"), rel=1e-6)
    if observed == "fp16":  # older stacks: fp16 autocast and no scaler
        assert any("without loss scaling" in message for message in said)
    else:
        assert said == [
            f"mpnb: transformers.Trainer was asked for fp16 but trains in {observed} (read from autocast and the weights during the forward pass)"
        ]
        assert [event["kind"] for event in callback.history.events] == ["run", "precision_mismatch"]


def test_autocast_left_on_around_the_trainer_is_said_and_so_is_fp16_without_a_scaler(tmp_path):
    callback = MpnbCallback(dashboard=None)
    with torch.autocast("cpu", dtype=torch.float16):  # what a cell under `%amp fp16` is in
        _, said = train(callback, "fp32", tmp_path, max_steps=2)
    assert callback.history.mode == ["fp16", "fp16"]
    kinds = [event["kind"] for event in callback.history.events if event["kind"] != "run"]
    assert kinds == ["session_autocast", "precision_mismatch", "fp16_without_scaling"]
    assert len(said) == 3 and "already on around transformers.Trainer" in said[0]


def test_session_op_lists_are_said_to_act_inside_the_trainer(tmp_path):
    from mpnb.precision.policy import session

    session.oplists.add("fp32", ["softmax"])
    callback = MpnbCallback(dashboard=None)
    _, said = train(callback, "bf16", tmp_path, max_steps=2)
    assert (
        len(said) == 1
        and "op lists (%oplist: 0 lower, 1 fp32) act inside transformers.Trainer" in said[0]
    )


def test_stop_ends_training_through_the_trainers_own_stop(tmp_path):
    callback = MpnbCallback(dashboard=None, flush_every=1)
    callback.telemetry.recorder.attach(StopAt(callback, 2))
    trainer, _ = train(callback, "bf16", tmp_path, max_steps=10)
    assert trainer.state.global_step == len(callback.history) == 2
    assert not callback.telemetry.running  # on_train_end ran: hooks off, dashboard closed
    model = trainer.model
    assert not model._forward_hooks and not any(m._forward_pre_hooks for m in model.modules())


def test_a_stop_pressed_after_mpnbs_hook_ran_still_ends_training_at_that_step(tmp_path):
    """Another callback presses mpnb's Stop in its own on_step_end, after mpnb's has run: the trainer
    stops at that step, whatever the order of the callbacks."""
    from transformers import TrainerCallback

    class StopAtStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                callback.control.stop()

    callback = MpnbCallback(dashboard=None)
    trainer, _ = train(callback, "bf16", tmp_path, max_steps=10, also=[StopAtStep()])
    assert trainer.state.global_step == len(callback.history) == 2
    assert not callback.telemetry.running and not callback.control.on_state


def test_a_failed_train_leaves_no_hooks_behind_once_the_next_one_starts(tmp_path):
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            if index >= 24:
                raise RuntimeError("bad record")
            return token_data(1)[0]

    callback = MpnbCallback(dashboard=None)
    with pytest.raises(RuntimeError, match="bad record"):
        train(callback, "bf16", tmp_path, data=Broken())
    failed_rows = len(callback.history)
    trainer, _ = train(callback, "bf16", tmp_path, max_steps=2)
    assert len(callback.history) == failed_rows + 2
    assert sum(len(m._forward_pre_hooks) for m in trainer.model.modules()) == 0
    assert not trainer.model._forward_hooks


def test_precision_args_follow_the_session_mode_and_refuse_unknown_modes():
    from mpnb.precision.policy import session

    session.set_mode("bf16", "cpu")
    assert precision_args() == {"bf16": True, "fp16": False, "tf32": None}
    assert precision_args("tf32", device="cuda")["tf32"] is True
    with pytest.raises(InvalidChoiceError, match="'fp8'"):
        precision_args("fp8")
    with pytest.raises(InvalidChoiceError, match="dashboard 'plot'"):
        MpnbCallback(dashboard="plot")


def test_a_train_that_raised_mid_step_does_not_double_count_the_next_ones_losses(tmp_path):
    from transformers import TrainerCallback

    class FailAtStep2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("failed at step 2")

    callback = MpnbCallback(dashboard=None)
    model = gpt2_model()
    args = TrainingArguments(str(tmp_path), use_cpu=True, per_device_train_batch_size=8, max_steps=3, logging_steps=1,
                             report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
    failing = Trainer(
        model=model, args=args, train_dataset=token_data(), callbacks=[callback, FailAtStep2()]
    )
    with pytest.raises(RuntimeError, match="failed at step 2"):
        failing.train()
    again = Trainer(model=model, args=args, train_dataset=token_data(), callbacks=[callback])
    again.train()
    assert callback.history.loss[-3:] == pytest.approx(logged(again, "loss"), rel=1e-6)
    assert len(model._forward_hooks) == 0


def test_a_loss_computed_outside_the_model_is_recorded_as_unknown_not_as_nan(tmp_path):
    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits  # no labels: the model computes no loss
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    callback = MpnbCallback(dashboard=None, on_nonfinite="stop")
    trainer, said = train(callback, "bf16", tmp_path, max_steps=3, trainer=OwnLoss)
    assert (
        trainer.state.global_step == len(callback.history) == 3
    )  # not stopped as if the loss were NaN
    assert (
        callback.history.loss_missing == [True] * 3 and callback.history.summary()["alarms"] == []
    )
    assert len(said) == 1 and "no loss" in said[0]


def test_evaluation_during_training_is_left_out_of_step_times_and_epochs_are_recorded(tmp_path):
    def slow_metrics(prediction):
        time.sleep(0.3)
        return {}

    callback = MpnbCallback(dashboard=None)
    trainer, _ = train(
        callback,
        "bf16",
        tmp_path,
        max_steps=-1,
        num_train_epochs=2,
        data=token_data(32),
        eval_strategy="steps",
        eval_steps=2,
        compute_metrics=slow_metrics,
    )
    history = callback.history
    assert len(history) == trainer.state.global_step == 8
    assert history.epoch == [0, 0, 0, 0, 1, 1, 1, 1]
    after_evaluation = [
        history.step_time[i] for i in (2, 4, 6)
    ]  # steps 3, 5, 7 follow the evaluations
    others = statistics.median(history.step_time[i] for i in (1, 3, 5, 7))
    assert max(after_evaluation) < others + 0.15, history.step_time  # each evaluation slept 0.3 s


def test_the_rows_of_a_train_that_raised_are_in_the_history_at_once(tmp_path):
    """transformers tells callbacks nothing when train() raises: the rows the run recorded must
    still be there when the history is read, not held back until the next train() ends the run."""
    from transformers import TrainerCallback

    class FailAtStep3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise RuntimeError("failed at step 3")

    callback = MpnbCallback(dashboard=None)
    with pytest.raises(RuntimeError, match="failed at step 3"):
        train(callback, "bf16", tmp_path, also=[FailAtStep3()])
    assert callback.history.step == [1, 2, 3]


def test_a_trainer_told_to_divide_by_the_accumulation_is_recorded_as_it_logs(tmp_path):
    """``model_accepts_loss_kwargs = False`` (as some Trainer subclasses set): the Trainer gives the
    model no token count and divides each micro-batch's mean by the accumulation: the rows hold
    the mean, as its log does."""

    class Dividing(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model_accepts_loss_kwargs = False

    callback = MpnbCallback(dashboard=None)
    trainer, said = train(
        callback, "bf16", tmp_path, max_steps=3, accumulate=4, data=token_data(96), trainer=Dividing
    )
    assert callback.history.loss == pytest.approx(logged(trainer, "loss"), rel=1e-6) and said == []


def test_a_stop_pressed_inside_an_accumulation_window_ends_training_as_the_trainers_own_stop_does(
    tmp_path,
):
    """The Trainer breaks off after the running micro-batch and drops the unfinished window: the step
    before is the last, and the rows say so."""
    from transformers import TrainerCallback

    class StopInStep3(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:  # step 3's first micro-batch is about to run
                callback.control.stop()

    callback = MpnbCallback(dashboard=None)
    trainer, _ = train(callback, "bf16", tmp_path, max_steps=6, accumulate=2, also=[StopInStep3()])
    assert trainer.state.global_step == len(callback.history) == 2
    assert not callback.telemetry.running


def test_label_smoothing_is_named_as_the_reason_no_loss_can_be_read(tmp_path):
    """The Trainer's label smoother computes the loss outside the model: said once, by its name."""
    callback = MpnbCallback(dashboard=None)
    trainer, said = train(callback, "bf16", tmp_path, max_steps=2, label_smoothing_factor=0.1)
    assert callback.history.loss_missing == [True, True] and len(logged(trainer, "loss")) == 2
    assert len(said) == 1 and "label_smoothing_factor=0.1" in said[0], said


@pytest.mark.parametrize("dashboard", ["text", None])
def test_a_train_that_raised_in_a_notebook_cell_is_ended_with_that_cell(tmp_path, ip, dashboard):
    """transformers tells its callbacks nothing when train() raises: in IPython, the end of the
    cell that raised ends mpnb's run (its dashboard closed, its hooks off, the failure noted),
    instead of leaving it to look alive until the next train()."""
    from transformers import TrainerCallback

    from tests.conftest import run, run_expecting

    class FailAtStep2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("failed at step 2")

    # (with no dashboard too: the run was left open, its hook on the model, no failure noted)
    callback = MpnbCallback(dashboard=dashboard)
    args = TrainingArguments(str(tmp_path), use_cpu=True, per_device_train_batch_size=8, max_steps=4, report_to=[],
                             save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = Trainer(
        model=gpt2_model(),
        args=args,
        train_dataset=token_data(),
        callbacks=[callback, FailAtStep2()],
    )
    ip.user_ns.update(trainer=trainer)
    cell_hooks = list(ip.events.callbacks["post_run_cell"])
    run_expecting(ip, "trainer.train()", RuntimeError)
    assert ip.events.callbacks["post_run_cell"] == cell_hooks  # mpnb's one-shot cell hook is gone
    assert not callback.telemetry.running and callback.control.state == "idle"
    assert not trainer.model._forward_hooks
    assert len(callback.history) == 2
    assert [
        e
        for e in callback.history.events
        if e.get("kind") == "run failed" and "failed at step 2" in e["message"]
    ]
    run(ip, "1 + 1")  # the next cell finds nothing left to end


def test_label_smoothing_the_trainer_turned_off_is_not_blamed_for_a_loss_that_was_read(tmp_path):
    """The Trainer turns label smoothing off for multi-label models: the loss is the model's, read."""

    class MultiLabel(Trainer):
        def __init__(self, *args, model, **kwargs):
            model.config.problem_type = "multi_label_classification"
            super().__init__(*args, model=model, **kwargs)

    callback = MpnbCallback(dashboard=None)
    trainer, said = train(
        callback, "bf16", tmp_path, max_steps=2, label_smoothing_factor=0.1, trainer=MultiLabel
    )
    assert callback.history.loss == pytest.approx(logged(trainer, "loss"), rel=1e-6)
    assert not any("label_smoothing" in message for message in said), said


class _LogOfShifted(torch.nn.Module):
    """A GPT-2 MLP activation that makes NaN: the log of values shifted below zero."""

    def forward(self, x):
        return torch.log(x - 100.0)


class _PlantedTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model.transformer.h[1].mlp.act = _LogOfShifted()


def test_a_nan_loss_inside_the_trainer_is_followed_into_the_next_step(tmp_path):
    """bf16, no scaler: the first NaN loss arms mpnb's locator, and step 2 is watched as the
    Trainer runs it. The update after step 1 wrote NaN into the weights (the Trainer does not skip
    a NaN step), so the note says the NaN was already in an op's inputs, and where."""
    callback = MpnbCallback(dashboard=None, flush_every=1)
    train(callback, "bf16", tmp_path, max_steps=3, trainer=_PlantedTrainer)
    history = callback.history
    (origin,) = [e for e in history.events if e["kind"] == "origin"]
    assert origin["step"] == 2 and "watched after step 1's loss was nan" in origin["message"]
    assert (origin["module"], origin["problem"]) == ("GPT2LMHeadModel.transformer.wte", "input")
    assert torch._C._len_torch_dispatch_stack() == 0


def test_mx_layers_swapped_around_the_trainer_are_read_as_mxfp8(tmp_path):
    pytest.importorskip("torchao.prototype.mx_formats", reason="mxfp8 needs torchao (mpnb[fp8])")
    import mpnb

    model = gpt2_model()  # 32 wide: its Conv1D projections are MX-eligible
    callback = MpnbCallback(dashboard=None)
    args = TrainingArguments(
        str(tmp_path), use_cpu=True, per_device_train_batch_size=8, max_steps=3,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        **precision_args("bf16"),
    )  # fmt: skip
    with mpnb.mx_layers(model, device="cpu") as layers:
        Trainer(model=model, args=args, train_dataset=token_data(), callbacks=[callback]).train()
    assert layers.converted and callback.history.mode == ["mxfp8"] * 3
    assert type(model.transformer.h[1].mlp.c_fc).__name__ == "Conv1D"  # given back


def test_a_run_resumed_from_the_trainers_checkpoint_numbers_its_steps_on(tmp_path):
    # a fresh callback numbered the resumed run's rows 1, 2... while the Trainer's logs and
    # checkpoints went on from step 3
    def arguments(steps: int, save: str) -> TrainingArguments:
        return TrainingArguments(
            str(tmp_path), use_cpu=True, per_device_train_batch_size=8, max_steps=steps,
            logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy=save, save_steps=3,
            disable_tqdm=True, **precision_args("bf16"),
        )  # fmt: skip

    first = MpnbCallback(dashboard=None)
    Trainer(
        model=gpt2_model(),
        args=arguments(3, "steps"),
        train_dataset=token_data(),
        callbacks=[first],
    ).train()
    resumed = MpnbCallback(dashboard=None)
    trainer = Trainer(
        model=gpt2_model(), args=arguments(6, "no"), train_dataset=token_data(), callbacks=[resumed]
    )
    trainer.train(resume_from_checkpoint=True)
    history = resumed.history
    assert history.step == [4, 5, 6] and trainer.state.global_step == 6
    assert history.loss == pytest.approx(logged(trainer, "loss")[-3:], rel=1e-6)
    assert "starts after step 3" in history.events[0]["message"]
