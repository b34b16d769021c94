"""``%%compare``: run a cell's training code once per precision mode and compare the runs.

For each mode the cell runs with the session in that mode (autocast on for fp16/bf16, off
otherwise), from the same torch seed, and every ``mpnb.Trainer.fit`` it makes trains in
that mode for the ``warmup`` steps. Then the modes' timed steps are trained in interleaved
turns, each turn continuing the cell's last fit in its mode (see
:mod:`mpnb.analysis.schedule`), so code after the fit in the cell sees the model after its
warm-up; measure trained models with ``--metric``, which is evaluated at the end among the
names the cell bound in that mode. The runs' curves are drawn overlaid while they train;
the table follows (see :func:`mpnb.analysis.comparison.compare`). The session mode, the
autocast state and torch's random state are as before when the cell ends, however it ends.
The comparison is kept in ``_comparison``, and is the cell's value unless the live view
already shows its table.

Example (in IPython)::

    %%compare --modes fp32,bf16 --steps 100 --metric "mpnb.examples.accuracy(trainer.model, test)"
    trainer, train, test = mpnb.examples.example_trainer()
    trainer.fit(train, epochs=3)
"""

from __future__ import annotations

import ast
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from mpnb._files import check_writable_folder
from mpnb.analysis.comparison import (
    Comparison,
    ModeResult,
    compare_runs,
    mode_labels,
    mode_result,
    progress_view,
)
from mpnb.precision.blocks import autocast
from mpnb.precision.modes import mode_names, parse_mode
from mpnb.precision.policy import session
from mpnb.training.capture import capture_fits
from mpnb.training.random_state import LARGEST_SEED
from mpnb.training.telemetry import Sink
from mpnb.ui.environment import DASHBOARD_KINDS
from mpnb.ui.magics.arguments import as_usage_error, cell_usage, choice, parse_line
from mpnb.ui.magics.cell_runner import run_cell_body

__all__: list[str] = []

RESULT_VARIABLE = "_comparison"
_PROGRESS_CHOICES = (*DASHBOARD_KINDS, "none")


@magics_class
class CompareMagics(Magics):
    """The ``%%compare`` cell magic."""

    @cell_usage
    @magic_arguments()
    @argument(
        "--modes",
        default="fp32,tf32,fp16,bf16",
        help=f"comma-separated modes to run, in order; from {', '.join(mode_names())} (default fp32,tf32,fp16,bf16)",
    )
    @argument("--steps", type=int, default=100, help="timed optimizer steps per mode (default 100)")
    @argument(
        "--warmup",
        type=int,
        default=5,
        help="steps run first and left out of the timing (default 5)",
    )
    @argument(
        "--block",
        type=int,
        help="timed steps each mode trains per turn (default a tenth of --steps, at most 10); "
        "--block equal to --steps runs the modes one after another",
    )
    @argument(
        "--seed",
        type=int,
        default=0,
        help=f"torch.manual_seed before each mode's run, 0 to {LARGEST_SEED} (default 0)",
    )
    @argument(
        "--metric",
        help="a Python expression evaluated after each mode's run (test accuracy, say); its value fills the "
        "table's metric column",
    )
    @argument(
        "--metric-name", help="the metric column's title (default: the name the expression calls)"
    )
    @argument(
        "--progress",
        default="auto",
        help="auto (live overlaid curves in a notebook, a bar per mode elsewhere), live, text or none",
    )
    @argument("--out", help="a folder to write comparison.csv, comparison.json and report.html to")
    @cell_magic
    def compare(self, line: str, cell: str) -> Comparison:
        """Run the training in this cell once per mode; show the curves overlaid, then the table.

        The cell trains through ``mpnb.Trainer.fit``; it is run once per mode from the same
        seed, its fits held to ``--warmup`` steps and trained in that mode whatever mode the
        trainer was built with. The ``--steps`` timed steps then continue the cell's last fit
        of each mode in interleaved turns of ``--block`` steps, so that a busy machine slows
        every mode alike; each mode keeps its own random state, so its run is the one it
        would be alone. A mode this device cannot run is listed with the reason. The session
        mode, autocast state and torch's random state are restored when the cell ends, also
        after an error or an interrupt.

        Example::

            %%compare --modes fp32,bf16 --steps 100
            trainer, train, test = mpnb.examples.example_trainer()
            trainer.fit(train, epochs=3)
        """
        __tracebackhide__ = True
        args = parse_line(
            self.compare,
            line,
            f"modes: {', '.join(mode_names())}; progress: auto, live, text, none",
        )
        progress = choice("progress", args.progress, _PROGRESS_CHOICES)
        with as_usage_error():
            try:
                modes = mode_labels(args.modes)
            except ValueError as error:  # no mode, or one named twice
                raise UsageError(f"--modes {args.modes!r}: {error}") from None
        for option, value, least in (
            ("--steps", args.steps, 1),
            ("--warmup", args.warmup, 0),
            ("--block", args.block, 1),
        ):
            if value is not None and value < least:
                raise UsageError(f"{option} must be >= {least}, got {value}")
        if not 0 <= args.seed <= LARGEST_SEED:  # torch's range, said before a mode trains
            raise UsageError(
                f"--seed must be a whole number from 0 to {LARGEST_SEED}, got {args.seed}"
            )
        if args.out:  # a file in the way, a folder that cannot be made: before a mode trains
            with as_usage_error():
                check_writable_folder(args.out, "--out")
        metric_text = _unquote(args.metric) if args.metric else None
        metric = self._compile_metric(metric_text)
        metric_name = _unquote(args.metric_name) if args.metric_name else _short_name(metric_text)
        view = progress_view(None if progress == "none" else progress, modes, "%%compare")
        comparison = compare_runs(
            lambda name: _CellRun(self.shell, name, cell, args.seed, metric),
            modes,
            args.steps,
            args.warmup,
            block=args.block,
            progress=view,
            metric_name=metric_name,
        )
        self.shell.user_ns[RESULT_VARIABLE] = comparison
        if args.out:
            _write(args.out, comparison)
        return None if view.shows_table else comparison

    def _compile_metric(self, expression: str | None):
        if not expression:
            return None
        try:
            return compile(expression, "<%%compare --metric>", "eval")
        except SyntaxError as error:
            raise UsageError(
                f"--metric {expression!r} is not a Python expression: {error.msg}"
            ) from None


