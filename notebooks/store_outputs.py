"""Run the lessons and store their outputs, for the docs site to show.

The docs render each lesson from its committed file (mkdocs-jupyter does not execute them: the
test suite already runs every lesson, through nbval). This script runs a lesson in a fresh
kernel, in a temporary folder (what the lesson writes stays there), and stores what a reader
would see: printed text, tables, images and plotly figures.

- Widget views (the panel, the live dashboard) are left out: a docs page has no kernel to draw
  them from. A plotly figure gets an HTML form beside its JSON, which the site draws.
- The outputs of cells marked ``# NBVAL_CHECK_OUTPUT`` stay as committed: nbval compares them on
  every machine, so they hold nothing a machine changes.
- Paths of this machine (the venv, the kernel's cell files, the temporary folder) become
  placeholders.
- Each lesson records a hash of its code (``metadata["mpnb"]["outputs_of"]``).
  ``tests/docs/test_site.py`` fails when the code changes and the outputs were not stored again.

    python notebooks/store_outputs.py                       # every lesson
    python notebooks/store_outputs.py 03_fp16_vs_bf16.ipynb  # one
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import sys
import sysconfig
import tempfile

LESSONS = pathlib.Path(__file__).resolve().parent
CHECKED = "NBVAL_CHECK_OUTPUT"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PLOTLY = "application/vnd.plotly.v1+json"
#: A plotly figure as the docs site draws it: docs/js/lesson-figures.js finds the figure's JSON
#: and draws it with the site's own copy of plotly.js (docs/hooks/lesson_figures.py).
FIGURE_HTML = '<div class="mpnb-figure"><script type="application/json">{}</script></div>'


def code_hash(notebook: dict) -> str:
    """What the stored outputs were made from: the sources of the code cells, in order.

    >>> code_hash({"cells": [{"cell_type": "code", "source": "print(1)"}]})
    'd287bb7f9d15abdc'
    """
    sources = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    return hashlib.sha256("\0".join(sources).encode()).hexdigest()[:16]


def stored_hash(notebook: dict) -> str | None:
    """The code hash the lesson's outputs were stored with (None: never stored)."""
    return notebook.get("metadata", {}).get("mpnb", {}).get("outputs_of")


def _placeholders(folder: str) -> list[tuple[re.Pattern[str], str]]:
    return [
        (re.compile(re.escape(sysconfig.get_paths()["purelib"])), "<site-packages>"),
        (re.compile(re.escape(sys.prefix)), "<venv>"),
        (re.compile(re.escape(folder)), "<lesson folder>"),
        (re.compile(re.escape(tempfile.gettempdir()) + r"/ipykernel_\d+/\d+\.py"), "<cell>"),
    ]


def _cleaned(output: dict, placeholders: list[tuple[re.Pattern[str], str]]) -> dict | None:
    """``output`` as a docs page can show it, or None where nothing is left."""

    def scrub(text: str | list[str]) -> str:
        text = "".join(text)
        for pattern, placeholder in placeholders:
            text = pattern.sub(placeholder, text)
        return text

    if output["output_type"] == "stream":
        return {**output, "text": scrub(output["text"])}
    data = output.get("data")
    if data is None:
        return output
    if WIDGET_VIEW in data:
        return None  # a widget's text/plain is only its class name
    kept = {
        mime: scrub(value) if isinstance(value, (str, list)) else value
        for mime, value in data.items()
    }
    if PLOTLY in kept and "text/html" not in kept:
        figure = json.dumps(kept[PLOTLY], separators=(",", ":")).replace("</", "<\\/")
        kept["text/html"] = FIGURE_HTML.format(figure)
    return {**output, "data": kept}


def store(path: pathlib.Path) -> None:
    """Run the lesson at ``path`` and write its outputs into it (see the module's docstring)."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    committed = [cell.get("outputs") for cell in notebook.cells]
    with tempfile.TemporaryDirectory(prefix="mpnb-lesson-") as folder:
        run = nbformat.read(path, as_version=4)
        NotebookClient(
            run, timeout=600, kernel_name="python3", resources={"metadata": {"path": folder}}
        ).execute()
        placeholders = _placeholders(folder)
    for cell, ran, before in zip(notebook.cells, run.cells, committed):
        if cell.cell_type != "code":
            continue
        cell.execution_count = ran.execution_count
        if CHECKED not in "".join(cell.source):
            cleaned = (_cleaned(output, placeholders) for output in ran.outputs)
            cell.outputs = [nbformat.from_dict(o) for o in cleaned if o is not None]
        else:
            cell.outputs = before
    notebook.metadata.setdefault("mpnb", {})["outputs_of"] = code_hash(notebook)
    nbformat.write(notebook, path)


def main(names: list[str]) -> None:
    paths = [LESSONS / name for name in names] or sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise SystemExit(f"no such lesson: {', '.join(missing)}")
    for path in paths:
        print(f"running {path.name}", flush=True)
        store(path)


if __name__ == "__main__":
    main(sys.argv[1:])
