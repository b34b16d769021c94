"""The session's op lists: one set, live wherever autocast is on, replaced atomically.

Each change builds the new lists, registers their kernels, and only then drops the old
ones, so a bad name or a failed registration leaves the previous lists in force. The
kernels act inside ``%%autocast`` and ``%amp`` cells and inside the user's own
``with torch.autocast(...)`` blocks alike. A per-block override (``%%autocast --fp32 ...``,
``mpnb.autocast(fp32=[...])``) is registered on top of the session's and removed after
the block, so for its ops the block's choice wins.

On Habana Gaudi the HPU library reads its own lists from files once, when it loads: the
lists are also written there, for the next kernel start (:func:`export_for_hpu`).

Example:
    >>> import torch
    >>> lists = SessionOpLists()
    >>> lists.add("fp32", ["linear"])  # notes for the user: none off Gaudi
    []
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype
    torch.float32
    >>> _ = lists.reset()
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator

from mpnb.oplists import compiled_kernels
from mpnb.oplists.lists import OpLists
from mpnb.oplists.override import OpListOverride
from mpnb.oplists.torch_rules import autocast_rules

__all__ = ["SessionOpLists"]

#: Habana's environment variables naming its list files, read when its library loads.
HPU_LIST_VARIABLES = {
    "lower": "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST",
    "fp32": "PT_HPU_AUTOCAST_FP32_OPS_LIST",
}

SEMANTICS = """\
How op lists act (only while autocast is on; outside autocast nothing changes):
  fp32 list   the op runs with its floating inputs cast to fp32 and autocast off for that op.
  lower list  (alias bf16) the op runs with its floating inputs cast to the autocast dtype (bf16 or fp16),
              even where torch would keep it in fp32 or leave its inputs as they are.
  neither     the op follows torch's own autocast rules (`%oplist preset torch` then `%oplist show` lists them).
