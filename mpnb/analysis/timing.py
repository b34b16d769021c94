"""How far to trust a comparison's timings: each mode's median and spread, each speedup's interval.

Step times come from interleaved blocks (see :mod:`mpnb.analysis.schedule`): in each round
every mode trains a few steps in turn, so drift of a shared machine hits all modes alike.
A mode's step times are summarised by torch.utils.benchmark's ``Measurement`` (median and
interquartile range). A speedup over fp32 is measured round by round, each round's ratio
of fp32's median block time to the mode's, so drift between rounds cancels; its interval is
the quartiles of those ratios. An interval that holds 1.0 is "no clear difference".

Example:
    >>> stats = step_time_stats([0.0100, 0.0101, 0.0102, 0.0103, 0.0100])
    >>> round(stats.median_s * 1e3, 2), round(stats.iqr_s * 1e3, 2), stats.spread_warning
    (10.1, 0.2, '')
    >>> step_time_stats([0.010, 0.020, 0.011, 0.010]).spread_warning[:37]
    'step times spread 31% (IQR/median): o'

    >>> speedup = speedup_over([[0.02, 0.02], [0.02, 0.021]], [[0.01, 0.01], [0.0105, 0.0105]])
    >>> round(speedup.median, 2), speedup.verdict
    (1.98, 'faster')
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

__all__: list[str] = []

#: A relative interquartile range above this reads as an unsteady machine (torch.utils.benchmark's own threshold).
SPREAD_WARN = 0.10


@dataclasses.dataclass(frozen=True)
class StepTimeStats:
    """One mode's timed steps: median, interquartile range, count, and a warning when unsteady."""

    median_s: float
    iqr_s: float
    count: int

    @property
    def relative_spread(self) -> float:
        """IQR over median (NaN without timings)."""
        return self.iqr_s / self.median_s if self.count and self.median_s > 0 else math.nan

    @property
    def spread_warning(self) -> str:
        """Empty, or what a relative spread above :data:`SPREAD_WARN` means and what to do about it."""
        if not self.relative_spread > SPREAD_WARN:
            return ""
        return (
            f"step times spread {self.relative_spread:.0%} (IQR/median): other load on the machine is the likely "
            "cause; more steps (steps=, --steps) narrow it"
        )


def step_time_stats(times: Sequence[float]) -> StepTimeStats:
    """Median and IQR of ``times`` (seconds), by torch.utils.benchmark's ``Measurement``."""
    finite = [t for t in times if math.isfinite(t)]
    if not finite:
        return StepTimeStats(math.nan, math.nan, 0)
    from torch.utils.benchmark.utils.common import (
        Measurement,
        TaskSpec,
    )  # 1 s to import: only when needed

    measurement = Measurement(
        number_per_run=1, raw_times=finite, task_spec=TaskSpec(stmt="step", setup="")
    )
    return StepTimeStats(measurement.median, measurement.iqr, len(finite))


@dataclasses.dataclass(frozen=True)
class Speedup:
    """A mode's speedup over fp32: the median of the per-round ratios and their quartiles."""

    median: float
    low: float
    high: float
    rounds: int

    @property
    def verdict(self) -> str:
        """``"faster"``, ``"slower"``, ``"no clear difference"`` (the interval holds 1.0), or ``""``
        (fewer than two rounds: no interval)."""
        if self.rounds < 2 or not math.isfinite(self.median):
            return ""
        if self.low <= 1.0 <= self.high:
            return "no clear difference"
        return "faster" if self.median > 1.0 else "slower"


NO_SPEEDUP = Speedup(math.nan, math.nan, math.nan, 0)


def speedup_over(
    baseline_blocks: Sequence[Sequence[float]], mode_blocks: Sequence[Sequence[float]]
) -> Speedup:
    """The speedup of a mode over the baseline from their step times, block by block.

    Args:
        baseline_blocks: fp32's timed step times, one list per round.
        mode_blocks: the mode's, one list per round (paired with the baseline's by index).
    """
    ratios = [
        statistics.median(base) / statistics.median(mode)
        for base, mode in zip(baseline_blocks, mode_blocks)
        if base and mode and statistics.median(mode) > 0
    ]
    if not ratios:
        return NO_SPEEDUP
    if len(ratios) == 1:
        return Speedup(ratios[0], ratios[0], ratios[0], 1)
    low, middle, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return Speedup(middle, low, high, len(ratios))
