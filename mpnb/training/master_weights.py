"""The weights' own dtype under mixed precision: fp32 master weights, and what goes wrong without.

Mixed precision keeps the weights in fp32 and lets autocast cast them to fp16 or bf16 for each
op; the optimizer then updates the fp32 copy. Weights that are themselves fp16 or bf16 break this
in two ways, each said before it bites:

- *fp16 weights under a loss scaler*: torch's GradScaler refuses to unscale fp16 gradients, and
  the first step ends in its bare ``ValueError: Attempting to unscale FP16 gradients.``
  :func:`check_scalable` refuses before training (nothing changed), naming the parameters and the
  fix; :func:`unscale_refusal` turns torch's error into the same one where the weights became fp16
  after that check (a hand loop that calls ``model.half()`` late).
- *bf16 weights with no fp32 copy*: every update is rounded to bf16, which keeps 8 significant
  bits, so an update smaller than about 1/256 of its weight is rounded away and a small learning
  rate stops training. :func:`low_precision_notice` says so (once a fit), with the same fix.

The fix for both is ``model.float()``: it converts the parameters in place, so an optimizer built
on them keeps them.

Example:
    >>> model = torch.nn.Linear(4, 2).half()
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> try:
    ...     check_scalable(optimizer, scales_loss=True, model=model)
    ... except UnscalableWeightsError as refused:
    ...     print(refused)
    2 parameters (weight, bias) are fp16 and the loss is scaled (fp16 mixed precision): ...
    >>> print(low_precision_notice(optimizer, model))
    2 parameters (weight, bias) are fp16, with no fp32 master copy: ... about 1/2048 of its ...
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from mpnb.errors import MpnbError

__all__: list[str] = []

#: The kind of the history event :func:`low_precision_notice`'s message is noted as.
LOW_PRECISION_WEIGHTS = "low_precision_weights"

#: How many parameters a message names before it counts the rest.
_NAMED = 3

# torch's own words (torch/amp/grad_scaler.py, GradScaler._unscale_grads_)
_TORCH_REFUSAL = "Attempting to unscale FP16 gradients"

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class UnscalableWeightsError(MpnbError):
    """fp16 weights where the loss is scaled: GradScaler cannot unscale their gradients.

    Attributes:
        parameters: the names of the fp16 parameters, as the model (or the optimizer's
            ``param_names``) calls them.
    """

    def __init__(self, parameters: list[str]) -> None:
        self.parameters = parameters
        super().__init__(
            f"{_counted(parameters)} {'is' if len(parameters) == 1 else 'are'} fp16 and the loss "
            "is scaled (fp16 mixed precision): torch's GradScaler cannot unscale fp16 gradients "
            '(the first step would end in "ValueError: Attempting to unscale FP16 gradients."). '
            "Keep fp32 master weights: call model.float() before training (the optimizer keeps "
            "its parameters), and autocast casts each op to fp16 itself"
        )


def check_scalable(
    optimizer: torch.optim.Optimizer, scales_loss: bool, model: nn.Module | None = None
) -> None:
    """Refuse fp16 parameters that ``optimizer`` trains when the loss is scaled (``scales_loss``);
    names are ``model``'s where given. One pass over the parameters: call it when training starts.

    Raises:
        UnscalableWeightsError: names a few of them, counts them all, and gives the fix.
    """
    if scales_loss:
        refused = unscalable(optimizer, model)
        if refused is not None:
            raise refused


def unscalable(
    optimizer: torch.optim.Optimizer, model: nn.Module | None = None
) -> UnscalableWeightsError | None:
    """The refusal of the fp16 parameters ``optimizer`` trains, named by ``model`` where given;
    None when it trains none."""
    fp16 = _trainable(optimizer, torch.float16, model)
    return UnscalableWeightsError(fp16) if fp16 else None


def unscale_refusal(
    error: BaseException, optimizer: torch.optim.Optimizer, model: nn.Module | None = None
) -> UnscalableWeightsError | None:
    """The error to raise (``from error``) in place of torch's refusal to unscale fp16 gradients;
    None when ``error`` is something else."""
    if not isinstance(error, ValueError) or _TORCH_REFUSAL not in str(error):
        return None
    return unscalable(optimizer, model)


def low_precision_notice(
    optimizer: torch.optim.Optimizer, model: nn.Module | None = None
) -> str | None:
    """What to say when ``optimizer`` trains bf16 (or fp16) weights where mixed precision was
    meant (call it under an autocast mode, not where training in the weights' own dtype is the
    choice made): updates below the weights' resolution are lost. None when every weight it
    trains is fp32 (or wider)."""
    dtypes = {parameter.dtype for group in optimizer.param_groups for parameter in group["params"]}
    if torch.bfloat16 not in dtypes and torch.float16 not in dtypes:
        return None  # the usual fit's start: no parameter named
    for dtype in (torch.bfloat16, torch.float16):
        names = _trainable(optimizer, dtype, model)
        if names:
            return _rounded_away(names, dtype)
    return None


def _rounded_away(names: list[str], dtype: torch.dtype) -> str:
    eps = torch.finfo(dtype).eps  # the spacing at 1: an update below half of it rounds away
    bits = 1 - int(math.log2(eps))
    name = _DTYPE_NAMES[dtype]
    return (
        f"{_counted(names)} {'is' if len(names) == 1 else 'are'} {name}, with no fp32 master "
        f"copy: each update is rounded to {name}, which keeps {bits} significant bits, so an "
        f"update smaller than about 1/{round(2 / eps)} of its weight is rounded away and a small "
        "learning rate stops training them. Keep fp32 master weights: call model.float() before "
        f"training (the optimizer keeps its parameters), and autocast casts each op to {name}"
    )


def _trainable(
    optimizer: torch.optim.Optimizer, dtype: torch.dtype, model: nn.Module | None
) -> list[str]:
    """The names of the parameters of ``dtype`` that ``optimizer`` trains."""
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    found = []
    for index, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")  # an optimizer built from model.named_parameters()
        for position, parameter in enumerate(group["params"]):
            if parameter.requires_grad and parameter.dtype == dtype:
                found.append(
                    names.get(id(parameter))
                    or (given[position] if given else f"param_groups[{index}][{position}]")
                )
    return found


def _counted(names: Iterable[str]) -> str:
    """``"5 parameters (a, b, c and 2 more)"``."""
    names = list(names)
    shown = ", ".join(names[:_NAMED])
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return f"{len(names)} parameter{'s' if len(names) != 1 else ''} ({shown}{more})"
