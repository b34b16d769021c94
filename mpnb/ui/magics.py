"""The IPython magics: ``%%autocast``, ``%amp`` and ``%tf32``.

Each magic parses its arguments and calls one core function; anything a magic does, the
Python API does too (``mpnb.autocast``, ``mpnb.set_mode``, ``mpnb.tf32``, ``mpnb.status``).
Bad input raises UsageError naming the bad value and the valid ones, and changes nothing.

Example (in IPython)::

    %load_ext mpnb
    %amp bf16
    %%autocast --dtype fp16 --device cpu
    %tf32 status
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from mpnb.backends import backend_for
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.modes import DTYPE_NAMES, MODE_NAMES
from mpnb.policy import autocast, session, tf32
from mpnb.status import status
from mpnb.ui.cell_runner import run_cell_body

__all__ = ["PrecisionMagics"]

_TF32_STATES = ("on", "off", "status")


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
    @cell_magic
    def autocast(self, line: str, cell: str) -> object:
        """Run this cell under torch.autocast; autocast state is restored exactly afterwards.

        The dtype and device are checked first: a combination torch would silently run in
        fp32 is an error here. The cell's own exceptions and interrupts reach you as usual.

        Example::

            %%autocast --dtype bf16
            out = model(x)
        """
        __tracebackhide__ = True  # noqa: F841 - show the cell's frames, not the magic's
        args = _parse(self.autocast, line)
        if args.off and args.dtype:
            raise UsageError(f"--off runs the cell without autocast; it takes no --dtype (got {args.dtype!r})")
        with _as_usage_error():
            context = autocast(args.dtype, args.device, enabled=not args.off, cache=args.cache)
        with context:
            return run_cell_body(self.shell, cell)

    @magic_arguments()
    @argument(
        "mode",
        nargs="?",
        default="status",
        help=f"one of {', '.join(MODE_NAMES)} (aliases float32, float16/half, bfloat16), or status (the default)",
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
        """
        args = _parse(self.amp, line)
        if args.mode.strip().lower() == "status":
            if args.device:
                raise UsageError(f"--device goes with a mode, not with status (got --device {args.device!r})")
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
        state = args.state.strip().lower()
        if state not in _TF32_STATES:
            raise UsageError(str(InvalidChoiceError("%tf32 state", args.state, _TF32_STATES)))
        with _as_usage_error():
            if state != "status":
                tf32(state == "on", args.device)
            device = session.resolved_device() if args.device is None else args.device
            print(f"mpnb: fp32 math on {device}: {backend_for(device).describe_fp32_math()}")
        return None
