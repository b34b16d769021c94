"""Checkpoints and resuming: a checkpoint is checked before anything changes and applied all or
nothing (another model, optimizer or kind of run, a damaged or hand-edited file is refused naming
the file); a load drops the replaced run's open window and its place in the data; a fit resumed
where the last one stopped goes on with the same data iterator and trains as one fit."""

from __future__ import annotations

import math

import pytest
import torch

import mpnb
import mpnb.examples as ex
from mpnb.errors import MpnbError

from .test_faults import build
from .test_training import linear_problem, mse

# -- a checkpoint is validated first and applied all or nothing ---------------------------------


def trained(seed: int = 0, optimizer: str = "adam", widths=(4, 8)):
    trainer, train, _ = ex.example_trainer(
        "fp16", "cpu", seed=seed, widths=widths, batch_size=128, dashboard=None
    )
    if optimizer == "sgd":
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
        trainer.amp = mpnb.AmpStep(trainer.optimizer, mode="fp16", device="cpu")
    trainer.fit(train, max_steps=3)
    return trainer, train


def state_of(trainer) -> dict:
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": repr(trainer.optimizer.state_dict()),
        "amp": repr(trainer.amp.state_dict()),
        "position": trainer.position,
        "history": trainer.history.to_dict(),
    }


def assert_unchanged(trainer, before: dict) -> None:
    after = state_of(trainer)
    assert after.keys() == before.keys()
    for key in before["model"]:
        assert torch.equal(after["model"][key], before["model"][key])
    assert {k: v for k, v in after.items() if k != "model"} == {
        k: v for k, v in before.items() if k != "model"
    }


def test_loading_another_models_checkpoint_names_the_mismatch_and_changes_nothing(tmp_path):
    other, _ = trained(widths=(8, 16))
    other.save(tmp_path / "wide.pt")
    trainer, _ = trained(seed=1)
    before = state_of(trainer)
    with pytest.raises(MpnbError, match=r"wide\.pt.*features\.0\.weight.*shape") as refused:
        trainer.load(tmp_path / "wide.pt")
    assert "nothing was loaded" in str(refused.value)
    assert_unchanged(trainer, before)


def test_loading_an_sgd_checkpoint_into_an_adam_trainer_is_refused_and_the_next_fit_works(tmp_path):
    sgd, _ = trained(optimizer="sgd")
    sgd.save(tmp_path / "sgd.pt")
    trainer, train = trained(seed=1)
    before = state_of(trainer)
    with pytest.raises(MpnbError, match=r"sgd\.pt.*SGD.*Adam"):
        trainer.load(tmp_path / "sgd.pt")
    assert_unchanged(trainer, before)
    assert len(trainer.fit(train, max_steps=2)) == 5


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_checkpoint_is_an_mpnb_error_naming_the_file(tmp_path, damage):
    trainer, _ = trained()
    trainer.save(tmp_path / "run.pt")
    data = (tmp_path / "run.pt").read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "garbage": b"\x00not a checkpoint" * 40,
    }[damage]
    (tmp_path / "bad.pt").write_bytes(damaged)
    before = state_of(trainer)
    with pytest.raises(MpnbError, match=r"bad\.pt"):
        trainer.load(tmp_path / "bad.pt")
    assert_unchanged(trainer, before)


def test_a_checkpoint_whose_history_or_scaler_is_broken_changes_nothing(tmp_path):
    trainer, _ = trained()
    trainer.save(tmp_path / "run.pt")
    state = torch.load(tmp_path / "run.pt", weights_only=True)
    state["history"]["columns"]["loss"] = [0.5]  # one loss for three steps
    torch.save(state, tmp_path / "history.pt")
    state = torch.load(tmp_path / "run.pt", weights_only=True)
    state["amp"]["scaler"] = {"scale": "big"}
    torch.save(state, tmp_path / "scaler.pt")
    other, _ = trained(seed=1)
    before = state_of(other)
    for name in ("history.pt", "scaler.pt"):
        with pytest.raises(MpnbError, match=name.replace(".", r"\.")):
            other.load(tmp_path / name)
        assert_unchanged(other, before)


def test_a_failure_while_applying_a_checkpoint_puts_everything_back(tmp_path, monkeypatch):
    source, _ = trained()
    source.save(tmp_path / "run.pt")
    trainer, _ = trained(seed=1)
    before = state_of(trainer)

    def failing(state):
        raise RuntimeError("scaler state rejected")

    monkeypatch.setattr(
        trainer.amp, "load_state_dict", failing
    )  # fails after model and optimizer were loaded
    with pytest.raises(RuntimeError, match="scaler state rejected"):
        trainer.load(tmp_path / "run.pt")
    monkeypatch.undo()
    assert_unchanged(trainer, before)


def trainer_for(mode="fp16", scheduler=False, seed=0):
    model, opt = build("adam", seed)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1) if scheduler else None
    return mpnb.Trainer(model, opt, mse, mode=mode, device="cpu", dashboard=None, scheduler=sched)


