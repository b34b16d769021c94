"""What every mpnb magic shares: parsing its line, and showing bad input as IPython's UsageError.

Example:
    >>> choice("%tf32 state", " ON ", ("on", "off"))
    'on'
    >>> choice("%tf32 state", "maybe", ("on", "off"))
    Traceback (most recent call last):
    ...
    IPython.core.error.UsageError: unknown %tf32 state 'maybe'; valid: on, off
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.oplists.session_lists import SEMANTICS

__all__ = ["as_usage_error", "choice", "parse_line", "with_semantics"]


def with_semantics(func):
    """Append the op-list semantics to a magic's help (read by ``%magic?``)."""
    func.__doc__ = f"{func.__doc__}\n{SEMANTICS}\n"
    return func


@contextlib.contextmanager
def as_usage_error() -> Iterator[None]:
    """Show mpnb's input errors the way IPython shows bad magic input."""
    try:
        yield
    except MpnbError as error:
        raise UsageError(str(error)) from None


def parse_line(magic, line: str) -> argparse.Namespace:
    """``line`` parsed by the magic's own magic_arguments; a line argparse cannot split is a UsageError."""
    try:
        return parse_argstring(magic, line)
    except ValueError as error:  # e.g. an unbalanced quote
        raise UsageError(f"cannot parse {line!r}: {error}") from None


def choice(what: str, value: str, valid: tuple[str, ...]) -> str:
    """``value`` normalised, if it is one of ``valid``; else a UsageError naming both."""
    chosen = value.strip().lower()
    if chosen not in valid:
        raise UsageError(str(InvalidChoiceError(what, value, valid)))
    return chosen
