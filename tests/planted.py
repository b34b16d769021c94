"""A symbolic link planted where mpnb will write, as someone sharing the folder could plant it,
and the checks that mpnb replaced the link instead of writing through it."""

from __future__ import annotations

import pathlib

#: What the link's target holds before mpnb writes, and must hold after.
VICTIM_TEXT = "someone else's file: mpnb must not write here\n"
#: Characters that make a spreadsheet run a cell as a formula (OWASP's list for CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def plant_link(destination: pathlib.Path) -> pathlib.Path:
    """A victim file outside ``destination``'s folder, and a link to it at ``destination``."""
    victim = destination.parent.parent / f"victim-of-{destination.name}"
    destination.parent.mkdir(parents=True, exist_ok=True)
    victim.write_text(VICTIM_TEXT)
    destination.symlink_to(victim)
    return victim


def assert_link_replaced(destination: pathlib.Path, victim: pathlib.Path) -> str:
    """The victim is as it was and ``destination`` is a file of its own; returns that file's text."""
    assert victim.read_text() == VICTIM_TEXT, "mpnb wrote through the planted link"
    assert destination.is_file() and not destination.is_symlink()
    return destination.read_text(encoding="utf-8")


def files_in(folder: pathlib.Path) -> list[str]:
    """The names in ``folder``: a temporary file left behind would show here."""
    return sorted(path.name for path in folder.iterdir())


def is_number(cell: str) -> bool:
    """Whether a CSV cell is a number (a spreadsheet shows it as one, never as a formula)."""
    try:
        float(cell)
    except ValueError:
        return False
    return True
