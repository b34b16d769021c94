"""Faults found by attacking the Trainer, each reproduced here: a failing optimizer step under a
loss scaler, a failure after the update, generators, leftover windows, bad losses and checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import mpnb
from mpnb.errors import MpnbError

from .test_training import linear_problem, mse


def build(optimizer="sgd", seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(6, 3)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05), "adam": lambda p: torch.optim.Adam(p, lr=0.01)}
    return model, make[optimizer](model.parameters())


def unbroken(data, mode="fp16", optimizer="sgd", **options):
    model, opt = build(optimizer)
    mpnb.Trainer(model, opt, mse, mode=mode, device="cpu", dashboard=None, **options).fit(data)
    return model


def fails_once(on_call: int, message: str):
    calls = []

    def hook(*args):
        calls.append(1)
        if len(calls) == on_call:
            raise RuntimeError(message)

    return hook


@pytest.mark.parametrize("options", [{}, {"clip_grad_norm": 1.0}], ids=["plain", "clipped"])
def test_an_fp16_optimizer_step_that_fails_after_unscaling_is_retried_exactly(options):
    _, data = linear_problem(steps=6)
    reference = unbroken(data, init_scale=1024.0, **options)
    model, opt = build()
    opt.register_step_pre_hook(fails_once(2, "transient failure"))
    trainer = mpnb.Trainer(model, opt, mse, mode="fp16", device="cpu", dashboard=None, init_scale=1024.0, **options)
    with pytest.raises(RuntimeError, match="transient failure"):
        trainer.fit(data)
    history = trainer.fit(data)
    assert history.step == list(range(1, 7)) and history.skipped_steps == []
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)


def test_a_failure_after_the_update_counts_the_step_and_never_trains_its_batch_again():
    _, data = linear_problem(steps=4)
    reference = unbroken(data, mode="fp32", optimizer="adam")
    model, opt = build("adam")
    opt.register_step_post_hook(fails_once(2, "logging hook failed"))
    trainer = mpnb.Trainer(model, opt, mse, mode="fp32", device="cpu", dashboard=None)
    with pytest.raises(RuntimeError, match="logging hook failed"):
        trainer.fit(data)
    assert trainer.history.step == [1, 2] and trainer._batch == 2  # step 2 happened: its batch is behind us
    trainer.fit(data)
    assert trainer.history.step == [1, 2, 3, 4] and opt.state[model.weight]["step"].item() == 4
    assert torch.equal(model.weight, reference.weight)


def test_a_failing_scheduler_or_sink_after_the_update_still_records_the_step():
    _, data = linear_problem(steps=3)
    model, opt = build()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # its step() needs a metric: it raises
    trainer = mpnb.Trainer(model, opt, mse, mode="bf16", device="cpu", dashboard=None, scheduler=plateau)
    with pytest.raises(TypeError):
        trainer.fit(data)
    assert trainer.history.step == [1] and trainer.amp.between_steps and trainer._batch == 1


def test_on_nonfinite_stop_rearms_for_each_fit():
    model, data = linear_problem(steps=6)
    data[1] = (data[1][0], torch.full_like(data[1][1], math.nan))
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mse,
        mode="fp32",
        device="cpu",
        dashboard=None,
        on_nonfinite="stop",
    )
    with pytest.warns(RuntimeWarning, match="loss is nan at step 2"):
        assert trainer.fit(data).step == [1, 2]
    _, fresh = linear_problem(seed=1, steps=3)
    model.reset_parameters()
    assert trainer.fit(fresh).step == [1, 2, 3]  # trains again (from where the stopped epoch was), no stale stop


def test_loading_drops_the_window_the_replaced_run_left_open(tmp_path):
    _, data = linear_problem(steps=4)
    saver, opt = build()
    mpnb.Trainer(saver, opt, mse, mode="bf16", device="cpu", dashboard=None, accumulate=2).fit(data[:2])
    source = mpnb.Trainer(*build(), mse, mode="bf16", device="cpu", dashboard=None, accumulate=2)
    source.fit(data[:2])
    source.save(tmp_path / "run.pt")

    fresh = mpnb.Trainer(*build(seed=3), mse, mode="bf16", device="cpu", dashboard=None, accumulate=2)
    fresh.load(tmp_path / "run.pt")
    fresh.fit(data[2:])
    used = mpnb.Trainer(*build(seed=3), mse, mode="bf16", device="cpu", dashboard=None, accumulate=2)
    used.fit(data[:2])
    inputs, targets = data[2]
    used.amp.train_step(lambda: mse(used.model(inputs), targets))  # one micro-batch of an unfinished window
    assert not used.amp.between_steps
    used.load(tmp_path / "run.pt")
    assert used.amp.between_steps and all(p.grad is None for p in used.model.parameters())
    used.fit(data[2:])
    assert torch.equal(used.model.weight, fresh.model.weight) and used.history.step == fresh.history.step


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_error_with_a_generator_keeps_the_windows_batches_for_the_next_fit(accumulate):
    _, data = linear_problem(steps=8)
    reference = unbroken(iter(data), mode="bf16", accumulate=accumulate)
    model, opt = build()
    calls = []

    def failing_once(output, target):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("bad batch")
        return mse(output, target)

    trainer = mpnb.Trainer(model, opt, failing_once, mode="bf16", device="cpu", dashboard=None, accumulate=accumulate)
    stream = iter(data)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit(stream)
    trainer.fit(stream)
    assert len(trainer.history) == 8 // accumulate
    assert torch.equal(model.weight, reference.weight)


def test_an_error_while_a_generators_window_is_replayed_keeps_the_batches_not_yet_replayed():
    """Fails on batch 2 of the first window, then on batch 1 of its replay: batch 2, read before and
    not yet replayed, used to be lost, and every later window shifted by one batch."""
    _, data = linear_problem(steps=9)
    reference = unbroken(iter(data), mode="bf16", accumulate=3)
    model, opt = build()
    calls = []

    def failing_twice(output, target):
        calls.append(1)
        if len(calls) in (2, 3):
            raise RuntimeError("bad batch")
        return mse(output, target)

    trainer = mpnb.Trainer(model, opt, failing_twice, mode="bf16", device="cpu", dashboard=None, accumulate=3)
    stream = iter(data)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="bad batch"):
            trainer.fit(stream)
    trainer.fit(stream)
    assert len(trainer.history) == 3
    assert torch.equal(model.weight, reference.weight)


def test_resuming_many_times_holds_one_iterator_not_a_chain_of_them():
    _, data = linear_problem(steps=30)
    trainer = mpnb.Trainer(*build(), mse, mode="bf16", device="cpu", dashboard=None)
    trainer.fit(data, epochs=1, max_steps=1)
    source = trainer._held.rest
    while trainer.resumable:
        trainer.fit(data, max_steps=1)
        assert trainer._held is None or trainer._held.rest is source
    assert len(trainer.history) == 30


def test_a_one_element_output_that_is_not_0_dim_is_not_taken_for_a_loss():
    model = nn.Linear(4, 1)
    trainer = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), mode="fp32", device="cpu", dashboard=None)
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
    ],
)
def test_a_loss_that_cannot_train_is_a_clear_error_and_changes_nothing(step_fn, message):
    model = nn.Linear(4, 1)
    weight = model.weight.detach().clone()
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), step_fn=step_fn, mode="fp32", device="cpu", dashboard=None
    )
    with pytest.raises(MpnbError, match=message):
        trainer.fit([torch.randn(2, 4)])
    assert torch.equal(model.weight, weight) and trainer.amp.between_steps and model.weight.grad is None


def test_bad_fit_arguments_are_refused():
    model, data = linear_problem(steps=2)
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), mse, mode="fp32", device="cpu", dashboard=None
    )
    with pytest.raises(MpnbError, match="data must be an iterable of batches .* got NoneType"):
        trainer.fit(None)
    with pytest.raises(ValueError, match="epochs must be a positive whole number, got 1.5"):
        trainer.fit(data, epochs=1.5)
    with pytest.raises(ValueError, match="accumulate must be a positive number of micro-batches, got 1.5"):
        mpnb.AmpStep(trainer.optimizer, accumulate=1.5)
    assert len(trainer.history) == 0


def test_the_advice_fits_the_mode():
    model, data = linear_problem(steps=3)
    data[0] = (data[0][0], torch.full_like(data[0][1], math.nan))
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), 0.1),
        mse,
        mode="bf16",
        device="cpu",
        dashboard=None,
        on_nonfinite="ignore",
    )
    message = trainer.fit(data).events[0]["message"]
    assert "loss is nan at step 1" in message and "try bf16" not in message


# -- checkpoints of another kind of run -------------------------------------------------------


def trainer_for(mode="fp16", scheduler=False, seed=0):
    model, opt = build("adam", seed)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1) if scheduler else None
    return mpnb.Trainer(model, opt, mse, mode=mode, device="cpu", dashboard=None, scheduler=sched)


@pytest.mark.parametrize(
    "saved, loading, message",
    [
        ({"scheduler": False}, {"scheduler": True}, "no scheduler state and this trainer has a StepLR"),
        ({"mode": "bf16"}, {"mode": "fp16"}, "saved without a loss scaler .* this trainer runs with one .fp16."),
        ({"mode": "fp16"}, {"mode": "bf16"}, "saved with a loss scaler .* this trainer runs without one .bf16."),
    ],
)
def test_a_checkpoint_of_another_kind_of_run_is_refused(tmp_path, saved, loading, message):
    _, data = linear_problem(steps=2)
    source = trainer_for(**saved)
    source.fit(data)
    source.save(tmp_path / "run.pt")
    target = trainer_for(seed=1, **loading)
    with pytest.raises(MpnbError, match=r"run\.pt.*" + message):
        target.load(tmp_path / "run.pt")


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda s: s["optimizer"].pop("state"), "no per-parameter state"),
        (lambda s: s["optimizer"].__setitem__("param_groups", [1]), "parameter groups are unreadable"),
        (lambda s: s.__setitem__("position", ["a", "b", None]), "position .* is not"),
        (lambda s: s["amp"].__setitem__("steps", "x"), "not whole numbers"),
        (lambda s: s["optimizer"]["state"][0].__setitem__("exp_avg", torch.zeros(7)), "'exp_avg' of parameter 0"),
        (lambda s: s["optimizer"]["state"].__setitem__(99, {}), "names parameter 99"),
    ],
)
def test_hand_edited_checkpoints_are_refused_before_anything_changes(tmp_path, damage, message):
    _, data = linear_problem(steps=2)
    source = trainer_for()
    source.fit(data)
    source.save(tmp_path / "run.pt")
    state = torch.load(tmp_path / "run.pt", weights_only=True)
    damage(state)
    torch.save(state, tmp_path / "edited.pt")
    target = trainer_for(seed=1)
    weight = target.model.weight.detach().clone()
    with pytest.raises(MpnbError, match=r"edited\.pt.*" + message):
        target.load(tmp_path / "edited.pt")
    assert torch.equal(target.model.weight, weight) and len(target.history) == 0


class _CountingLoader:
    """A re-iterable like a DataLoader that counts every batch it loads."""

    def __init__(self, batches):
        self.batches, self.loaded = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.loaded += 1
            yield batch


def test_a_resumed_fit_goes_on_with_its_data_iterator_instead_of_reloading_the_epoch():
    """Fits resumed in turns (what an interleaved compare does) read each batch once, and train as one fit."""
    import mpnb.examples as ex

    batches = list(ex.digits(batch_size=32)[0])[:12]
    trainer, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    whole, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    loader = _CountingLoader(batches)
    trainer.fit(loader, epochs=1, max_steps=2)
    while trainer.resumable:
        trainer.fit(loader, max_steps=2)
    whole.fit(batches, epochs=1)
    assert loader.loaded == 12  # before: 2 + 4 + 6 + ... re-read to skip to the position (42 loads)
    assert trainer.history.loss == whole.history.loss


def test_a_load_between_fits_forgets_where_the_stopped_fit_was_in_its_data(tmp_path):
    import mpnb.examples as ex

    batches = list(ex.digits(batch_size=32)[0])[:6]
    trainer, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    trainer.save(tmp_path / "start.pt")
    loader = _CountingLoader(batches)
    trainer.fit(loader, epochs=1, max_steps=3)
    trainer.load(tmp_path / "start.pt")  # back to batch 0: the loader's place at batch 3 no longer applies
    trainer.fit(loader, epochs=1)
    assert trainer.history.step == [1, 2, 3, 4, 5, 6] and len(trainer.history) == 6
