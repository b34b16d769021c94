r"""Training across processes with torch.distributed: the model wrapped for a strategy, each
rank's share of the batches.

``mpnb.Trainer(..., strategy="ddp")`` wraps the model in torch's
``DistributedDataParallel`` (gradients averaged across ranks in the backward pass) and trains
each rank on its share of a plain sequence of batches: batch ``i`` goes to rank
``i % world_size``, as ``DistributedSampler`` deals examples without shuffling, so one step of
N ranks trains on N consecutive batches. The last, incomplete round of an epoch (its
``len % world_size`` batches) is left out: every rank must take the same number of steps, or
the ranks that took one more would wait for the others forever. A DataLoader that already has
a ``DistributedSampler`` is used as it is. Since DDP averages the gradients before the optimizer sees them, GradScaler
finds the same inf/NaN on every rank: all ranks skip a step together, and AmpStep counts it
as one process does.

``strategy="fsdp"`` shards the model instead (torch's FSDP2, ``fully_shard``): each block (the
elements of the model's ``ModuleList``\ s, a transformer's layers; else its children that hold
parameters), then the whole model, with a ``MixedPrecisionPolicy`` derived from the mode: the
parameters gathered for compute in bf16 / fp16, the gradients reduced in fp32. Each rank keeps
only its shard of every weight, gradient and optimizer state. ``fully_shard`` changes the model
in place and gives it new parameters: the optimizer's parameter groups are pointed at them, so
the optimizer must not have stepped yet. A gradient overflow reaches only the rank that owns
the overflowing elements, but GradScaler's inf check on sharded gradients (DTensors) takes the
maximum of every rank's flag (torch's DTensor handles that op so): all ranks skip the step
together, as with DDP. The policy is fixed when the Trainer is built; a later ``%amp`` switch
changes autocast and the scaler, not the parameter dtype.

Mode fp8 with ``strategy="fsdp"`` follows torchao's FSDP2 recipe (torchtitan's): the eligible
Linear layers are converted to torchao's float8 training first (the mode's recipe and kept
layers, as one process does), then sharded; with the tensorwise recipe their weights are
all-gathered in float8 (1 byte an element) and their scales refreshed after each optimizer step
(torchao's ``precompute_float8_dynamic_scale_for_fsdp``, one all-reduce, run as an optimizer
step hook; and at each fit's start, as weights may have been loaded since). Sharding replaces
every parameter, so the conversion lasts as long as the model: the float8 layers are not put
back after a fit as they are in one process (the state dict keeps its keys and plain values, so
the full weights load into the plain model). A switch into or out of fp8 while such a model
trains is refused.

Stopping (Stop, ``on_nonfinite="stop"``, an interrupt) is agreed across ranks: see :func:`agreed_stop`.

The process group must exist: run the training through :func:`mpnb.distributed.launch` (or
``torchrun``).

Example (one process, a world of one):
    >>> import torch, torch.distributed as dist, tempfile, os
    >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    >>> type(wrap_model(torch.nn.Linear(2, 2), "ddp", torch.device("cpu"))).__name__
    'DistributedDataParallel'
    >>> list(rank_share([10, 11, 12]))
    [10, 11, 12]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.precision.modes import Mode, parse_mode

__all__: list[str] = []

#: What ``Trainer(strategy=...)`` accepts besides None (one process).
STRATEGIES = ("ddp", "fsdp")


def check_strategy(strategy: str | None) -> None:
    """Refuse an unknown strategy, or one asked for without a process group."""
    if strategy is None:
        return
    if strategy not in STRATEGIES:
        raise InvalidChoiceError("strategy", strategy, [*STRATEGIES, "None"])
    if not (dist.is_available() and dist.is_initialized()):
        raise MpnbError(
            f"strategy={strategy!r} trains across processes and needs torch.distributed's process group: "
            "run the training through mpnb.distributed.launch(fn, nproc=N) (or torchrun)"
        )


def agreed_stop(wants_stop: bool, steps: int, every: int, device: torch.device) -> bool:
    """Whether training stops before the next step, agreed by all ranks (every rank calls this
    before each step, after the same number of ``steps``).

    A rank that stopped alone would leave the others waiting in the next step's gradient
    reduction forever. So a rank's wish (a Stop, a non-finite loss with ``on_nonfinite="stop"``,
    an interrupt) is shared every ``every`` steps (at the telemetry flushes, which find the
    non-finite losses; every step with ``on_nonfinite="stop"``) in one small all-reduce, and all
    ranks stop there if any of them wants to.
    """
    if steps % every:
        return False
    flag = torch.tensor([float(wants_stop)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def check_same_mode(label: str) -> None:
    """Refuse a fit whose ranks would train in different modes (a mode chosen by rank-local
    code, or a switch on one rank): DDP averages their gradients, and an fp16 gradient scaled by
    65536 averaged with a bf16 one trains neither. Every rank calls this as its fit starts; one
    small all-gather of the labels, and every rank raises the same error.

    Raises:
        MpnbError: the ranks' modes differ (each named with its rank).
    """
    labels: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(labels, label)
    if len(set(labels)) > 1:
        by_rank = ", ".join(f"rank {rank} {name}" for rank, name in enumerate(labels))
        raise MpnbError(
            f"the ranks would train in different modes ({by_rank}): their gradients are averaged "
            "every step, so every rank must train in one mode; give each Trainer the same mode "
            "(nothing was trained)"
        )


def wrap_model(
    model: nn.Module,
    strategy: str | None,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None = None,
    mode: Mode | None = None,
) -> nn.Module:
    """``model`` (already on ``device``) as the strategy trains it; for ``"fsdp"``, sharded in
    place with ``mode``'s policy and ``optimizer`` pointed at the sharded parameters (mode fp8:
    its float8 layers converted first, for good)."""
    check_strategy(strategy)
    if strategy is None:
        return model
    if strategy == "fsdp":
        return _shard(model, optimizer, mode or parse_mode("fp32"), device)
    if device.type != "cuda":  # CPU (and other devices): DDP takes no device ids
        return nn.parallel.DistributedDataParallel(model)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return nn.parallel.DistributedDataParallel(model, device_ids=[index])


def check_switch(strategy: str | None, mode: Mode, new_mode: Mode) -> None:
    """Refuse a switch into or out of a mode that converts layers (fp8) for a sharded model: its
    layers were converted before sharding and stay (see the module's notes)."""
    converting = [m for m in (mode, new_mode) if m.converts_layers]
    if strategy == "fsdp" and mode != new_mode and converting:
        raise MpnbError(
            f"strategy='fsdp' cannot switch {mode.label} -> {new_mode.label}: {converting[0].name}'s layers are "
            "converted before the model is sharded and stay; build a Trainer in the mode wanted"
        )


def refresh_sharded(model: nn.Module, strategy: str | None, mode: Mode) -> None:
    """With FSDP, what the mode's sharded layers need from the weights as they are now (fp8: the
    float8 weights' all-gather scales; a checkpoint may have been loaded since the last step).
    Every rank calls it as a fit starts."""
    if strategy == "fsdp":
        mode.refresh_sharded(model)


def mixed_precision_policy(mode: Mode) -> Any:
    """FSDP2's policy for ``mode`` (:meth:`~mpnb.precision.modes.base.Mode.fsdp_policy`): the
    parameters gathered for compute in the autocast dtype, gradients reduced in fp32; no casting
    without autocast. fp8's layers outside float8 run under bf16 autocast, so their weights are
    gathered in bf16, as torchtitan's float8 training does; the float8 layers' weights are
    gathered in float8 whatever the policy says.

    >>> policy = mixed_precision_policy(parse_mode("bf16"))
    >>> policy.param_dtype, policy.reduce_dtype
    (torch.bfloat16, torch.float32)
    >>> mixed_precision_policy(parse_mode("fp8")).param_dtype
    torch.bfloat16
    >>> mixed_precision_policy(parse_mode("tf32")).param_dtype is None
    True
    """
    return mode.fsdp_policy()


def model_blocks(model: nn.Module) -> list[nn.Module]:
    r"""The modules FSDP shards one by one: the elements of the model's ``ModuleList``\ s that hold
    parameters (a transformer's layers), else its children that do; but not one that shares a
    parameter with the rest of the model (a tied embedding): that stays with the whole model.

    >>> model_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1)))
    [Linear(in_features=2, out_features=2, bias=True), Linear(in_features=2, out_features=1, bias=True)]
    """
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList)]
    candidates = (
        [block for blocks in lists for block in blocks] if lists else list(model.children())
    )
    candidates = [block for block in candidates if any(True for _ in block.parameters())]
    # A parameter tied across blocks (an embedding and an output head) must stay in one FSDP group:
    # blocks holding one that is also used elsewhere in the model are left to the whole model's group.
    uses = _parameter_uses(model)
    return [
        block
        for block in candidates
        if all(uses[key] == count for key, count in _parameter_uses(block).items())
    ]


