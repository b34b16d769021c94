"""Recorders for the conformance tier: every aten op with its inputs and outputs, and every
torch function the model calls with its output dtypes."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from mpnb.oplists import OpLists, aten_overloads
from mpnb.oplists.lists import canonical_name

_CASTS = {"aten::_to_copy", "aten::to", "aten::detach", "aten::lift_fresh"}
# Allocators whose memory is uninitialised: their "output" is whatever was there before.
_UNINITIALISED = ("aten::empty", "aten::new_empty")


@dataclasses.dataclass
class AtenCall:
    name: str
    seeded: bool  # random or uninitialised: the outputs do not follow from the inputs
    inputs: Any
    outputs: Any


def _snapshot(value: Any) -> Any:
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, value)


class AtenRecorder(TorchDispatchMode):
    """Every aten op below autocast (after its casts), with inputs copied before and outputs after."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[AtenCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _snapshot((args, kwargs))
        result = func(*args, **kwargs)
        name = func._schema.name
        if name not in _CASTS:
            arbitrary = torch.Tag.nondeterministic_seeded in func.tags or name.startswith(
                _UNINITIALISED
            )
            self.calls.append(AtenCall(name, arbitrary, inputs, _snapshot(result)))
        return result


@dataclasses.dataclass
class FunctionCall:
    name: str
    input_dtypes: tuple[torch.dtype, ...]
    output_dtypes: tuple[torch.dtype, ...]


class FunctionRecorder(TorchFunctionMode):
    """The torch functions the model calls itself (this mode is off inside them), with dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[FunctionCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = canonical_name(getattr(func, "__name__", str(func)).strip("_"))
        floating = lambda values: tuple(  # noqa: E731
            v.dtype
            for v in tree_leaves(values)
            if isinstance(v, torch.Tensor) and v.is_floating_point()
        )
        self.calls.append(FunctionCall(name, floating((args, kwargs)), floating(result)))
        return result


def same(a: Any, b: Any) -> bool:
    """Bitwise equal, structure and dtypes included (NaN equals NaN)."""
    left, right = tree_leaves(a), tree_leaves(b)
    if len(left) != len(right):
        return False
    for x, y in zip(left, right):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            equal = x == y
            if x.is_floating_point():
                equal |= x.isnan() & y.isnan()
            if not bool(equal.all()):
                return False
        elif x != y:
            return False
    return True


@dataclasses.dataclass
class Comparison:
    """Unlisted ops of a listed run against the same ops of a plain autocast run."""

    checked: int = 0
    equal: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)
    listed_or_downstream: int = 0
    unaligned: int = 0


def listed_aten_names(lists: OpLists) -> set[str]:
    return {op._schema.name for name in (*lists.lower, *lists.fp32) for op in aten_overloads(name)}


def compare_unlisted(plain: list[AtenCall], listed: list[AtenCall], lists: OpLists) -> Comparison:
    """Align the two op sequences by name; where an op no list names got bitwise the same inputs,
    its outputs must be bitwise the same. Seeded random ops are left out (their outputs depend on
    the generator, not on their inputs)."""
    named = listed_aten_names(lists)
    matcher = difflib.SequenceMatcher(
        None, [c.name for c in plain], [c.name for c in listed], autojunk=False
    )
    result = Comparison()
    aligned = 0
    for block in matcher.get_matching_blocks():
        aligned += block.size
        for offset in range(block.size):
            a, b = plain[block.a + offset], listed[block.b + offset]
            if a.name in named or a.seeded or not same(a.inputs, b.inputs):
                result.listed_or_downstream += 1
                continue
            result.checked += 1
            if same(a.outputs, b.outputs):
                result.equal += 1
            else:
                result.mismatches.append(f"{a.name} (call {block.b + offset})")
    result.unaligned = len(listed) - aligned
    return result
