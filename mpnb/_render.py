"""Small helpers that render result objects: tables as text, HTML and CSV cells, dtypes by short name.

Example:
    >>> print(text_table(["mode", "dtype"], [["bf16", "bfloat16"]]))
    mode  dtype
    bf16  bfloat16
    >>> dtype_name(torch.bfloat16), dtype_name(torch.int64), dtype_name(None)
    ('bf16', 'torch.int64', '-')
    >>> csv_cell("=1+1"), csv_cell(-0.5), from_csv_cell(csv_cell("'quoted"))
    ("'=1+1", -0.5, "'quoted")
"""

from __future__ import annotations

import html
import textwrap
from collections.abc import Sequence

import torch

__all__: list[str] = []

#: How a text cell a spreadsheet would run as a formula starts (OWASP's list for CSV injection).
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
#: What spreadsheets take as "this cell is text", shown to no one.
_TEXT_MARK = "'"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces; a header with a newline takes two lines
    (its last line beside the other headers' one line).

    >>> print(text_table(["mode", "median\\nstep (ms)"], [["bf16", "1.5"]]))
          median
    mode  step (ms)
    bf16  1.5
    """
    split = [str(h).split("\n") for h in headers]
    height = max((len(lines) for lines in split), default=1)
    header_rows = [
        [lines[len(lines) - height + i] if i >= height - len(lines) else "" for lines in split]
        for i in range(height)
    ]
    cells = [*header_rows, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def text_notes(notes: Sequence[str], width: int = 100) -> str:
    """Notes under a text table, one ``- note`` each, wrapped at ``width`` columns.

    >>> print(text_notes(["a note long enough to wrap"], width=16))
    - a note long
      enough to wrap
    """
    return "\n".join(
        textwrap.fill(note, width, initial_indent="- ", subsequent_indent="  ") for note in notes
    )


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table with escaped cells; headers that are all empty (a table of names and
    values) leave out the header row, which would show as a blank row.

    >>> html_table(["", ""], [["mode", "bf16"]])
    "<table><tbody><tr><td style='text-align:left'>mode</td><td style='text-align:left'>bf16</td></tr></tbody></table>"
    """
    head = "".join(f"<th style='text-align:left'>{html.escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f"<td style='text-align:left'>{html.escape(str(c))}</td>" for c in row)
        + "</tr>"
        for row in rows
    )
    thead = f"<thead><tr>{head}</tr></thead>" if any(str(h) for h in headers) else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def html_list(items: Sequence[str], css_class: str) -> str:
    """An HTML bullet list with escaped items, or nothing for no items."""
    if not items:
        return ""
    return (
        f"<ul class='{css_class}'>" + "".join(f"<li>{html.escape(i)}</li>" for i in items) + "</ul>"
    )


def csv_cell(value: object) -> object:
    """``value`` as a CSV cell a spreadsheet shows and never runs, as OWASP advises.

    Text that starts like a formula (``=``, ``+``, ``-``, ``@``, a tab or a carriage return)
    gets a leading ``'``; so does text that already starts with ``'``, so that
    :func:`from_csv_cell` gives back exactly what was written. Anything else (a negative
    number, ``-inf``) is left to the :mod:`csv` writer: numbers stay numbers.
    """
    if isinstance(value, str) and value.startswith((*_FORMULA_STARTS, _TEXT_MARK)):
        return _TEXT_MARK + value
    return value


def from_csv_cell(text: str) -> str:
    """A text cell written by :func:`csv_cell`, as it was before (one leading ``'`` taken off)."""
    return text.removeprefix(_TEXT_MARK)


def dtype_name(dtype: torch.dtype | None) -> str:
    """Short name of a dtype: ``torch.bfloat16`` -> ``"bf16"``; None -> ``"-"``."""
    if dtype is None:
        return "-"
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(
        dtype, str(dtype)
    )
