"""Checkpoints of a sharded (``strategy="fsdp"``) Trainer: a directory, one shard per rank.

The weights and the optimizer's state go through ``torch.distributed.checkpoint`` (each rank
writes and reads only its shards; the directory loads into any number of ranks), obtained and
put back with its ``get_state_dict`` / ``set_state_dict``. The rest of the run (scaler and step
counters, scheduler, position, history: the same records as a one-file checkpoint, see
:mod:`mpnb.training.checkpoint`) is one small file, ``run.pt``, written by rank 0 and read by
every rank with ``weights_only=True``. Every rank calls :func:`save_sharded` /
:func:`load_sharded` (the Trainer's ``save`` / ``load`` do), since both are collective.

Before anything is loaded, the run record is checked against the trainer and the directory's
weight names against the model's; a mismatch raises :class:`~mpnb.errors.MpnbError` naming the
directory and changes nothing.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from mpnb.errors import MpnbError
from mpnb.training.checkpoint import FORMAT, VERSION, apply_run_state, run_mismatch, run_state
from mpnb.training.history import History

#: The trainer a checkpoint belongs to (``mpnb.training.trainer.Trainer``; not imported: it imports this).
Trainer = Any

__all__ = ["RUN_FILE", "load_sharded", "save_sharded"]

#: The file beside the shards that holds the run's records.
RUN_FILE = "run.pt"


def save_sharded(trainer: Trainer, path: str | os.PathLike[str]) -> None:
    """Write ``trainer``'s checkpoint into the directory ``path`` (made if missing); collective."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.fspath(path))
    if dist.get_rank() == 0:
        scheduler = trainer.amp.scheduler
        record = {
            "format": FORMAT,
            "version": VERSION,
            "sharded": True,
            "optimizer_type": type(trainer.optimizer).__name__,
            "scheduler_type": type(scheduler).__name__ if scheduler is not None else None,
            **run_state(trainer),
            "history": trainer.history.to_dict(),
        }
        torch.save(record, os.path.join(path, RUN_FILE))
    dist.barrier()  # no rank reads the directory before run.pt is there


def load_sharded(trainer: Trainer, path: str | os.PathLike[str]) -> None:
    """Restore a :func:`save_sharded` directory into ``trainer``; collective.

    Raises:
        MpnbError: not a sharded mpnb checkpoint, or one that does not fit this trainer
            (other weights, optimizer type, scaler, scheduler); nothing is changed.
        FileNotFoundError: there is no such directory.
    """
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    name = os.fspath(path)
    record, history = _read_run(trainer, name)
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    saved = dcp.FileSystemReader(name).read_metadata().state_dict_metadata
    weights = {key.removeprefix("model.") for key in saved if key.startswith("model.")}
    if weights != set(model_state):
        extra, absent = sorted(weights - set(model_state))[:3], sorted(set(model_state) - weights)[:3]
        raise MpnbError(
            f"{name!r} does not fit this trainer: its model has other parameters (unexpected {extra}, missing "
            f"{absent}); nothing was loaded"
        )
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=name)
    set_state_dict(
        trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    apply_run_state(trainer, record, history)
    trainer.amp.discard_window()  # an unfinished accumulation window belonged to the run replaced


def _read_run(trainer: Trainer, name: str) -> tuple[dict[str, Any], History]:
    run_file = os.path.join(name, RUN_FILE)
    if not os.path.isdir(name):
        raise FileNotFoundError(f"no checkpoint directory {name!r}")
    try:
        record = torch.load(run_file, weights_only=True)
    except FileNotFoundError:
        raise MpnbError(f"{name!r} is not a sharded mpnb checkpoint (it has no {RUN_FILE})") from None
    except Exception as error:  # torch reports a damaged file in many ways
        raise MpnbError(f"{run_file!r} cannot be read (damaged or truncated?): {error!r}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not record.get("sharded"):
        raise MpnbError(f"{name!r} is not a sharded mpnb checkpoint (saved by Trainer.save with strategy='fsdp')")
    missing = [key for key in ("amp", "scheduler", "position", "history") if key not in record]
    problem = f"it lacks {missing}" if missing else run_mismatch(trainer, record)
    if problem is None:
        try:
            return record, History.from_dict(record["history"])
        except (KeyError, TypeError, ValueError) as error:
            problem = f"its history is unreadable ({error!r})"
    raise MpnbError(f"{name!r} does not fit this trainer: {problem}; nothing was loaded")
