"""The IPython magics: ``%%autocast``, ``%amp``, ``%tf32`` and ``%oplist``.

Each magic parses its arguments and calls one core function; anything a magic does, the
Python API does too (``mpnb.autocast``, ``mpnb.set_mode``, ``mpnb.tf32``, ``mpnb.status``,
``mpnb.oplists``, ``mpnb.trace``). Bad input raises UsageError naming the bad value and the
valid ones, and changes nothing.

Example (in IPython)::

    %load_ext mpnb
    %amp bf16
    %%autocast --dtype fp16 --device cpu --fp32 softmax --trace
    %tf32 status
    %oplist add fp32 layer_norm
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from mpnb.backends import backend_for
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.modes import DTYPE_NAMES, MODE_NAMES
from mpnb.oplists import PRESETS
from mpnb.policy import autocast, session, tf32
from mpnb.session_oplists import SEMANTICS
from mpnb.status import status
from mpnb.trace import trace
from mpnb.ui.cell_runner import run_cell_body

__all__ = ["PrecisionMagics"]

_TF32_STATES = ("on", "off", "status")
_OPLIST_ACTIONS = ("show", "add", "remove", "preset", "load", "save", "reset")
TRACE_VARIABLE = "_trace"


def _with_semantics(func):
    """Append the op-list semantics to a magic's help (read by ``%magic?``)."""
    func.__doc__ = f"{func.__doc__}\n{SEMANTICS}\n"
    return func


def _op_names(values: list[list[str]] | None) -> list[str]:
    """``--fp32 linear,addmm --fp32 mm`` -> ``["linear", "addmm", "mm"]``."""
    return [name for group in values or [] for value in group for name in value.split(",") if name]


@contextlib.contextmanager
def _as_usage_error() -> Iterator[None]:
    """Show mpnb's input errors the way IPython shows bad magic input."""
    try:
        yield
    except MpnbError as error:
        raise UsageError(str(error)) from None


def _parse(magic, line: str) -> argparse.Namespace:
    try:
        return parse_argstring(magic, line)
    except ValueError as error:  # e.g. an unbalanced quote
        raise UsageError(f"cannot parse {line!r}: {error}") from None


def _choice(what: str, value: str, valid: tuple[str, ...]) -> str:
    """``value`` normalised, if it is one of ``valid``; else a UsageError naming both."""
    chosen = value.strip().lower()
    if chosen not in valid:
        raise UsageError(str(InvalidChoiceError(what, value, valid)))
    return chosen