@pytest.mark.parametrize(
    "saved, loading, message",
    [
        (
            {"scheduler": False},
            {"scheduler": True},
            "no scheduler state and this trainer has a StepLR",
        ),
        (
            {"mode": "bf16"},
            {"mode": "fp16"},
            "saved without a loss scaler .* this trainer runs with one .fp16.",
        ),
        (
            {"mode": "fp16"},
            {"mode": "bf16"},
            "saved with a loss scaler .* this trainer runs without one .bf16.",
        ),
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


def test_a_checkpoint_loaded_in_its_own_mode_trains_on_in_another_once_the_mode_is_set(tmp_path):
    _, data = linear_problem(steps=2)
    source = trainer_for(mode="fp16")
    source.fit(data)
    source.save(tmp_path / "run.pt")
    with pytest.raises(MpnbError, match=r"load, then switch \(trainer.mode = 'bf16'\)"):
        trainer_for(seed=1, mode="bf16").load(tmp_path / "run.pt")
    target = trainer_for(seed=1, mode="fp16")
    target.load(tmp_path / "run.pt")
    with pytest.raises(mpnb.InvalidChoiceError, match="'fp99'"):
        target.mode = "fp99"
    assert target.mode.name == "fp16"  # a refused mode changes nothing
    target.mode = "bf16"
    assert target.history.events[-1]["message"] == "mode fp16 -> bf16"
    target.fit(data, max_steps=target.amp.steps + 1)
    assert target.history.mode[-1] == "bf16" and target.history.mode[0] == "fp16"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda s: s["optimizer"].pop("state"), "no per-parameter state"),
        (
            lambda s: s["optimizer"].__setitem__("param_groups", [1]),
            "parameter groups are unreadable",
        ),
        (lambda s: s.__setitem__("position", ["a", "b", None]), "position .* is not"),
        (lambda s: s["amp"].__setitem__("steps", "x"), "not whole numbers"),
        (
            lambda s: s["optimizer"]["state"][0].__setitem__("exp_avg", torch.zeros(7)),
            "'exp_avg' of parameter 0",
        ),
        (lambda s: s["optimizer"]["state"].__setitem__(99, {}), "names parameter 99"),
        # each of these was loaded, and broke the next fit
        (lambda s: s.__setitem__("position", [-3, -7, None]), r"position \[-3, -7, None\]"),
        (lambda s: s["amp"].__setitem__("steps", -100), "step counter -100"),
        (lambda s: s["amp"].__setitem__("epoch", -1), "epoch counter -1"),
        (lambda s: s["history"]["columns"].__setitem__("step", [7, 9]), "history ends at step 9"),
        (lambda s: s["scheduler"].__setitem__("step", 1), "scheduler state has 'step'"),
        (lambda s: s["scheduler"].__setitem__("optimizer", {}), "scheduler state has 'optimizer'"),
        (lambda s: s["scheduler"].__setitem__("gamma", "x"), "scheduler's 'gamma' is 'x'"),
        (
            lambda s: s["optimizer"]["param_groups"][0].__setitem__("lr", "x"),
            "optimizer's 'lr' is 'x'",
        ),
        (
            lambda s: s["optimizer"]["param_groups"][0].__setitem__("betas", (0.9,)),
            r"optimizer's 'betas' is \(0.9,\)",
        ),
        (lambda s: s["optimizer"]["param_groups"][0].__setitem__("lr", math.nan), "'lr' is nan"),
        (lambda s: s["scheduler"].__setitem__("gamma", math.nan), "'gamma' is nan"),
        (lambda s: s["amp"]["scaler"].__setitem__("scale", 0.0), "loss scaler's scale must be"),
        (
            lambda s: s["amp"]["scaler"].__setitem__("growth_interval", 1.5),
            "loss scaler's growth_interval must be",
        ),
    ],
)
def test_hand_edited_checkpoints_are_refused_before_anything_changes(tmp_path, damage, message):
    _, data = linear_problem(steps=2)
    source = trainer_for(scheduler=True)
    source.fit(data)
    source.save(tmp_path / "run.pt")
    state = torch.load(tmp_path / "run.pt", weights_only=True)
    damage(state)
    torch.save(state, tmp_path / "edited.pt")
    target = trainer_for(seed=1, scheduler=True)
    weight = target.model.weight.detach().clone()
    with pytest.raises(MpnbError, match=r"edited\.pt.*" + message):
        target.load(tmp_path / "edited.pt")
    assert torch.equal(target.model.weight, weight) and len(target.history) == 0
    assert target.amp.scheduler.last_epoch == 0 and target.position == (0, 0, None)


# -- resuming: from a checkpoint, or where the last fit stopped ---------------------------------


