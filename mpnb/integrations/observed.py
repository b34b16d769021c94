"""The precision a framework really trains in, read from torch's autocast state and the weights'
dtype during the forward pass.

A precision is named by a mode (``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``: autocast on
fp32 weights, see :class:`~mpnb.precision.modes.Mode`) or, for weights kept in a low precision
(Lightning's ``"bf16-true"``, ``model.to(torch.bfloat16)``), ``"bf16-true"`` / ``"fp16-true"``;
float64 weights (``"64-true"``), which autocast never casts, are ``"fp64"``.
Frameworks enter autocast in different places: around the loss computation (Hugging Face
Trainer), around ``training_step`` (Lightning), inside a wrapped ``model.forward``
(Accelerate). All of them are active by the time the model's first leaf module runs, so a
forward pre-hook there, and on the first leaf that trains (a frozen teacher declared before the
student may run without grad), reads what torch will really do. Reading the state is host-only
(no device work). A module with a hook leaves torch's fast call path, so in eager mode the hook
is on only for some steps (see :class:`PrecisionObserver`).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> observer = PrecisionObserver(model, "cpu", interval=0.0)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     _ = model(torch.ones(1, 2))
    >>> observer.step_end()  # a loop calls this as each step ends, rearm() as the next starts
    'bf16'
    >>> observer.rearm()
    >>> _ = model.to(torch.bfloat16)(torch.ones(1, 2, dtype=torch.bfloat16))
    >>> observer.step_end()
    'bf16-true'
    >>> observer.remove()
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from mpnb._render import dtype_name
from mpnb.errors import InvalidChoiceError
from mpnb.precision.modes import Mode, parse_mode, registered

__all__: list[str] = []

#: Weights in these dtypes name the precision themselves: autocast never casts float64 (not
#: eligible), and weights already in bf16 / fp16 run in it with autocast or without.
_WEIGHT_PRECISIONS = {
    torch.bfloat16: "bf16-true",
    torch.float16: "fp16-true",
    torch.float64: "fp64",
}


def precisions() -> tuple[str, ...]:
    """Every precision a run can be asked for or observed in: the registered modes that change
    something, and weights in a low (or high) dtype.

    >>> precisions()
    ('fp32', 'tf32', 'fp16', 'bf16', 'fp8', 'mxfp8', 'nvfp4', 'bf16-true', 'fp16-true', 'fp64')
    """
    modes = (mode.name for mode in registered() if not mode().changes_nothing)
    return (*modes, *_WEIGHT_PRECISIONS.values())


def check_precision(precision: str | Mode | None) -> str | None:
    """The precision's name, refusing one that is not in :func:`precisions`.

    >>> check_precision(parse_mode("bf16")), check_precision("fp16-true"), check_precision(None)
    ('bf16', 'fp16-true', None)
    """
    if precision is None:
        return None
    name = precision.name if isinstance(precision, Mode) else precision
    if name not in precisions():
        raise InvalidChoiceError("precision", precision, precisions())
    return name


def mode_in_effect(device_type: str) -> Mode:
    """The mode torch runs in right now on ``device_type``: fp16 / bf16 autocast, else tf32
    when fp32 matmuls may use reduced precision, else fp32.

    >>> mode_in_effect("cpu")
    Mode('fp32')
    """
    return parse_mode(precision_in_effect(device_type))


def precision_in_effect(
    device_type: str, weights: torch.dtype | None = torch.float32, fp32_math: str | None = None
) -> str:
    """``"bf16-true"`` / ``"fp16-true"`` / ``"fp64"`` for weights in that dtype, else :func:`mode_in_effect`'s name.
    Host state only, a few hundred nanoseconds. ``fp32_math``: the name outside autocast
    (``"fp32"`` / ``"tf32"``) when already known; read from torch otherwise (which code that
    ``torch.compile`` traces cannot do without a graph break).

    >>> precision_in_effect("cpu", torch.bfloat16), precision_in_effect("cpu")
    ('bf16-true', 'fp32')
    """
    named = _WEIGHT_PRECISIONS.get(weights)
    if named is not None:
        return named
    if torch.is_autocast_enabled(device_type):
        return dtype_name(torch.get_autocast_dtype(device_type))
    return fp32_math or fp32_math_in_effect()


def fp32_math_in_effect() -> str:
    """``"tf32"`` when fp32 matmuls may use reduced precision, else ``"fp32"``.

    >>> fp32_math_in_effect()
    'fp32'
    """
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


class PrecisionObserver:
    """Reads the precision in effect during ``model``'s training forward passes (those with grad
    enabled; evaluation is left out), from autocast and the dtype of its first floating parameter
    that trains (``requires_grad``; else its first), read where its first leaf module runs and
    where its first leaf that trains runs, whichever runs with grad enabled.
    A loop calls :meth:`rearm` as each optimizer step starts and :meth:`step_end` as it ends.

    A hook left on a module slows each of its calls (the module leaves torch's fast call path:
    measured 10-40 us a step in a Lightning loop, 1-2% of a small model's step), so in eager mode
    the hook is on for a step only when that costs little: when the step before took at least
    ``slow_step`` seconds (under 0.5% of it), or ``interval`` seconds have passed since the last
    reading. A step with the hook on is read from its own last training pass (a pass that failed
    and was retried does not count); a step with it off repeats the last reading, at most
    ``interval`` seconds old. Inside code that ``torch.compile`` traced, the hook is part of the
    compiled code (recompiled when autocast changes), costs nothing there and stays on.
    A step with the hook on in which it never ran reads None: the model ran only in compiled code
    traced while the hook was off (or not at all), so nothing true can be said of it.
    """

    def __init__(
        self, model: nn.Module, device_type: str, interval: float = 0.25, slow_step: float = 0.01
    ) -> None:
        self.model, self.device_type = model, device_type
        self.interval, self.slow_step = interval, slow_step
        #: The latest reading (None until one).
        self.precision: str | None = None
        self._seen = False  # read since the hook went on (or since the last step_end)
        self._traced = False  # torch.compile traced the hook: it stays on
        self._read_at = self._step_started = -math.inf
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._arm()

    def rearm(self) -> None:
        """A step starts: put the hook on if the previous step was slow or the reading is old."""
        now = time.perf_counter()
        slow, self._step_started = now - self._step_started >= self.slow_step, now
        if not self._handles and (slow or now - self._read_at >= self.interval):
            self._arm()

    def step_end(self) -> str | None:
        """A step ended: its precision (see the class docstring); takes an eager hook off."""
        if not self._handles:
            return self.precision
        seen, self._seen = self._seen, False
        if not self._traced:
            self.remove()
        return self.precision if seen else None

    def _arm(self) -> None:
        # found again at each arming: a replaced first module or new parameter objects are followed
        self._weight = _first_weight(self.model)
        self._fp32_math = fp32_math_in_effect()
        self._seen = False
        self._handles = [
            leaf.register_forward_pre_hook(self._observe) for leaf in _observed_leaves(self.model)
        ]

    def _observe(self, module: nn.Module, args: object) -> None:
        if not torch.is_grad_enabled():
            return
        weights = self._weight.dtype if self._weight is not None else None
        # what is stored here is stored again at each compiled call
        if torch.compiler.is_compiling():
            self.precision = precision_in_effect(self.device_type, weights, self._fp32_math)
            self._traced = True
        else:
            self.precision = precision_in_effect(self.device_type, weights)
            self._read_at = time.perf_counter()
        self._seen = True

    def remove(self) -> None:
        """Take the hook off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _first_weight(model: nn.Module) -> nn.Parameter | None:
    """The first floating parameter that trains, else the first floating one (None without any).
    Stops at the first that trains: called at each arming."""
    first = None
    for parameter in model.parameters():
        if parameter.is_floating_point():
            if parameter.requires_grad:
                return parameter
            first = first if first is not None else parameter
    return first


def _observed_leaves(model: nn.Module) -> list[nn.Module]:
    """Where the hook goes: the first module without children (the model itself when it has none),
    which runs inside whatever the model's own forward enters, and the first one holding a
    parameter that trains, if another: a frozen part that runs first without grad does not
    stand for what trains, and a trainable part may be one the forward never calls.
    Stops at the first that trains: called at each arming."""
    first = None
    for module in model.modules():
        if not any(True for _ in module.children()):
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                return [first, module] if first is not None else [module]
            first = first if first is not None else module
    return [first if first is not None else model]
