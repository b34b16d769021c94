"""Where a trainer stands in its data, and what it holds of it between fits.

A :class:`DataPosition` is the one owner of a :class:`~mpnb.Trainer`'s place in its data: the
next batch to train on (epoch, batch), the epoch an unfinished plan ends before, where the
running accumulation window began and (for one-shot data) its batches, the batches a stopped
fit read and did not train, and the reader the running fit takes its batches from. Its methods
are the only moves: :meth:`~DataPosition.plan` a fit, read an epoch's batches
(:meth:`~DataPosition.epoch_batches`), note a batch (:meth:`~DataPosition.take`, which may
start a window, and :meth:`~DataPosition.trained`), :meth:`~DataPosition.hold` at a
stop, :meth:`~DataPosition.drop_window` after an error, :meth:`~DataPosition.next_epoch`.

Where a resumed fit's batches come from (:func:`resume`): a fit that stopped keeps the
iterator it was reading (:class:`HeldBatches`), and the next fit at the same place goes on
with it, so no batch is loaded twice.

Example (a fit of one epoch that stops after two batches, and the next one that goes on):
    >>> data = ["a", "b", "c"]
    >>> place = DataPosition()
    >>> place.plan(epochs=1)
    >>> reader = place.epoch_batches(data)
    >>> for batch in reader:
    ...     if place.batch == 2:
    ...         place.hold(batch)
    ...         break
    ...     _ = place.take(batch, starts_window=True)
    ...     place.trained()
    >>> place.close(), place.position
    (None, (0, 2, 1))
    >>> list(place.epoch_batches(data))  # the batch read at the stop, then the same iterator
    ['c']
"""

from __future__ import annotations

import collections
import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from mpnb.training.batches import to_device

__all__: list[str] = []


class HeldBatches(NamedTuple):
    """Where a stopped fit left its data: ``batches`` read and not trained, then ``rest``.

    ``position`` is the (epoch, batch) they start at; None for a one-shot iterator, which has
    no other place to go on from.
    """

    data: Iterable[Any]
    position: tuple[int, int] | None
    batches: list[Any]
    rest: Iterator[Any]


class BatchReader:
    """An epoch's batches: first those read before and not trained, then the data's own iterator.

    However many times a fit stops and resumes, what it holds stays one list and one iterator
    (no chain of chains growing by one link per resume).

    Example:
        >>> reader = BatchReader([1], iter([2, 3]))
        >>> next(reader), reader.hold("data", (0, 1), next(reader)).batches
        (1, [2])
    """

    def __init__(self, pending: Iterable[Any], source: Iterator[Any]) -> None:
        self.pending = collections.deque(pending)
        self.source = source

    def __iter__(self) -> BatchReader:
        return self

    def __next__(self) -> Any:
        return self.pending.popleft() if self.pending else next(self.source)

    def hold(
        self, data: Iterable[Any], position: tuple[int, int] | None, *read: Any
    ) -> HeldBatches:
        """What a stopping fit keeps: the batches it ``read`` and did not train, then everything not yet read."""
        return HeldBatches(data, position, [*read, *self.pending], self.source)


def resume(
    held: HeldBatches | None, data: Iterable[Any], position: tuple[int, int], one_shot: bool
) -> BatchReader:
    """An epoch's batches from ``position`` (epoch, batch) on.

    Where the last fit stopped at this very position on this very data, its iterator goes on
    (after the batches it had read): nothing is read twice, so resuming a DataLoader costs no
    reloading, and an unseeded shuffle keeps its order. Otherwise a fresh pass skips to the
    position (a one-shot iterator simply goes on where it is).

    Example:
        >>> rest = iter([3, 4])
        >>> list(resume(HeldBatches("data", (0, 2), [2], rest), "data", (0, 2), one_shot=False))
        [2, 3, 4]
        >>> list(resume(None, [0, 1, 2, 3], (0, 2), one_shot=False))
        [2, 3]
    """
    if held is not None and held.data is data and held.position in (None, position):
        return BatchReader(held.batches, held.rest)
    return BatchReader((), iter(data) if one_shot else itertools.islice(data, position[1], None))


def warn_no_batches(epoch: int, one_shot: bool) -> None:
    """Say that the data gave no batches in ``epoch`` (a used-up generator, for one): a
    ``RuntimeWarning`` pointing at the ``fit`` call."""
    used_up = (
        " (a generator is used up after one pass: pass a list or a DataLoader to train more epochs)"
    )
    warnings.warn(
        f"mpnb: the data gave no batches in epoch {epoch}{used_up if one_shot else ''}",
        RuntimeWarning,
        stacklevel=6,  # here, DataPosition.next_epoch, Trainer._run, _fit, fit: its caller
    )


