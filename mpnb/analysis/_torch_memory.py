"""The one place mpnb touches torch's private memory-accounting machinery.

torch counts a training step's memory by category in
``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch mode that follows every
tensor storage and tags it as a parameter, gradient, optimizer state, activation or temporary)
and runs a model on shapes alone under ``torch._subclasses.fake_tensor.FakeTensorMode``. Both
are private; a change in either fails ``tests/analysis/test_memory_account.py`` loudly, here,
instead of quietly changing the numbers mpnb shows.

This module adds two things torch does not count: which saved activations are autocast's
low-precision copies of weights, and (on a CPU, which keeps no allocator statistics) the peak
of torch's CPU allocator, read from the profiler's memory events.

Example:
    >>> model = torch.nn.Linear(64, 64)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> def step(model, optimizer):
    ...     model(torch.ones(8, 64)).sum().backward()
    ...     optimizer.step()
    >>> peak = tracked_peak(model, optimizer, [step, step], fake=True)
    >>> peak["parameters"], peak["gradients"]
    (16640, 16640)
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mpnb._stderr import native_stderr_without

__all__: list[str] = []

#: mpnb's category of each of torch's, by its name (autocast's weight copies are split out of
#: ACT later). The tracker is imported when first used: it brings torch.distributed (~1 s).
_CATEGORY_OF = {
    "PARAM": "parameters",
    "BUFFER": "parameters",
    "GRAD": "gradients",
    "OPT": "optimizer state",
    "ACT": "activations",
    "TEMP": "workspace",
    "OTH": "other",
}

Step = Callable[[nn.Module, torch.optim.Optimizer], None]


def fake_mode() -> Any:
    """A mode in which tensors have shapes, dtypes and devices but no data: a step under it
    allocates nothing and computes nothing. Real tensors met inside (a constant a model builds)
    are converted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def shape_only_copy(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` and a fresh optimizer of the same class and parameter groups, made of fake
    tensors (call inside ``with fake_mode():``). The real model and optimizer are untouched;
    the optimizer's state is not copied (it appears at the copy's first step)."""
    # a buffer (BatchNorm's running statistics and step count) is cloned here, a fake tensor:
    # deepcopy copies a plain tensor's storage for real, which a fake tensor cannot take
    twin = copy.deepcopy(model, {id(buffer): buffer.clone() for buffer in model.buffers()})
    twins = dict(zip((id(p) for p in model.parameters()), twin.parameters(), strict=True))
    groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [twins[id(parameter)] for parameter in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    return twin, type(optimizer)(groups)


def tracked_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: Sequence[Step], *, fake: bool
) -> dict[str, int]:
    """Bytes by category at the highest point of the calls ``step(model, optimizer)`` of
    each of ``steps`` in turn,
    with ``"weight copies"`` (autocast's low-precision copies of parameters, saved for
    backward) split out of ``"activations"`` and ``"total"`` their sum.

    ``fake=True`` runs on a shape-only copy (nothing is computed; the model and optimizer are
    untouched); ``fake=False`` runs the real step (it trains).
    """
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    with fake_mode() if fake else contextlib.nullcontext():
        if fake:
            model, optimizer = shape_only_copy(model, optimizer)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        copies: list[int] = []  # each step's weight copies, in bytes
        with tracker:
            for step in steps:
                with _weight_copies_into(found := {}, model):
                    step(model, optimizer)
                copies.append(sum(found.values()))
                tracker.reset_mod_stats()  # the tracker refuses a module's second forward otherwise
        # The model's device only: on a GPU the optimizer keeps small state on the CPU (Adam's
        # step counts), and torchao's fp8 layers are built on the meta device first.
        device = next((parameter.device for parameter in model.parameters()), None)
        peaks = {torch.device(d): v for d, v in tracker.get_tracker_snapshot("peak").items()}
        peak = peaks.get(device) or next((v for d, v in peaks.items() if d.type != "meta"), {})
    counted: dict[str, int] = {}
    for kind, size in peak.items():
        if isinstance(kind, _MemRefType):  # the other key is the total
            category = _CATEGORY_OF[kind.name]
            counted[category] = counted.get(category, 0) + int(size)
    # the tracker counts what the optimizer's step allocates as its state: beyond the state it
    # keeps (Adam's moments and step counts), the step's temporaries (foreach's copies the size
    # of the weights), which are the step's workspace
    if "optimizer state" in counted:
        kept = storage_bytes(
            value
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.device == device
        )
        step = counted["optimizer state"]
        counted["optimizer state"] = min(kept, step)
        counted["workspace"] = counted.get("workspace", 0) + step - counted["optimizer state"]
    in_copies = min(max(copies, default=0), counted.get("activations", 0))
    counted["weight copies"] = in_copies
    counted["activations"] = counted.get("activations", 0) - in_copies
    counted["total"] = sum(counted.values())
    return counted


@contextlib.contextmanager
def _weight_copies_into(copies: dict[int, int], model: nn.Module) -> Iterator[None]:
    """Note, in ``copies`` (storage -> bytes), each tensor saved for backward that autocast cast
    from one of ``model``'s parameters (its grad_fn is a copy whose input is the parameter),
    or a view of one."""
    parameters = {id(parameter) for parameter in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # a view of a copy (a linear layer saves its weight transposed) is the copy's memory
        source = tensor._base if tensor._is_view() else tensor
        function = source.grad_fn
        if function is not None and function.name() == "ToCopyBackward0":
            origin = function.next_functions[0][0]
            if id(getattr(origin, "variable", None)) in parameters:
                copies.update(_storage_sizes([source]))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one storage count once)."""
    return sum(_storage_sizes(tensors).values())


def _storage_sizes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    sizes = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        sizes[storage._cdata] = storage.nbytes()
    return sizes


def cpu_allocator_peak(work: Callable[[], None]) -> int:
    """The most bytes torch's CPU allocator held during ``work()`` above what it held before:
    every allocation, a kernel's own scratch buffers included, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with native_stderr_without(_TRACE_MARK.fullmatch):
        profiler.__enter__()
    try:
        work()
    finally:
        with native_stderr_without(_TRACE_MARK.fullmatch):
            profiler.__exit__(None, None, None)
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    held = peak = 0
    for _, change in events:
        held += change
        peak = max(peak, held)
    return peak


#: The line torch's profiling library (kineto, as built into torch 2.13) writes to stderr each
#: time a trace starts or stops. Its level ranks above errors, so torch's own quieting of kineto
#: leaves it on: in a notebook, two lines of red stderr for every step mpnb measures.
_TRACE_MARK = re.compile(rb"USDT:.*\] profiler_(start|stop)\r?\n?")
