"""Per-op precision lists: ops that always run in the autocast dtype, ops that always run in fp32.

Habana's mixed-precision tool kept two such lists per model. An :class:`OpLists` holds
them, with where each entry came from (a preset, a file, the user), and resolves each
name to the aten operators it stands for (``cross_entropy`` is ``aten::cross_entropy_loss``).
Unknown names are refused with suggestions. Enforcement lives in :mod:`mpnb.opoverride`.

Example:
    >>> lists = OpLists.preset("resnet50")
    >>> sorted(lists.fp32)[:3]
    ['cross_entropy', 'log_softmax', 'nll_loss']
    >>> lists.add("fp32", ["linear"], source="me")
    >>> lists.source("fp32", "linear"), "linear" in lists.lower
    ('me', False)
    >>> lists.add("lower", ["softmx"])
    Traceback (most recent call last):
    ...
    mpnb.errors.InvalidChoiceError: unknown op 'softmx'; valid: softmax, log_softmax, ... Any other aten operator name ...
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable

import torch

from mpnb.errors import InvalidChoiceError

__all__ = ["OpLists", "PRESETS", "LIST_NAMES", "aten_overloads"]

LIST_NAMES = ("lower", "fp32")

# Names users write (Python / Habana) that differ from the aten operators they mean.
ALIASES: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("cross_entropy_loss",),
    "truediv": ("true_divide", "div"),
    "divide": ("divide", "div"),
    "nll_loss": ("nll_loss", "nll_loss_nd"),
    "dropout": ("dropout", "feature_dropout"),
}

# Habana's default lists for its mixed-precision tool, and its ResNet50 example lists.
_HMP_LOWER = (
    "addmm batch_norm bmm conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d dot dropout "
    "group_norm instance_norm layer_norm leaky_relu linear matmul mm mul mv relu t"
)
_HMP_FP32 = (
    "binary_cross_entropy binary_cross_entropy_with_logits cross_entropy div divide embedding embedding_bag log "
    "log2 log_softmax nll_loss smooth_l1_loss softmax topk truediv"
)
PRESETS: dict[str, tuple[str, str, str]] = {
    "torch": ("", "", "torch's own autocast rules, no overrides"),
    "hmp": (_HMP_LOWER, _HMP_FP32, "Habana's default mixed-precision lists"),
    "resnet50": (
        "addmm avg_pool2d bmm conv2d dot max_pool2d mm mv relu t linear",
        "cross_entropy log_softmax softmax nll_loss topk",
        "Habana's custom lists for ResNet50",
    ),
}


def _is_tensor_op(packet: object) -> bool:
    return isinstance(packet, torch._ops.OpOverloadPacket)


def aten_overloads(name: str) -> list[torch._ops.OpOverload]:
    """The functional aten overloads behind a list entry (out= and scalar-only variants left out)."""
    overloads = []
    for aten_name in ALIASES.get(name, (name,)):
        packet = getattr(torch.ops.aten, aten_name, None)
        if not _is_tensor_op(packet):
            continue
        for overload_name in packet.overloads():
            overload = getattr(packet, overload_name)
            schema = overload._schema
            takes_tensor = any("Tensor" in str(arg.type) for arg in schema.arguments)
            if takes_tensor and not schema.is_mutable:
                overloads.append(overload)
    return overloads


def _check_op(name: str) -> None:
    if not aten_overloads(name):
        known = sorted({n for n in dir(torch.ops.aten) if not n.startswith("_")} | set(ALIASES))
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        raise InvalidChoiceError("op", name, close, "Any other aten operator name (torch.ops.aten.<name>) works too.")


@dataclasses.dataclass
class OpLists:
    """Two op lists with provenance: ``lower`` (run in the autocast dtype) and ``fp32``.

    Attributes:
        lower: op name -> where the entry came from.
        fp32: op name -> where the entry came from.
    """

    lower: dict[str, str] = dataclasses.field(default_factory=dict)
    fp32: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def preset(cls, name: str) -> OpLists:
        """A named preset: ``torch`` (no overrides), ``hmp`` (Habana's defaults), ``resnet50``.

        Raises:
            InvalidChoiceError: an unknown preset.
        """
        if name not in PRESETS:
            raise InvalidChoiceError("preset", name, PRESETS)
        lower, fp32, _ = PRESETS[name]
        lists = cls()
        lists.add("lower", lower.split(), source=f"preset {name}")
        lists.add("fp32", fp32.split(), source=f"preset {name}")
        return lists

    @classmethod
    def from_files(
        cls, lower_path: str | os.PathLike[str] | None = None, fp32_path: str | os.PathLike[str] | None = None
    ) -> OpLists:
        """Read Habana-format files: one op per line, ``#`` starts a comment.

        Raises:
            InvalidChoiceError: a file names an unknown op (nothing is loaded).
        """
        lists = cls()
        for which, path in (("lower", lower_path), ("fp32", fp32_path)):
            if path is not None:
                lists.add(which, read_op_file(path), source=os.path.basename(os.fspath(path)))
        return lists

    def _list(self, which: str) -> dict[str, str]:
        if which not in LIST_NAMES:
            raise InvalidChoiceError(
                "list", which, LIST_NAMES, "lower = run in the autocast dtype; fp32 = run in fp32."
            )
        return self.lower if which == "lower" else self.fp32

    def add(self, which: str, ops: Iterable[str], source: str = "user") -> None:
        """Put ``ops`` on list ``which`` (taking them off the other list). All names are checked
        first: one bad name changes nothing."""
        target = self._list(which)
        names = list(ops)
        for name in names:
            _check_op(name)
        other = self.fp32 if target is self.lower else self.lower
        for name in names:
            other.pop(name, None)
            target[name] = source

    def remove(self, which: str, ops: Iterable[str]) -> None:
        """Take ``ops`` off list ``which``.

        Raises:
            InvalidChoiceError: an op that is not on the list (nothing is removed).
        """
        target = self._list(which)
        names = list(ops)
        for name in names:
            if name not in target:
                raise InvalidChoiceError(f"op on the {which} list", name, sorted(target) or ["(the list is empty)"])
        for name in names:
            del target[name]

    def source(self, which: str, name: str) -> str:
        """Where an entry came from."""
        return self._list(which)[name]

    def save(self, directory: str | os.PathLike[str]) -> tuple[str, str]:
        """Write ``lower_list.txt`` and ``fp32_list.txt`` into ``directory``; return their paths."""
        os.makedirs(directory, exist_ok=True)
        paths = []
        for which in LIST_NAMES:
            path = os.path.join(directory, f"{which}_list.txt")
            with open(path, "w", encoding="utf-8") as file:
                file.write(f"# mpnb {which} op list\n" + "".join(f"{name}\n" for name in sorted(self._list(which))))
            paths.append(path)
        return paths[0], paths[1]

    def copy(self) -> OpLists:
        """An independent copy."""
        return OpLists(dict(self.lower), dict(self.fp32))

    def __bool__(self) -> bool:
        return bool(self.lower or self.fp32)


def read_op_file(path: str | os.PathLike[str]) -> list[str]:
    """Op names from a file: one per line; blank lines and ``#`` comments ignored."""
    with open(path, encoding="utf-8") as file:
        return [line.split("#", 1)[0].strip() for line in file if line.split("#", 1)[0].strip()]
