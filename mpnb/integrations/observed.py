"""The precision a framework really trains in, read from torch's autocast state during the forward pass.

Frameworks enter autocast in different places: around the loss computation (Hugging Face
Trainer), around ``training_step`` (Lightning), inside a wrapped ``model.forward``
(Accelerate). All of them are active by the time the model's first leaf module runs, so a
forward pre-hook there reads what torch will really do. Reading the state is host-only
(no device work), a few microseconds per forward pass.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> observer = PrecisionObserver(model, "cpu")
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     _ = model(torch.ones(1, 2))
    >>> observer.mode
    <Mode.BF16: 'bf16'>
    >>> observer.remove()
"""

from __future__ import annotations

import torch
from torch import nn

from mpnb.precision.modes import Mode

__all__ = ["PrecisionObserver", "mode_in_effect"]

_AUTOCAST_MODES = {torch.float16: Mode.FP16, torch.bfloat16: Mode.BF16}


def mode_in_effect(device_type: str) -> Mode:
    """The mode torch runs in right now on ``device_type``: fp16 / bf16 autocast, else tf32
    when fp32 matmuls may use reduced precision, else fp32.

    >>> mode_in_effect("cpu")
    <Mode.FP32: 'fp32'>
    """
    if torch.is_autocast_enabled(device_type):
        return _AUTOCAST_MODES.get(torch.get_autocast_dtype(device_type), Mode.FP32)
    return Mode.FP32 if torch.get_float32_matmul_precision() == "highest" else Mode.TF32


class PrecisionObserver:
    """Keeps :attr:`mode`: the mode in effect at the latest training forward pass of ``model``
    (None until one ran). Passes under ``torch.no_grad`` (evaluation) are left out."""

    def __init__(self, model: nn.Module, device_type: str) -> None:
        self.device_type = device_type
        self.mode: Mode | None = None
        self._handle = _first_leaf(model).register_forward_pre_hook(self._observe)

    def _observe(self, module: nn.Module, args: object) -> None:
        if torch.is_grad_enabled():
            self.mode = mode_in_effect(self.device_type)

    def remove(self) -> None:
        self._handle.remove()


def _first_leaf(model: nn.Module) -> nn.Module:
    """The first module without children (the model itself when it has none): it runs inside
    whatever the model's own forward enters."""
    for module in model.modules():
        if not any(True for _ in module.children()):
            return module
    return model
