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

A save writes every rank's files into a new private folder beside the destination and renames
it into place when all are written: a reader never sees half a checkpoint, and a link someone
planted in the destination (at a shard's or the metadata's name) is never written through.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
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
    run_history,
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
    """Write ``trainer``'s checkpoint into the directory ``path``; collective.

    Every rank writes into one new private folder beside ``path`` (mode 0700, made by rank 0 with
    a random name: nothing can be planted in it), which then takes ``path``'s place whole: an
    older checkpoint there is replaced, and a link planted in it is removed, never written
    through. The folder ends with the permissions ``os.mkdir`` would give it.

    Raises:
        MpnbError: ``path`` is a file or a link, or a folder holding anything but a sharded
            checkpoint's files (named); nothing is written.
    """
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = os.path.abspath(os.fspath(path))
    _check_destination(name)
    staging = _staging_folder(name, trainer.device)
    try:
        model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging)
        with atomic_write(run_file(staging, dist.get_rank()), binary=True) as file:
            torch.save({**run_record(trainer), "sharded": True}, file)
        dist.barrier()  # every rank's files are written
        if dist.get_rank() == 0:
            _put_in_place(staging, name)
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    dist.barrier()  # no rank reads the directory before it is in place


#: What a sharded checkpoint's folder holds: DCP's metadata (global and per rank) and shards,
#: the run records, and what an interrupted write of either leaves.
_CHECKPOINT_FILE = re.compile(
    r"(\.metadata(\.tmp)?|__\d+\.metadata|__\d+_\d+\.distcp|run-rank\d+\.pt"
    r"|\.run-rank\d+\.pt\.[0-9a-f]+\.tmp)"
)


def _check_destination(name: str) -> None:
    if os.path.islink(name):
        raise MpnbError(
            f"{name!r} is a link: a sharded checkpoint is written as a folder of its own, "
            "never through a link (save to the folder the link names, or remove the link)"
        )
    if os.path.exists(name) and not os.path.isdir(name):
        raise MpnbError(
            f"{name!r} is a file, not a directory: a sharded checkpoint is a directory of shards"
        )
    if os.path.isdir(name):
        foreign = sorted(
            entry for entry in os.listdir(name) if not _CHECKPOINT_FILE.fullmatch(entry)
        )
        if foreign:
            raise MpnbError(
                f"{name!r} holds {foreign[0]!r}, which is not part of a sharded checkpoint, and "
                "saving replaces the folder whole: save into a new folder or an older checkpoint's"
            )


def _staging_folder(name: str, device: torch.device) -> str:
    """A new private folder beside ``name`` for every rank to write into; collective.

    Rank 0 makes it (``os.mkdir`` refuses a name that exists, a planted link included) and sends
    its random part to the other ranks as a tensor: no pickle between ranks.
    """
    parent, base = os.path.split(name)
    token = torch.zeros(_TOKEN_BYTES + 1, dtype=torch.int64, device=device)
    problem = "see rank 0"
    if dist.get_rank() == 0:
        try:
            drawn = _make_staging(parent, base)
            token = torch.tensor([1, *drawn], dtype=torch.int64, device=device)
        except OSError as error:
            problem = str(error)
    dist.broadcast(token, src=0)
    values = token.tolist()
    if not values[0]:
        raise MpnbError(
            f"no folder could be made beside {name!r} to write the checkpoint into ({problem})"
        )
    return _staging_name(parent, base, bytes(values[1:]))


_TOKEN_BYTES = 8


def _staging_name(parent: str, base: str, token: bytes) -> str:
    return os.path.join(parent, f".{base[:40]}.{token.hex()}.saving")


def _make_staging(parent: str, base: str) -> bytes:
    while True:
        token = secrets.token_bytes(_TOKEN_BYTES)
        try:
            os.mkdir(_staging_name(parent, base, token), 0o700)
            return token
        except FileExistsError:
            continue


def _put_in_place(staging: str, name: str) -> None:
    """Rename the finished ``staging`` folder to ``name``; an older checkpoint there is moved
    aside first and removed after (links in it are removed, not followed)."""
    os.chmod(staging, 0o777 & ~_umask())
    if not os.path.lexists(name):
        os.rename(staging, name)
        return
    replaced = staging.removesuffix(".saving") + ".replaced"
    os.rename(name, replaced)
    os.rename(staging, name)
    shutil.rmtree(replaced, ignore_errors=True)


def _umask() -> int:
    """This process's umask, read without setting it (Linux); 0o022 where it cannot be read."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


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
        history, problem = run_history(record)
        if history is not None:
            return record, history
    raise MpnbError(f"{name!r} does not fit this trainer: {problem}; nothing was loaded")
