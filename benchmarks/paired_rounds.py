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

__all__ = ["fastest_ratio", "median_ratio", "paired_rounds"]


def paired_rounds(
    baseline: Callable[[int], float], candidate: Callable[[int], float], rounds: int
) -> tuple[list[float], list[float]]:
    """Call each with the round's index (1 to ``rounds``, after a warm-up round 0) and keep the
    seconds they return: baseline first in even rounds, candidate first in odd ones."""
    baseline_times, candidate_times = [], []
    for round_index in range(rounds + 1):
        if round_index % 2:
            candidate_time, baseline_time = candidate(round_index), baseline(round_index)
        else:
            baseline_time, candidate_time = baseline(round_index), candidate(round_index)
        if round_index:
            baseline_times.append(baseline_time)
            candidate_times.append(candidate_time)
    return baseline_times, candidate_times


def median_ratio(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """The median over rounds of candidate / baseline (paired: each round's own ratio)."""
    return statistics.median(c / b for b, c in zip(baseline, candidate))


def fastest_ratio(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """The candidate's fastest round over the baseline's fastest round."""
    return min(candidate) / min(baseline)
