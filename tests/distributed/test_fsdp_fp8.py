"""mpnb.Trainer(mode="fp8", strategy="fsdp") across 2 real processes (gloo), fp8 emulated on CPU:
torchao's float8 layers converted before FSDP2 shards the model, their weights all-gathered in
float8, their scales refreshed after each optimizer step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpnb.distributed import launch
from mpnb.errors import MpnbError
from mpnb.precision.modes import parse_mode
from mpnb.training.parallel import check_switch
from mpnb.training.trainer import Trainer

pytest.importorskip("torchao.float8", reason="mode fp8 needs torchao (mpnb[fp8])")

#: Relative difference allowed between the losses of fp8 on 2 ranks and of fp8 in one process
#: on the merged batches. The same math, but tensorwise fp8 scales each cast by the amax of the
#: tensor it casts: a rank's half batch of inputs (e4m3, 3 mantissa bits) and of output gradients
#: (e5m2, 2 bits) gets another scale than the merged batch, so single values round differently
#: (up to 6% and 12%); averaged over a loss of 256 values a rank that is what remains. Measured:
#: at most 0.25% over 4 steps; bf16 against fp8 differs by as much, so this bound checks the run
#: trains the same model, and the types read during the forward pass check fp8 ran.
LOSS_RTOL = 0.01


def model() -> nn.Module:
    """First and last layers stay in high precision; the middle one (64x64) is converted."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)
    )


def batches(count: int = 8, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 32, generator=generator), torch.randn(size, 16, generator=generator))
        for _ in range(count)
    ]


def trainer_for(mode: str, strategy: str | None) -> Trainer:
    net = model()
    return Trainer(
        net, torch.optim.Adam(net.parameters(), lr=0.01), nn.functional.mse_loss, mode=mode,
        device="cpu", dashboard=None, strategy=strategy,
    )  # fmt: skip


def full_weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in trainer.model.parameters()]


def fp8_fsdp_rank() -> dict:
    trainer = trainer_for("fp8", "fsdp")
    seen = []  # what the middle layer computes with, after FSDP's all-gather
    trainer.model[2].register_forward_pre_hook(
        lambda module, args: seen.append(
            (
                type(module).__mro__[2].__name__,
                type(module.weight).__name__,
                module.weight._data.dtype,
            )
        )
    )
    trainer.fit(batches(), max_steps=4)
    weight = trainer.model[2].weight
    full = full_weights(trainer)
    plain = model()
    plain.load_state_dict(
        {name: value.full_tensor() for name, value in trainer.model.state_dict().items()}
    )
    bf16 = trainer_for("bf16", "fsdp")
    bf16.fit(batches(), max_steps=4)
    return {
        "losses": trainer.history.loss,
        "modes": set(trainer.history.mode),
        "seen": set(seen),
        "sharded_as": (type(weight).__name__, type(weight._local_tensor).__name__),
        # torchao's precompute after the last step: 448 / amax of the whole weight
        "scale": float(weight._local_tensor._precomputed_scale),
        "expected_scale": float(448 / full[2].abs().max().double()),
        "classes": [type(m).__name__ for m in trainer.model],
        "weights": full,
        "loads_into_plain": [torch.equal(a, b) for a, b in zip(plain.parameters(), full)],
        "bf16_losses": bf16.history.loss,
    }


def test_fp8_with_fsdp_gathers_float8_weights_and_trains_as_one_process():
    rank0, rank1 = launch(fp8_fsdp_rank, nproc=2).results
    for result in (rank0, rank1):
        assert result["modes"] == {"fp8"}
        # the middle layer ran as torchao's Float8Linear (FSDP's subclass of it), its weight
        # gathered as float8 data (FSDP's all-gather output), not cast after a bf16 gather
        assert result["seen"] == {("Float8Linear", "Float8TrainingTensor", torch.float8_e4m3fn)}
        assert result["sharded_as"] == ("DTensor", "WeightWithDynamicFloat8CastTensor")
        assert result["scale"] == pytest.approx(result["expected_scale"], rel=1e-6)
        # sharding is for good: the float8 layer stays; the weights load into the plain model
        assert result["classes"] == ["FSDPLinear", "ReLU", "FSDPFloat8Linear", "ReLU", "FSDPLinear"]
        assert all(result["loads_into_plain"])
    assert all(torch.equal(a, b) for a, b in zip(rank0["weights"], rank1["weights"]))
    data = batches()
    merged = [
        (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(data[0::2], data[1::2])
    ]
    single = trainer_for("fp8", None)
    single.fit(merged, max_steps=4)
    assert [type(m).__name__ for m in single.model] == [
        "Linear",
        "ReLU",
        "Linear",
        "ReLU",
        "Linear",
    ]
    both = [(a + b) / 2 for a, b in zip(rank0["losses"], rank1["losses"])]
    bf16 = [(a + b) / 2 for a, b in zip(rank0["bf16_losses"], rank1["bf16_losses"])]
    assert both == pytest.approx(single.history.loss, rel=LOSS_RTOL)
    assert both == pytest.approx(bf16, rel=LOSS_RTOL) and both != bf16  # fp8 changed the numbers


def fp8_fsdp_more_rank(directory: str) -> dict:
    first = trainer_for("fp8", "fsdp")
    first.fit(batches(), max_steps=2)
    first.fit(batches(), max_steps=1)  # a second fit: the layers are float8 already, as they stay
    first.save(directory)
    resumed = trainer_for("fp8", "fsdp")
    resumed.load(directory)  # new weights: the fit's start refreshes their float8 scales
    resumed.fit(batches(), max_steps=1)
    first.fit(batches(), max_steps=1)
    rowwise = trainer_for("fp8:rowwise", "fsdp")  # no float8 all-gather in torchao: bf16
    rowwise.fit(batches(), max_steps=2)
    return {
        "classes": [type(m).__name__ for m in first.model],
        "losses": (first.history.loss[3:], resumed.history.loss[3:]),
        "steps": len(first.history),
        "rowwise": (
            type(rowwise.model[2]).__name__,
            type(rowwise.model[2].weight._local_tensor).__name__,
            rowwise.model[2].config.cast_config_weight.scaling_granularity.value,
            len(rowwise.history.loss),
        ),
    }


def test_a_sharded_fp8_model_fits_again_resumes_from_a_checkpoint_and_takes_rowwise(tmp_path):
    for result in launch(fp8_fsdp_more_rank, str(tmp_path / "ckpt"), nproc=2).results:
        assert result["classes"] == ["FSDPLinear", "ReLU", "FSDPFloat8Linear", "ReLU", "FSDPLinear"]
        assert result["steps"] == 4
        continued, resumed = result["losses"]
        assert continued == resumed and len(resumed) == 1
        assert result["rowwise"] == ("FSDPFloat8Linear", "Tensor", "axiswise", 2)


@pytest.mark.parametrize(
    ("old", "new"),
    [(parse_mode("fp8"), parse_mode("bf16")), (parse_mode("bf16"), parse_mode("fp8"))],
)
def test_a_switch_into_or_out_of_fp8_is_refused_for_a_sharded_model(old, new):
    with pytest.raises(MpnbError, match=f"cannot switch {old.label} -> {new.label}"):
        check_switch("fsdp", old, new)
    check_switch("ddp", old, new)
    check_switch(None, old, new)
    check_switch("fsdp", parse_mode("bf16"), parse_mode("fp16"))
