"""Checkpoints of a sharded (``strategy="fsdp"``) Trainer: a directory, one shard per rank.

The weights and the optimizer's state go through ``torch.distributed.checkpoint`` (each rank
writes and reads only its shards; the directory loads into any number of ranks), obtained and
put back with its ``get_state_dict`` / ``set_state_dict``. The rest of the run (scaler and step
counters, scheduler, position, history: the same records as a one-file checkpoint, see
:mod:`mpnb.training.checkpoint`) is one small file per rank, ``run-rank<N>.pt``, read with
``weights_only=True``: each rank gets its own history back (loaded into more ranks than saved
it, the new ranks take rank 0's). Every rank calls :func:`save_sharded` / :func:`load_sharded`
(the Trainer's ``save`` / ``load`` do), since both are collective.

Before anything is loaded, the run record is checked against the trainer and the directory's
weight names and shapes against the model's; a mismatch raises :class:`~mpnb.errors.MpnbError`
naming the directory and changes nothing. Nothing in the directory is unpickled with code
allowed to run (:mod:`mpnb.training.safe_load`): a file that holds code is refused, named.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mpnb._files import atomic_write
from mpnb.errors import MpnbError
from mpnb.training.checkpoint import (
    FORMAT,
    RUN_KEYS,
    apply_run_state,
    incomplete,
    run_mismatch,
    run_record,
)
from mpnb.training.history import History
from mpnb.training.safe_load import load_dcp, load_plain, read_dcp_metadata

if TYPE_CHECKING:
    from mpnb.training.trainer_protocols import Checkpointed

__all__: list[str] = []


def run_file(path: str | os.PathLike[str], rank: int) -> str:
    """The file beside the shards that holds ``rank``'s run record.

    >>> run_file("ckpt", 1)
    'ckpt/run-rank1.pt'
    """
    return os.path.join(path, f"run-rank{rank}.pt")


def save_sharded(trainer: Checkpointed, path: str | os.PathLike[str]) -> None:
    """Write ``trainer``'s checkpoint into the directory ``path`` (made if missing); collective."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = os.fspath(path)
    if os.path.exists(name) and not os.path.isdir(name):
        raise MpnbError(
            f"{name!r} is a file, not a directory: a sharded checkpoint is a directory of shards"
        )
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=name)
    with atomic_write(run_file(name, dist.get_rank()), binary=True) as file:
        torch.save({**run_record(trainer), "sharded": True}, file)
    dist.barrier()  # no rank reads the directory before every run record is there


def load_sharded(trainer: Checkpointed, path: str | os.PathLike[str]) -> None:
    """Restore a :func:`save_sharded` directory into ``trainer``; collective.

    Raises:
        MpnbError: not a sharded mpnb checkpoint, one that does not fit this trainer
            (other weights, optimizer type, scaler, scheduler), or one with a file that holds
            code (named, and none of it run); nothing is changed.
        FileNotFoundError: there is no such directory.
    """
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    name = os.fspath(path)
    record, history = _read_run(trainer, name)
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    problem = _weights_mismatch(read_dcp_metadata(name).state_dict_metadata, model_state)
    if problem is not None:
        raise MpnbError(f"{name!r} does not fit this trainer: {problem}; nothing was loaded")
    # DCP reads into the tensors it is given, and these are the trainer's own: a shard refused or
    # damaged half-way through must leave the trainer as it was, so the reads go into copies.
    state = _copy_tensors({"model": model_state, "optimizer": optimizer_state})
    try:
        load_dcp(state, name)
    except dcp.api.CheckpointException as error:
        raise MpnbError(
            f"{name!r} does not fit this trainer ({error}); nothing was loaded"
        ) from None
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    apply_run_state(trainer, record, history)
    trainer.amp.discard_window()  # an unfinished accumulation window belonged to the run replaced


def _copy_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copy_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_tensors(item) for item in value)
    return value


def _weights_mismatch(saved: dict[str, Any], model_state: dict[str, Any]) -> str | None:
    weights = {
        key.removeprefix("model."): meta for key, meta in saved.items() if key.startswith("model.")
    }
    if set(weights) != set(model_state):
        extra, absent = (
            sorted(set(weights) - set(model_state))[:3],
            sorted(set(model_state) - set(weights))[:3],
        )
        return f"its model has other parameters (unexpected {extra}, missing {absent})"
    for key, tensor in model_state.items():
        size = getattr(weights[key], "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            return (
                f"model entry {key} has shape {tuple(size)}, this model's is {tuple(tensor.shape)}"
            )
    return None


def _read_run(trainer: Checkpointed, name: str) -> tuple[dict[str, Any], History]:
    if not os.path.isdir(name):
        raise FileNotFoundError(f"no checkpoint directory {name!r}")
    path = run_file(name, dist.get_rank())
    if not os.path.exists(path):  # loaded into more ranks than saved it
        path = run_file(name, 0)
    try:
        record = load_plain(path)
    except FileNotFoundError:
        raise MpnbError(
            f"{name!r} is not a sharded mpnb checkpoint (it has no {os.path.basename(path)})"
        ) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not record.get("sharded"):
        raise MpnbError(
            f"{name!r} is not a sharded mpnb checkpoint (saved by Trainer.save with strategy='fsdp')"
        )
    problem = incomplete(record, RUN_KEYS) or run_mismatch(trainer, record)
    if problem is None:
        try:
            return record, History.from_dict(record["history"])
        except (KeyError, TypeError, ValueError) as error:
            problem = f"its history is unreadable ({error!r})"
    raise MpnbError(f"{name!r} does not fit this trainer: {problem}; nothing was loaded")
