"""mpnb.Trainer(strategy="fsdp") across 2 real processes (gloo): FSDP2 sharding, its mixed-precision
policy, skips agreed across ranks, sharded checkpoints."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mpnb.distributed import launch
from mpnb.errors import MpnbError
from mpnb.precision.modes import parse_mode
from mpnb.training.parallel import mixed_precision_policy, model_blocks
from mpnb.training.trainer import Trainer

from .test_ddp import batches, build_trainer, model


def trainer_for(mode: str, strategy: str | None, **options) -> Trainer:
    return build_trainer(strategy, mode, optimizer=torch.optim.Adam, lr=0.01, **options)


def full_weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in trainer.model.parameters()]


def fsdp_fp32_rank() -> tuple[list[torch.Tensor], bool, list[float]]:
    trainer = trainer_for("fp32", "fsdp")
    trainer.fit(batches(), max_steps=4)
    sharded = all(type(p).__name__ == "DTensor" for p in trainer.model.parameters())
    return full_weights(trainer), sharded, trainer.history.loss


def test_fsdp_in_fp32_trains_as_one_process_on_the_merged_batches():
    (rank0, sharded0, losses0), (rank1, sharded1, losses1) = launch(fsdp_fp32_rank, nproc=2).results
    assert sharded0 and sharded1
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))
    data = batches()
    merged = [
        (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(data[0::2], data[1::2])
    ]
    single = trainer_for("fp32", None)
    single.fit(merged, max_steps=4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(rank0, single.model.parameters()))
    assert len(losses0) == len(losses1) == 4 and losses0 != losses1


def fsdp_bf16_rank() -> dict:
    trainer = trainer_for("bf16", "fsdp")
    seen = []
    trainer.model[0].register_forward_pre_hook(
        lambda module, args: seen.append(module.weight.dtype)
    )
    trainer.fit(batches(), epochs=3)  # 4 steps an epoch on each rank
    return {
        "losses": trainer.history.loss,
        "modes": set(trainer.history.mode),
        "compute_dtypes": set(seen),
        "stored_dtypes": {p.dtype for p in trainer.model.parameters()},
        "shard_rows": trainer.model[0].weight.to_local().shape[0],
    }


def test_fsdp_bf16_computes_in_bf16_keeps_fp32_shards_and_trains():
    for result in launch(fsdp_bf16_rank, nproc=2).results:
        assert result["modes"] == {"bf16"}
        assert result["compute_dtypes"] == {torch.bfloat16}  # the policy's parameter dtype
        assert result["stored_dtypes"] == {torch.float32}
        assert result["shard_rows"] == 8  # half of the 16 rows of the first weight
        losses = result["losses"]
        assert len(losses) == 12 and all(map(torch.isfinite, torch.tensor(losses)))
        assert sum(losses[8:]) < sum(losses[:4])  # the same batches, third epoch against the first


class _OverflowOnce(torch.autograd.Function):
    """Passes x through; gives its parameter an inf gradient in one element when armed."""

    @staticmethod
    def forward(ctx, x, parameter, armed):
        ctx.armed, ctx.shape = armed, parameter.shape
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        spike = torch.zeros(ctx.shape)
        if ctx.armed:
            spike[1] = float("inf")
        return grad, spike, None


class Spike(nn.Module):
    """A 2-element parameter: FSDP gives element 0 to rank 0 and element 1 to rank 1."""

    armed = False

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return _OverflowOnce.apply(x, self.weight, Spike.armed)


def overflow_in_rank_ones_shard(model, batch):
    inputs, targets = batch
    Spike.armed = dist.get_rank() == 1 and bool((inputs[0, 0] == 1000.0).item())
    return nn.functional.mse_loss(model(inputs), targets)


def fsdp_fp16_rank() -> tuple[list[int], list[float]]:
    data = batches()
    data[5][0][0, 0] = 1000.0  # batch 5 is rank 1's third
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2), Spike())
    trainer = Trainer(
        net, torch.optim.SGD(net.parameters(), lr=0.1), step_fn=overflow_in_rank_ones_shard, mode="fp16",
        device="cpu", dashboard=None, strategy="fsdp", init_scale=256.0,
    )  # fmt: skip
    trainer.fit(data, max_steps=4)
    return trainer.history.skipped_steps, trainer.history.loss_scale


def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank():
    # The inf reaches only the shard rank 1 owns: rank 0 must learn of it from rank 1.
    (skips0, scales0), (skips1, scales1) = launch(fsdp_fp16_rank, nproc=2).results
    assert skips0 == skips1 == [3]
    assert scales0 == scales1 == [256.0, 256.0, 256.0, 128.0]


def fsdp_checkpoint_rank(directory: str) -> dict:
    data = batches(12)
    first = trainer_for("bf16", "fsdp")
    first.fit(data, max_steps=3)
    first.save(directory)
    first.fit(data, max_steps=2)
    resumed = trainer_for("bf16", "fsdp")
    resumed.load(directory)
    loaded_steps = len(resumed.history)
    resumed.fit(data, max_steps=2)
    refusals = []
    try:
        trainer_for("fp16", "fsdp").load(directory)  # saved without a loss scaler
    except MpnbError as error:
        refusals.append(str(error))
    wider = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2), nn.Linear(2, 2))
    other = Trainer(
        wider, torch.optim.Adam(wider.parameters()), nn.functional.mse_loss, mode="bf16", device="cpu",
        dashboard=None, strategy="fsdp",
    )  # fmt: skip
    try:
        other.load(directory)
    except MpnbError as error:
        refusals.append(str(error))
    return {
        "same_weights": all(
            torch.equal(a, b) for a, b in zip(full_weights(first), full_weights(resumed))
        ),
        "losses": (first.history.loss[3:], resumed.history.loss[3:]),
        "loaded_steps": loaded_steps,
        "refusals": refusals,
        "files": sorted(os.listdir(directory)),
    }


def test_a_sharded_checkpoint_resumes_the_run_exactly(tmp_path):
    for result in launch(fsdp_checkpoint_rank, str(tmp_path / "ckpt"), nproc=2).results:
        assert result["same_weights"]
        continued, resumed = result["losses"]
        assert continued == resumed and len(resumed) == 2
        assert result["loaded_steps"] == 3
        assert {"run-rank0.pt", "run-rank1.pt"} <= set(result["files"])
        assert any(name.endswith(".distcp") for name in result["files"])
        scaler_refusal, weights_refusal = result["refusals"]
        assert "loss scaler" in scaler_refusal and "nothing was loaded" in scaler_refusal
        assert "other parameters" in weights_refusal


def fsdp_refusals_rank() -> list[str]:
    messages = []
    net = model()
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 8)).sum().backward()
    optimizer.step()
    try:
        Trainer(
            net, optimizer, nn.functional.mse_loss, device="cpu", dashboard=None, strategy="fsdp"
        )
    except MpnbError as error:
        messages.append(str(error))
    other, own = model(), model()  # an optimizer over the model's parameters and some of another's
    mixed = torch.optim.SGD([*other.parameters(), *own.parameters()], lr=0.1)
    try:
        Trainer(own, mixed, device="cpu", dashboard=None, strategy="fsdp")
    except MpnbError as error:
        messages.append(str(error))
    return messages


def test_fsdp_refuses_an_optimizer_it_cannot_point_at_the_shards():
    stepped, foreign = launch(fsdp_refusals_rank, nproc=2).results[0]
    assert "has already stepped" in stepped and "Adam" in stepped
    assert "not the model's" in foreign


@pytest.mark.parametrize(
    ("mode", "param_dtype", "reduce_dtype"),
    [
        (parse_mode("bf16"), torch.bfloat16, torch.float32),
        (parse_mode("fp16"), torch.float16, torch.float32),
        (
            parse_mode("fp8"),
            torch.bfloat16,
            torch.float32,
        ),  # outside the float8 layers (gathered in fp8)
        (parse_mode("fp32"), None, None),
    ],
)
def test_the_policy_follows_the_mode(mode, param_dtype, reduce_dtype):
    policy = mixed_precision_policy(mode)
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


def test_blocks_are_a_transformers_layers_or_the_children_with_parameters():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    assert model_blocks(gpt2) == list(gpt2.transformer.h)
    assert [type(b).__name__ for b in model_blocks(model())] == ["Linear", "Linear"]


def clipped_fsdp_rank() -> list[float]:
    trainer = trainer_for("bf16", "fsdp", clip_grad_norm=0.5, record_grad_norm=True)
    trainer.fit(batches(), max_steps=4)
    return trainer.history.grad_norm


def test_the_clipped_gradient_norm_of_sharded_gradients_is_the_whole_models():
    norms0, norms1 = launch(clipped_fsdp_rank, nproc=2).results
    assert norms0 == norms1 and len(norms0) == 4 and all(norm > 0 for norm in norms0)


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight, in two children (no ModuleList)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = (
            nn.Embedding(32, 8),
            nn.LayerNorm(8),
            nn.Linear(8, 32, bias=False),
        )
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def tied_fsdp_rank() -> tuple[bool, list[float]]:
    torch.manual_seed(0)
    net = TiedLM()
    trainer = Trainer(
        net, torch.optim.SGD(net.parameters(), lr=0.1), nn.functional.cross_entropy, mode="bf16", device="cpu",
        dashboard=None, strategy="fsdp",
    )  # fmt: skip
    ids = torch.randint(0, 32, (6,), generator=torch.Generator().manual_seed(0))
    trainer.fit([(ids, ids)] * 4)
    return trainer.model.head.weight is trainer.model.embed.weight, trainer.history.loss


def test_a_weight_tied_across_two_children_stays_tied_and_trains():
    for tied, losses in launch(tied_fsdp_rank, nproc=2).results:
        assert tied and len(losses) == 2 and losses[1] < losses[0]


def sharded_checkpoint_refusals_rank(directory: str) -> list[str]:
    first = trainer_for("fp32", "fsdp")
    first.fit(batches(), max_steps=2)
    first.save(directory)
    messages = []
    torch.manual_seed(0)
    wider = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)
    )  # the same names, other shapes
    other = Trainer(
        wider, torch.optim.Adam(wider.parameters(), lr=0.01), nn.functional.mse_loss, mode="fp32", device="cpu",
        dashboard=None, strategy="fsdp",
    )  # fmt: skip
    before = full_weights(other)
    for attempt in (
        lambda: other.load(directory),
        lambda: first.save(os.path.join(directory, "run-rank0.pt")),
    ):
        try:
            attempt()
        except MpnbError as error:
            messages.append(str(error))
    assert all(torch.equal(a, b) for a, b in zip(before, full_weights(other))), (
        "a refused load changed weights"
    )
    return messages


def test_a_sharded_checkpoint_that_does_not_fit_is_refused_with_a_clear_error(tmp_path):
    shapes, not_a_directory = launch(
        sharded_checkpoint_refusals_rank, str(tmp_path / "ckpt"), nproc=2
    ).results[0]
    assert (
        "0.weight" in shapes
        and "(32, 8)" in shapes
        and "(16, 8)" in shapes
        and "nothing was loaded" in shapes
    )
    assert "not a directory" in not_a_directory


def own_history_rank(directory: str) -> tuple[list[float], list[float]]:
    first = trainer_for("fp32", "fsdp")
    first.fit(batches(), max_steps=2)
    first.save(directory)
    resumed = trainer_for("fp32", "fsdp")
    resumed.load(directory)
    return first.history.loss, resumed.history.loss


def test_each_rank_gets_its_own_history_back_from_a_sharded_checkpoint(tmp_path):
    (saved0, loaded0), (saved1, loaded1) = launch(
        own_history_rank, str(tmp_path / "ckpt"), nproc=2
    ).results
    assert loaded0 == saved0 and loaded1 == saved1 and saved0 != saved1
