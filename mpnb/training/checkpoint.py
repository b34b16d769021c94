"""Trainer checkpoints: one file, read without running code, validated whole, applied all or nothing.

:func:`read_checkpoint` loads with ``torch.load(weights_only=True)`` and checks everything
against the trainer it is meant for (format and version, model keys and shapes, optimizer
type and parameter groups, scaler, scheduler, position, history) before :func:`apply_checkpoint`
touches anything; applying keeps a copy of the trainer's state and puts it back if a step
still fails. Every problem is an :class:`~mpnb.errors.MpnbError` that names the file.

Example:
    >>> import tempfile, os, torch, mpnb.examples as ex
    >>> trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    >>> _ = trainer.fit(train, max_steps=2)
    >>> path = os.path.join(tempfile.mkdtemp(), "run.pt")
    >>> trainer.save(path)
    >>> trainer.load(path)
    >>> len(trainer.history)
    2
"""

from __future__ import annotations

import copy
import math
import os
from typing import TYPE_CHECKING, Any

import torch

from mpnb._files import atomic_write
from mpnb.errors import MpnbError, plain_number, quoted
from mpnb.training.amp_step import check_scaler_settings
from mpnb.training.history import History
from mpnb.training.random_state import RandomState
from mpnb.training.safe_load import load_plain

if TYPE_CHECKING:
    from mpnb.training.trainer_protocols import Checkpointed

__all__: list[str] = []

FORMAT = "mpnb-trainer"
#: 2 adds the optimizer's type. Version 1 files (no version) are still read.
VERSION = 2
#: The keys of a :func:`run_record`'s run, and those of a whole one-file checkpoint.
RUN_KEYS = ("amp", "scheduler", "position", "history")
_KEYS = ("model", "optimizer", *RUN_KEYS)


def checkpoint_state(trainer: Checkpointed) -> dict[str, Any]:
    """Everything :meth:`Trainer.save` writes: plain data and tensors only. Its ``"random"``
    entry, torch's random state (an mpnb before it reads the file without it), makes a model
    that draws random numbers (Dropout) resume as the unbroken run would."""
    state = RandomState.capture(trainer.device.type)
    return {
        **run_record(trainer),
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "random": {"device_type": state.device_type, "cpu": state.cpu, "devices": state.devices},
    }


def write_checkpoint(trainer: Checkpointed, path: str | os.PathLike[str]) -> None:
    """Write :func:`checkpoint_state` to ``path`` whole or not at all: a file beside it, renamed
    over it at the end (a link someone planted at ``path`` is replaced, never written through)."""
    with atomic_write(path, binary=True) as file:
        torch.save(checkpoint_state(trainer), file)


def run_record(trainer: Checkpointed) -> dict[str, Any]:
    """A checkpoint without the weights and the optimizer's state: format, the optimizer's and
    scheduler's types, :func:`run_state` and the history (a sharded checkpoint's run file)."""
    scheduler = trainer.amp.scheduler
    return {
        "format": FORMAT,
        "version": VERSION,
        "optimizer_type": type(trainer.optimizer).__name__,
        "scheduler_type": type(scheduler).__name__ if scheduler is not None else None,
        **run_state(trainer),
        "history": trainer.history.to_dict(),
    }


def _training_state(trainer: Checkpointed) -> dict[str, Any]:
    """What :func:`_apply` puts into a trainer, but the history: model, optimizer, scaler, scheduler, position."""
    return {
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        **run_state(trainer),
    }


def run_state(trainer: Checkpointed) -> dict[str, Any]:
    """The run's state besides its weights and optimizer: scaler and step counters, scheduler, position."""
    scheduler = trainer.amp.scheduler
    return {
        "amp": trainer.amp.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "position": list(trainer.position),
    }


def read_checkpoint(
    trainer: Checkpointed, path: str | os.PathLike[str]
) -> tuple[dict[str, Any], History]:
    """Load ``path`` and check it fits ``trainer``; returns the state and its rebuilt history.

    Raises:
        MpnbError: unreadable, damaged, not a trainer checkpoint, or saved by another kind of
            run; the message names the file and what does not match. Nothing is changed.
            A file that holds Python objects (code that unpickling would run) is refused
            without running any of it, naming what it holds.
        FileNotFoundError: there is no such file.
    """
    name = os.fspath(path)
    return checked_state(trainer, load_plain(name, map_location=trainer.device), repr(name))


