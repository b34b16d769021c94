"""The ``mpnb`` command.

Example (shell)::

    $ mpnb compare                  # the example CNN in every mode; table + self-contained HTML report
    $ mpnb compare --modes fp32,bf16 --steps 50 --out runs/compare
    $ mpnb train                    # the example CNN on the bundled digits, in the device's best AMP mode
    $ mpnb train --mode fp16 --steps 100 --out runs/fp16
    $ mpnb train --mode fp8 --model mlp --steps 20   # torchao's float8 layers (emulated on a CPU)
    $ mpnb devices                  # capability report, with a tiny autocast check per dtype
    $ mpnb devices --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from mpnb._files import check_writable_folder
from mpnb.errors import MpnbError, quoted
from mpnb.precision.modes.registry import option_arguments, read_options
from mpnb.training.random_state import LARGEST_SEED

__all__ = ["main"]


def _devices(args: argparse.Namespace) -> int:
    from mpnb.precision.status import devices

    report = devices(check=not args.no_check)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    return 0


def _train(args: argparse.Namespace) -> int:
    from mpnb._render import dtype_name
    from mpnb.examples import accuracy, example_trainer
    from mpnb.precision.backends import backend_for, resolve_device
    from mpnb.precision.backends.base import format_bytes
    from mpnb.precision.modes import parse_mode
    from mpnb.ui.plots.report import write_report

    device = resolve_device(args.device)
    options = read_options(args)
    mode = parse_mode(args.mode or dtype_name(backend_for(device).preferred_dtype()), **options)
    trainer, train, test = example_trainer(
        mode,
        device,
        model=args.model,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        dashboard="text",
    )
    _announce_if_slow(trainer, train, args.steps)
    history = trainer.fit(train, epochs=math.ceil(args.steps / len(train)), max_steps=args.steps)
    test_accuracy = accuracy(trainer.model, test, device)
    summary = history.summary()
    print(
        f"{trainer.describe()}: test accuracy {test_accuracy:.1%}, final loss {summary['final_loss']:.4f}, "
        f"{summary['skipped']} skipped steps, peak memory {format_bytes(summary['peak_memory'])}, "
        f"median step {summary['median_step_time'] * 1e3:.2f} ms"
    )
    os.makedirs(args.out, exist_ok=True)
    csv_path, html_path = (
        os.path.join(args.out, "history.csv"),
        os.path.join(args.out, "dashboard.html"),
    )
    history.to_csv(csv_path)
    write_report(
        html_path,
        history,
        f"mpnb train: {trainer.describe()}",
        [("test accuracy", f"{test_accuracy:.1%}")],
    )
    print(f"wrote {csv_path} and {html_path}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from mpnb.analysis.comparison import compare, mode_labels
    from mpnb.analysis.schedule import default_block
    from mpnb.errors import InvalidChoiceError
    from mpnb.examples import MODELS, accuracy, example_trainer
    from mpnb.precision.backends import resolve_device
    from mpnb.precision.status import devices
    from mpnb.ui.plots.compare_report import COMPARISON_FILES, write_comparison_files

    if args.model not in MODELS:
        raise InvalidChoiceError("example model", args.model, MODELS)
    device = resolve_device(args.device)
    try:
        modes = mode_labels(args.modes)
    except ValueError as error:
        raise MpnbError(str(error)) from None

    def make_run(mode: str):
        trainer, train, test = example_trainer(
            mode,
            device,
            model=args.model,
            batch_size=args.batch_size,
            seed=args.seed,
            dashboard=None,
        )
        return trainer, train, lambda fitted: accuracy(fitted.model, test, device)

    block = args.block or default_block(args.steps)
    turns = f"in turns of {block} step(s)" if block < args.steps else "one mode after another"
    print(
        f"comparing {', '.join(modes)} on {device}: {args.warmup} warm-up + {args.steps} timed steps each, {turns}"
    )
    built = {}  # each run is built once: here, to say up front what will be slow, then handed to compare
    for mode in modes:
        try:
            built[mode] = make_run(mode)
            _announce_if_slow(
                built[mode][0], built[mode][1], args.warmup + args.steps, prefix=f"{mode}: "
            )
        except MpnbError:  # it cannot train (fp8 converting no layer): built again by the
            built.pop(mode, None)  # comparison, which lists the mode with the reason
            continue
    comparison = compare(
        lambda mode: built.pop(mode) if mode in built else make_run(mode),
        modes,
        steps=args.steps,
        warmup=args.warmup,
        block=block,
        progress="text",
        metric_name="test accuracy",
    )
    print()
    print(comparison)
    title = f"mpnb compare: example {args.model} on the bundled digits, {device}"
    earlier = [name for name in COMPARISON_FILES if os.path.exists(os.path.join(args.out, name))]
    paths = write_comparison_files(args.out, comparison, title, devices(check=False).to_text())
    replacing = f" (replacing an earlier run's {', '.join(earlier)})" if earlier else ""
    print(f"wrote {', '.join(paths)}{replacing}")
    if all(result.history is None for result in comparison.results):
        print(
            f"mpnb compare: no mode ran ({', '.join(modes)}); the notes above say why",
            file=sys.stderr,
        )
        return 2
    return 0


def _announce_if_slow(trainer, data, steps: int, prefix: str = "") -> None:
    """Say before training when the trainer's mode is slow on its device, and how long the run will take."""
    from mpnb.analysis.slow_modes import slow_mode_notice

    notice = slow_mode_notice(trainer, next(iter(data)), steps)
    if notice:
        print(f"{prefix}{notice}", flush=True)


