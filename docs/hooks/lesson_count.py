"""MkDocs hook: how many lessons there are, counted at build time, in words.

A page that holds ``<!-- lesson count -->`` gets the number of lessons in ``notebooks/``
(``NN_name.ipynb``) written out ("thirteen"), so that adding a lesson needs no edit of the
front page.
"""

from __future__ import annotations

import pathlib

PLACEHOLDER = "<!-- lesson count -->"
LESSONS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NUMBERS = (
    "no one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()


def lesson_count() -> str:
    """The number of lessons, in words (in figures beyond twenty)."""
    count = len(list(LESSONS.glob("[0-9][0-9]_*.ipynb")))
    return NUMBERS[count] if count < len(NUMBERS) else str(count)


def on_page_markdown(markdown: str, **_: object) -> str:
    """Write the count where a page asks for it."""
    return markdown.replace(PLACEHOLDER, lesson_count()) if PLACEHOLDER in markdown else markdown