def checked_state(
    trainer: Checkpointed, state: Any, name: str = "the state"
) -> tuple[dict[str, Any], History]:
    """Check that ``state`` (a :func:`checkpoint_state`, from a file or a ``Trainer.state_dict()``)
    fits ``trainer``; returns it with its rebuilt history.

    Raises:
        MpnbError: it is not a trainer checkpoint's state, or does not fit; the message starts
            with ``name`` and says what does not match. Nothing is changed.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise MpnbError(f"{name} is not an mpnb trainer checkpoint (saved by Trainer.save)")
    try:
        problem = _mismatch(trainer, state)
    # data of the wrong shape where the checks expect another (a tensor for a flag...)
    except _MALFORMED as error:
        problem = f"its contents are not what Trainer.save writes ({type(error).__name__}: {error})"
    if problem is None:
        history, problem = run_history(state)
    if problem is not None:
        raise MpnbError(f"{name} does not fit this trainer: {problem}; nothing was loaded")
    return state, history


def run_history(state: dict[str, Any]) -> tuple[History, None] | tuple[None, str]:
    """The history a checked run record holds, or what is wrong with it: unreadable, or ending
    after the record's step counter (the next fit would number its steps again)."""
    try:
        history = History.from_dict(state["history"])
    except _MALFORMED as error:
        return None, f"its history is unreadable ({error!r})"
    steps = state["amp"]["steps"]
    if len(history) and history.step[-1] > steps:
        return None, f"its history ends at step {history.step[-1]}, after its step counter {steps}"
    return history, None


#: What checking a file's contents of unexpected types can raise (a tensor's truth value is a RuntimeError).
_MALFORMED = (AttributeError, IndexError, KeyError, RuntimeError, TypeError, ValueError)


def _mismatch(trainer: Checkpointed, state: dict[str, Any]) -> str | None:
    """What in ``state`` cannot be applied to ``trainer``; None when everything fits."""
    problem = incomplete(state, _KEYS)
    if problem is not None:
        return problem
    own = trainer.model.state_dict()
    saved = state["model"]
    if not isinstance(saved, dict) or set(saved) != set(own):
        extra, absent = sorted(set(saved) - set(own))[:3], sorted(set(own) - set(saved))[:3]
        return f"its model has other parameters (unexpected {extra}, missing {absent})"
    for key, tensor in own.items():
        if not isinstance(saved[key], torch.Tensor) or saved[key].shape != tensor.shape:
            shape = (
                tuple(saved[key].shape)
                if isinstance(saved[key], torch.Tensor)
                else type(saved[key]).__name__
            )
            return f"model entry {key} has shape {shape}, this model's is {tuple(tensor.shape)}"
    optimizer_type = state.get("optimizer_type")
    problem = _optimizer_type_mismatch(trainer, optimizer_type) or _optimizer_mismatch(
        trainer, state["optimizer"]
    )
    if problem is not None:
        return problem
    if optimizer_type is None and _state_keys(state["optimizer"]) - _state_keys(
        trainer.optimizer.state_dict()
    ):
        if trainer.optimizer.state:
            return "its optimizer state has other entries (saved with another optimizer type?)"
    return _random_mismatch(state.get("random")) or run_mismatch(trainer, state)


def _random_mismatch(saved: Any) -> str | None:
    """What makes a checkpoint's random state unusable (None: fine, or none saved)."""
    if saved is None:
        return None
    cpu = saved.get("cpu") if isinstance(saved, dict) else None
    own = torch.get_rng_state()
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != own.dtype or cpu.shape != own.shape:
        return "its random state is not what Trainer.save writes"
    try:  # torch's own check, on a generator of no one's: a valid Mersenne Twister state
        torch.Generator().set_state(cpu)
    except RuntimeError as refused:
        return f"its random state is not one torch's generator takes ({refused})"
    devices = saved.get("devices")
    if devices is not None and not (
        isinstance(saved.get("device_type"), str)
        and saved["device_type"] != "cpu"  # a CPU run saves its one generator only
        and isinstance(devices, (list, tuple))
        and all(
            isinstance(d, torch.Tensor) and d.dtype == torch.uint8 and d.is_contiguous()
            for d in devices
        )
    ):
        return "its device random state is not what Trainer.save writes"
    return None


def _restore_random(trainer: Checkpointed, saved: Any) -> None:
    """torch's random state as saved (the device's where the trainer runs on that kind of
    device with as many of them; the CPU's always)."""
    if saved is None:
        return
    devices = saved.get("devices")
    kind = trainer.device.type
    same_devices = (
        devices is not None
        and saved.get("device_type") == kind
        and len(devices) == torch.get_device_module(kind).device_count()
    )
    RandomState(
        kind if same_devices else "cpu", saved["cpu"], devices if same_devices else None
    ).restore()


