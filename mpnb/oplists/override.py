"""Live enforcement of op lists: kernels on torch's Autocast dispatch keys, undone exactly.

torch.autocast decides each op's dtype in kernels registered on the ``AutocastCPU`` /
``AutocastCUDA`` / ``AutocastHPU`` ... dispatch keys. An :class:`OpListOverride` registers
its own kernel there for every listed op: the kernel casts the floating inputs (to fp32, or to
the current autocast dtype) and calls the op again below the autocast key. The kernels are
C++ (``list_kernel.cpp``, built on first use by :mod:`~mpnb.oplists.compiled_kernels`), or
Python (``torch.library.Library(..., "IMPL", key)`` with ``allow_override``) where no compiler
is. Nothing happens outside autocast, because those keys are only active inside it. An op whose torch kernel already
casts as the list says gets no kernel of its own (unless another override holds it), so a list
entry that only repeats torch's rule costs nothing. Releasing destroys the registrations,
which puts torch's own kernels back. Code compiled by torch.compile is dropped on each
change, so that it recompiles under the lists now in force.

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

import collections
import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from mpnb.errors import InvalidChoiceError
from mpnb.oplists import compiled_kernels
from mpnb.oplists.keys import AUTOCAST_KEYS
from mpnb.oplists.lists import OpLists, aten_overloads
from mpnb.oplists.torch_rules import torch_rule

__all__ = ["OpListOverride"]

#: How many applied overrides hold a kernel for each (operator, device type).
_HELD: collections.Counter[tuple[torch._ops.OpOverload, str]] = collections.Counter()


@functools.cache
def _state_argument_names() -> frozenset[str]:
    """Argument names torch's schemas mark as written by ops that also return a new result.

    ``aten::batch_norm`` updates ``running_mean`` and ``running_var`` through
    ``_native_batch_norm_legit``, whose schema says ``Tensor(a!) running_mean``; its own schema
    says nothing. ``self`` and ``out`` are left out: they name the written tensor of in-place and
    out= ops, which cannot be listed at all.
    """
    names: set[str] = set()
    for base in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, base, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            schema = getattr(packet, overload)._schema
            names.update(
                arg.name
                for arg in schema.arguments
                if arg.alias_info is not None and arg.alias_info.is_write and not arg.kwarg_only
            )
    return frozenset(names - {"self", "out"})


_ON_DEVICE: dict[str, Callable[[torch.Tensor], bool]] = {
    "cpu": torch.Tensor.is_cpu.__get__,
    "cuda": torch.Tensor.is_cuda.__get__,
}

#: The cheapest way to cast to each dtype from Python: ``x.bfloat16()`` parses no arguments and
#: costs about 2/3 of ``x.to(torch.bfloat16)``; both are ``aten::to`` with the same semantics.
_CAST_METHOD: dict[torch.dtype, Callable[[torch.Tensor], torch.Tensor]] = {
    torch.float32: torch.Tensor.float,
    torch.bfloat16: torch.Tensor.bfloat16,
    torch.float16: torch.Tensor.half,
}


def _cast_method(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return _CAST_METHOD.get(dtype) or (lambda tensor: tensor.to(dtype))


#: Floating dtypes torch.autocast may cast, by the dtype it casts to: every floating dtype but
#: float64 and the target itself (``is_eligible`` and ``cached_cast`` in ATen/autocast_mode.h).
_CASTABLE_TO: dict[torch.dtype, frozenset[torch.dtype]] = {}


def _castable_to(dtype: torch.dtype) -> frozenset[torch.dtype]:
    castable = _CASTABLE_TO.get(dtype)
    if castable is None:
        floating = {
            v for v in vars(torch).values() if isinstance(v, torch.dtype) and v.is_floating_point
        }
        castable = _CASTABLE_TO[dtype] = frozenset(floating - {torch.float64, dtype})
    return castable


def _holds_tensors(kind: torch._C.JitType) -> bool:
    """Whether an argument of this schema type can hold tensors: Tensor, Tensor?, Tensor[], Tensor?[]."""
    while isinstance(kind, (torch._C.OptionalType, torch._C.ListType)):
        kind = kind.getElementType()
    return isinstance(kind, torch._C.TensorType)


def _tensor_positions(op: torch._ops.OpOverload) -> tuple[int, ...]:
    """Indices of the schema arguments a list kernel may cast: those that can hold tensors.

    An op that keeps state (arguments such as ``running_mean``, see :func:`_state_argument_names`)
    has only its data, the first argument, cast: its weights and statistics stay in their own
    precision, as torch's mixed-precision BatchNorm kernels take them, so statistics update
    exactly and never round.
    """
    arguments = op._schema.arguments
    if any(arg.name in _state_argument_names() and _holds_tensors(arg.type) for arg in arguments):
        return (0,)
    return tuple(i for i, arg in enumerate(arguments) if _holds_tensors(arg.type))


def _kernel(
    op: torch._ops.OpOverload, device_type: str, key: str, to_fp32: bool
) -> Callable[..., Any]:
    """The Python list kernel for ``op``: cast as torch.autocast casts, call below autocast, keep writes.

    Only the tensors torch.autocast itself would cast are cast: floating, on the autocast
    device, not float64 (``is_eligible`` in ATen/autocast_mode.h), at :func:`_tensor_positions`.
    What an op writes into a cast copy (its version counter moved) is copied back to the caller.
    ``list_kernel.cpp`` does the same in C++ and is used instead where it could be built.

    The kernel runs for every call of a listed op, so everything that does not depend on the
    call is decided here, once, from the op's schema: which arguments can hold tensors, which
    dtypes are castable. No pytree, no per-call closures, no argument parsing for casts.
    """
    below_autocast = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    exclude_autocast = torch._C._ExcludeDispatchKeyGuard
    on_device = _ON_DEVICE.get(device_type, lambda tensor: tensor.device.type == device_type)
    call = op._op  # the overload's C++ entry point, without OpOverload.__call__'s Python frame
    arguments = op._schema.arguments
    # Where tensors can be: positions of the positional arguments, names of the keyword-only ones.
    tensor_positions = tuple(i for i in _tensor_positions(op) if not arguments[i].kwarg_only)
    tensor_keywords = tuple(
        arguments[i].name for i in _tensor_positions(op) if arguments[i].kwarg_only
    )
    tensor_type = torch.Tensor
    fixed = (
        (torch.float32, _cast_method(torch.float32), _castable_to(torch.float32))
        if to_fp32
        else None
    )
    autocast_dtype = torch.get_autocast_dtype

    def cast(value: Any, castable: frozenset, cast_to: Callable, copies: list) -> Any:
        if isinstance(value, tensor_type):
            if value.dtype in castable and on_device(value):
                copy = cast_to(value)
                # no version counter; only arguments no listed op writes are cast
                if not copy.is_inference():
                    copies.append((value, copy, copy._version))
                return copy
            return value
        if isinstance(value, (list, tuple)):  # Tensor[], Tensor?[]
            return type(value)([cast(item, castable, cast_to, copies) for item in value])
        return value  # None, or a Python number standing for a wrapped scalar tensor

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if fixed is None:
            dtype = autocast_dtype(device_type)
            cast_to, castable = _cast_method(dtype), _castable_to(dtype)
        else:
            dtype, cast_to, castable = fixed
        copies: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        # casts too, as torch's kernels cast: fewer keys to pass
        with exclude_autocast(below_autocast):
            args = list(args)
            for position in tensor_positions:
                if position < len(args):
                    args[position] = cast(args[position], castable, cast_to, copies)
            for name in tensor_keywords:
                if name in kwargs:
                    kwargs[name] = cast(kwargs[name], castable, cast_to, copies)
            result = call(*args, **kwargs)
        for original, copy, version in copies:
            if copy._version != version:
                with torch.no_grad():
                    original.copy_(copy)
        return result

    return kernel


class _CompiledCode:
    """torch.compile traces through the list kernels, so compiled code keeps the lists in force
    when it was compiled; torch cannot guard on dispatcher registrations. So a list change drops
    compiled code (``torch.compiler.reset()``), and it recompiles with the new lists at its next
    call, but only when something was compiled since mpnb's last reset: torch's count of compiled
    graphs says so. mpnb never imports torch's compiler itself: without it nothing was compiled."""

    graphs_at_reset = 0

    @classmethod
    def invalidate(cls) -> None:
        dynamo_utils = sys.modules.get("torch._dynamo.utils")
        if dynamo_utils is None:
            return
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        if graphs != cls.graphs_at_reset:
            torch.compiler.reset()
            cls.graphs_at_reset = graphs