def _parameter_uses(module: nn.Module) -> collections.Counter[int]:
    """How many submodules of ``module`` hold each parameter (by id): more than one for a tied weight."""
    return collections.Counter(
        id(param) for sub in module.modules() for param in sub.parameters(recurse=False)
    )


def _shard(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, mode: Mode, device: torch.device
) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    names = {id(param): name for name, param in model.named_parameters()}
    if optimizer is not None:
        if optimizer.state:
            raise MpnbError(
                f"strategy='fsdp' replaces the model's parameters, but the {type(optimizer).__name__} has already "
                "stepped (it holds state for the old ones): build the Trainer with an optimizer that has not stepped"
            )
        foreign = sum(
            id(p) not in names for group in optimizer.param_groups for p in group["params"]
        )
        if foreign:
            raise MpnbError(
                f"strategy='fsdp': {foreign} of the optimizer's parameters are not the model's; build the optimizer "
                "on model.parameters()"
            )
    refreshes = mode.prepare_sharded(model, device)  # fp8: its layers converted, for good
    policy = mixed_precision_policy(mode)
    for block in model_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if optimizer is not None:
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(param)]] for param in group["params"]]
        if refreshes:
            # fp8 (torchao's recipe): the float8 weights' scales for the next all-gather, from
            # the updated weights in one all-reduce instead of one per layer (every rank steps
            # together: a skipped step calls no optimizer on any rank)
            optimizer.register_step_post_hook(lambda *_: mode.refresh_sharded(model))
    return model


