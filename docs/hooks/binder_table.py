"""MkDocs hook: each lesson's time and peak memory on a machine like Binder's, from the
committed results of benchmarks/binder_lessons.py (one CPU, 2 GB).

A page that holds ``<!-- binder table -->`` gets a row per notebook: the seconds it took top to
bottom on one core, its peak resident memory (nbconvert and the kernel together), and whether
it fits Binder's 2 GB.
"""

from __future__ import annotations

import json
import pathlib

PLACEHOLDER = "<!-- binder table -->"
RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks/results/binder_lessons.json"


def binder_table() -> str:
    """The Markdown table of the committed measurement."""
    figures = json.loads(RESULTS.read_text())
    lines = [
        "| notebook | time on one core | peak memory | fits 2 GB |",
        "|---|---|---|---|",
    ]
    for name, row in figures["notebooks"].items():
        fits = "yes" if row["fits"] else ("no" if row["ran"] else "did not run")
        lines.append(
            f"| {name} | {row['seconds']:.0f} s | {row['peak_memory'] / 2**30:.2f} GiB | {fits} |"
        )
    load = ", ".join(f"{value:.1f}" for value in figures.get("load_average", []))
    lines += [
        "",
        f"Measured by `python benchmarks/binder_lessons.py` on {figures.get('cpu', 'this CPU')} "
        f"({figures.get('torch', '')}), pinned to one core; the machine's load average at the end "
        f"was {load} (others' work shared it, so the times are upper bounds).",
    ]
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_: object) -> str:
    """Put the table where a page asks for it."""
    return markdown.replace(PLACEHOLDER, binder_table()) if PLACEHOLDER in markdown else markdown