def incomplete(state: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    """What makes ``state`` unreadable as a record with ``keys``: a format version this mpnb does
    not read, or missing keys; None when complete."""
    version = state.get("version", 1)
    if version not in (1, VERSION):
        return f"it is format version {version!r}, this mpnb reads 1 and {VERSION}"
    missing = [key for key in keys if key not in state]
    return f"it lacks {missing}" if missing else None


def run_mismatch(trainer: Checkpointed, state: dict[str, Any]) -> str | None:
    """What in a :func:`run_state` (with the optimizer's type) cannot be applied to ``trainer``."""
    problem = _optimizer_type_mismatch(trainer, state.get("optimizer_type"))
    if problem is not None:
        return problem
    amp = state["amp"]
    if not isinstance(amp, dict) or not {"scaler", "steps", "epoch"} <= set(amp):
        return "its loss-scaler record is incomplete"
    if not all(
        isinstance(amp[key], int) and not isinstance(amp[key], bool) for key in ("steps", "epoch")
    ):
        return f"its step and epoch counters are {amp['steps']!r} and {amp['epoch']!r}, not whole numbers"
    for counter in ("steps", "epoch"):
        if amp[counter] < 0:
            return f"its {counter.rstrip('s')} counter {amp[counter]} is negative"
    scaler = amp["scaler"]
    if bool(scaler) != trainer.amp.scaler.is_enabled():
        saved, own = ("with", "without") if scaler else ("without", "with")
        return (
            f"it was saved {saved} a loss scaler (fp16 has one), this trainer runs {own} one "
            f"({trainer.mode.label}): build the trainer in the checkpoint's mode, load, then switch (trainer.mode = {trainer.mode.name!r})"
        )
    if scaler:
        try:
            check_scaler_settings(scaler)
        except MpnbError as refused:
            return f"its loss scaler's {refused}"
    scheduler = trainer.amp.scheduler
    if (state["scheduler"] is None) != (scheduler is None):
        return (
            "it has a scheduler state and this trainer has no scheduler"
            if scheduler is None
            else (f"it has no scheduler state and this trainer has a {type(scheduler).__name__}")
        )
    saved_scheduler = state.get("scheduler_type")
    if (
        scheduler is not None
        and saved_scheduler is not None
        and saved_scheduler != type(scheduler).__name__
    ):
        return f"its scheduler is a {saved_scheduler}, this trainer's a {type(scheduler).__name__}"
    if scheduler is not None:
        problem = _scheduler_mismatch(scheduler, state["scheduler"])
        if problem is not None:
            return problem
    position = state["position"]
    if not (
        isinstance(position, (list, tuple))
        and len(position) == 3
        and all(_count(value) for value in position[:2])
        and (position[2] is None or _count(position[2]))
    ):
        return f"its position {position!r} is not [epoch, batch, end epoch] of counts from 0"
    if position[2] is not None and position[0] > position[2]:  # the next fit would train nothing
        return f"its position {list(position)!r} is in epoch {position[0]}, past its end epoch {position[2]}"
    return None


def _count(value: Any) -> bool:
    """A whole number from 0 up."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _scheduler_mismatch(scheduler: Any, saved: Any) -> str | None:
    """What in a saved scheduler state cannot go into ``scheduler``, whose ``load_state_dict``
    puts every entry on the object: one that would replace its optimizer or a method (a
    ``step`` number in place of ``step()``), or a value of another kind (:func:`_values_mismatch`)."""
    if not isinstance(saved, dict):
        return f"its scheduler state is a {type(saved).__name__}, not a mapping"
    own = scheduler.state_dict()  # its own entries are its to read back (CyclicLR's scale_fn)
    for key in set(saved) - set(own):
        replaced = "optimizer" if key == "optimizer" else "method"
        if key == "optimizer" or callable(getattr(scheduler, str(key), None)):
            return f"its scheduler state has {quoted(key)}, which would replace the scheduler's {replaced}"
    return _values_mismatch("scheduler", own, saved)


def _values_mismatch(what: str, own: dict[str, Any], saved: dict[str, Any]) -> str | None:
    """The first entry of ``saved`` (a scheduler's state, an optimizer's parameter group) that
    cannot replace its entry in ``own``: a number or a tuple of numbers (a learning rate, Adam's
    betas) given as something else."""
    for key, value in saved.items():
        if key in own and not _same_kind(own[key], value):
            return f"its {what}'s {key!r} is {quoted(value)}, where this {what}'s is {quoted(own[key])}"
    return None


def _same_kind(own: Any, saved: Any) -> bool:
    """Whether ``saved`` can stand where ``own`` stands: a number for a number (a one-element
    tensor too, as torch takes a learning rate), finite where ``own`` is; a tuple of as many
    numbers for a tuple of numbers."""
    if isinstance(own, (int, float)) and not isinstance(own, bool):
        number = plain_number(saved)
        return number is not None and (math.isfinite(number) or not math.isfinite(own))
    if isinstance(own, tuple) and all(isinstance(item, (int, float)) for item in own):
        return (
            isinstance(saved, (tuple, list))
            and len(saved) == len(own)
            and all(_same_kind(mine, theirs) for mine, theirs in zip(own, saved))
        )
    return True


def _optimizer_type_mismatch(trainer: Checkpointed, optimizer_type: str | None) -> str | None:
    if optimizer_type is not None and optimizer_type != type(trainer.optimizer).__name__:
        return f"it was saved with a {optimizer_type} optimizer, this trainer has {type(trainer.optimizer).__name__}"
    return None


def _optimizer_mismatch(trainer: Checkpointed, saved: Any) -> str | None:
    """What in a saved optimizer state cannot go into the trainer's optimizer."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        return "its optimizer record has no per-parameter state"
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        return "its optimizer parameter groups are unreadable"
    own_groups = trainer.optimizer.param_groups
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in own_groups]:
        return "its optimizer has other parameter groups"
    for own, group in zip(own_groups, groups):
        problem = _values_mismatch("optimizer", own, group)
        if problem is not None:
            return problem
    parameters = dict(
        zip((i for g in groups for i in g["params"]), (p for g in own_groups for p in g["params"]))
    )
    for index, entry in saved["state"].items():
        if index not in parameters:
            return f"its optimizer state names parameter {index!r}, which none of its groups holds"
        if not isinstance(entry, dict):
            return f"its optimizer state of parameter {index} is a {type(entry).__name__}, not a mapping"
        parameter = parameters[index]
        for key, value in entry.items():
            if not _state_value(value):
                return (
                    f"its optimizer state {key!r} of parameter {index} is {quoted(value)}, "
                    "not a tensor or a number"
                )
            # per element, or factored (Adafactor's row and column statistics), as the
            # parameter's shape takes by broadcasting
            if isinstance(value, torch.Tensor) and not _broadcasts(value.shape, parameter.shape):
                return (
                    f"its optimizer state {key!r} of parameter {index} has shape {tuple(value.shape)}, "
                    f"the parameter's is {tuple(parameter.shape)}"
                )
    return None


