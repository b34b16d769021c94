"""What a step does with the gradients between the last backward and the optimizer: check the loss
they come from, rescale a window that ended short, unscale and clip them.

Example:
    >>> model = torch.nn.Linear(2, 1)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> rescale(optimizer, 0.5)
    >>> model.bias.grad
    tensor([0.5000])
"""

from __future__ import annotations

from typing import Any

import torch

from mpnb.errors import MpnbError

__all__: list[str] = []


def check_loss(loss: Any) -> None:
    """Refuse what backward cannot train on, saying what to return instead.

    Raises:
        MpnbError: ``loss`` is not a tensor, not a single number, or does not require grad.
    """
    if not isinstance(loss, torch.Tensor):
        raise MpnbError(
            f"the loss must be a tensor, got {type(loss).__name__}: return the loss tensor itself"
        )
    if loss.is_complex():  # backward would train on its real part alone, without a word
        raise MpnbError(
            f"the loss must be a real number, got a {loss.dtype} tensor: return a real loss "
            "(of a complex output, its .abs() or .real, as you mean it)"
        )
    if loss.numel() != 1:
        raise MpnbError(
            f"the loss must be a single number, got a tensor of shape {tuple(loss.shape)}: reduce it (.mean())"
        )
    if not loss.requires_grad:
        raise MpnbError(
            "the loss does not require grad (computed under torch.no_grad, detached, or from a frozen model): "
            "nothing to train"
        )


def _with_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters that have a gradient."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def rescale(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every gradient the optimizer will use by ``factor`` (in place)."""
    with torch.no_grad():
        for param in _with_gradients(optimizer):
            param.grad.mul_(factor)


def unscale_and_clip(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, max_norm: float | None
) -> torch.Tensor:
    """Unscale the gradients, clip them to ``max_norm`` (None: no clipping) and return their
    total norm before clipping, the whole model's where the gradients are sharded (FSDP)."""
    scaler.unscale_(optimizer)
    params = _with_gradients(optimizer)
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    full = getattr(norm, "full_tensor", None)  # sharded gradients give a DTensor
    return full() if callable(full) else norm
