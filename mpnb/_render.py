"""Small helpers that render result objects: tables as text and HTML, dtypes by short name.

Example:
    >>> print(text_table(["mode", "dtype"], [["bf16", "bfloat16"]]))
    mode  dtype
    bf16  bfloat16
    >>> dtype_name(torch.bfloat16), dtype_name(torch.int64), dtype_name(None)
    ('bf16', 'torch.int64', '-')
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import torch

__all__ = ["text_table", "html_table", "html_list", "dtype_name"]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table with escaped cells."""
    head = "".join(f"<th style='text-align:left'>{html.escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(c))}</td>" for c in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_list(items: Sequence[str], css_class: str) -> str:
    """An HTML bullet list with escaped items, or nothing for no items."""
    if not items:
        return ""
    return f"<ul class='{css_class}'>" + "".join(f"<li>{html.escape(i)}</li>" for i in items) + "</ul>"


def dtype_name(dtype: torch.dtype | None) -> str:
    """Short name of a dtype: ``torch.bfloat16`` -> ``"bf16"``; None -> ``"-"``."""
    if dtype is None:
        return "-"
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
