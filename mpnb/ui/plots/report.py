"""A self-contained HTML page of a training run: the dashboard and the summary table.

plotly.js is embedded in the page, so it opens with no network.

Example:
    >>> from mpnb.training.history import History
    >>> h = History(meta={"model": "demo"})
    >>> h.extend({"step": [1, 2], "loss": [1.0, 0.5]})
    >>> page = report_html(h, "demo run", [("accuracy", "0.9")])
    >>> "<script src=\\"http" in page, "accuracy" in page
    (False, True)
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence

from mpnb._files import atomic_write
from mpnb._render import html_table
from mpnb.training.history import History
from mpnb.ui.plots.figure import dashboard_figure

__all__: list[str] = []


def report_html(history: History, title: str, extra_rows: Sequence[tuple[str, str]] = ()) -> str:
    """The whole page as a string."""
    figure = dashboard_figure(history, title="")
    plot = figure.to_html(include_plotlyjs=True, full_html=False, config={"displaylogo": False})
    table = html_table(("", ""), [*extra_rows, *history.summary_rows()])
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td{padding:2px 12px}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{table}{plot}</body></html>\n"
    )


def write_report(
    path: str | os.PathLike[str],
    history: History,
    title: str,
    extra_rows: Sequence[tuple[str, str]] = (),
) -> None:
    """Write :func:`report_html` to ``path``, replacing it whole (never writing through a link)."""
    with atomic_write(path) as file:
        file.write(report_html(history, title, extra_rows))
