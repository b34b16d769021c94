"""Live enforcement of op lists: kernels on torch's Autocast dispatch keys, undone exactly.

torch.autocast decides each op's dtype in kernels registered on the ``AutocastCPU`` /
``AutocastCUDA`` / ``AutocastHPU`` ... dispatch keys. An :class:`OpListOverride` registers
its own kernel there for every listed op (``torch.library.Library(..., "IMPL", key)`` with
``allow_override``): the kernel casts the floating inputs (to fp32, or to the current
autocast dtype) and calls the op again below the autocast key. Nothing happens outside
autocast, because those keys are only active inside it. Releasing destroys the library
handles, which puts torch's own kernels back.

Example:
    >>> import torch
    >>> from mpnb.oplists.lists import OpLists
    >>> lists = OpLists()
    >>> lists.add("fp32", ["linear"])
    >>> linear, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    >>> with OpListOverride(lists, ["cpu"]), torch.autocast("cpu", dtype=torch.bfloat16):
    ...     linear(x).dtype
    torch.float32
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     linear(x).dtype
    torch.bfloat16
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from mpnb.errors import InvalidChoiceError
from mpnb.oplists.lists import OpLists, aten_overloads

__all__ = ["OpListOverride", "AUTOCAST_KEYS"]

#: Device type -> the dispatch key where torch.autocast's kernels live.
AUTOCAST_KEYS = {
    "cpu": "AutocastCPU",
    "cuda": "AutocastCUDA",
    "hpu": "AutocastHPU",
    "xpu": "AutocastXPU",
    "mps": "AutocastMPS",
}


def _caster(device_type: str, target: Callable[[], torch.dtype]) -> Callable[[Any], Any]:
    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type == device_type:
            dtype = target()
            return value if value.dtype == dtype else value.to(dtype)
        return value

    return cast


def _kernel(op: torch._ops.OpOverload, device_type: str, key: str, to_fp32: bool) -> Callable[..., Any]:
    below_autocast = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    cast = _caster(device_type, (lambda: torch.float32) if to_fp32 else (lambda: torch.get_autocast_dtype(device_type)))

    def kernel(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(cast, (args, kwargs))
        with torch._C._ExcludeDispatchKeyGuard(below_autocast):
            return op(*args, **kwargs)

    return kernel


def _impl_name(op: torch._ops.OpOverload) -> str:
    """``"softmax.int"``, or ``"linear"`` for a default overload: the name Library.impl takes."""
    schema = op._schema
    base = schema.name.split("::", 1)[1]
    return f"{base}.{schema.overload_name}" if schema.overload_name else base


class OpListOverride:
    """Apply :class:`~mpnb.oplists.lists.OpLists` to torch.autocast on some device types.

    Use as a context manager, or call :meth:`apply` and :meth:`release`.

    Args:
        lists: the lists to enforce (copied: later edits of ``lists`` do not leak in).
        device_types: whose autocast to change; default all that torch knows.
    """

    def __init__(self, lists: OpLists, device_types: Iterable[str] = tuple(AUTOCAST_KEYS)) -> None:
        self.lists = lists.copy()
        self.device_types = list(device_types)
        unknown = [d for d in self.device_types if d not in AUTOCAST_KEYS]
        if unknown:
            raise InvalidChoiceError("device type", unknown[0], AUTOCAST_KEYS)
        self._libraries: list[torch.library.Library] = []

    @property
    def active(self) -> bool:
        """Whether the overrides are registered now."""
        return bool(self._libraries)

    def apply(self) -> None:
        """Register the kernels (a no-op when already applied)."""
        if self._libraries:
            return
        try:
            for device_type in self.device_types:
                self._libraries.append(self._register(device_type))
        except BaseException:
            self.release()
            raise

    def _register(self, device_type: str) -> torch.library.Library:
        key = AUTOCAST_KEYS[device_type]
        library = torch.library.Library("aten", "IMPL", key)
        with warnings.catch_warnings():
            # torch warns (once per process) that we replace its own autocast kernel: that is the point.
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            for to_fp32, names in ((True, self.lists.fp32), (False, self.lists.lower)):
                for name in names:
                    for op in aten_overloads(name):
                        library.impl(_impl_name(op), _kernel(op, device_type, key, to_fp32), key, allow_override=True)
        return library

    def release(self) -> None:
        """Remove every kernel this override registered; torch's own come back."""
        while self._libraries:
            self._libraries.pop()._destroy()

    def __enter__(self) -> OpListOverride:
        self.apply()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
