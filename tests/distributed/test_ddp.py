"""mpnb.Trainer(strategy="ddp") across 2 real processes (gloo), against one process."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mpnb.distributed import launch
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.training.telemetry import Sink
from mpnb.training.trainer import Trainer


def batches(count: int = 8, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 8, generator=generator), torch.randn(size, 2, generator=generator))
        for _ in range(count)
    ]


def model() -> nn.Module:
    """The small model every distributed test trains, from the same seed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def build_trainer(
    strategy: str | None,
    mode: str = "fp32",
    step_fn=None,
    optimizer=torch.optim.SGD,
    lr: float = 0.1,
    **options,
) -> Trainer:
    """A CPU Trainer of :func:`model` (mse loss unless ``step_fn``), no dashboard unless ``options`` say."""
    net = model()
    options.setdefault("dashboard", None)
    return Trainer(
        net,
        optimizer(net.parameters(), lr=lr),
        None if step_fn else nn.functional.mse_loss,
        step_fn=step_fn,
        mode=mode,
        device="cpu",
        strategy=strategy,
        **options,
    )


def trained(
    data,
    mode: str = "fp32",
    strategy: str | None = None,
    steps: int = 4,
    step_fn=None,
    **amp_options,
):
    trainer = build_trainer(strategy, mode, step_fn, **amp_options)
    trainer.fit(data, max_steps=steps)
    inner = trainer.model.module if strategy else trainer.model
    return [p.detach().clone() for p in inner.parameters()], trainer.history


def ddp_rank() -> tuple[list[torch.Tensor], list[float]]:
    parameters, history = trained(batches(), strategy="ddp")
    return parameters, history.loss


def test_two_ranks_train_as_one_process_on_the_merged_batches():
    launched = launch(ddp_rank, nproc=2)
    (rank0, losses0), (rank1, losses1) = launched.results
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1)), "the ranks must end identical"
    data = batches()
    merged = [
        (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(data[0::2], data[1::2])
    ]
    single, _ = trained(merged)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(rank0, single))
    assert len(losses0) == len(losses1) == 4 and losses0 != losses1  # each rank's own batches
    assert [len(h) for h in launched.histories[0]] == [4]


def overflow_on_rank_one_at_its_third_batch(model, batch):
    inputs, targets = batch
    loss = nn.functional.mse_loss(model(inputs), targets)
    if dist.get_rank() == 1 and bool((inputs[0, 0] == 1000.0).item()):
        loss = loss * float("inf")  # this rank's gradients overflow; DDP spreads them to every rank
    return loss


def fp16_ddp_rank() -> list[int]:
    data = batches()
    data[5][0][0, 0] = 1000.0  # batch 5 is rank 1's third
    _, history = trained(
        data,
        mode="fp16",
        strategy="ddp",
        step_fn=overflow_on_rank_one_at_its_third_batch,
        init_scale=256.0,
    )
    return history.skipped_steps


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    assert launch(fp16_ddp_rank, nproc=2).results == [[3], [3]]


def test_a_strategy_without_a_process_group_or_unknown_is_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(MpnbError, match="mpnb.distributed.launch"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), dashboard=None, strategy="ddp")
    with pytest.raises(InvalidChoiceError, match="'dpp'.*ddp"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), dashboard=None, strategy="dpp")


def nan_on_rank_one_at_its_third_batch(model, batch):
    inputs, targets = batch
    loss = nn.functional.mse_loss(model(inputs), targets)
    if dist.get_rank() == 1 and bool((inputs[0, 0] == 1000.0).item()):
        loss = loss * float("nan")
    return loss


def ddp_stop_on_nonfinite_rank(strategy: str) -> tuple[int, bool, list[str]]:
    data = batches()
    data[5][0][0, 0] = 1000.0  # batch 5 is rank 1's third: only rank 1 sees a NaN loss at step 3
    trainer = build_trainer(
        strategy, "bf16", step_fn=nan_on_rank_one_at_its_third_batch, on_nonfinite="stop"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(data, max_steps=4)
    return (
        len(trainer.history),
        trainer.stopped,
        [event["kind"] for event in trainer.history.events],
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_nonfinite_loss_on_one_rank_stops_every_rank_at_the_same_step(strategy):
    # without agreement rank 0 would go on to a 4th step and wait there for rank 1 forever
    (steps0, stopped0, events0), (steps1, stopped1, events1) = launch(
        ddp_stop_on_nonfinite_rank, strategy, nproc=2, timeout=60
    ).results
    assert steps0 == steps1 == 3 and stopped0 and stopped1
    assert "nonfinite" in events1 and "nonfinite" not in events0  # rank 0's own loss was finite


def stop_on_rank_zero_rank() -> tuple[int, bool]:
    trainer = build_trainer("ddp", flush_every=2)

    class StopAtStepThree(Sink):
        def update(self, history):
            if dist.get_rank() == 0 and len(history) >= 3:
                trainer.control.stop()

    trainer.amp.recorder.attach(StopAtStepThree())
    trainer.fit(batches(16), max_steps=8)
    return len(trainer.history), trainer.stopped


def test_a_stop_on_one_rank_ends_every_rank_at_the_next_flush():
    # rank 0 asks after step 3 (seen at the flush of step 4): all ranks stop before step 5
    assert launch(stop_on_rank_zero_rank, nproc=2, timeout=60).results == [(4, True), (4, True)]


def uneven_epoch_rank() -> int:
    parameters, history = trained(batches(count=7), strategy="ddp", steps=None)
    return len(history)


def test_an_epoch_that_does_not_divide_among_the_ranks_does_not_hang():
    """7 batches on 2 ranks: 3 steps each; rank 0 must not wait for a 4th that rank 1 never takes."""
    assert launch(uneven_epoch_rank, nproc=2, timeout=60).results == [3, 3]


def rank_in_its_own_mode() -> str:
    """fp16 on rank 0, bf16 on rank 1: DDP would average a scaled gradient with an unscaled one."""
    trainer = build_trainer("ddp", mode=("fp16", "bf16")[dist.get_rank()])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        trainer.fit(batches(), max_steps=4)
    except MpnbError as refused:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        return f"{refused} | unchanged {unchanged} | steps {len(trainer.history)}"
    return "trained"


def test_ranks_in_different_modes_are_refused_before_a_step():
    # rank 1's weights reached 3e3 within 4 steps, without a word
    said = launch(rank_in_its_own_mode, nproc=2, dashboard=None).results
    assert said[0] == said[1] and "rank 0 fp16, rank 1 bf16" in said[0], said
    assert said[0].endswith("| unchanged True | steps 0"), said
