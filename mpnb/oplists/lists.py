"""Per-op precision lists: ops that always run in the autocast dtype, ops that always run in fp32.

Habana's mixed-precision tool kept two such lists per model. An :class:`OpLists` holds
them, with where each entry came from (a preset, a file, the user), and resolves each
name to the aten operators it stands for (``cross_entropy`` is ``aten::cross_entropy_loss``).
Unknown names are refused with suggestions. Enforcement lives in :mod:`mpnb.oplists.override`.

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
    mpnb.errors.InvalidChoiceError: unknown op 'softmx'; valid: softmax. Any other aten operator name ...
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import functools
import os
from collections.abc import Iterable, Mapping

import torch

from mpnb._files import atomic_write, open_regular
from mpnb.errors import InvalidChoiceError, MpnbError, quoted

__all__ = [
    "OpLists",
    "PRESETS",
    "LIST_NAMES",
    "aten_overloads",
    "canonical_name",
    "check_op",
    "read_op_file",
]

#: The largest op-list file read (1 MiB).
MAX_OP_FILE_BYTES = 2**20

#: The two lists: ops that run in the autocast (lower) dtype, and ops that always run in fp32.
LIST_NAMES = ("lower", "fp32")

# Habana called the lower-precision list the BF16 list; both names work.
LIST_ALIASES = {"bf16": "lower"}

# Prefixes users write before an op name: aten's, torch's Python namespaces.
_PREFIXES = (
    "torch.ops.aten.",
    "aten::",
    "aten.",
    "torch.nn.functional.",
    "nn.functional.",
    "F.",
    "torch.",
)

# Names users write (Python / Habana) that differ from the aten operators they mean.
ALIASES: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("cross_entropy_loss",),
    "truediv": ("true_divide", "div"),
    "divide": ("divide", "div"),
    "nll_loss": ("nll_loss", "nll_loss_nd"),
    "dropout": ("dropout", "feature_dropout"),
}

# Habana's default lists for its mixed-precision tool, and its ResNet50 example lists. Habana's
# lower list also holds `t`: a transpose is a view, which keeps its input's dtype, so it is left out
# here (the matmuls that consume it are on the list).
_HMP_LOWER = (
    "addmm batch_norm bmm conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d dot dropout "
    "group_norm instance_norm layer_norm leaky_relu linear matmul mm mul mv relu"
)
_HMP_FP32 = (
    "binary_cross_entropy binary_cross_entropy_with_logits cross_entropy div divide embedding embedding_bag log "
    "log2 log_softmax nll_loss smooth_l1_loss softmax topk truediv"
)
#: Named lists to start from: name -> (lower ops, fp32 ops, what they are).
PRESETS: dict[str, tuple[str, str, str]] = {
    "torch": ("", "", "torch's own autocast rules, no overrides"),
    "hmp": (_HMP_LOWER, _HMP_FP32, "Habana's default mixed-precision lists"),
    "resnet50": (
        "addmm avg_pool2d bmm conv2d dot max_pool2d mm mv relu linear",
        "cross_entropy log_softmax softmax nll_loss topk",
        "Habana's custom lists for ResNet50",
    ),
}


def _is_tensor_op(packet: object) -> bool:
    return isinstance(packet, torch._ops.OpOverloadPacket)


def canonical_name(name: str) -> str:
    """The list entry for a name as users write it.

    Example:
        >>> [canonical_name(n) for n in ("aten::addmm", "F.softmax", "torch.nn.functional.linear", "softmax.int")]
        ['addmm', 'softmax', 'linear', 'softmax.int']
    """
    name = name.strip()
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _overloads_of(aten_name: str) -> list[torch._ops.OpOverload]:
    base, _, only = aten_name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if not _is_tensor_op(packet):
        return []
    names = packet.overloads()
    if only:
        names = [n for n in names if n == only]
    overloads = [getattr(packet, n) for n in names]
    # TorchScript-only overloads (eq.Tensor_list, index.Tensor_hacked_twin) have no dispatcher entry.
    return [op for op in overloads if torch._C._dispatch_has_kernel(op.name())]


#: The ops autocast (and a list kernel) casts with: listing one would make every cast recurse.
_CASTS = {"aten::_to_copy", "aten::to"}


def _not_castable_because(overload: torch._ops.OpOverload) -> str | None:
    """Why autocast cannot cast this overload's inputs without changing what it means, or None.

    torch.autocast itself only casts ops that take tensors and return new ones: casting the
    input of an op that writes into it (in place, ``out=``) would lose the write, and casting
    the input of a view op would turn the view into a copy.
    """
    schema = overload._schema
    if schema.name in _CASTS:
        return "is the cast itself: autocast casts with it"
    if not any("Tensor" in str(arg.type) for arg in schema.arguments):
        return "takes no tensors"
    if schema.is_mutable:
        return "writes into its input (in place or out=)"
    if any(result.alias_info is not None for result in schema.returns):
        return "returns a view of its input, and a view keeps its input's dtype"
    return None


def aten_overloads(name: str) -> list[torch._ops.OpOverload]:
    """The aten overloads behind a list entry that autocast can cast (in-place, out=, view and
    scalar-only variants left out).

    Example:
        >>> [str(op) for op in aten_overloads("softmax")]
        ['aten.softmax.int']
    """
    name = canonical_name(name)
    return [
        overload
        for aten_name in ALIASES.get(name, (name,))
        for overload in _overloads_of(aten_name)
        if _not_castable_because(overload) is None
    ]


@functools.cache
def _covered(entry: str) -> frozenset[str]:
    """The aten overloads a list entry stands for (its own name where it has none that
    autocast casts): two entries that share one name the same op."""
    overloads = frozenset(str(overload) for overload in aten_overloads(entry))
    return overloads or frozenset({_spelled(canonical_name(entry))})


def _check_apart(lower: Iterable[str], fp32: Iterable[str]) -> None:
    """Refuse lists that name one op on both, by one name or under two spellings (``softmax``
    and ``softmax.int``, ``div`` and ``truediv``): the lower list would win, whatever the fp32
    list says.

    >>> _check_apart(["softmax"], ["linear"])
    >>> _check_apart(["F.softmax"], ["softmax"])
    Traceback (most recent call last):
    ...
    mpnb.errors.MpnbError: op 'softmax' is on both the lower and the fp32 list; name each op on one list
    """
    lower, fp32 = list(lower), list(fp32)
    both = sorted(
        {_spelled(canonical_name(n)) for n in lower} & {_spelled(canonical_name(n)) for n in fp32}
    )
    if both:
        raise MpnbError(
            f"op {both[0]!r} is on both the lower and the fp32 list; name each op on one list"
        )
    for low in lower:
        for high in fp32:
            if _covered(low) & _covered(high):
                raise MpnbError(
                    f"{_spelled(canonical_name(low))!r} (lower) and "
                    f"{_spelled(canonical_name(high))!r} (fp32) name the same op "
                    f"({sorted(_covered(low) & _covered(high))[0]}); put it on one list"
                )


def _spelled(entry: str) -> str:
    """``entry`` as torch spells it (``LSTM`` -> ``lstm``, ``softmax.INT`` -> ``softmax.int``), or
    as written when no operator has that name in any case. aten has no two operator names
    that differ only by case (``mT`` is the only spelling of its name), so case never chooses."""
    return _names_by_case().get(entry.lower(), entry)


@functools.cache
def _names_by_case() -> dict[str, str]:
    names = {
        name[len("aten::") :]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
    }
    names |= {name.split(".", 1)[0] for name in names} | set(ALIASES)
    return {name.lower(): name for name in names}


def _op_names(ops: str | Iterable[str]) -> list[str]:
    """One name or several: a string is one op name, never the letters of one."""
    return [ops] if isinstance(ops, str) else list(ops)


def check_op(name: str) -> str:
    """The canonical entry for ``name``, or an error that says why it cannot be on a list.
    Case does not matter: ``LSTM`` is ``lstm``.

    Raises:
        InvalidChoiceError: an unknown name or overload, with close matches.
        MpnbError: an operator autocast must not cast: it takes no tensors, writes into its
            input (in place, ``out=``) or returns a view of it.

    Example:
        >>> check_op("F.softmax"), check_op("aten::addmm"), check_op("LSTM")
        ('softmax', 'addmm', 'lstm')
        >>> check_op("relu_")
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: op 'relu_' cannot be on a list: aten::relu_ writes into its input (in place or out=); ... List 'relu' for the op that returns a new tensor.
    """
    entry = _spelled(canonical_name(name))
    if aten_overloads(entry):
        return entry
    base, dot, _ = entry.partition(".")
    if dot and aten_overloads(base) and not _overloads_of(entry):
        valid = [f"{base}.{op._schema.overload_name or 'default'}" for op in aten_overloads(base)]
        raise InvalidChoiceError(
            f"overload of {base}", name, valid, f"Or write just {base!r} for all of them."
        )
    refused = _overloads_of(entry) or (_overloads_of(base) if dot else [])
    if refused:
        # The reason of the op's own (not out=) variants: `arange` takes no tensors; `relu_` writes.
        own = [op for op in refused if "out" not in op._schema.overload_name.split("_")] or refused
        reason = " / ".join(sorted({_not_castable_because(op) for op in own}))
        functional = base.rstrip("_")
        hint = (
            f" List {functional!r} for the op that returns a new tensor."
            if functional != entry and aten_overloads(functional)
            else ""
        )
        raise MpnbError(
            f"op {name!r} cannot be on a list: aten::{entry} {reason}; torch.autocast never casts such ops, "
            f"and a cast copy would lose what the op shares with its input.{hint}"
        )
    close = (
        difflib.get_close_matches(entry, _listable_names(), n=3, cutoff=0.75)
        if len(entry) <= 64
        else []
    )
    if not close:
        raise MpnbError(
            f"unknown op {quoted(name)}: no operator has a close name. Any aten operator name "
            "(torch.ops.aten.<name>) or an alias (F.softmax) works."
        )
    raise InvalidChoiceError(
        "op", name, close, "Any other aten operator name (torch.ops.aten.<name>) works too."
    )


@functools.cache
def _listable_names() -> list[str]:
    """Names a user would put on a list: public aten names that are not in-place variants, and aliases."""
    # every registered aten operator (dir(torch.ops.aten) lists only those already looked up)
    bases = {
        name[len("aten::") :].split(".", 1)[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
    }
    return sorted(
        {n for n in bases if n and not n.startswith("_") and not n.endswith("_")} | set(ALIASES)
    )


@dataclasses.dataclass
class OpLists:
    """Two op lists with provenance: ``lower`` (run in the autocast dtype) and ``fp32``.

    Built from op names (``OpLists(fp32=["lstm"])``, as :meth:`of` builds them) or from
    entries with their sources (``{"lstm": "user"}``, as :meth:`copy` makes them).

    Attributes:
        lower: op name -> where the entry came from.
        fp32: op name -> where the entry came from.

    Example:
        >>> OpLists(fp32=["LSTM"])
        OpLists(lower={}, fp32={'lstm': 'user'})
        >>> lists = OpLists.of(lower=["linear"], fp32=["F.softmax"])
        >>> lists.add("fp32", ["linear"], source="me")  # moves it off the lower list
        >>> lists
        OpLists(lower={}, fp32={'softmax': 'user', 'linear': 'me'})
        >>> bool(lists), bool(OpLists())
        (True, False)
    """

    lower: dict[str, str] = dataclasses.field(default_factory=dict)
    fp32: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        given = {"lower": self.lower, "fp32": self.fp32}
        if all(isinstance(entries, Mapping) for entries in given.values()):
            self.lower, self.fp32 = dict(self.lower), dict(self.fp32)
            _check_apart(list(self.lower), list(self.fp32))
            return
        names = {
            which: list(entries) if isinstance(entries, Mapping) else _op_names(entries)
            for which, entries in given.items()
        }
        built = OpLists.of(names["lower"], names["fp32"])
        for which, entries in given.items():  # entries given with their sources keep them
            if isinstance(entries, Mapping):
                built._list(which).update({check_op(n): s for n, s in entries.items()})
        self.lower, self.fp32 = built.lower, built.fp32

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
    def of(
        cls, lower: str | Iterable[str] = (), fp32: str | Iterable[str] = (), source: str = "user"
    ) -> OpLists:
        """Lists from two name collections (or single names); an op named on both is an error.

        Example:
            >>> OpLists.of(lower=["F.softmax"], fp32=["aten::linear"])
            OpLists(lower={'softmax': 'user'}, fp32={'linear': 'user'})
        """
        lower, fp32 = _op_names(lower), _op_names(fp32)
        _check_apart(lower, fp32)
        lists = cls()
        lists.add("lower", lower, source)
        lists.add("fp32", fp32, source)
        return lists

    @classmethod
    def from_files(
        cls,
        lower_path: str | os.PathLike[str] | None = None,
        fp32_path: str | os.PathLike[str] | None = None,
    ) -> OpLists:
        """Read Habana-format files: one op per line, ``#`` starts a comment.

        Raises:
            InvalidChoiceError: a file names an unknown op (nothing is loaded).
        """
        read = {
            which: (read_op_file(path), os.path.basename(os.fspath(path)))
            for which, path in (("lower", lower_path), ("fp32", fp32_path))
            if path is not None
        }
        # one op in both files: refused, where adding the fp32 file would take it silently
        _check_apart(*(read[which][0] if which in read else [] for which in LIST_NAMES))
        lists = cls()
        for which, (names, source) in read.items():
            lists.add(which, names, source=source)
        return lists

    def _list(self, which: str) -> dict[str, str]:
        name = LIST_ALIASES.get(which.strip().lower(), which.strip().lower())
        if name not in LIST_NAMES:
            raise InvalidChoiceError(
                "list",
                which,
                LIST_NAMES,
                "lower (alias bf16) = run in the autocast dtype; fp32 = run in fp32.",
            )
        return self.lower if name == "lower" else self.fp32

    def add(self, which: str, ops: str | Iterable[str], source: str = "user") -> None:
        """Put ``ops`` (one name or several) on list ``which``, taking them off the other list.
        All names are checked first: one bad name changes nothing."""
        target = self._list(which)
        names = [check_op(name) for name in _op_names(ops)]
        other = self.fp32 if target is self.lower else self.lower
        covered = set().union(*map(_covered, names)) if names else set()
        for entry in [entry for entry in other if _covered(entry) & covered]:
            del other[entry]  # another spelling of the same op (truediv for div) goes too
        for name in names:
            target[name] = source

    def remove(self, which: str, ops: str | Iterable[str]) -> None:
        """Take ``ops`` (one name or several) off list ``which``.

        Raises:
            InvalidChoiceError: an op that is not on the list (nothing is removed).
        """
        target = self._list(which)
        names = [_spelled(canonical_name(name)) for name in _op_names(ops)]
        for name in names:
            if name not in target:
                raise InvalidChoiceError(
                    f"op on the {which} list", name, sorted(target) or ["(the list is empty)"]
                )
        for name in names:
            del target[name]

    def source(self, which: str, name: str) -> str:
        """Where an entry came from."""
        return self._list(which)[_spelled(canonical_name(name))]

    def save(self, directory: str | os.PathLike[str]) -> tuple[str, str]:
        """Write ``lower_list.txt`` and ``fp32_list.txt`` into ``directory``; return their paths.

        Each file is replaced whole, never written through a link (see :func:`mpnb._files.atomic_write`).
        """
        os.makedirs(directory, exist_ok=True)
        paths = []
        for which in LIST_NAMES:
            path = os.path.join(directory, f"{which}_list.txt")
            with atomic_write(path) as file:
                file.write(
                    f"# mpnb {which} op list\n"
                    + "".join(f"{name}\n" for name in sorted(self._list(which)))
                )
            paths.append(path)
        return paths[0], paths[1]

    def copy(self) -> OpLists:
        """An independent copy."""
        return OpLists(dict(self.lower), dict(self.fp32))

    def __bool__(self) -> bool:
        return bool(self.lower or self.fp32)


def read_op_file(path: str | os.PathLike[str]) -> list[str]:
    """Op names from a UTF-8 text file: one per line; blank lines and ``#`` comments ignored.

    Raises:
        MpnbError: the file is not a regular file (a device or a pipe: refused unread), is
            larger than :data:`MAX_OP_FILE_BYTES` (1 MiB: some thousand times every aten
            operator name), is not UTF-8 text, or names an op that cannot be listed (the
            message names the file and the line).
        OSError: the file cannot be read.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = os.path.join(folder, "fp32_list.txt")
        ...     with open(path, "w", encoding="utf-8") as file:
        ...         _ = file.write("# ops kept in fp32\\nsoftmax\\n\\nF.log_softmax  # the loss\\n")
        ...     read_op_file(path)
        ['softmax', 'F.log_softmax']
    """
    name = os.fspath(path)
    with open_regular(name, what="an op-list file") as file:
        size = os.fstat(file.fileno()).st_size
        if size > MAX_OP_FILE_BYTES:
            raise MpnbError(
                f"op-list file {quoted(name)} is {size:,} bytes; op-list files are limited to 1 MiB"
            )
        raw = file.read(size)
    raw = raw.removeprefix(codecs.BOM_UTF8)  # what Windows' Notepad writes first
    names = []
    for number, line in enumerate(raw.splitlines(), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise MpnbError(
                f"op-list file {quoted(name)}, line {number}: not UTF-8 text ({error.reason} at byte {error.start}); "
                "op-list files hold one op name per line"
            ) from None
        if "\x00" in text:
            raise MpnbError(
                f"op-list file {quoted(name)}, line {number}: a NUL byte; is it a binary file?"
            )
        entry = text.split("#", 1)[0].strip()
        if entry:
            try:
                check_op(entry)
            except MpnbError as error:
                raise MpnbError(f"op-list file {quoted(name)}, line {number}: {error}") from None
            names.append(entry)
    return names
