"""Time spent inside chosen functions during a run: a direct reading of a helper's own cost per
step, which a whole-run ratio on a noisy machine cannot resolve below a few percent.

Only outermost calls count (a hook that calls another measured function is not counted twice).
The wrappers cost a little themselves, so measure in a run of its own, not in the timed rounds.

    >>> class Work:
    ...     def step(self):
    ...         return sum(range(1000))
    >>> with OwnTime([(Work, "step")]) as own:
    ...     _ = [Work().step() for _ in range(3)]
    >>> own.calls, own.seconds > 0
    (3, True)
    >>> Work.step.__name__  # put back on leaving
    'step'
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["OwnTime"]


class OwnTime:
    """Accumulates the seconds spent in ``targets`` (``(owner, attribute name)`` pairs: a class and
    a method, a module and a function) while the ``with`` block runs."""

    def __init__(self, targets: Iterable[tuple[Any, str]]) -> None:
        self.targets = list(targets)
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> OwnTime:
        for owner, name in self.targets:
            original = owner.__dict__[name]
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _timed(self, function: Any) -> Any:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return function(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
                self._depth -= 1

        return timed
