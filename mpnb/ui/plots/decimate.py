"""Streaming min/max decimation: a series of any length drawn with a bounded number of points.

Points arrive in order and fall into buckets of ``width`` consecutive points; each bucket
keeps its lowest and highest point, so spikes (a loss blow-up, a scale back-off) survive.
When the buckets outnumber the budget, neighbours merge and the width doubles. Adding a
point costs O(1) amortised and :meth:`MinMaxSeries.points` O(budget): the cost of a redraw
does not grow with the length of the run.

Example:
    >>> series = MinMaxSeries(max_points=8)
    >>> series.extend(range(1000), [float(i % 7) for i in range(1000)])
    >>> xs, ys = series.points()
    >>> len(xs) <= 8, float(ys.min()), float(ys.max()), series.count
    (True, 0.0, 6.0, 1000)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

__all__: list[str] = []

# A bucket: [x of min, min, x of max, max]
Bucket = list[float]


class MinMaxSeries:
    """A decimated view of a growing (x, y) series: at most ``max_points`` points.

    Non-finite y values (inf/NaN losses of overflowed steps) are counted but not drawn.
    """

    def __init__(self, max_points: int = 500) -> None:
        if max_points < 4:
            raise ValueError(f"max_points must be at least 4, got {max_points}")
        self.max_buckets = max_points // 2
        self.width = 1
        self.count = 0
        self._buckets: list[Bucket | None] = []

    def extend(self, xs: Iterable[float], ys: Iterable[float]) -> None:
        """Append points in x order."""
        for x, y in zip(xs, ys):
            self._add(float(x), float(y))

    def _add(self, x: float, y: float) -> None:
        index = self.count // self.width
        self.count += 1
        if index == len(self._buckets):
            self._buckets.append(None)
        if math.isfinite(y):
            bucket = self._buckets[index]
            if bucket is None:
                self._buckets[index] = [x, y, x, y]
            else:
                if y < bucket[1]:
                    bucket[0], bucket[1] = x, y
                if y > bucket[3]:
                    bucket[2], bucket[3] = x, y
        if len(self._buckets) > self.max_buckets:
            self._merge_pairs()

    def _merge_pairs(self) -> None:
        merged: list[Bucket | None] = []
        for left, right in zip(self._buckets[0::2], self._buckets[1::2] + [None]):
            merged.append(_merge(left, right))
        self._buckets = merged
        self.width *= 2

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """The kept points in x order: float64 x, float32 y (compact for the widget's binary buffers)."""
        xs: list[float] = []
        ys: list[float] = []
        for bucket in self._buckets:
            if bucket is None:
                continue
            x_first, y_first, x_second, y_second = bucket
            if x_second < x_first:  # the maximum came first
                x_first, y_first, x_second, y_second = x_second, y_second, x_first, y_first
            xs.append(x_first)
            ys.append(y_first)
            if x_second != x_first:  # one point when the lowest is the highest
                xs.append(x_second)
                ys.append(y_second)
        return np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float32)


def _merge(left: Bucket | None, right: Bucket | None) -> Bucket | None:
    if left is None or right is None:
        return list(left or right) if (left or right) else None
    low = left[:2] if left[1] <= right[1] else right[:2]
    high = left[2:] if left[3] >= right[3] else right[2:]
    return [*low, *high]
