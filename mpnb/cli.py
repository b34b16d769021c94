"""The ``mpnb`` command.

Example (shell)::

    $ mpnb devices          # capability report, with a tiny autocast check per dtype
    $ mpnb devices --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _devices(args: argparse.Namespace) -> int:
    from mpnb.status import devices

    report = devices(check=not args.no_check)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpnb`` command."""
    parser = argparse.ArgumentParser(prog="mpnb", description="Mixed-precision training toolkit for PyTorch.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = commands.add_parser("devices", help="report what each device can do for mixed precision")
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.add_argument("--no-check", action="store_true", help="skip running a tiny Linear under each dtype")
    report.set_defaults(run=_devices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mpnb`` command; returns its exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