class DataPosition:
    """A trainer's place in its data, what it holds of it, and the batch it trained last.

    Attributes:
        epoch: the epoch of the next batch to train on.
        batch: the index of the next batch to train on in its epoch.
        end: the epoch an unfinished plan ends before; None when the last plan was finished.
        held: the batches the last fit read and did not train (the one read when it stopped; for
            a one-shot iterator also an unfinished window after an error) and the iterator to go
            on with; None when it holds nothing.
        device: where the running fit's batches go (:func:`~mpnb.training.batches.indexed`).
        last_batch: the batch trained last, as it went to the model; None before the first.
    """

    def __init__(self) -> None:
        self.epoch, self.batch = 0, 0
        self.end: int | None = None
        self.held: HeldBatches | None = None
        self.device = torch.device("cpu")
        self.last_batch: Any = None
        self._window_start = (0, 0)  # the position of the open accumulation window's first batch
        self._window: list[Any] = []  # its batches, kept while the data is one-shot
        self._data: Iterable[Any] | None = None  # the running fit's data
        self._one_shot = False  # whether it is an iterator, read once
        self._reader: BatchReader | None = None  # where the running fit reads its batches

    @property
    def position(self) -> tuple[int, int, int | None]:
        """``(epoch, batch, end)``: what a checkpoint keeps."""
        return self.epoch, self.batch, self.end

    @position.setter
    def position(self, position: tuple[int, int, int | None]) -> None:
        self.epoch, self.batch, self.end = position

    @property
    def unfinished(self) -> bool:
        """Whether the plan has epochs left to train."""
        return self.end is not None and self.epoch < self.end

    def plan(self, epochs: int | None) -> None:
        """A fit of ``epochs`` more epochs starts (a partly trained epoch counts as one); None goes
        on with an unfinished plan, or plans one epoch."""
        if epochs is not None or self.end is None:
            self.end = self.epoch + (epochs or 1)

    def finish(self) -> None:
        """The plan is done: the next fit plans anew."""
        self.end = None

    def epoch_batches(self, data: Iterable[Any]) -> BatchReader:
        """This epoch's batches from the position on: what the last fit held, when it stopped
        right here on this very data, else a fresh pass (see :func:`resume`). A ``set_epoch``
        of the data, or of a DataLoader's sampler (``DistributedSampler``), is told the epoch."""
        for holder in (data, getattr(data, "sampler", None)):
            if callable(getattr(holder, "set_epoch", None)):
                holder.set_epoch(self.epoch)
        # A generator goes on where it stopped, nothing to skip. Asked without iter(data): a DataLoader's
        # iterator draws a seed from torch's random state, which would change the run at every fit.
        self._one_shot = isinstance(data, Iterator)
        held, self.held = self.held, None
        self._data = data
        self._reader = resume(held, data, (self.epoch, self.batch), self._one_shot)
        return self._reader

    def take(self, batch: Any, starts_window: bool) -> Any:
        """``batch`` goes into the open accumulation window (a new one that starts at the position
        when ``starts_window``); returned on :attr:`device`, kept as :attr:`last_batch`. The
        window's batches are kept only for one-shot data, to give back after an error."""
        if starts_window:
            self._window_start = (self.epoch, self.batch)
            self._window = []
        if self._one_shot:
            self._window.append(batch)
        self.last_batch = to_device(batch, self.device)
        return self.last_batch

    def trained(self) -> None:
        """The batch at the position is trained: the position moves to the next."""
        self.batch += 1

    def window_stepped(self) -> None:
        """The open window's update happened: its batches are trained, whatever fails after."""
        self._window = []

    def hold(self, batch: Any) -> None:
        """The fit stops before training ``batch``, just read: keep it and the rest of the reader
        for the next fit (for re-iterable data, only if that one resumes at this position)."""
        assert self._reader is not None and self._data is not None
        position = None if self._one_shot else (self.epoch, self.batch)
        self.held = self._reader.hold(self._data, position, batch)

    def drop_window(self, unfinished: bool) -> None:
        """After an error: for one-shot data, hold the open window's batches for the next fit;
        when the window is ``unfinished`` (its gradients dropped), go back to its first batch."""
        if self._one_shot and self._reader is not None and self._data is not None:
            self.held = self._reader.hold(self._data, None, *self._window)
            self._window = []
        if unfinished:
            self.epoch, self.batch = self._window_start

    def next_epoch(self, trained_any: bool) -> None:
        """The epoch's data is read to its end; the position moves to the next epoch's first batch.
        An epoch that gave no batch at all is said (a used-up generator, for one)."""
        if not trained_any and self.batch == 0:
            warn_no_batches(self.epoch, self._one_shot)
        self.epoch, self.batch = self.epoch + 1, 0

    def close(self) -> None:
        """The fit ended, however it ended: the data and its reader are let go (held batches stay)."""
        self._data = self._reader = None
