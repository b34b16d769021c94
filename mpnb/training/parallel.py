"""Training across processes with torch.distributed: the model wrapped for a strategy, each
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

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mpnb.errors import InvalidChoiceError, MpnbError

__all__ = ["STRATEGIES", "RankShare", "check_strategy", "rank_share", "wrap_model"]

#: What ``Trainer(strategy=...)`` accepts besides None (one process).
STRATEGIES = ("ddp",)


def check_strategy(strategy: str | None, on_nonfinite: str = "warn") -> None:
    """Refuse an unknown strategy, one asked for without a process group, or one with
    ``on_nonfinite="stop"``: each rank would decide alone, and a rank that stopped would leave
    the others waiting in the next step's all-reduce forever."""
    if strategy is None:
        return
    if strategy not in STRATEGIES:
        raise InvalidChoiceError("strategy", strategy, [*STRATEGIES, "None"])
    if on_nonfinite == "stop":
        raise MpnbError(
            f"on_nonfinite='stop' with strategy={strategy!r} is not supported yet: a rank that stops alone leaves "
            "the others waiting forever; use 'warn' (every rank records the NaN) and stop from your own code"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise MpnbError(
            f"strategy={strategy!r} trains across processes and needs torch.distributed's process group: "
            "run the training through mpnb.distributed.launch(fn, nproc=N) (or torchrun)"
        )


def wrap_model(model: nn.Module, strategy: str | None, device: torch.device) -> nn.Module:
    """``model`` (already on ``device``) as the strategy trains it."""
    check_strategy(strategy)
    if strategy is None:
        return model
    if device.type != "cuda":  # CPU (and other devices): DDP takes no device ids
        return nn.parallel.DistributedDataParallel(model)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return nn.parallel.DistributedDataParallel(model, device_ids=[index])


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
