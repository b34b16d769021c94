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
import shlex
from collections.abc import Iterator

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from mpnb.errors import QUOTE_LIMIT, InvalidChoiceError, MpnbError, quoted
from mpnb.oplists.session_lists import SEMANTICS
from mpnb.precision.modes.registry import option_arguments

__all__: list[str] = []

#: The longest magic argument line read (shell-style splitting of megabytes takes minutes).
MAX_LINE = 65_536


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


def parse_line(
    magic, line: str, valid: str = "", *, expressions: bool = False
) -> argparse.Namespace:
    """``line`` split as a shell splits it (quotes group words and are removed), then parsed by
    the magic's own magic_arguments.

    Args:
        valid: what the magic accepts, added to every error (``"modes: off, fp32, ..."``).
        expressions: the magic's arguments are Python expressions: a bracketed one written
            with spaces is one argument (:func:`bracketed`).

    Raises:
        UsageError: a line that cannot be split or parsed; it quotes the input short, and says
            the usage and the valid values.
    """
    if len(line) > MAX_LINE:
        raise UsageError(
            f"arguments {quoted(line)} are too long; a magic's arguments are limited to {MAX_LINE:,} characters"
        )
    try:
        words = shlex.split(without_comment(line))
    except ValueError as error:  # an unbalanced quote
        raise UsageError(f"cannot parse {quoted(line)}: {error}") from None
    if expressions:
        words = bracketed(words)
    if {"-h", "--help"} & set(words):  # magic_arguments' parsers add no help option
        raise UsageError(magic.parser.format_help().removeprefix("::").strip())
    try:
        return magic.parser.parse_args(words)
    except UsageError as error:
        usage = (
            " ".join(magic.parser.format_usage().split()).removeprefix("::").strip()
        )  # IPython's "::" prefix
        detail = f"; {valid}" if valid else ""
        raise UsageError(f"{_short(str(error))}{detail}; usage: {usage}") from None


def bracketed(words: list[str]) -> list[str]:
    """``words`` with those inside one bracketed expression joined back into one: an argument
    written as Python with spaces (``(x, y)``, ``batch[: 16]``) is one word. Brackets that never
    close take every word after them (the expression then fails to read, saying so).

    >>> bracketed(["model", "(x,", "y)", "--loss", "f"])
    ['model', '(x, y)', '--loss', 'f']
    >>> bracketed(["[a,", "(b,", "c)]"]), bracketed(["x)", "y"])
    (['[a, (b, c)]'], ['x)', 'y'])
    """
    joined: list[str] = []
    depth = 0
    for word in words:
        if depth > 0:
            joined[-1] += " " + word
        else:
            joined.append(word)
        depth = max(
            0, depth + sum(word.count(c) for c in "([{") - sum(word.count(c) for c in ")]}")
        )
    return joined


def without_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a word outside quotes: a comment, as in the Python
    around the magic (IPython hands a line magic its comment as arguments).

    >>> without_comment("bf16   # every following cell")
    'bf16   '
    >>> without_comment("--keep 'head #2' lm#x")
    "--keep 'head #2' lm#x"
    >>> without_comment(r'--keep "a\\"b # c"  # a comment')  # an escaped quote
    '--keep "a\\\\"b # c"  '
    """
    quote, escaped = None, False
    for index, char in enumerate(line):
        if escaped:  # the character after a backslash is itself, as the shell reads it
            escaped = False
        elif char == "\\" and quote != "'":  # literal within single quotes only
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def cell_usage(func):
    """Show a cell magic's usage with its ``%%`` (magic_arguments writes one ``%`` for every
    magic); put above ``magic_arguments()``."""
    parser = func.parser
    said = parser.format_usage()
    parser.prog = f"%{parser.prog}"
    func.__doc__ = func.__doc__.replace(said.rstrip(), parser.format_usage().rstrip(), 1)
    return func


def _short(message: str) -> str:
    """An argparse message with any long word in it quoted short."""
    return " ".join(
        quoted(word)[1:-1] if len(word) > QUOTE_LIMIT else word for word in message.split(" ")
    )


def with_mode_options(func):
    """Add ``--NAME`` for every option of the registered modes (fp8's ``--recipe``, ``--keep``)
    to a magic declared with ``magic_arguments``; ``read_options(args)`` reads them back."""
    for flag, keywords in reversed(option_arguments()):
        func = argument(flag, **keywords)(func)
    return func


def choice(what: str, value: str, valid: tuple[str, ...]) -> str:
    """``value`` normalised, if it is one of ``valid``; else a UsageError naming both."""
    chosen = value.strip().lower()
    if chosen not in valid:
        raise UsageError(str(InvalidChoiceError(what, value, valid)))
    return chosen
