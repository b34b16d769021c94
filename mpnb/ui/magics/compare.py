"""``%%compare``: run a cell's training code once per precision mode and compare the runs.

For each mode the cell runs with the session in that mode (autocast on for fp16/bf16, off
otherwise), from the same torch seed, and every ``mpnb.Trainer.fit`` it makes trains in
that mode within ``warmup + steps`` optimizer steps. The runs' curves are drawn overlaid
while they train; the table follows (see :func:`mpnb.analysis.comparison.compare`). The session mode,
the autocast state and torch's random state are as before when the cell ends, however it
ends. The result is the cell's value and is kept in ``_comparison``.

Example (in IPython)::

    %%compare --modes fp32,bf16 --steps 100 --metric "mpnb.examples.accuracy(trainer.model, test)"
    trainer, train, test = mpnb.examples.example_trainer()
    trainer.fit(train, epochs=3)
"""

from __future__ import annotations

import math
import os

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from mpnb.analysis.comparison import Comparison, ModeResult, compare_runs, mode_result
from mpnb.precision.blocks import autocast
from mpnb.precision.modes import MODE_NAMES, parse_mode
from mpnb.precision.policy import session
from mpnb.training.capture import capture_fits
from mpnb.training.telemetry import Sink
from mpnb.ui.environment import DASHBOARD_KINDS
from mpnb.ui.magics.arguments import as_usage_error, choice, parse_line
from mpnb.ui.magics.cell_runner import run_cell_body

__all__ = ["CompareMagics", "RESULT_VARIABLE"]

RESULT_VARIABLE = "_comparison"
_PROGRESS_CHOICES = (*DASHBOARD_KINDS, "none")


@magics_class
class CompareMagics(Magics):
    """The ``%%compare`` cell magic."""

    @magic_arguments()
    @argument(
        "--modes",
        default="fp32,tf32,fp16,bf16",
        help=f"comma-separated modes to run, in order; from {', '.join(MODE_NAMES)} (default fp32,tf32,fp16,bf16)",
    )
    @argument("--steps", type=int, default=100, help="timed optimizer steps per mode (default 100)")
    @argument("--warmup", type=int, default=5, help="steps run first and left out of the timing (default 5)")
    @argument("--seed", type=int, default=0, help="torch.manual_seed before each mode's run (default 0)")
    @argument(
        "--metric",
        help="a Python expression evaluated after each mode's run (test accuracy, say); its value fills the "
        "table's metric column",
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

        The cell trains through ``mpnb.Trainer.fit`` (the fits it makes are timed); it is run
        once per mode from the same seed, with each fit held to ``--warmup + --steps`` steps
        and trained in that mode whatever mode the trainer was built with. A mode this device
        cannot run is listed with the reason. The session mode, autocast state and torch's
        random state are restored when the cell ends, also after an error or an interrupt.

        Example::

            %%compare --modes fp32,bf16 --steps 100
            trainer, train, test = mpnb.examples.example_trainer()
            trainer.fit(train, epochs=3)
        """
        __tracebackhide__ = True
        args = parse_line(self.compare, line, f"modes: {', '.join(MODE_NAMES)}; progress: auto, live, text, none")
        progress = choice("progress", args.progress, _PROGRESS_CHOICES)
        with as_usage_error():
            modes = [parse_mode(name.strip()).value for name in args.modes.split(",") if name.strip()]
        if not modes:
            raise UsageError(f"--modes names no mode: {args.modes!r}; valid: {', '.join(MODE_NAMES)}")
        if args.steps < 1 or args.warmup < 0:
            raise UsageError(f"--steps must be >= 1 and --warmup >= 0, got --steps {args.steps} --warmup {args.warmup}")
        metric_text = _unquote(args.metric) if args.metric else None
        metric = self._compile_metric(metric_text)

        def run_mode(name: str, sink: Sink | None) -> ModeResult:
            return self._run_mode(name, cell, args.warmup + args.steps, args.warmup, args.seed, metric, sink)

        comparison = compare_runs(
            run_mode,
            modes,
            args.steps,
            args.warmup,
            progress=None if progress == "none" else progress,
            metric_name=metric_text or "metric",
            title="%%compare",
        )
        self.shell.user_ns[RESULT_VARIABLE] = comparison
        if args.out:
            _write(args.out, comparison)
        return comparison

    def _compile_metric(self, expression: str | None):
        if not expression:
            return None
        try:
            return compile(expression, "<%%compare --metric>", "eval")
        except SyntaxError as error:
            raise UsageError(f"--metric {expression!r} is not a Python expression: {error.msg}") from None

    def _run_mode(self, name, cell, budget, warmup, seed, metric, sink) -> ModeResult:
        __tracebackhide__ = True
        dtype = parse_mode(name).autocast_dtype
        with torch.random.fork_rng(), session.mode_scope(name), autocast(dtype, enabled=dtype is not None):
            torch.manual_seed(seed)
            with capture_fits(name, budget, sink) as capture:
                run_cell_body(self.shell, cell)
            if not capture.trainers:
                raise UsageError(
                    "the cell trained nothing through mpnb.Trainer.fit: %%compare times the fits the cell makes "
                    "(build an mpnb.Trainer and call trainer.fit(data) in the cell)"
                )
            value = float(eval(metric, self.shell.user_global_ns, self.shell.user_ns)) if metric else math.nan
        return mode_result(name, capture.trainers[-1], warmup, value)


def _unquote(text: str) -> str:
    """``'a b'`` -> ``a b``: IPython's argument splitting keeps an option's quotes."""
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def _write(folder: str, comparison: Comparison) -> None:
    from mpnb.precision.status import devices
    from mpnb.ui.plots.compare_report import write_comparison_files

    paths = write_comparison_files(folder, comparison, "%%compare", devices(check=False).to_text())
    print(f"wrote {', '.join(os.fspath(path) for path in paths)}")
