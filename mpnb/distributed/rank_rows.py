"""Every rank's telemetry as it reaches the launching process, and what to see across ranks.

The ranks of a data-parallel run must agree on the loss scale and on which steps were skipped
(one rank stepping where another skipped means their weights have parted); their step times
show a straggler, which every other rank waits for at each gradient reduction.

Example:
    >>> rows = RankRows()
    >>> rows.add(0, 0, {"step": [1, 2], "loss": [0.9, 0.7], "step_time": [0.010, 0.010], "skipped": [False, True]})
    >>> rows.add(1, 0, {"step": [1, 2], "loss": [0.8, 0.6], "step_time": [0.010, 0.016], "skipped": [False, False]})
    >>> rows.ranks, rows.disagreements(), rows.stragglers(threshold=1.2, least=1)
    ([0, 1], [2], {1: 1.6})
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from mpnb.training.history import History

__all__ = ["RankRows", "RanksView"]


class RankRows:
    """Each rank's histories (one per ``mpnb.Trainer`` that fitted there, in order), filled as rows arrive.

    Attributes:
        histories: rank -> its histories so far.

    Example (rank 1 has reported one step fewer than rank 0):
        >>> rows = RankRows()
        >>> rows.add(0, 0, {"step": [1, 2], "loss": [0.9, 0.7]})
        >>> rows.add(1, 0, {"step": [1], "loss": [0.8]})
        >>> rows.ranks, rows.common_steps(), rows.latest()[0].loss
        ([0, 1], 1, [0.9, 0.7])
    """

    def __init__(self) -> None:
        self.histories: dict[int, list[History]] = {}
        self._newest: dict[int, int] = {}  # rank -> index of the history its latest rows went to

    def add(self, rank: int, index: int, columns: Mapping[str, Sequence[Any]]) -> None:
        """Rows of the ``index``-th history of ``rank``, given column-wise."""
        histories = self.histories.setdefault(rank, [])
        while len(histories) <= index:
            histories.append(History())
        histories[index].extend(columns)
        self._newest[rank] = index

    def settle(self, exact: Mapping[int, Sequence[History]]) -> None:
        """Replace each given rank's histories with ``exact`` (what the rank returned once it
        ended): rows the stream lost are then in, and nothing another process slipped in stays.

        Example:
            >>> rows = RankRows()
            >>> rows.add(0, 0, {"step": [2], "loss": [0.7]})  # step 1's rows were lost
            >>> whole = History()
            >>> whole.extend({"step": [1, 2], "loss": [0.9, 0.7]})
            >>> rows.settle({0: [whole]})
            >>> rows.latest()[0].step
            [1, 2]
        """
        for rank, histories in exact.items():
            if not histories:  # no trainer fitted there
                self.histories.pop(rank, None)
                self._newest.pop(rank, None)
                continue
            self.histories[rank] = list(histories)
            last = len(histories) - 1
            self._newest[rank] = min(self._newest.get(rank, last), last)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.histories)

    def latest(self) -> dict[int, History]:
        """Each rank's history that rows came to last (its running or last fit; a trainer that
        fits again after another one continues its own history)."""
        return {rank: self.histories[rank][self._newest[rank]] for rank in self.ranks}

    def common_steps(self) -> int:
        """Rows every rank's newest history has (the steps all ranks have reported)."""
        latest = self.latest()
        return min((len(history) for history in latest.values()), default=0)

    def disagreements(self) -> list[int]:
        """Steps (of the newest histories) where the ranks differ in loss scale or skipping:
        with DDP or FSDP they should never differ."""
        latest = list(self.latest().values())
        found = []
        for row in range(self.common_steps()):
            skips = {history.skipped[row] for history in latest}
            scales = {history.loss_scale[row] for history in latest}
            if len(skips) > 1 or len({repr(scale) for scale in scales}) > 1:  # repr: NaN equals NaN
                found.append(latest[0].step[row])
        return found

    def stragglers(
        self, window: int = 20, threshold: float = 1.15, least: int = 10
    ) -> dict[int, float]:
        """Ranks whose median time of their own work over the last ``window`` common steps is at
        least ``threshold`` times the median of the other ranks', with that ratio (2 decimals).

        A rank's own work is its ``forward_time`` where recorded (``mpnb.Trainer``): its step
        time would not do, since data-parallel ranks wait for each other in every gradient
        reduction and so take the same time a step. Without it, the step time. Said only once
        more than ``least`` steps are in (the first carries warm-up): fewer are noise."""
        end = self.common_steps()
        if end <= max(least, 1) or len(self.histories) < 2:  # step 1 alone is all warm-up
            return {}
        start = max(1, end - window)  # the first step carries warm-up
        medians = {
            rank: statistics.median(_own_time(h)[start:end]) for rank, h in self.latest().items()
        }
        slow = {}
        for rank, median in medians.items():
            others = statistics.median(m for other, m in medians.items() if other != rank)
            if others > 0 and median / others >= threshold:
                slow[rank] = round(median / others, 2)
        return slow


class RanksView:
    """Shows a launch's :class:`RankRows` while the ranks train. Override what you need;
    :func:`~mpnb.distributed.launch` calls :meth:`update` as rows arrive and :meth:`close` once at the end.

    Example:
        >>> class Steps(RanksView):
        ...     def update(self, rows):
        ...         print(rows.common_steps(), "steps on every rank")
    """

    def update(self, rows: RankRows) -> None:
        """New rows arrived."""

    def close(self, rows: RankRows) -> None:
        """The launch ended. ``rows`` holds what each rank returned (the histories of
        ``Launched.histories``, whole) where the launch succeeded, else what streamed in."""


def _own_time(history: History) -> list[float]:
    forward = history.forward_time
    return forward if forward and all(value == value for value in forward) else history.step_time