class RankShare:
    """Batch ``rank`` of each complete round of ``world_size`` batches of ``data``; re-iterable as ``data`` is."""

    def __init__(self, data: Iterable[Any], rank: int, world_size: int) -> None:
        self.data, self.rank, self.world_size = data, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        return _share_of_rounds(iter(self.data), self.rank, self.world_size)

    def __len__(self) -> int:
        return len(self.data) // self.world_size  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Passed on to ``data`` (mpnb.examples.Batches reshuffles by epoch)."""
        inner = getattr(self.data, "set_epoch", None)
        if callable(inner):
            inner(epoch)


def _share_of_rounds(batches: Iterator[Any], rank: int, world_size: int) -> Iterator[Any]:
    while len(round_ := list(itertools.islice(batches, world_size))) == world_size:
        yield round_[rank]


def rank_share(data: Iterable[Any]) -> Iterable[Any]:
    """This rank's share of ``data`` (all of it in a world of one, or when a ``DistributedSampler``
    deals it already). An iterator stays an iterator (one pass), anything else stays re-iterable.

    >>> list(_share_of_rounds(iter(range(7)), 1, 3))  # rounds 0-2 and 3-5; 6 is an incomplete round
    [1, 4]
    """
    if isinstance(getattr(data, "sampler", None), torch.utils.data.distributed.DistributedSampler):
        return data
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return data
    if isinstance(data, Iterator):
        return _share_of_rounds(data, rank, world_size)
    return RankShare(data, rank, world_size)
