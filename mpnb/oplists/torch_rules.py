"""torch's own autocast rules, read from the installed torch.

torch.autocast keeps its op lists in C++ (``autocast_mode.cpp``) and has no public way to
list them. The dispatcher knows which operators have a kernel on a device's Autocast key;
what each kernel does is found by running it once: with fp32 inputs, a kernel that casts
to the low dtype is on the lower-precision list; with low-precision inputs, one that casts
to fp32 is on the fp32 list; the rest (``cat``, ``stack``: promote to the widest input)
have some other rule. The probe stops each op right after autocast's casts, so shapes
and values never matter and nothing is computed.

Example:
    >>> rules = autocast_rules("cpu")
    >>> "mm" in rules.lower, "nll_loss" in rules.fp32, "cat" in rules.other
    (True, True, True)
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpnb._stderr import native_stderr_without
from mpnb.oplists.keys import AUTOCAST_KEYS

__all__ = ["AutocastRules", "autocast_rules"]


@dataclasses.dataclass(frozen=True)
class AutocastRules:
    """What torch.autocast does per op on one device type.

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``...
        lower: ops autocast runs in the low dtype.
        fp32: ops autocast runs in fp32.
        other: ops with some other autocast rule (promotion), or that could not be probed.
        probed: False when the device is absent, so every op with a kernel is in ``other``.

    Example:
        >>> rules = autocast_rules("cpu")
        >>> rules.device_type, rules.probed
        ('cpu', True)
        >>> "conv2d" in rules.lower, "mse_loss" in rules.fp32, "stack" in rules.other
        (True, True, True)
    """

    device_type: str
    lower: tuple[str, ...]
    fp32: tuple[str, ...]
    other: tuple[str, ...]
    probed: bool


class _CastsSeen(Exception):
    """Raised by the probe at the first real op: autocast's casts are done by then."""


class _CastProbe(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.cast_to: list[torch.dtype] = []
        self.op_dtype: torch.dtype | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.cast_to.append(kwargs.get("dtype"))
            return func(*args, **kwargs)
        self.op_dtype = kwargs.get("dtype")
        raise _CastsSeen


def _sample(type_text: str, device: str, dtype: torch.dtype) -> Any:
    """A value of a schema type; optional arguments are left out (None)."""
    if type_text.startswith("Optional[") or type_text.endswith("?"):
        return None
    samples = {
        "Tensor": lambda: torch.ones(2, 2, 2, 2, device=device, dtype=dtype),
        "List[Tensor]": lambda: [torch.ones(2, 2, device=device, dtype=dtype)] * 2,
        "int": lambda: 1,
        "SymInt": lambda: 1,
        "float": lambda: 1.0,
        "bool": lambda: False,
        "number": lambda: 1,
        "str": lambda: "fro",
        "List[float]": lambda: [1.0],
    }
    if type_text.startswith(("List[int]", "List[SymInt]")):
        return [1]
    return samples[type_text]()


def _casts(
    op: torch._ops.OpOverload, device: str, low: torch.dtype, inputs: torch.dtype
) -> _CastProbe:
    args, kwargs = [], {}
    for argument in op._schema.arguments:
        if argument.has_default_value():
            continue
        value = _sample(str(argument.type), device, inputs)
        if argument.kwarg_only:
            kwargs[argument.name] = value
        else:
            args.append(value)
    probe = _CastProbe()
    try:
        with torch.autocast(device, dtype=low), probe:
            op(*args, **kwargs)
    except Exception:
        pass
    return probe


def _rule(op: torch._ops.OpOverload, device: str, low: torch.dtype) -> str:
    try:
        if low in _casts(op, device, low, torch.float32).cast_to:
            return "lower"
        from_low = _casts(op, device, low, low)
    except KeyError:  # an argument type the probe cannot make
        return "other"
    return (
        "fp32"
        if torch.float32 in from_low.cast_to or from_low.op_dtype == torch.float32
        else "other"
    )


@functools.cache
def torch_rule(op: torch._ops.OpOverload, device_type: str) -> str | None:
    """``"lower"``, ``"fp32"`` or ``"other"``: what torch's own autocast kernel for ``op`` does on
    ``device_type``; None when torch has none there, or the device is absent and cannot be probed.

    Read once per process and op, like :func:`autocast_rules`, while no mpnb kernel holds the op.

    Example:
        >>> torch_rule(torch.ops.aten.mm.default, "cpu"), torch_rule(torch.ops.aten.relu.default, "cpu")
        ('lower', None)
    """
    if not _device_present(device_type):
        return None
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), AUTOCAST_KEYS[device_type]):
        return None
    low = torch.get_autocast_dtype(device_type)
    # Deprecated ops (torch.lu, torch.qr...) print a one-time note, from Python and from C++
    # straight to the process's stderr, which Jupyter shows: the probe is not a use of them.
    with torch.no_grad(), warnings.catch_warnings(), native_stderr_without():
        warnings.simplefilter("ignore")
        return _rule(op, device_type, torch.bfloat16 if low == torch.float32 else low)


def _overload(qualified_name: str) -> torch._ops.OpOverload:
    base, _, overload = qualified_name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _entry(qualified_name: str) -> str:
    return qualified_name.removeprefix("aten::")


@functools.cache
def autocast_rules(device_type: str) -> AutocastRules:
    """torch's autocast rules on ``device_type``, read once per process.

    Call it while no op lists are applied (mpnb's session does): an override is a
    kernel on the same key and would be read as torch's own.

    Example:
        >>> rules = autocast_rules("cpu")
        >>> "linear" in rules.lower, "linear" in rules.fp32
        (True, False)
        >>> autocast_rules("cpu") is rules  # read once per process
        True
    """
    key = AUTOCAST_KEYS[device_type]
    names = sorted(
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    )
    if not _device_present(device_type):
        return AutocastRules(device_type, (), (), tuple(_entry(n) for n in names), probed=False)
    found: dict[str, list[str]] = {"lower": [], "fp32": [], "other": []}
    for name in names:
        found[torch_rule(_overload(name), device_type)].append(_entry(name))
    return AutocastRules(
        device_type, tuple(found["lower"]), tuple(found["fp32"]), tuple(found["other"]), probed=True
    )


def _device_present(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    module = getattr(torch, device_type, None)
    return bool(module is not None and getattr(module, "is_available", lambda: False)())