def _whole_number(text: str, smallest: int, wanted: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {quoted(text)}") from None
    if value < smallest:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1, "a positive whole number")


def _count(text: str) -> int:
    return _whole_number(text, 0, "a whole number, 0 or more")


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= LARGEST_SEED:
        raise argparse.ArgumentTypeError(
            f"must be a whole number from 0 to {LARGEST_SEED}, got {quoted(text)}"
        )
    return value


def _folder(text: str) -> str:
    """The folder ``--out`` names, its ``..`` steps resolved: ``a/../b`` is ``b``, and no ``a/`` is made."""
    return os.path.normpath(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {quoted(text)}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error is one line: the bad value and what is valid, then where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpnb`` command."""
    from mpnb._version import __version__
    from mpnb.precision.modes import mode_names

    parser = _Parser(prog="mpnb", description="Mixed-precision training toolkit for PyTorch.")
    parser.add_argument("--version", action="version", version=f"mpnb {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = commands.add_parser(
        "devices", help="report what each device can do for mixed precision"
    )
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.add_argument(
        "--no-check", action="store_true", help="skip running a tiny Linear under each dtype"
    )
    report.set_defaults(run=_devices)
    comparing = commands.add_parser(
        "compare",
        help="train the example model once per precision mode; print the comparison, write CSV, JSON and HTML report",
    )
    comparing.add_argument(
        "--modes",
        default="fp32,tf32,fp16,bf16",
        help="comma-separated modes (default fp32,tf32,fp16,bf16)",
    )
    comparing.add_argument(
        "--steps", type=_positive_int, default=100, help="timed steps per mode (default 100)"
    )
    comparing.add_argument(
        "--warmup", type=_count, default=5, help="untimed steps first (default 5)"
    )
    comparing.add_argument(
        "--block",
        type=_positive_int,
        help="timed steps each mode trains per turn (default a tenth of --steps, at most 10); "
        "--block equal to --steps runs the modes one after another",
    )
    comparing.add_argument("--model", default="cnn", help="cnn, mlp or transformer (default cnn)")
    comparing.add_argument("--device", help="cpu, cuda, cuda:1, hpu (default: the best available)")
    comparing.add_argument(
        "--batch-size", type=_positive_int, default=64, help="examples per step (default 64)"
    )
    comparing.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help=f"seed of the model and the data order, 0 to {LARGEST_SEED} (default 0)",
    )
    comparing.add_argument(
        "--out",
        type=_folder,
        default="mpnb-compare",
        help="folder for the results (default ./mpnb-compare)",
    )
    comparing.set_defaults(run=_compare)
    train = commands.add_parser(
        "train",
        help="train the example CNN on the bundled 8x8 digits; print progress, write history CSV and HTML dashboard",
    )
    train.add_argument(
        "--mode",
        help=f"{', '.join(mode_names())} (default: the device's preferred AMP dtype; a mode that "
        "converts Linear layers, such as fp8, needs a model with them: --model mlp or transformer)",
    )
    for flag, keywords in option_arguments():  # the modes' options: fp8's --recipe, --keep
        train.add_argument(flag, **keywords)
    train.add_argument("--model", default="cnn", help="cnn, mlp or transformer (default cnn)")
    train.add_argument("--device", help="cpu, cuda, cuda:1, hpu (default: the best available)")
    train.add_argument(
        "--steps", type=_positive_int, default=200, help="optimizer steps (default 200)"
    )
    train.add_argument(
        "--batch-size", type=_positive_int, default=64, help="examples per step (default 64)"
    )
    train.add_argument(
        "--lr", type=_positive_float, default=3e-3, help="Adam learning rate (default 3e-3)"
    )
    train.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help=f"seed of the model and the data order, 0 to {LARGEST_SEED} (default 0)",
    )
    train.add_argument(
        "--out",
        type=_folder,
        default="mpnb-train",
        help="folder for history.csv and dashboard.html (default ./mpnb-train)",
    )
    train.set_defaults(run=_train)
    parser.commands = commands.choices  # each command's parser, by name
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mpnb`` command; returns its exit status.

    Example:
        >>> main(["devices", "--json", "--no-check"])
        {...}
        0
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command whose options they are not, pointing at its help
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if getattr(args, "out", None) is not None:
            check_writable_folder(args.out, "--out")
        return args.run(args)
    except MpnbError as error:
        print(f"mpnb {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
