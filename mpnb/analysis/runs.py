"""The run an analysis asks ``make_run(mode)`` for, checked before it is used.

:func:`mpnb.compare`, :func:`mpnb.memory` and :func:`mpnb.max_batch_size` all take a
``make_run``: a function that builds a fresh run for a mode, so that every mode starts from
the same model, data and seed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from mpnb.errors import MpnbError
from mpnb.precision.modes import Mode, mode_names, parse_mode
from mpnb.training.batches import describe_batch, samples_in, tensors_in

__all__: list[str] = []

#: ``make_run(mode)`` returns ``(trainer, train_data)`` or ``(trainer, train_data, metric)``,
#: where ``metric(trainer) -> float`` is measured after training (test accuracy, say).
MakeRun = Callable[[str], Sequence[Any]]


def built_run(make_run: MakeRun, mode: str) -> tuple[Any, Any, Callable[[Any], float] | None]:
    """``make_run(mode)``, checked: its trainer, its data and its metric (None without one).

    Example:
        >>> built_run(lambda mode: "a trainer", "bf16")
        Traceback (most recent call last):
        ...
        TypeError: make_run('bf16') returned a str; it must return (trainer, data) or (trainer, data, metric), e.g. return trainer, train_loader

    Raises:
        TypeError: ``make_run`` returned something else than 2 or 3 items with a trainer first
            (and, third, a function).
    """
    run = make_run(mode)
    shape = "(trainer, data) or (trainer, data, metric), e.g. return trainer, train_loader"
    if not isinstance(run, (tuple, list)) or len(run) not in (2, 3):
        got = f"{len(run)} items" if isinstance(run, (tuple, list)) else f"a {type(run).__name__}"
        raise TypeError(f"make_run({mode!r}) returned {got}; it must return {shape}")
    trainer = run[0]
    if not hasattr(trainer, "fit") or not hasattr(trainer, "amp"):
        raise TypeError(
            f"make_run({mode!r}) returned a {type(trainer).__name__} first; it must return {shape} "
            "with an mpnb.Trainer"
        )
    metric = run[2] if len(run) == 3 else None
    if metric is not None and not callable(metric):  # said before any mode trains, not after all
        raise TypeError(
            f"make_run({mode!r}) returned a {type(metric).__name__} as its metric; the metric is "
            "a function measured after training, metric(trainer) -> float, e.g. "
            "lambda trainer: accuracy(trainer.model, test)"
        )
    return trainer, run[1], metric


def check_trains_in(trainer: Any, mode: str) -> None:
    """Refuse a run built for ``mode`` (a label) whose trainer trains in another: its row would
    hold another mode's steps.

    Raises:
        ValueError: the trainer's mode is another (not an :class:`~mpnb.errors.MpnbError`: an
            analysis lists a mode that cannot run here as skipped, and this is no such mode).
    """
    if trainer.mode.label != mode:
        raise ValueError(
            f"the run built for mode {mode!r} trains in {trainer.mode.label!r}: build its Trainer "
            f"with mode={mode!r} (make_run(mode) receives the mode to use)"
        )


def first_batch(data: Any) -> Any:
    """The first batch of a run's data, the one a step is measured on.

    >>> import torch
    >>> first_batch([(torch.zeros(0, 3), torch.zeros(0))])
    Traceback (most recent call last):
    ...
    mpnb.errors.MpnbError: the run's first batch holds no samples (a tuple of 2, whose first tensor is shaped (0, 3)): a step on it measures nothing, and it has no sample to grow a batch from; give data whose first batch holds samples

    Raises:
        ValueError: the data yields no batch.
        MpnbError: its first batch holds no samples.
    """
    for batch in data:
        if samples_in(batch) == 0:
            first = next(tensors_in(batch))
            raise MpnbError(
                f"the run's first batch holds no samples ({describe_batch(batch)}, whose first "
                f"tensor is shaped {tuple(first.shape)}): a step on it measures nothing, and it "
                "has no sample to grow a batch from; give data whose first batch holds samples"
            )
        return batch
    raise ValueError("the run's data yields no batch to measure with")


def mode_labels(modes: Iterable[str | Mode | torch.dtype] | str | Mode | torch.dtype) -> list[str]:
    """The modes' labels (what ``make_run`` is called with), checked: known, at least one, none
    twice (``"fp32,bf16"`` is split; ``"fp8"`` and ``"fp8:rowwise"`` are two, ``"fp32"`` and
    ``"float32"`` one; a torch dtype names a mode as ``Trainer(mode=...)`` takes it).

    Raises:
        InvalidChoiceError: an unknown mode or option.
        ValueError: no mode, one named twice, or a mode object with options its label cannot say
            (fp8's ``keep``: give it to the Trainer inside ``make_run``).
    """
    if isinstance(modes, str):
        modes = modes.split(",")
    elif isinstance(modes, (Mode, torch.dtype)):  # one mode, as Trainer(mode=...) takes it
        modes = [modes]
    # a name may come with spaces ("fp32, bf16"); a dtype or a mode object as it is
    given = [mode.strip() if isinstance(mode, str) else mode for mode in modes]
    chosen = [parse_mode(mode) for mode in given if not (isinstance(mode, str) and not mode)]
    unsaid = [repr(mode) for mode in chosen if mode != mode.label]
    if unsaid:
        raise MpnbError(
            f"compare calls make_run with each mode's label, which cannot say all of {', '.join(unsaid)}: "
            'pass the label ("fp8:rowwise") and give the other options to the Trainer in make_run'
        )
    names = [mode.label for mode in chosen]
    if not names:
        raise MpnbError(f"modes names no mode; valid: {', '.join(mode_names())}")
    twice = next((name for index, name in enumerate(names) if name in names[:index]), None)
    if twice is not None:
        raise MpnbError(f"mode {twice!r} is named twice in {names}: each mode runs once")
    return names
