"""A trainer's place in its data is one object whose moves are what fits do: each trained batch
moves it on, an epoch's end moves it to the next epoch, a stop holds the batch just read for the
next fit, an error mid-window goes back to the window's first batch (and keeps a generator's
batches of it), a finished plan is forgotten. The Trainer keeps few attributes of its own."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

import mpnb
from mpnb.training import trainer as trainer_module

from .test_faults import build
from .test_training import linear_problem, mse


def trainer_on_cpu(loss_fn=mse, **options) -> mpnb.Trainer:
    return mpnb.Trainer(*build(), loss_fn, mode="bf16", device="cpu", dashboard=None, **options)


def weights(trainer: mpnb.Trainer) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in trainer.model.parameters()]


def test_each_trained_batch_moves_the_position_and_an_epochs_end_moves_to_the_next():
    _, data = linear_problem(steps=3)
    trainer = trainer_on_cpu()
    assert trainer.position == (0, 0, None) and not trainer.resumable
    trainer.fit(data, epochs=2, max_steps=4)
    assert trainer.position == (1, 1, 2) and trainer.resumable
    trainer.fit(data, max_steps=1)
    assert trainer.position == (1, 2, 2)
    trainer.fit(data)  # the plan's last batch, then its end
    assert trainer.position == (2, 0, None) and not trainer.resumable
    assert trainer.history.step == [1, 2, 3, 4, 5, 6] and trainer.history.epoch[-1] == 1


def test_a_stop_holds_the_batch_just_read_and_the_next_fit_trains_it_first():
    _, data = linear_problem(steps=6)
    reads: list[int] = []

    class Loader:
        def __iter__(self):
            for index, batch in enumerate(data):
                reads.append(index)
                yield batch

    loader = Loader()
    trainer = trainer_on_cpu()
    trainer.fit(loader, max_steps=2)
    assert reads == [0, 1, 2]  # the third batch was read when the fit stopped
    assert trainer.last_batch is data[1] and trainer.position == (0, 2, 1)
    trainer.fit(loader)
    assert reads == list(range(6))  # nothing read twice
    whole = trainer_on_cpu()
    whole.fit(data)
    assert all(map(torch.equal, weights(trainer), weights(whole)))


def test_a_load_moves_the_position_and_a_fresh_pass_skips_to_it(tmp_path):
    _, data = linear_problem(steps=6)
    trainer = trainer_on_cpu()
    trainer.fit(data, max_steps=4)
    trainer.save(tmp_path / "four.pt")
    other = trainer_on_cpu()
    other.load(tmp_path / "four.pt")
    assert other.position == (0, 4, 1)
    other.fit(data)
    whole = trainer_on_cpu()
    whole.fit(data)
    assert other.history.step == whole.history.step
    assert all(map(torch.equal, weights(other), weights(whole)))


def failing_at(call: int):
    """A step_fn computing the mse loss that raises at its ``call``-th call, once."""
    calls = []

    def step(model, batch):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("injected failure")
        inputs, targets = batch
        return mse(model(inputs), targets)

    return step


@pytest.mark.parametrize("one_shot", [False, True], ids=["list", "generator"])
def test_an_error_mid_window_goes_back_to_its_first_batch_and_the_next_fit_is_exact(one_shot):
    _, data = linear_problem(steps=8)
    trainer = trainer_on_cpu(None, accumulate=2, step_fn=failing_at(4))  # window 2's second batch
    stream = iter(data) if one_shot else data
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(stream)
    assert trainer.position == (0, 2, 1) and trainer.amp.between_steps
    assert len(trainer.history) == 1
    trainer.fit(stream)
    whole = trainer_on_cpu(accumulate=2)
    whole.fit(data)
    assert trainer.history.step == whole.history.step == [1, 2, 3, 4]
    assert all(map(torch.equal, weights(trainer), weights(whole)))


def test_an_error_between_windows_keeps_the_position_of_the_last_trained_batch():
    _, data = linear_problem(steps=6)
    trainer = trainer_on_cpu(None, accumulate=2, step_fn=failing_at(3))  # window 2's first batch
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(data)
    assert trainer.position == (0, 2, 1) and trainer.resumable
    trainer.fit(data)
    assert trainer.position == (1, 0, None) and trainer.history.step == [1, 2, 3]


def _own_attributes(cls: type) -> set[str]:
    """Every ``self.name`` a class's methods assign, but its properties' setters."""
    properties = {name for name, value in vars(cls).items() if isinstance(value, property)}
    tree = ast.parse(inspect.getsource(cls))
    assigned = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            assigned.add(node.attr)
    return assigned - properties


def test_the_trainer_keeps_at_most_sixteen_attributes_of_its_own():
    own = _own_attributes(trainer_module.Trainer)
    assert len(own) <= 16, sorted(own)
    trainer = trainer_on_cpu()
    trainer.fit(linear_problem(steps=2)[1])
    assert set(vars(trainer)) <= own  # none set from outside the class's own code