Floating inputs are what torch.autocast casts: floating tensors on the device, never float64. Ops that keep
state (batch_norm) have only their data cast: weights and running statistics stay as they are. Views (t),
in-place (relu_) and out= ops cannot be listed. Compiled code (torch.compile) recompiles under the new lists at its next call.
Precedence: a block's own lists (%%autocast --fp32/--lower, mpnb.autocast(fp32=, lower=)) win over the
session lists for the ops they name; the session lists win over torch's rules.
Lists change what the dispatcher calls at autocast's level: ops that torch calls internally from inside
another op (the log_softmax inside cross_entropy) follow the outer op."""


def export_for_hpu(lists: OpLists, directory: str | os.PathLike[str]) -> dict[str, str]:
    """Write ``lists`` as Habana's list files in ``directory`` and point its variables at them.

    Habana reads the files once, when its PyTorch library loads: a new kernel applies them.

    Returns:
        The environment variables set, name -> file path.

    Example:
        >>> import tempfile
        >>> lists = OpLists.preset("resnet50")
        >>> variables = export_for_hpu(lists, tempfile.mkdtemp())
        >>> sorted(variables) == sorted(HPU_LIST_VARIABLES.values())
        True
        >>> for name in variables: del os.environ[name]
    """
    lower_path, fp32_path = lists.save(directory)
    variables = {HPU_LIST_VARIABLES["lower"]: lower_path, HPU_LIST_VARIABLES["fp32"]: fp32_path}
    os.environ.update(variables)
    return variables


def _default_hpu_directory() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "mpnb", "hpu_op_lists")


class SessionOpLists:
    """The session's lower-precision and fp32 lists, enforced on every device's autocast.

    Every method that changes the lists either succeeds completely or changes nothing, and
    returns notes for the user (on Gaudi: where Habana's list files were written).

    Habana's own autocast reads its lists from files named by two environment variables
    (:data:`HPU_LIST_VARIABLES`). They are the user's: mpnb sets them only when lists are applied
    on a machine with a Gaudi, and puts the user's values back (or unsets them) when the lists
    are reset, which ``%unload_ext mpnb`` does too.

    Args:
        hpu_present: whether a Gaudi is here (asked on each change). The session policy passes
            the HPU backend's probe; this package knows no devices, so alone it assumes none.
        hpu_directory: where Habana's list files go.
        on_change: called after each change.

    Example:
        >>> lists = SessionOpLists()
        >>> lists.preset("resnet50")  # notes for the user: none off Gaudi
        []
        >>> lists.active, lists.summary()
        (True, 'mpnb: op lists now lower 10, fp32 5 (`%oplist show` for details)')
        >>> lists.add("lower", ["F.softmx"])
        Traceback (most recent call last):
        ...
        mpnb.errors.InvalidChoiceError: unknown op 'F.softmx'; valid: softmax. ...
        >>> len(lists.lists.fp32)  # the refused change left the lists as they were
        5
        >>> _ = lists.reset()
        >>> lists.active
        False
    """

    def __init__(
        self,
        hpu_present: Callable[[], bool] = lambda: False,
        hpu_directory: str | os.PathLike[str] | None = None,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.lists = OpLists()
        self._override: OpListOverride | None = None
        self._hpu_present = hpu_present
        self.hpu_directory = hpu_directory or _default_hpu_directory()
        self._on_change = on_change
        # while mpnb's values are set
        self._users_hpu_variables: dict[str, str | None] | None = None

    @property
    def active(self) -> bool:
        """Whether any list entry is enforced now."""
        return self._override is not None

    def replace(self, lists: OpLists) -> list[str]:
        """Make ``lists`` the session's lists, live from the next op."""
        new = OpListOverride(lists) if lists else None
        if new is not None:
            new.apply(replacing=self._override)
        old, self._override = self._override, new
        if old is not None:
            old.release()
        self.lists = lists.copy()
        if not self.lists:
            notes = self._restore_hpu_variables()
        else:
            notes = self._export_for_hpu() if self._hpu_present() else []
        self._on_change()
        return notes

    def _export_for_hpu(self) -> list[str]:
        if self._users_hpu_variables is None:  # the user's own list files, put back by reset
            self._users_hpu_variables = {
                name: os.environ.get(name) for name in HPU_LIST_VARIABLES.values()
            }
        variables = export_for_hpu(self.lists, self.hpu_directory)
        written = ", ".join(f"{name}={path}" for name, path in variables.items())
        return [
            f"Habana reads its own op lists when its library loads: wrote {written}; restart the kernel to apply "
            "them (`%oplist reset` or `%unload_ext mpnb` puts your own values of these variables back)"
        ]

    def _restore_hpu_variables(self) -> list[str]:
        """Put Habana's list variables back as the user had them before mpnb first wrote them."""
        saved, self._users_hpu_variables = self._users_hpu_variables, None
        if saved is None:
            return []
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shown = ", ".join(
            f"{name}={value!r}" if value is not None else f"{name} unset"
            for name, value in saved.items()
        )
        return [f"Habana's list variables are yours again: {shown}"]

    def _edit(self, change: Callable[[OpLists], None]) -> list[str]:
        edited = self.lists.copy()
        change(edited)
        return self.replace(edited)

    def add(self, which: str, ops: Iterable[str], source: str = "user") -> list[str]:
        """Put ``ops`` on list ``which`` (``lower``/``bf16`` or ``fp32``)."""
        return self._edit(lambda lists: lists.add(which, ops, source))

    def remove(self, which: str, ops: Iterable[str]) -> list[str]:
        """Take ``ops`` off list ``which``."""
        return self._edit(lambda lists: lists.remove(which, ops))

    def preset(self, name: str) -> list[str]:
        """Replace the lists with a preset: ``torch`` (none), ``hmp``, ``resnet50``."""
        return self.replace(OpLists.preset(name))

    def load(self, lower_path: str | None, fp32_path: str | None) -> list[str]:
        """Replace the lists with those in Habana-format files (either may be None)."""
        return self.replace(OpLists.from_files(lower_path, fp32_path))

    def save(self, directory: str | os.PathLike[str]) -> tuple[str, str]:
        """Write the lists as ``lower_list.txt`` and ``fp32_list.txt``; return the paths."""
        return self.lists.save(directory)

    def reset(self) -> list[str]:
        """No lists: torch's own autocast rules everywhere."""
        return self.replace(OpLists())

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Take the session's kernels out for a block (to read torch's own rules)."""
        override = self._override
        if override is not None:
            override.release()
        try:
            yield
        finally:
            if override is not None:
                override.apply()

    def summary(self) -> str:
        """One line: how many ops each list holds.

        Example:
            >>> SessionOpLists().summary()
            "mpnb: no op lists; torch's own autocast rules apply"
        """
        if not self.lists:
            return "mpnb: no op lists; torch's own autocast rules apply"
        lower, fp32 = len(self.lists.lower), len(self.lists.fp32)
        return f"mpnb: op lists now lower {lower}, fp32 {fp32} (`%oplist show` for details)"

    def describe(self, device_type: str) -> str:
        """The lists with the provenance of each entry, or torch's rules when there are none."""
        if not self.lists:
            return self._describe_torch(device_type)
        lines = [
            "mpnb op lists (act wherever autocast is on; a block's --fp32/--lower win for that block):"
        ]
        for title, entries in (
            ("lower (run in the autocast dtype)", self.lists.lower),
            ("fp32 (run in fp32)", self.lists.fp32),
        ):
            lines.append(f"{title}: {len(entries)} op{'s' * (len(entries) != 1)}")
            for source in sorted(set(entries.values())):
                names = sorted(name for name, where in entries.items() if where == source)
                lines.append(f"  from {source}: {', '.join(names)}")
        if compiled_kernels.kind() == "compiled":
            lines.append("kernels: C++ (about 1 us a listed op call)")
        else:
            why = compiled_kernels.unavailable_reason() or "MPNB_LIST_KERNELS=python"
            lines.append(f"kernels: Python (about 15 us a listed op call; C++ not in use: {why})")
        return "\n".join(lines)

    def _describe_torch(self, device_type: str) -> str:
        with self.suspended():
            rules = autocast_rules(device_type)
        head = f"No op lists: torch's own autocast rules on {device_type} apply."
        if not rules.probed:
            return (
                f"{head}\nThere is no {device_type} device here to probe them; ops with their own autocast kernel "
                f"on {device_type}: {', '.join(rules.other)}"
            )
        return "\n".join(
            [
                head,
                f"lowered to the autocast dtype ({len(rules.lower)}): {', '.join(rules.lower)}",
                f"kept in fp32 ({len(rules.fp32)}): {', '.join(rules.fp32)}",
                f"other rules, e.g. promote to the widest input ({len(rules.other)}): {', '.join(rules.other)}",
                "every other op runs in the dtype of its inputs.",
            ]
        )
