"""Which op ran in which dtype, in which module: a trace of forward and backward.

:func:`trace` watches the aten operators that actually run (after autocast and the op
lists have cast their inputs) with a ``TorchDispatchMode``, and records for each the
phase, the module it ran in, its input dtypes and output dtype, the casts autocast
inserted, and how many of its calls gave an output holding an inf or a NaN (counted on the
device, read once when the block ends), so the op where an fp16 overflow appears stands out. Modules are found with global forward hooks (forward) and by tagging each
autograd node with the module that created it (backward), so no model needs changing.
Tracing only observes: every op runs exactly as it would have. ``detach`` calls (autograd's
own bookkeeping) are left out.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(dim=-1))
    >>> x = torch.randn(2, 4)
    >>> with trace() as t, torch.autocast("cpu", dtype=torch.bfloat16):
    ...     out = model(x)
    >>> [(row.module, row.op, row.output) for row in t.ops()]
    [('Sequential.0', 't', 'bf16'), ('Sequential.0', 'addmm', 'bf16'), ('Sequential.1', '_softmax', 'bf16')]
    >>> t.summary()
    '3 ops: 100% bf16, 3 casts'
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import html
import os
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mpnb._files import atomic_write
from mpnb._render import csv_cell, dtype_name

__all__ = ["Trace", "TraceRow", "trace"]

#: Output dtype names of floating ops, as the rows spell them.
_FLOATING = {
    dtype_name(dtype).removeprefix("torch.")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}

_MODULE_TAG = "mpnb.module"
_TOP_LEVEL = "(top level)"
_USER_CASTS = frozenset({"to", "type", "type_as", "half", "bfloat16", "float", "double"})
_BOOKKEEPING = frozenset({torch.ops.aten.detach.default})
#: A call number above any: "no call of this kind gave a non-finite output".
_NEVER = 2**62
_COLUMNS = ("phase", "module", "kind", "op", "inputs", "output", "count", "non-finite")


@dataclasses.dataclass(frozen=True)
class TraceRow:
    """One kind of call: the same op, module, phase and dtypes, counted.

    Attributes:
        phase: ``"forward"`` or ``"backward"``.
        module: the module path (``"DigitsCNN.features.0"``), or ``"(top level)"``.
        kind: ``"op"``, or ``"cast"`` for a dtype change autocast (or an op list) inserted.
        op: the aten operator name.
        inputs: the dtypes of its tensor inputs, comma-separated.
        output: the dtype of its first tensor output (``"-"`` when it has none).
        count: how many times it ran.
        nonfinite: how many of those calls gave an output holding an inf or a NaN.

    Example:
        >>> linear = torch.nn.Linear(4, 2)
        >>> with trace(linear) as t, torch.autocast("cpu", dtype=torch.bfloat16):
        ...     _ = linear(torch.randn(3, 4))
        >>> t.filter(op="addmm").rows
        [TraceRow(phase='forward', module='Linear', kind='op', op='addmm', inputs='bf16, bf16, bf16', output='bf16', count=1, nonfinite=0)]
        >>> _ = torch.nn.init.ones_(linear.weight)
        >>> x = torch.full((3, 4), 60000.0)
        >>> with trace(linear) as t, torch.autocast("cpu", dtype=torch.float16):
        ...     _ = linear(x)  # 240000: beyond fp16's 65504
        >>> t.filter(op="addmm").rows[0].nonfinite, t.summary()
        (1, '2 ops: 100% fp16, 3 casts; 1 call gave inf/NaN, first addmm in Linear (forward)')
    """

    phase: str
    module: str
    kind: str
    op: str
    inputs: str
    output: str
    count: int
    nonfinite: int = 0


@dataclasses.dataclass
class Trace:
    """The recorded rows, in order of first appearance.

    Example:
        >>> t = Trace([TraceRow("forward", "Net.fc", "op", "addmm", "bf16, bf16, bf16", "bf16", 3)])
        >>> str(t.filter(op="mm").summary())
        '0 ops, 0 casts'
    """

    rows: list[TraceRow] = dataclasses.field(default_factory=list)
    #: The row of the first call, in the order they ran, whose output held an inf or a NaN.
    first_nonfinite: TraceRow | None = None

    def ops(self) -> list[TraceRow]:
        """The rows of real ops (casts left out)."""
        return [row for row in self.rows if row.kind == "op"]

    def casts(self) -> int:
        """How many casts autocast and the op lists inserted."""
        return sum(row.count for row in self.rows if row.kind == "cast")

    def summary(self) -> str:
        """``"412 ops: 58% bf16, 42% fp32, 37 casts"``: shares of the floating ops by output dtype.

        Ops with other outputs (BatchNorm's int64 step counter, uint8 masks) are counted apart,
        as ``" (+12 non-floating: int64 10, uint8 2)"``, so they do not dilute the shares.
        """
        floating: collections.Counter[str] = collections.Counter()
        other: collections.Counter[str] = collections.Counter()
        for row in self.ops():
            (floating if row.output in _FLOATING else other)[row.output] += row.count
        total = sum(floating.values())
        shares = ", ".join(
            f"{round(100 * count / total)}% {dtype}" for dtype, count in floating.most_common()
        )
        text = f"{total} ops{': ' + shares if shares else ''}, {self.casts()} casts"
        if other:
            listed = ", ".join(f"{dtype} {count}" for dtype, count in other.most_common())
            text += f" (+{sum(other.values())} non-floating: {listed})"
        calls = sum(row.nonfinite for row in self.rows)
        first = self.first_nonfinite
        if calls and first is not None:
            text += (
                f"; {calls} call{'s' if calls > 1 else ''} gave inf/NaN, "
                f"first {first.op} in {first.module} ({first.phase})"
            )
        return text

    def filter(
        self, module: str | None = None, op: str | None = None, phase: str | None = None
    ) -> Trace:
        """The rows whose module path contains ``module``, whose op is ``op`` and phase ``phase``."""
        return Trace(
            [
                row
                for row in self.rows
                if (module is None or module in row.module)
                and (op is None or row.op == op.removeprefix("aten::"))
                and (phase is None or row.phase == phase)
            ]
        )

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write the rows as CSV with a header, each text as a spreadsheet shows it and never runs
        it. The file is replaced whole, never written through a link (see :func:`mpnb._files.atomic_write`)."""
        with atomic_write(path, newline="") as file:
            writer = csv.writer(file)
            writer.writerow(_COLUMNS)
            writer.writerows(map(csv_cell, dataclasses.astuple(row)) for row in self.rows)

    def __str__(self) -> str:
        table = [_COLUMNS] + [_cells(row) for row in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
            for line in table
        ]
        return "\n".join([self.summary(), *lines])

    def __repr__(self) -> str:
        return f"<mpnb.Trace {self.summary()}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{name}</th>" for name in _COLUMNS)
        body = "".join(
            ('<tr style="color:#c0392b;font-weight:bold">' if row.nonfinite else "<tr>")
            + "".join(f"<td>{html.escape(value)}</td>" for value in _cells(row))
            + "</tr>"
            for row in self.rows
        )
        return (
            f"<p><b>{html.escape(self.summary())}</b></p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        )


def _cells(row: TraceRow) -> tuple[str, ...]:
    """A row's cells as the tables show them: its non-finite count only where there is one."""
    *cells, nonfinite = (str(value) for value in dataclasses.astuple(row))
    return (*cells, nonfinite if row.nonfinite else "")


class _ModulePaths:
    """The module stack during forward, and each module's path under the outermost one called."""

    def __init__(self, root: torch.nn.Module | None) -> None:
        self.fixed_root = root
        self.stack: list[torch.nn.Module] = []
        self._names: dict[int, str] = {}
        self._roots: set[int] = set()

    def enter(self, module: torch.nn.Module, *unused: Any) -> None:
        root = self.fixed_root or (module if not self.stack else None)
        if root is not None and id(root) not in self._roots:
            self._roots.add(id(root))
            prefix = type(root).__name__
            for name, child in root.named_modules():
                self._names.setdefault(id(child), f"{prefix}.{name}" if name else prefix)
        self.stack.append(module)

    def leave(self, module: torch.nn.Module, *unused: Any) -> None:
        while self.stack and self.stack.pop() is not module:
            pass

    def current(self) -> str:
        if not self.stack:
            return _TOP_LEVEL
        module = self.stack[-1]
        return self._names.get(id(module), type(module).__name__)


class _TagNodes(TorchFunctionMode):
    """Tags the autograd nodes each torch call creates with the module it ran in; marks user casts."""

    def __init__(self, paths: _ModulePaths, oldest_node: int) -> None:
        super().__init__()
        self.paths = paths
        self.oldest_node = oldest_node
        self.user_casts = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        user_cast = getattr(func, "__name__", "") in _USER_CASTS
        self.user_casts += user_cast
        try:
            result = func(*args, **(kwargs or {}))
        finally:
            self.user_casts -= user_cast
        module = self.paths.current()
        for value in tree_leaves(result):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                self._tag(value.grad_fn, module)
        return result

    def _tag(self, node: Any, module: str) -> None:
        pending = [node]
        while pending:
            node = pending.pop()
            if (
                node is None
                or _MODULE_TAG in node.metadata
                or node._sequence_nr() <= self.oldest_node
            ):
                continue
            if type(node).__name__ == "AccumulateGrad":
                continue
            node.metadata[_MODULE_TAG] = module
            pending.extend(next_node for next_node, _ in node.next_functions)


def _dtypes(values: Any) -> list[str]:
    """Short dtype names of the tensors in ``values``: bf16, fp32, int64..."""
    return [
        dtype_name(value.dtype).removeprefix("torch.")
        for value in tree_leaves(values)
        if isinstance(value, torch.Tensor)
    ]


class _RecordOps(TorchDispatchMode):
    """Counts every aten call by phase, module, op and dtypes."""

    def __init__(self, paths: _ModulePaths, tags: _TagNodes) -> None:
        super().__init__()
        self.paths = paths
        self.tags = tags
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        #: Per key, how many calls gave a non-finite output, and the first such call's number:
        #: device tensors, read at the end (no read of the device per op).
        self.nonfinite: dict[tuple[str, ...], torch.Tensor] = {}
        self.first_bad: dict[tuple[str, ...], torch.Tensor] = {}
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _BOOKKEEPING:
            return result
        node = torch._C._current_autograd_node()
        if node is None:
            phase, module = "forward", self.paths.current()
        else:
            phase, module = "backward", node.metadata.get(_MODULE_TAG, _TOP_LEVEL)
        inputs, outputs = _dtypes((args, kwargs)), _dtypes(result)
        output = outputs[0] if outputs else "-"
        is_cast = (
            func is torch.ops.aten._to_copy.default
            and not (phase == "forward" and self.tags.user_casts)
            and args[0].is_floating_point()
            and inputs[0] != output
        )
        name = func._schema.name.removeprefix("aten::")
        key = (phase, module, "cast" if is_cast else "op", name, ", ".join(inputs), output)
        self.counts[key] += 1
        first = next((v for v in tree_leaves(result) if isinstance(v, torch.Tensor)), None)
        if first is not None and first.is_floating_point() and first.layout == torch.strided:
            self.calls += 1
            with torch._C.DisableTorchFunction():  # the check is no user op: _TagNodes skips it
                bad = torch.logical_not(torch.isfinite(first)).any()
                number = torch.where(bad, self.calls, _NEVER)
                if key in self.nonfinite:
                    self.nonfinite[key] = self.nonfinite[key] + bad
                    self.first_bad[key] = torch.minimum(self.first_bad[key], number)
                else:
                    self.nonfinite[key], self.first_bad[key] = bad.to(torch.int64), number
        return result

    def nonfinite_counts(self) -> tuple[dict[tuple[str, ...], int], tuple[str, ...] | None]:
        """Per key, how many calls gave a non-finite output, and the key of the first such call
        (None when none did): one read of the device."""
        keys = list(self.nonfinite)
        if not keys:
            return {}, None
        counts, firsts = (
            torch.stack([values[key].to("cpu") for key in keys]).tolist()
            for values in (self.nonfinite, self.first_bad)
        )
        earliest = min(range(len(keys)), key=firsts.__getitem__)
        first = keys[earliest] if firsts[earliest] < _NEVER else None
        return dict(zip(keys, counts)), first


class trace:  # noqa: N801 - a context manager used like torch.autocast
    """Record which aten op ran in which dtype and module, forward and backward.

    Args:
        model: the model whose module names to use. Default: the outermost module called.

    ``with trace() as t:`` gives a :class:`Trace` that fills in when the block ends.

    Example (forward under autocast, then backward, both traced):
        >>> linear = torch.nn.Linear(4, 2)
        >>> with trace(linear) as t:
        ...     with torch.autocast("cpu", dtype=torch.bfloat16):
        ...         loss = linear(torch.randn(3, 4)).float().pow(2).mean()
        ...     loss.backward()
        >>> [(row.phase, row.op, row.output) for row in t.filter(module="Linear").ops() if "mm" in row.op]
        [('forward', 'addmm', 'bf16'), ('backward', 'mm', 'bf16')]
        >>> linear.weight.grad.dtype  # autograd casts the gradient back to the weight's dtype
        torch.float32
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.result = Trace()

    def __enter__(self) -> Trace:
        seed = torch.zeros((), requires_grad=True)
        oldest_node = (seed * 1).grad_fn._sequence_nr()  # nodes from before the trace keep no tag
        paths = _ModulePaths(self.model)
        tags = _TagNodes(paths, oldest_node)
        self._recorder = _RecordOps(paths, tags)
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(paths.enter),
            hooks.register_module_forward_hook(paths.leave, always_call=True),
        ]
        self._modes = [tags, self._recorder]
        for mode in self._modes:
            mode.__enter__()
        return self.result

    def __exit__(self, *exc_info: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc_info)
        for handle in self._handles:
            handle.remove()
        nonfinite, first = self._recorder.nonfinite_counts()
        self.result.rows[:] = [
            TraceRow(*key, count, nonfinite.get(key, 0))
            for key, count in self._recorder.counts.items()
        ]
        self.result.first_nonfinite = next(
            (row for row in self.result.rows if first == dataclasses.astuple(row)[:6]), None
        )