class _CellRun:
    """One mode of ``%%compare``: its first turn runs the cell; later turns continue the cell's last fit.

    Every turn runs with the session in the mode (and autocast as the mode has it), and its
    fits held to the turn's steps. The names the cell bound are kept per mode, so that the
    metric of each mode is evaluated among its own ``trainer``, ``test``...
    """

    def __init__(self, shell: Any, name: str, cell: str, seed: int, metric: Any) -> None:
        self.shell, self.name, self.cell, self.seed, self.metric = shell, name, cell, seed, metric
        self.trainer: Any = None
        self.data: Any = None
        self.bound: dict[str, Any] = {}

    @contextlib.contextmanager
    def _in_mode(self) -> Iterator[None]:
        dtype = parse_mode(self.name).autocast_dtype
        with session.mode_scope(self.name), autocast(dtype, enabled=dtype is not None):
            yield

    def advance(self, steps: int, sink: Sink | None) -> int:
        __tracebackhide__ = True
        with self._in_mode(), capture_fits(self.name, steps, sink) as capture:
            if self.trainer is None:
                self._run_cell(capture)
            elif self.trainer.resumable and not self.trainer.stopped:
                self.trainer.fit(self.data)
        return capture.steps_taken

    def _run_cell(self, capture: Any) -> None:
        __tracebackhide__ = True
        names = self.shell.user_ns
        before = dict(names)
        torch.manual_seed(self.seed)
        run_cell_body(self.shell, self.cell)
        if capture.last_fit is None:
            raise UsageError(
                "the cell trained nothing through mpnb.Trainer.fit: %%compare times the fits the cell makes "
                "(build an mpnb.Trainer and call trainer.fit(data) in the cell)"
            )
        self.trainer, self.data = capture.last_fit
        self.bound = {
            key: value
            for key, value in names.items()
            if key not in before or before[key] is not value
        }

    def result(self, warmup: int) -> ModeResult:
        expression = self.metric
        if expression is None:
            return mode_result(self.name, self.trainer, warmup)

        def measure() -> object:
            # one dict: nested scopes (a generator expression, a lambda) see the names too
            with self._in_mode():
                namespace = {**self.shell.user_global_ns, **self.shell.user_ns, **self.bound}
                return eval(expression, namespace)

        return mode_result(self.name, self.trainer, warmup, measure)


def _short_name(expression: str | None) -> str:
    """The metric column's title: the name an expression calls or reads
    (``"mpnb.examples.accuracy(trainer.model, test)"`` -> ``"accuracy"``)."""
    if not expression:
        return "metric"
    node = ast.parse(expression, mode="eval").body
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return expression if len(expression) <= 24 else expression[:23] + "…"


def _unquote(text: str) -> str:
    """``'a b'`` -> ``a b``: IPython's argument splitting keeps an option's quotes."""
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def _write(folder: str, comparison: Comparison) -> None:
    from mpnb.precision.status import devices
    from mpnb.ui.plots.compare_report import write_comparison_files

    paths = write_comparison_files(folder, comparison, "%%compare", devices(check=False).to_text())
    print(f"wrote {', '.join(os.fspath(path) for path in paths)}")
