"""The timing schedule the side-by-side benchmarks share: rounds that time a baseline and a
candidate back to back, the order flipped every round so that drift favours neither, round 0
only warming both up. Two figures: the median of each round's own ratio, and the ratio of each
side's fastest round. On a shared machine noise only ever adds time (another process takes the
core, a cache is cold), so a side's fastest round is the closest reading of its undisturbed
cost; the median of ratios still moves by the noise of a pair.

    >>> order = []
    >>> def timer(name, seconds):
    ...     return lambda round_index: order.append(f"{name}{round_index}") or seconds * round_index
    >>> baseline, candidate = paired_rounds(timer("a", 1.0), timer("b", 1.5), rounds=2)
    >>> order, baseline, candidate
    (['a0', 'b0', 'b1', 'a1', 'a2', 'b2'], [1.0, 2.0], [1.5, 3.0])
    >>> median_ratio(baseline, candidate), fastest_ratio(baseline, candidate)
    (1.5, 1.5)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

__all__ = ["fastest_ratio", "median_ratio", "paired_rounds", "round_robin"]


def paired_rounds(
    baseline: Callable[[int], float], candidate: Callable[[int], float], rounds: int
) -> tuple[list[float], list[float]]:
    """Call each with the round's index (1 to ``rounds``, after a warm-up round 0) and keep the
    seconds they return: baseline first in even rounds, candidate first in odd ones."""
    times = round_robin({"baseline": baseline, "candidate": candidate}, rounds)
    return times["baseline"], times["candidate"]


def round_robin(timers: dict[str, Callable[[int], float]], rounds: int) -> dict[str, list[float]]:
    """:func:`paired_rounds` for any number of timers: each once a round, the order turned by one
    each round so that drift favours none; round 0 only warms up (and compiles).

    >>> order = []
    >>> timers = {name: (lambda n: lambda i: order.append(f"{n}{i}") or 1.0)(name) for name in "abc"}
    >>> round_robin(timers, rounds=2)["c"], order
    ([1.0, 1.0], ['a0', 'b0', 'c0', 'b1', 'c1', 'a1', 'c2', 'a2', 'b2'])
    """
    names, times = list(timers), {name: [] for name in timers}
    for round_index in range(rounds + 1):
        turn = round_index % len(names)
        for name in names[turn:] + names[:turn]:
            seconds = timers[name](round_index)
            if round_index:
                times[name].append(seconds)
    return times


def median_ratio(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """The median over rounds of candidate / baseline (paired: each round's own ratio)."""
    return statistics.median(c / b for b, c in zip(baseline, candidate))


def fastest_ratio(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """The candidate's fastest round over the baseline's fastest round."""
    return min(candidate) / min(baseline)