def _impl_name(op: torch._ops.OpOverload) -> str:
    """``"softmax.int"``, or ``"linear"`` for a default overload: the name Library.impl takes."""
    schema = op._schema
    base = schema.name.split("::", 1)[1]
    return f"{base}.{schema.overload_name}" if schema.overload_name else base


class _KernelGroup(Protocol):
    def release(self) -> None: ...


class _PythonKernels:
    """Python list kernels on one dispatch key, held by a ``torch.library.Library``."""

    def __init__(
        self, key: str, device_type: str, kernels: list[tuple[torch._ops.OpOverload, bool]]
    ) -> None:
        self._library = torch.library.Library("aten", "IMPL", key)
        try:
            for op, to_fp32 in kernels:
                self._library.impl(
                    _impl_name(op), _kernel(op, device_type, key, to_fp32), key, allow_override=True
                )
        except BaseException:
            self._library._destroy()
            raise

    def release(self) -> None:
        self._library._destroy()


class OpListOverride:
    """Apply :class:`~mpnb.oplists.lists.OpLists` to torch.autocast on some device types.

    Use as a context manager, or call :meth:`apply` and :meth:`release`.

    Args:
        lists: the lists to enforce (copied: later edits of ``lists`` do not leak in).
        device_types: whose autocast to change; default all that torch knows.

    Example (:meth:`apply` and :meth:`release` instead of a ``with`` block):
        >>> override = OpListOverride(OpLists.of(fp32=["linear"]), ["cpu"])
        >>> override.apply()
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype
        torch.float32
        >>> override.release()
        >>> override.active
        False
    """

    def __init__(self, lists: OpLists, device_types: Iterable[str] = tuple(AUTOCAST_KEYS)) -> None:
        self.lists = lists.copy()
        self.device_types = list(device_types)
        unknown = [d for d in self.device_types if d not in AUTOCAST_KEYS]
        if unknown:
            raise InvalidChoiceError("device type", unknown[0], AUTOCAST_KEYS)
        self._groups: list[_KernelGroup] = []
        self._held: list[list[tuple[torch._ops.OpOverload, str]]] = []
        self._unhold: weakref.finalize | None = None

    @property
    def active(self) -> bool:
        """Whether the overrides are registered now."""
        return bool(self._groups)

    def apply(self, replacing: OpListOverride | None = None) -> None:
        """Register the kernels (a no-op when already applied).

        Args:
            replacing: an applied override this one is about to replace (released right after):
                its kernels do not count as another override holding an op.
        """
        if self._groups:
            return
        try:
            for device_type in self.device_types:
                self._groups.append(self._register(device_type, replacing))
        except BaseException:
            self.release()
            raise
        # dropped without release(), the groups remove their kernels when collected; so do the holds
        self._unhold = weakref.finalize(
            self, _HELD.subtract, [entry for held in self._held for entry in held]
        )
        _CompiledCode.invalidate()

    def _register(self, device_type: str, replacing: OpListOverride | None) -> _KernelGroup:
        key = AUTOCAST_KEYS[device_type]
        leaving = collections.Counter(
            entry for entries in (replacing._held if replacing else []) for entry in entries
        )
        held, kernels = [], []
        for to_fp32, names in ((True, self.lists.fp32), (False, self.lists.lower)):
            for name in names:
                for op in aten_overloads(name):
                    # torch_rule is first read when nobody holds the op (the first holder always
                    # meets _HELD == 0), so it probes torch's own kernel; later reads are cached.
                    held_elsewhere = _HELD[op, device_type] - leaving[op, device_type]
                    if held_elsewhere == 0 and torch_rule(op, device_type) == (
                        "fp32" if to_fp32 else "lower"
                    ):
                        continue  # torch's own kernel already does exactly this, at no Python cost
                    kernels.append((op, to_fp32))
                    held.append((op, device_type))
        with warnings.catch_warnings():
            # torch warns (once per process) that we replace its own autocast kernel: that is the point.
            warnings.filterwarnings(
                "ignore", message=r"(?s).*Overriding a previously registered kernel"
            )
            if compiled_kernels.kind() == "compiled":
                entries = [
                    (_impl_name(op), to_fp32, _tensor_positions(op)) for op, to_fp32 in kernels
                ]
                group: _KernelGroup = compiled_kernels.register(key, device_type, entries)
            else:
                group = _PythonKernels(key, device_type, kernels)
        _HELD.update(held)
        self._held.append(held)
        return group

    def release(self) -> None:
        """Remove every kernel this override registered; torch's own come back."""
        if not self._groups:
            return
        while self._groups:
            self._groups.pop().release()
        if self._unhold is not None:
            self._unhold()
        else:  # apply() failed part way
            _HELD.subtract([entry for held in self._held for entry in held])
        self._held.clear()
        self._unhold = None
        _CompiledCode.invalidate()

    def __enter__(self) -> OpListOverride:
        self.apply()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
