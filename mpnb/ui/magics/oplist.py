"""``%oplist``: show or change the session's op lists (the same calls as ``mpnb.set_oplists``).

Example (in IPython)::

    %load_ext mpnb
    %oplist preset hmp
    %oplist add fp32 layer_norm
    %oplist show
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from mpnb.oplists.lists import PRESETS
from mpnb.precision.policy import session
from mpnb.ui.magics.arguments import as_usage_error, choice, parse_line, with_semantics

__all__: list[str] = []

_OPLIST_ACTIONS = ("show", "add", "remove", "preset", "load", "save", "reset")


@magics_class
class OpListMagics(Magics):
    """The op-list magic; see ``%oplist?``."""

    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        default="show",
        help="show (the default), add LIST OP..., remove LIST OP..., preset NAME, load BF16_FILE [FP32_FILE], "
        "save DIR, or reset. LIST is lower (alias bf16) or fp32; a file may be '-' for an empty list.",
    )
    @argument(
        "values", nargs="*", help="the list and op names, the preset, the files or the directory"
    )
    @with_semantics
    @line_magic
    def oplist(self, line: str) -> None:
        """Show or change the session's op lists: ops that always run in fp32 or in the autocast dtype.

        Changes are live from the next op, wherever autocast is on (``%amp`` and
        ``%%autocast`` cells, and your own ``with torch.autocast(...)`` blocks). Presets: torch
        (no lists), hmp (Habana's default lists), resnet50 (Habana's ResNet50 lists). Files are
        Habana's format: one op per line, ``#`` comments.

        Example::

            %oplist preset hmp
            %oplist add fp32 layer_norm
            %oplist show
        """
        args = parse_line(
            self.oplist, line, "actions: show, add, remove, preset, load, save, reset"
        )
        action = choice("%oplist action", args.action, _OPLIST_ACTIONS)
        with as_usage_error():
            notes = _OPLIST_HANDLERS[action](args.values)
        for note in notes:
            print(note)


def _expect(action: str, values: list[str], usage: str, counts: range) -> None:
    if len(values) not in counts:
        raise UsageError(f"%oplist {action} takes {usage}; got {' '.join(values) or 'nothing'}")


def _show(values: list[str]) -> list[str]:
    _expect("show", values, "no arguments", range(1))
    return [session.oplists.describe(session.resolved_device().type)]


def _add(values: list[str]) -> list[str]:
    _expect("add", values, "a list (lower, bf16 or fp32) and op names", range(2, 1 << 16))
    return session.oplists.add(values[0], values[1:]) + [session.oplists.summary()]


def _remove(values: list[str]) -> list[str]:
    _expect("remove", values, "a list (lower, bf16 or fp32) and op names", range(2, 1 << 16))
    return session.oplists.remove(values[0], values[1:]) + [session.oplists.summary()]


def _preset(values: list[str]) -> list[str]:
    _expect("preset", values, f"one preset name ({', '.join(PRESETS)})", range(1, 2))
    return session.oplists.preset(values[0]) + [session.oplists.summary()]


def _load(values: list[str]) -> list[str]:
    _expect("load", values, "a BF16 file and optionally an FP32 file ('-' for none)", range(1, 3))
    lower_path, fp32_path = [None if value == "-" else value for value in [*values, "-"][:2]]
    try:
        notes = session.oplists.load(lower_path, fp32_path)
    except OSError as error:
        raise UsageError(f"cannot read op list file: {error}") from None
    return notes + [session.oplists.summary()]


def _save(values: list[str]) -> list[str]:
    _expect("save", values, "one directory", range(1, 2))
    try:
        paths = session.oplists.save(values[0])
    except OSError as error:
        raise UsageError(f"cannot save op lists: {error}") from None
    return [f"mpnb: wrote {' and '.join(paths)}"]


def _reset(values: list[str]) -> list[str]:
    _expect("reset", values, "no arguments", range(1))
    return session.oplists.reset() + [session.oplists.summary()]


_OPLIST_HANDLERS = {
    "show": _show,
    "add": _add,
    "remove": _remove,
    "preset": _preset,
    "load": _load,
    "save": _save,
    "reset": _reset,
}
