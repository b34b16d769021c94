"""The precision magics: ``%%autocast``, ``%amp`` and ``%tf32`` (``%oplist`` is in :mod:`.oplist`).

Each magic parses its arguments and calls one core function; anything a magic does, the
Python API does too (``mpnb.autocast``, ``mpnb.set_mode``, ``mpnb.tf32``, ``mpnb.status``,
``mpnb.set_oplists``, ``mpnb.trace``). Bad input raises UsageError naming the bad value and the
valid ones, and changes nothing.

Example (in IPython)::

    %load_ext mpnb
    %amp bf16
    %%autocast --dtype fp16 --device cpu --fp32 softmax --trace
    %tf32 status
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from mpnb._render import dtype_name
from mpnb.oplists.trace import trace
from mpnb.precision.backends import backend_for
from mpnb.precision.blocks import autocast, tf32
from mpnb.precision.modes import mode_names
from mpnb.precision.modes.registry import read_options
from mpnb.precision.names import DTYPE_NAMES
from mpnb.precision.policy import session
from mpnb.precision.status import status
from mpnb.ui.environment import in_notebook_kernel
from mpnb.ui.magics.arguments import (
    as_usage_error,
    cell_usage,
    choice,
    parse_line,
    with_mode_options,
    with_semantics,
)
from mpnb.ui.magics.cell_runner import run_cell_body

__all__: list[str] = []

_TF32_STATES = ("on", "off", "status")
TRACE_VARIABLE = "_trace"


def _op_names(values: list[list[str]] | None) -> list[str]:
    """``--fp32 linear,addmm --fp32 mm`` -> ``["linear", "addmm", "mm"]``."""
    return [name for group in values or [] for value in group for name in value.split(",") if name]


def rest_of_the_cell(device_type: str) -> str:
    """What the code after ``%amp`` in its own cell runs under: the autocast the cell began
    with (on ``device_type``), kept until the cell ends, as the mode's autocast is entered per
    cell (``ipython file.ipy`` and ``ipython -c`` run a script as one cell: there the mode
    never applies).

    >>> rest_of_the_cell("cpu")  # doctest: +ELLIPSIS
    'autocast follows the mode from the next cell: here autocast stays off for the rest of this one ...'
    """
    now = (
        f"{dtype_name(torch.get_autocast_dtype(device_type))} autocast stays on"
        if torch.is_autocast_enabled(device_type)
        else "autocast stays off"
    )
    return (
        f"autocast follows the mode from the next cell: here {now} for the rest of this one "
        "(ipython file.ipy and ipython -c run a script as one cell); a Trainer built from now on "
        "trains in the mode, and `with mpnb.autocast():` applies it to a block"
    )


def code_after_the_magic(cell: str, magic: str) -> bool:
    """Whether ``cell`` runs code after its first line that calls ``magic`` (blank lines,
    comments and more of the same magic left out).

    >>> code_after_the_magic("%amp bf16\\n# next cells\\n", "%amp")
    False
    >>> code_after_the_magic("%amp bf16\\nout = model(x)\\n", "%amp")
    True
    """
    lines = [line.strip() for line in cell.splitlines()]
    first = next((i for i, line in enumerate(lines) if line.startswith(magic)), None)
    return first is not None and any(
        line and not line.startswith(("#", magic)) for line in lines[first + 1 :]
    )


def _runs_on_after(shell: Any) -> bool:
    """Whether code runs after the magic running now, in what the shell runs as one cell: a
    script IPython runs silently (``ipython file.ipy``), or a cell with code after the magic
    (IPython's own record of the running cell, which its display hook holds while it runs)."""
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    info = getattr(running, "info", None)
    if info is None:
        return False
    return bool(info.silent) or code_after_the_magic(info.raw_cell or "", "%amp")


@magics_class
class PrecisionMagics(Magics):
    """Precision-mode magics; see each magic's ``?`` help."""

    @cell_usage
    @magic_arguments()
    @argument(
        "dtype_word",
        nargs="?",
        metavar="DTYPE",
        help="the autocast dtype, as --dtype takes it: %%%%autocast bf16",
    )
    @argument(
        "-d",
        "--dtype",
        help=f"autocast dtype: {' or '.join(DTYPE_NAMES)} (aliases float16/half, bfloat16). "
        "Default: the %%amp mode's dtype, else the device's preferred one (bf16 where supported).",
    )
    @argument(
        "--device",
        help="cpu, cuda, cuda:N or hpu. Default: the session device, else cuda > hpu > cpu.",
    )
    @argument(
        "--off",
        action="store_true",
        help="run the cell with autocast off (overrides %%amp for this cell)",
    )
    @argument(
        "--cache",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep cast copies of weights for the whole cell. Off by default: a cell that runs "
        "optimizer steps under a cached autocast keeps using the first step's weights.",
    )
    @argument(
        "--fp32", nargs="+", action="append", metavar="OP", help="ops to run in fp32 in this cell"
    )
    @argument(
        "--lower",
        nargs="+",
        action="append",
        metavar="OP",
        help="ops to run in the autocast dtype in this cell",
    )
    @argument(
        "--trace",
        action="store_true",
        help=f"record which op ran in which dtype and module; shown after the cell and kept in {TRACE_VARIABLE}",
    )
    @with_semantics
    @cell_magic
    def autocast(self, line: str, cell: str) -> object:
        """Run this cell under torch.autocast; autocast state is restored exactly afterwards.

        The dtype and device are checked first: a combination torch would silently run in
        fp32 is an error here. The cell's own exceptions and interrupts reach you as usual.
        ``--fp32`` / ``--lower`` change single ops for this cell only (see below).

        Example::

            %%autocast bf16 --fp32 layer_norm --trace
            out = model(x)
        """
        __tracebackhide__ = True
        args = parse_line(self.autocast, line, f"dtypes: {', '.join(DTYPE_NAMES)}")
        if args.dtype_word and args.dtype and args.dtype_word != args.dtype:
            raise UsageError(
                f"two dtypes: {args.dtype_word!r} and --dtype {args.dtype!r}; give one"
            )
        args.dtype = args.dtype or args.dtype_word
        if args.off and args.dtype:
            raise UsageError(
                f"--off runs the cell without autocast; it takes no --dtype (got {args.dtype!r})"
            )
        with as_usage_error():
            # the cell asks for autocast: in a mode without it (fp32), the device's preferred
            # dtype, where `with mpnb.autocast():` would follow the mode and run it off
            asked = args.dtype or (
                None if args.off else session.autocast_settings(None, args.device).dtype
            )
            context = autocast(
                asked,
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
        help=f"one of {', '.join(mode_names())} (aliases float32, float16/half, bfloat16; "
        "fp8:rowwise names a recipe), status (the default), or panel (a control panel with every switch)",
    )
    @argument("--device", help="cpu, cuda, cuda:N or hpu. Default: cuda > hpu > cpu.")
    @with_mode_options
    @argument(
        "--model",
        help=f"{', '.join(mode_names(converts_layers=True))} only: the variable holding a model whose "
        "layers to convert now, until the mode changes (a Trainer converts its own model for each fit)",
    )
    @line_magic
    def amp(self, line: str) -> object:
        """Set the session precision mode for every following cell, or show the status.

        Modes (every registered one is listed under ``mode`` below): off (mpnb changes nothing),
        fp32 (exact fp32), tf32 (reduced-precision fp32 math), fp16 and bf16 (autocast), fp8,
        mxfp8 and nvfp4 (Linear layers in that format through torchao, the rest under bf16
        autocast; emulated on a CPU, nvfp4 on Blackwell GPUs only). ``%%autocast`` overrides
        the mode for one cell; a switch takes effect from the next cell.

        Example::

            %amp bf16
            %amp fp8 --model net --recipe rowwise --keep lm_head
            %amp status
            %amp panel
        """
        args = parse_line(self.amp, line, f"modes: {', '.join(mode_names())}, status, panel")
        if args.mode.strip().lower() in ("status", "panel"):
            given = {"device": args.device, "model": args.model, **read_options(args)}
            extra = {flag: value for flag, value in given.items() if value is not None}
            if extra:
                flags = " and ".join(f"--{flag}" for flag in extra)
                got = ", ".join(f"--{flag} {value!r}" for flag, value in extra.items())
                verb = "goes" if len(extra) == 1 else "go"
                raise UsageError(f"{flags} {verb} with a mode, not with {args.mode} (got {got})")
            if args.mode.strip().lower() == "panel":
                from mpnb.ui.widgets.panel import panel

                panel()  # in a terminal: where it shows, and the session's status after
                if in_notebook_kernel():
                    return None
            # shown, not returned: a value is shown only as a cell's last line, and `ipython
            # file.ipy` runs a whole file as one cell (mpnb.status() returns the object)
            display(status())
            return None
        model = self._model(args.model) if args.model else None
        with as_usage_error():
            mode = session.set_mode(args.mode, args.device, model=model, **read_options(args))
        print(f"mpnb: mode {mode.label} on {session.resolved_device()}: {mode.summary}")
        if _runs_on_after(self.shell):
            print(f"mpnb: {rest_of_the_cell(session.resolved_device().type)}")
        if session.held is not None:
            print(f"mpnb: {args.model}: {session.held.describe()} converted until the mode changes")
        for note in session.warnings():
            print(f"mpnb warning: {note}")
        return None

    def _model(self, name: str) -> object:
        """The user's variable ``name`` for ``%amp fp8 --model``."""
        if name not in self.shell.user_ns:
            raise UsageError(f"--model names no variable: {name!r}")
        return self.shell.user_ns[name]

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
        args = parse_line(self.tf32, line, "states: on, off, status")
        state = choice("%tf32 state", args.state, _TF32_STATES)
        with as_usage_error():
            if state != "status":
                tf32(state == "on", args.device)
            device = session.resolved_device() if args.device is None else args.device
            print(f"mpnb: fp32 math on {device}: {backend_for(device).describe_fp32_math()}")
        return None