def _state_value(value: Any) -> bool:
    """What an optimizer keeps per parameter: a strided tensor (Adam's moments), a number (a step
    count), None (SGD's momentum before its first step), or a list or tuple of them."""
    if isinstance(value, torch.Tensor):
        return value.layout == torch.strided
    if isinstance(value, (list, tuple)):
        return all(map(_state_value, value))
    return value is None or isinstance(value, (int, float))


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` (a 0-dim one does)."""
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _state_keys(optimizer_state: Any) -> set[str]:
    per_parameter = optimizer_state.get("state", {}) if isinstance(optimizer_state, dict) else {}
    return {key for entry in per_parameter.values() for key in entry}


def apply_checkpoint(
    trainer: Checkpointed, state: dict[str, Any], history: History, name: str = "the state"
) -> None:
    """Put a :func:`read_checkpoint` state into ``trainer``; on any failure, put everything back,
    torch's random state included. What torch refuses that the checks let through (a model
    entry its ``load_state_dict`` cannot copy) is an MpnbError that starts with ``name``."""
    saved, saved_history = copy.deepcopy(_training_state(trainer)), trainer.amp.recorder.history
    stream = RandomState.capture(trainer.device.type)
    try:
        _apply(trainer, state, history)
        _restore_random(trainer, state.get("random"))
    except BaseException as error:
        _apply(trainer, saved, saved_history)
        stream.restore()
        if isinstance(error, Exception) and not isinstance(error, MpnbError):
            raise MpnbError(
                f"{name} does not fit this trainer: torch refused its contents "
                f"({type(error).__name__}: {_first_line(error)}); nothing was loaded"
            ) from error
        raise
    trainer.amp.discard_window()  # an unfinished accumulation window belonged to the run replaced


def _first_line(error: BaseException) -> str:
    """An error's message, its first line only (torch's state_dict errors run over several)."""
    return str(error).strip().split("\n")[0]


def _apply(trainer: Checkpointed, state: dict[str, Any], history: History) -> None:
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    apply_run_state(trainer, state, history)


def apply_run_state(trainer: Checkpointed, state: dict[str, Any], history: History) -> None:
    """Put a :func:`run_state` and its history into ``trainer``."""
    trainer.amp.load_state_dict(state["amp"])
    if trainer.amp.scheduler is not None and state["scheduler"] is not None:
        trainer.amp.scheduler.load_state_dict(state["scheduler"])
    trainer.position = tuple(state["position"])
    trainer.amp.recorder.history = history
    trainer.amp.health.restart(history)