@magics_class
class PrecisionMagics(Magics):
    """Precision-mode magics; see each magic's ``?`` help."""

    @magic_arguments()
    @argument(
        "-d",
        "--dtype",
        help=f"autocast dtype: {' or '.join(DTYPE_NAMES)} (aliases float16/half, bfloat16). "
        "Default: the %%amp mode's dtype, else the device's preferred one (bf16 where supported).",
    )
    @argument("--device", help="cpu, cuda, cuda:N or hpu. Default: the session device, else cuda > hpu > cpu.")
    @argument("--off", action="store_true", help="run the cell with autocast off (overrides %%amp for this cell)")
    @argument(
        "--cache",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep cast copies of weights for the whole cell. Off by default: a cell that runs "
        "optimizer steps under a cached autocast keeps using the first step's weights.",
    )
    @argument("--fp32", nargs="+", action="append", metavar="OP", help="ops to run in fp32 in this cell")
    @argument("--lower", nargs="+", action="append", metavar="OP", help="ops to run in the autocast dtype in this cell")
    @argument(
        "--trace",
        action="store_true",
        help=f"record which op ran in which dtype and module; shown after the cell and kept in {TRACE_VARIABLE}",
    )
    @_with_semantics
    @cell_magic
    def autocast(self, line: str, cell: str) -> object:
        """Run this cell under torch.autocast; autocast state is restored exactly afterwards.

        The dtype and device are checked first: a combination torch would silently run in
        fp32 is an error here. The cell's own exceptions and interrupts reach you as usual.
        ``--fp32`` / ``--lower`` change single ops for this cell only (see below).

        Example::

            %%autocast --dtype bf16 --fp32 layer_norm --trace
            out = model(x)
        """
        __tracebackhide__ = True
        args = _parse(self.autocast, line)
        if args.off and args.dtype:
            raise UsageError(f"--off runs the cell without autocast; it takes no --dtype (got {args.dtype!r})")
        with _as_usage_error():
            context = autocast(
                args.dtype,
                args.device,
                enabled=not args.off,
                cache=args.cache,
                fp32=_op_names(args.fp32),
                lower=_op_names(args.lower),
            )
        if not args.trace:
            with context:
                return run_cell_body(self.shell, cell)
        recorder = trace()
        try:
            with context, recorder:
                return run_cell_body(self.shell, cell)
        finally:
            self.shell.user_ns[TRACE_VARIABLE] = recorder.result
            display(recorder.result)

    @magic_arguments()
    @argument(
        "mode",
        nargs="?",
        default="status",
        help=f"one of {', '.join(MODE_NAMES)} (aliases float32, float16/half, bfloat16), status (the default), "
        "or panel (a control panel with every switch)",
    )
    @argument("--device", help="cpu, cuda, cuda:N or hpu. Default: cuda > hpu > cpu.")
    @line_magic
    def amp(self, line: str) -> object:
        """Set the session precision mode for every following cell, or show the status.

        Modes: off (mpnb changes nothing), fp32 (exact fp32), tf32 (reduced-precision fp32
        math), fp16 and bf16 (autocast). ``%%autocast`` overrides the mode for one cell.

        Example::

            %amp bf16
            %amp status
            %amp panel
        """
        args = _parse(self.amp, line)
        if args.mode.strip().lower() in ("status", "panel"):
            if args.device:
                raise UsageError(f"--device goes with a mode, not with {args.mode} (got --device {args.device!r})")
            if args.mode.strip().lower() == "panel":
                from mpnb.ui.panel import panel

                panel()
                return None
            return status()
        with _as_usage_error():
            mode = session.set_mode(args.mode, args.device)
        print(f"mpnb: mode {mode.value} on {session.resolved_device()}: {mode.summary}")
        for note in session.warnings():
            print(f"mpnb warning: {note}")
        return None

    @magic_arguments()
    @argument("state", nargs="?", default="status", help="on, off, or status (the default)")
    @argument("--device", help="the device whose flags to switch. Default: the session device.")
    @line_magic
    def tf32(self, line: str) -> object:
        """Switch reduced-precision fp32 math: TF32 on NVIDIA GPUs, oneDNN bf16 math on CPUs.

        ``on`` lets fp32 matmuls and convolutions use faster, less precise math; ``off``
        restores every flag to what it was before. In modes fp32 and tf32 the mode owns
        this switch, so ``on``/``off`` move between those two modes.

        Example::

            %tf32 on
            %tf32 status
        """
        args = _parse(self.tf32, line)
        state = _choice("%tf32 state", args.state, _TF32_STATES)
        with _as_usage_error():
            if state != "status":
                tf32(state == "on", args.device)
            device = session.resolved_device() if args.device is None else args.device
            print(f"mpnb: fp32 math on {device}: {backend_for(device).describe_fp32_math()}")
        return None

    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        default="show",
        help="show (the default), add LIST OP..., remove LIST OP..., preset NAME, load BF16_FILE [FP32_FILE], "
        "save DIR, or reset. LIST is lower (alias bf16) or fp32; a file may be '-' for an empty list.",
    )
    @argument("values", nargs="*", help="the list and op names, the preset, the files or the directory")
    @_with_semantics
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
        args = _parse(self.oplist, line)
        action = _choice("%oplist action", args.action, _OPLIST_ACTIONS)
        with _as_usage_error():
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
