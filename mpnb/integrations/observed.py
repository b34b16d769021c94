"""The precision a framework really trains in, read from torch's autocast state and the weights'
dtype during the forward pass.

A precision is named by a mode (``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``: autocast on
fp32 weights, see :class:`~mpnb.precision.modes.Mode`) or, for weights kept in a low precision
(Lightning's ``"bf16-true"``, ``model.to(torch.bfloat16)``), ``"bf16-true"`` / ``"fp16-true"``.
Frameworks enter autocast in different places: around the loss computation (Hugging Face
Trainer), around ``training_step`` (Lightning), inside a wrapped ``model.forward``
(Accelerate). All of them are active by the time the model's first leaf module runs, so a
forward pre-hook there reads what torch will really do. Reading the state is host-only
(no device work). In eager mode the hook reads once and comes off until the next step that
starts a quarter second later: a module with a hook leaves torch's fast call path.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> observer = PrecisionObserver(model, "cpu", interval=0.0)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     _ = model(torch.ones(1, 2))
    >>> observer.precision
    'bf16'
    >>> observer.rearm()  # a loop does this as each step starts
    >>> _ = model.to(torch.bfloat16)(torch.ones(1, 2, dtype=torch.bfloat16))
    >>> observer.precision
    'bf16-true'
    >>> observer.remove()
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from mpnb.errors import InvalidChoiceError
from mpnb.precision.modes import Mode

__all__ = ["PRECISIONS", "PrecisionObserver", "check_precision", "mode_in_effect", "precision_in_effect"]

_AUTOCAST_NAMES = {torch.float16: Mode.FP16.value, torch.bfloat16: Mode.BF16.value}
_LOW_PRECISION_WEIGHTS = {torch.bfloat16: "bf16-true", torch.float16: "fp16-true"}
#: Every precision a run can be asked for or observed in.
PRECISIONS = (*(mode.value for mode in Mode if mode is not Mode.OFF), *_LOW_PRECISION_WEIGHTS.values())


def check_precision(precision: str | Mode | None) -> str | None:
    """The precision's name, refusing one that is not in :data:`PRECISIONS`.

    >>> check_precision(Mode.BF16), check_precision("fp16-true"), check_precision(None)
    ('bf16', 'fp16-true', None)
    """
    if precision is None:
        return None
    name = precision.value if isinstance(precision, Mode) else precision
    if name not in PRECISIONS:
        raise InvalidChoiceError("precision", precision, PRECISIONS)
    return name


def mode_in_effect(device_type: str) -> Mode:
    """The mode torch runs in right now on ``device_type``: fp16 / bf16 autocast, else tf32
    when fp32 matmuls may use reduced precision, else fp32.

    >>> mode_in_effect("cpu")
    <Mode.FP32: 'fp32'>
    """
    return Mode(precision_in_effect(device_type))


def precision_in_effect(device_type: str, weights: torch.dtype | None = torch.float32) -> str:
    """``"bf16-true"`` / ``"fp16-true"`` for weights in that dtype, else :func:`mode_in_effect`'s name.
    Host state only, a few hundred nanoseconds.

    >>> precision_in_effect("cpu", torch.bfloat16), precision_in_effect("cpu")
    ('bf16-true', 'fp32')
    """
    low = _LOW_PRECISION_WEIGHTS.get(weights)
    if low is not None:
        return low
    if torch.is_autocast_enabled(device_type):
        return _AUTOCAST_NAMES.get(torch.get_autocast_dtype(device_type), "fp32")
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


class PrecisionObserver:
    """Keeps :attr:`precision`: the precision in effect at a recent training forward pass of
    ``model`` (None until one ran), from autocast and the dtype of the model's first floating
    parameter. Passes under ``torch.no_grad`` (evaluation) are left out.

    A hook left on a module slows each of its calls (it leaves torch's fast call path: measured
    10-40 us a step in a Lightning loop, 1-2% of a small model's step). So in eager mode the hook
    reads once and takes itself off; :meth:`rearm`, called as a step starts, puts it back once
    ``interval`` seconds have passed since the reading: each row holds a reading at most that old.
    Inside code that ``torch.compile`` traces the hook stays on: compiled code keeps no guard on
    hooks (a hook taken off and put back is not seen), and there the hook costs nothing, since the
    reading is part of the compiled code, recompiled when autocast changes.
    """

    def __init__(self, model: nn.Module, device_type: str, interval: float = 0.25) -> None:
        self.device_type, self.interval = device_type, interval
        self.precision: str | None = None
        self._weight = next((p for p in model.parameters() if p.is_floating_point()), None)
        self._leaf = _first_leaf(model)
        self._read_at = -math.inf
        self._handle: torch.utils.hooks.RemovableHandle | None = None
        self._arm()

    def rearm(self) -> None:
        """Read again at the next training forward pass if the hook is off and ``interval``
        seconds have passed since the last reading."""
        if self._handle is None and time.perf_counter() - self._read_at >= self.interval:
            self._arm()

    def _arm(self) -> None:
        self._handle = self._leaf.register_forward_pre_hook(self._observe)

    def _observe(self, module: nn.Module, args: object) -> None:
        if torch.is_grad_enabled():
            self.precision = precision_in_effect(
                self.device_type, self._weight.dtype if self._weight is not None else None
            )
            if not torch.compiler.is_compiling():
                self._read_at = time.perf_counter()
                self.remove()  # torch calls the hooks from a copy of their list: safe from inside one

    def remove(self) -> None:
        """Take the hook off (nothing more is read until :meth:`rearm`)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _first_leaf(model: nn.Module) -> nn.Module:
    """The first module without children (the model itself when it has none): it runs inside
    whatever the model's own forward enters."""
    for module in model.modules():
        if not any(True for _ in module.children()):
            return module
    return model
