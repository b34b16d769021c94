"""Op lists against PyTorch's own CPU autocast test lists (torch.testing._internal.autocast_test_lists).

Every entry runs under plain torch.autocast and under each preset's lists, in bf16 and fp16: an op
a list names returns the listed dtype; any other op returns bitwise what plain autocast returns.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

from mpnb.oplists import OpListOverride, OpLists
from mpnb.oplists.lists import canonical_name
from tests.conformance.recording import same

pytest.importorskip("expecttest")  # torch's test lists import it
_frozen_before = torch.backends.flags_frozen()
from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists  # noqa: E402

# Importing torch's test utilities freezes torch.backends flags for the whole process
# (disable_global_flags); undo that, or every later test of mpnb's fp32-math switch fails.
if not _frozen_before and torch.backends.flags_frozen():
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

_LISTS = AutocastCPUTestLists(torch.device("cpu"))
_NAMESPACES = {"torch": torch, "nn": torch._C._nn, "methods": None}
ENTRIES = [
    (f"{group}:{entry[0]}", group, entry)
    for group in (
        "torch_16",
        "nn_16",
        "torch_fp32",
        "nn_fp32",
        "torch_need_autocast_promote",
        "torch_expect_builtin_promote",
        "methods_expect_builtin_promote",
    )
    for entry in getattr(_LISTS, group)
]


def _call(group: str, entry: tuple):
    name, args = entry[0], entry[1]
    kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
    namespace = _NAMESPACES[group.split("_")[0]]
    if namespace is None:
        return getattr(args[0], name)(*args[1:], **kwargs)
    return getattr(namespace, name)(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("preset", ["hmp", "resnet50"])
@pytest.mark.parametrize(
    ("label", "group", "entry"), ENTRIES, ids=[label for label, _, _ in ENTRIES]
)
def test_torchs_own_autocast_cases_under_the_lists(label, group, entry, preset, dtype):
    lists = OpLists.preset(preset)
    try:
        with torch.autocast("cpu", dtype=dtype):
            plain = _call(group, entry)
    # torch itself refuses some (bf16 inputs under fp16): so must the lists
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match=str(error).splitlines()[0]):
            with OpListOverride(lists, ["cpu"]), torch.autocast("cpu", dtype=dtype):
                _call(group, entry)
        return
    with OpListOverride(lists, ["cpu"]), torch.autocast("cpu", dtype=dtype):
        listed = _call(group, entry)
    op = canonical_name(entry[0].strip("_"))
    which = "fp32" if op in lists.fp32 else "lower" if op in lists.lower else None
    inputs = [
        t.dtype
        for t in tree_leaves(entry[1])
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if which is None:
        assert same(plain, listed), f"{label} is on no list, yet the lists changed its result"
    elif inputs and torch.float64 not in inputs:
        expected = torch.float32 if which == "fp32" else dtype
        outputs = [
            t.dtype
            for t in tree_leaves(listed)
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        assert outputs and set(outputs) == {expected}, (label, which, outputs)


def test_importing_torchs_test_lists_left_torch_backends_flags_settable():
    assert not torch.backends.flags_frozen()
