"""Habana's ``hmp`` API on torch.autocast: scripts written for Habana's old mixed-precision
tool run after an import change.

Habana's tool switched a whole script to bf16 with one call and two op lists, and let a
block opt out. Here the same calls turn on torch.autocast (bf16, no cast cache) for the
rest of the thread, apply the lists as mpnb's session op lists, and
:func:`disable_casts` turns autocast off for a block. :func:`revert` (or
``%unload_ext mpnb``) restores everything.

Example::

    from mpnb import hmp          # was: from habana_frameworks.torch.hpex import hmp
    hmp.convert(bf16_file_path="", fp32_file_path="")   # empty paths: Habana's default lists
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        with hmp.disable_casts():
            optimizer.step()
    hmp.revert()

Doctest:
    >>> import torch
    >>> _ = convert(device="cpu")
    >>> linear = torch.nn.Linear(4, 4)
    >>> linear(torch.randn(2, 4)).dtype, torch.softmax(torch.randn(3), 0).dtype
    (torch.bfloat16, torch.float32)
    >>> with disable_casts():
    ...     linear(torch.randn(2, 4)).dtype
    torch.float32
    >>> revert()
    >>> linear(torch.randn(2, 4)).dtype
    torch.float32
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from mpnb.errors import InvalidChoiceError
from mpnb.oplists.keys import AUTOCAST_KEYS
from mpnb.oplists.lists import OpLists, read_op_file
from mpnb.precision.autocast_settings import check_autocast_dtype
from mpnb.precision.backends import backend_for, resolve_device
from mpnb.precision.policy import session

__all__ = ["convert", "disable_casts", "revert", "Conversion"]

_OPT_LEVELS = ("O1",)


class Conversion:
    """bf16 autocast switched on for the thread, with op lists; undone by :meth:`revert`.

    Attributes:
        device_type: whose autocast was switched on.
        lists: the op lists in force.

    Example:
        >>> conversion = convert(device="cpu")
        >>> conversion.device_type, conversion.active, "linear" in conversion.lists.lower
        ('cpu', True, True)
        >>> conversion.revert()
        >>> conversion.active, torch.is_autocast_enabled("cpu")
        (False, False)
    """

    def __init__(self, device_type: str, lists: OpLists) -> None:
        self.device_type = device_type
        self.lists = lists
        self._saved = (
            session.thread_autocast(),
            session.oplists.lists,
        )  # as outside any notebook cell
        self.active = False

    def apply(self) -> None:
        """Switch autocast on and the lists in; on failure nothing is left changed."""
        found, _ = self._saved
        session.oplists.replace(self.lists)
        # no cast cache: a cache that lives for the whole script keeps computing with stale weights
        session.set_thread_autocast(
            found.with_device(self.device_type, enabled=True, dtype=torch.bfloat16, cache=False)
        )
        session.reset_callbacks.append(self.revert)
        self.active = True

    def revert(self) -> None:
        """Put autocast and the session's op lists back as they were before :meth:`apply`."""
        if not self.active:
            return
        found, lists = self._saved
        session.set_thread_autocast(found)
        session.oplists.replace(lists)
        session.reset_callbacks.remove(self.revert)
        self.active = False


_current: list[Conversion] = []


def _lists(
    bf16_file_path: str | os.PathLike[str], fp32_file_path: str | os.PathLike[str]
) -> OpLists:
    """Each list from its file, or Habana's default for that list when the path is empty."""
    lists = OpLists()
    defaults = OpLists.preset("hmp")
    for which, path in (("lower", bf16_file_path), ("fp32", fp32_file_path)):
        if path:
            lists.add(which, read_op_file(path), source=os.path.basename(os.fspath(path)))
        else:
            lists.add(which, getattr(defaults, which), source="preset hmp")
    return lists


def convert(
    opt_level: str = "O1",
    bf16_file_path: str | os.PathLike[str] = "",
    fp32_file_path: str | os.PathLike[str] = "",
    isVerbose: bool = False,  # noqa: N803 - Habana's spelling, so ported calls keep working
    *,
    device: str | torch.device | None = None,
) -> Conversion:
    """Run the rest of this thread under bf16 autocast with Habana-style op lists.

    Args:
        opt_level: ``"O1"``, the level torch.autocast implements.
        bf16_file_path: ops that always run in bf16, one per line; empty: Habana's defaults.
        fp32_file_path: ops that always run in fp32; empty: Habana's defaults.
        isVerbose: print the device and the lists.
        device: whose autocast to switch on; default the session device (cuda > hpu > cpu).

    Raises:
        MpnbError: another opt level, an unknown op in a file, or a device without bf16
            autocast. Nothing is changed then.

    Example:
        >>> conversion = convert(device="cpu")  # Habana's default lists
        >>> torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype, conversion.lists.source("fp32", "softmax")
        (torch.bfloat16, 'preset hmp')
        >>> revert()
        >>> convert("O2")
        Traceback (most recent call last):
        ...
        mpnb.errors.InvalidChoiceError: unknown opt_level 'O2'; valid: O1. torch.autocast casts per op (O1); there is no O2 on top of it.
    """
    if opt_level not in _OPT_LEVELS:
        raise InvalidChoiceError(
            "opt_level",
            opt_level,
            _OPT_LEVELS,
            "torch.autocast casts per op (O1); there is no O2 on top of it.",
        )
    target = resolve_device(session.device if device is None else device)
    check_autocast_dtype(backend_for(target), target, torch.bfloat16)
    lists = _lists(bf16_file_path, fp32_file_path)
    revert()
    conversion = Conversion(target.type, lists)
    conversion.apply()
    _current.append(conversion)
    if isVerbose:
        print(
            f"mpnb.hmp: bf16 autocast on {target.type}, {len(lists.lower)} bf16 ops, {len(lists.fp32)} fp32 ops"
        )
        print(session.oplists.describe(target.type))
    return conversion


def revert() -> None:
    """Undo :func:`convert` (a no-op when nothing is converted).

    Example:
        >>> _ = convert(device="cpu")
        >>> torch.is_autocast_enabled("cpu")
        True
        >>> revert()
        >>> torch.is_autocast_enabled("cpu"), session.oplists.active
        (False, False)
    """
    while _current:
        _current.pop().revert()


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run a block without autocast on every device where it is on (and so without op lists).

    Example:
        >>> linear = torch.nn.Linear(4, 4)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     with disable_casts():
        ...         inside = linear(torch.randn(2, 4)).dtype
        ...     after = linear(torch.randn(2, 4)).dtype
        >>> inside, after
        (torch.float32, torch.bfloat16)
    """
    with contextlib.ExitStack() as stack:
        for device_type in AUTOCAST_KEYS:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
