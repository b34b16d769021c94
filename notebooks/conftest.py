"""Lessons leave nothing behind: whatever a lesson writes goes into a temporary folder.

nbval runs each lesson with notebooks/ as its working directory, so a relative path in a lesson
(``TrainingArguments("hf-out")``, a ``lightning_logs`` folder) lands beside the lessons, in the
user's checkout. After a lesson's last cell, a file or folder new in notebooks/ since its first
cell is an error on that cell, naming what appeared. (Lessons that run at once on several xdist
workers share those windows: the message names the lesson that ran, and the files.)
"""

from __future__ import annotations

import pathlib

import pytest

LESSONS = pathlib.Path(__file__).resolve().parent
#: What Python, pytest and Jupyter write beside any file they run: not the lessons' doing.
_TOOLING = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".virtual_documents"}

_before: dict[pathlib.Path, set[str]] = {}  # per lesson: what notebooks/ held before it ran


def _contents() -> set[str]:
    return {
        path.relative_to(LESSONS).as_posix()
        for path in LESSONS.rglob("*")
        if not _TOOLING.intersection(path.relative_to(LESSONS).parts)
    }


def _lesson(item: pytest.Item) -> pathlib.Path | None:
    path = pathlib.Path(str(item.path))
    return path if path.suffix == ".ipynb" else None


def pytest_runtest_setup(item: pytest.Item) -> None:
    lesson = _lesson(item)
    if lesson is not None and lesson not in _before:
        _before[lesson] = _contents()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    lesson = _lesson(item)
    if lesson is None or lesson not in _before:
        return
    if nextitem is not None and _lesson(nextitem) == lesson:
        return
    left = sorted(_contents() - _before.pop(lesson))
    if left:
        pytest.fail(
            f"{LESSONS.name}/ gained {', '.join(left)} while {lesson.name} ran: a lesson writes "
            "only into a temporary folder (tempfile.TemporaryDirectory()), never beside the lessons",
            pytrace=False,
        )
