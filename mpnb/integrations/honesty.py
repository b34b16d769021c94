"""What a framework does that its user may not know: each said once, as a warning and a history event.

Precisions are named as :mod:`mpnb.integrations.observed` names them (``"bf16"``, ``"bf16-true"``...).

Example:
    >>> print(precision_mismatch(asked="fp16", observed="bf16", framework="Lightning"))
    Lightning was asked for fp16 but trains in bf16 (read from autocast and the weights during the forward pass)
    >>> precision_mismatch(asked="bf16", observed="bf16", framework="Lightning") is None
    True
"""

from __future__ import annotations

import torch

from mpnb.errors import warn_user
from mpnb.oplists.lists import OpLists
from mpnb.precision.modes import find_mode
from mpnb.training.history import History

__all__: list[str] = []

#: The mode column of a step in which no training forward pass was observed.
UNSEEN = "unseen"


def precision_mismatch(asked: str | None, observed: str | None, framework: str) -> str | None:
    """Say so when the precision observed differs from the one the framework was asked for."""
    if asked is None or observed is None or asked == observed:
        return None
    mode = find_mode(asked)  # a mode that converts layers reads as its name once they ran
    missing = mode.missing_layers(framework, observed) if mode is not None else None
    if missing is not None:
        return missing
    return (
        f"{framework} was asked for {asked} but trains in {observed} "
        "(read from autocast and the weights during the forward pass)"
    )


def fp16_without_scaling(
    observed: str | None, scaler: torch.amp.GradScaler | None, framework: str
) -> str | None:
    """fp16 with no enabled GradScaler: small gradients flush to zero, overflows go unnoticed."""
    if not _needs_scaling(observed) or (scaler is not None and scaler.is_enabled()):
        return None
    return (
        f"{framework} trains in {observed} without loss scaling (no GradScaler): gradients below fp16's range "
        "become zero and overflowing steps are applied, not skipped; use bf16, or a loss scaler "
        "(transformers on CPU: bf16=True; Lightning: precision='bf16-mixed')"
    )


def _needs_scaling(observed: str | None) -> bool:
    """Whether training in ``observed`` needs loss scaling: a mode that says so (fp16 autocast),
    or weights in fp16 themselves (``"fp16-true"``)."""
    mode = find_mode(observed)
    return mode.needs_scaler if mode is not None else observed == "fp16-true"


def session_lists_inside(lists: OpLists, framework: str) -> str | None:
    """The session's op lists act in every autocast region, the framework's included."""
    if not lists:
        return None
    return (
        f"the session's op lists (%oplist: {len(lists.lower)} lower, {len(lists.fp32)} fp32) act inside "
        f"{framework}'s autocast too: the listed ops run in the listed precision there; %oplist reset removes them"
    )


def session_autocast_around(device_type: str, framework: str) -> str | None:
    """Autocast already on when training starts (``%amp`` in this cell, or an enclosing block)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    return (
        f"autocast ({dtype}) is already on around {framework}'s training (the session's %amp mode, or an enclosing "
        f"autocast block): where {framework} does not enter autocast itself, it trains in {dtype} anyway; "
        "%amp off (or leaving the block) lets the framework's own setting decide"
    )


def no_loss(framework: str, step: int, reason: str | None = None) -> str:
    """A step gave no loss to read (said once; its rows hold NaN with ``loss_missing``), and why,
    where the framework's settings say (``reason``)."""
    reason = (
        reason
        or "a training step that returns none, manual optimization, a custom loss computed outside the model"
    )
    return (
        f"{framework} gave no loss mpnb can read at step {step} ({reason}): those rows hold NaN with "
        "loss_missing=True, and are not counted as a non-finite loss"
    )


def not_prepared(framework: str, step: int) -> str:
    """A step ended without ``before_optimizer_step()``: what of it is unknown."""
    return (
        f"{framework}: step {step} ended without before_optimizer_step(), so its loss scale, learning rate "
        "and whether it was skipped are unknown (recorded as 1.0, NaN and not skipped): call "
        "before_optimizer_step() just before each optimizer step"
    )


def mode_unseen(framework: str, step: int) -> str:
    """No training forward pass of the model was seen in a step (its mode is :data:`UNSEEN`)."""
    return (
        f"{framework}: mpnb saw no training forward pass of the model in step {step}, so that row's mode is "
        f"'{UNSEEN}': the model ran only in code torch.compile traced before mpnb's hook was on it (call "
        "torch._dynamo.reset() before training to have it traced again), or the loss came from another model"
    )


class Notices:
    """Says each kind of notice at most once per run: a ``RuntimeWarning`` and a history event.

    The warning points at the user's code (:func:`~mpnb.errors.warn_user`).
    """

    def __init__(self, history: History) -> None:
        self.history = history
        self.said: dict[str, str] = {}

    def restart(self) -> None:
        """A new run: every notice may be said again."""
        self.said.clear()

    def say(self, kind: str, message: str | None, step: int = 0) -> None:
        """Warn and note ``message`` at ``step`` (the optimizer step it was seen at; 0: before training)."""
        if message is None or kind in self.said:
            return
        self.said[kind] = message
        self.history.note(message, kind=kind, step=step)
        warn_user(message)