def test_loading_drops_the_window_the_replaced_run_left_open(tmp_path):
    _, data = linear_problem(steps=4)
    saver, opt = build()
    mpnb.Trainer(saver, opt, mse, mode="bf16", device="cpu", dashboard=None, accumulate=2).fit(
        data[:2]
    )
    source = mpnb.Trainer(*build(), mse, mode="bf16", device="cpu", dashboard=None, accumulate=2)
    source.fit(data[:2])
    source.save(tmp_path / "run.pt")

    fresh = mpnb.Trainer(
        *build(seed=3), mse, mode="bf16", device="cpu", dashboard=None, accumulate=2
    )
    fresh.load(tmp_path / "run.pt")
    fresh.fit(data[2:])
    used = mpnb.Trainer(
        *build(seed=3), mse, mode="bf16", device="cpu", dashboard=None, accumulate=2
    )
    used.fit(data[:2])
    inputs, targets = data[2]
    used.amp.train_step(
        lambda: mse(used.model(inputs), targets)
    )  # one micro-batch of an unfinished window
    assert not used.amp.between_steps
    used.load(tmp_path / "run.pt")
    assert used.amp.between_steps and all(p.grad is None for p in used.model.parameters())
    used.fit(data[2:])
    assert (
        torch.equal(used.model.weight, fresh.model.weight)
        and used.history.step == fresh.history.step
    )


def test_resuming_many_times_holds_one_iterator_not_a_chain_of_them():
    _, data = linear_problem(steps=30)
    trainer = mpnb.Trainer(*build(), mse, mode="bf16", device="cpu", dashboard=None)
    trainer.fit(data, epochs=1, max_steps=1)
    source = trainer._data.held.rest
    while trainer.resumable:
        trainer.fit(data, max_steps=1)
        assert trainer._data.held is None or trainer._data.held.rest is source
    assert len(trainer.history) == 30


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
    assert (
        loader.loaded == 12
    )  # not 2 + 4 + 6 + ...: no batch is re-read to skip to the position (42 loads)
    assert trainer.history.loss == whole.history.loss


def test_a_load_between_fits_forgets_where_the_stopped_fit_was_in_its_data(tmp_path):
    import mpnb.examples as ex

    batches = list(ex.digits(batch_size=32)[0])[:6]
    trainer, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    trainer.save(tmp_path / "start.pt")
    loader = _CountingLoader(batches)
    trainer.fit(loader, epochs=1, max_steps=3)
    trainer.load(
        tmp_path / "start.pt"
    )  # back to batch 0: the loader's place at batch 3 no longer applies
    trainer.fit(loader, epochs=1)
    assert trainer.history.step == [1, 2, 3, 4, 5, 6] and len(trainer.history) == 6


def round_trip(make_optimizer, make_scheduler=lambda optimizer: None, tmp_path=None):
    """A run of ``make_optimizer``'s optimizer saved after a fit and loaded into a fresh one,
    which then trains on."""
    _, data = linear_problem(steps=2)

    def trainer():
        model, _ = linear_problem(steps=0)
        optimizer = make_optimizer(model.parameters())
        return mpnb.Trainer(model, optimizer, mse, mode="fp16", device="cpu", dashboard=None,
                            scheduler=make_scheduler(optimizer))  # fmt: skip

    source = trainer()
    source.fit(data)
    source.save(tmp_path / "run.pt")
    target = trainer()
    target.load(tmp_path / "run.pt")
    target.fit(data)  # the next epoch
    return target


def test_an_adafactor_checkpoint_with_factored_statistics_loads(tmp_path):
    target = round_trip(lambda parameters: torch.optim.Adafactor(parameters, lr=1e-2),
                        tmp_path=tmp_path)  # fmt: skip
    assert target.amp.steps == 4


def test_a_cyclic_schedule_with_its_own_scale_function_loads(tmp_path):
    target = round_trip(
        lambda parameters: torch.optim.SGD(parameters, lr=0.01, momentum=0.9),
        lambda optimizer: torch.optim.lr_scheduler.CyclicLR(
            optimizer, 0.01, 0.1, step_size_up=2, scale_fn=lambda x: 1.0
        ),
        tmp_path=tmp_path,
    )
    assert target.amp.steps == 4


def test_numpy_scaler_settings_make_a_checkpoint_that_loads_back(tmp_path):
    import numpy as np

    _, data = linear_problem(steps=2)

    def trainer():
        model, _ = linear_problem(steps=0)
        return mpnb.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), mse,
                            mode="fp16", device="cpu", dashboard=None,
                            growth_factor=np.float64(2.0), growth_interval=np.int64(100),
                            init_scale=np.float32(1024.0))  # fmt: skip

    source = trainer()
    source.save(tmp_path / "before.pt")  # an unused scaler reports its settings as given
    source.fit(data)
    source.save(tmp_path / "run.pt")
    trainer().load(tmp_path / "before.pt")
    target = trainer()
    target.load(tmp_path / "run.pt")
    assert target.amp.steps == 2
