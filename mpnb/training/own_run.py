"""What two training runs share that each must have its own: compare's modes and a what-if's
proof train one run after another, and a run that trains another's model, or on the batches
another left, fills its row with the other's steps.

Example:
    >>> import torch
    >>> from mpnb import Trainer
    >>> def run(model):
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     return Trainer(model, optimizer, torch.nn.functional.mse_loss, mode="bf16", device="cpu", dashboard=None)
    >>> shared = torch.nn.Linear(2, 2)
    >>> first, second = run(torch.nn.Sequential(shared)), run(torch.nn.Sequential(shared))
    >>> shared_part(first, [], second, [])
    "the parameter '0.weight' (a module built once, outside the run)"
    >>> shared_part(first, [], run(torch.nn.Linear(2, 2)), []) is None
    True
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__: list[str] = []


def shared_part(trainer: Any, data: Any, other_trainer: Any, other_data: Any) -> str | None:
    """What the run ``(trainer, data)`` shares with ``(other_trainer, other_data)``, in words
    ("one Trainer", "one model", "the parameter 'x' (...)", "one data iterator"), or None."""
    if other_trainer is trainer:
        return "one Trainer"
    if other_trainer.model is trainer.model:
        return "one model"
    theirs = {id(parameter) for parameter in other_trainer.model.parameters()}
    parameter = next(
        (name for name, p in trainer.model.named_parameters() if id(p) in theirs), None
    )
    if parameter is not None:
        return f"the parameter {parameter!r} (a module built once, outside the run)"
    if isinstance(data, Iterator) and other_data is data:
        return "one data iterator"
    return None
