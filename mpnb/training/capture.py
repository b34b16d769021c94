"""Capture the ``Trainer.fit`` calls a block of code makes, to run that code once per mode.

``%%compare`` runs a cell's training code once per precision mode. Inside
:func:`capture_fits`, every ``Trainer.fit`` trains in the captured mode (whatever mode the
trainer was built with), stops when the block's step budget is spent, reports to the
capture's sink instead of the trainer's own dashboard, and leaves its trainer in
``capture.trainers``.

Example:
    >>> import mpnb.examples as ex
    >>> with capture_fits("bf16", max_steps=3) as capture:
    ...     trainer, train, _ = ex.example_trainer("fp32", "cpu", widths=(4, 8), dashboard=None)
    ...     _ = trainer.fit(train, epochs=5)
    >>> len(capture.trainers[0].history), capture.trainers[0].mode.label
    (3, 'bf16')
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mpnb.precision.modes import Mode, parse_mode
from mpnb.training.telemetry import Sink

if TYPE_CHECKING:
    from mpnb.training.trainer_protocols import Fitting

__all__: list[str] = []


@dataclasses.dataclass
class FitCapture:
    """The fits made inside one :func:`capture_fits` block.

    Attributes:
        mode: the mode every fit trains in.
        max_steps: optimizer steps allowed over all fits of the block.
        sink: where each fit reports progress (None: no display).
        trainers: the trainers that fitted, in order of their first fit.
        steps_taken: optimizer steps taken so far.
        last_fit: ``(trainer, data)`` of the block's last ``fit`` call, None before any.
    """

    mode: Mode
    max_steps: int
    sink: Sink | None = None
    trainers: list[Fitting] = dataclasses.field(default_factory=list)
    steps_taken: int = 0
    last_fit: tuple[Fitting, Any] | None = None

    def steps_allowed(self, asked: int | None) -> int:
        """How many steps a fit that asked for ``asked`` (None: no limit) may take now."""
        left = self.max_steps - self.steps_taken
        return left if asked is None else min(asked, left)

    def adopt(self, trainer: Fitting, data: Any) -> None:
        """Note ``trainer`` as one of the block's, fitting on ``data``."""
        if trainer not in self.trainers:
            self.trainers.append(trainer)
        self.last_fit = (trainer, data)


_active: contextvars.ContextVar[FitCapture | None] = contextvars.ContextVar(
    "mpnb_fit_capture", default=None
)


def active_capture() -> FitCapture | None:
    """The capture in force, or None."""
    return _active.get()


@contextlib.contextmanager
def capture_fits(
    mode: str | Mode, max_steps: int, sink: Sink | None = None
) -> Iterator[FitCapture]:
    """Make every ``Trainer.fit`` in the block train in ``mode``, ``max_steps`` steps in all."""
    capture = FitCapture(parse_mode(mode), max_steps, sink)
    token = _active.set(capture)
    try:
        yield capture
    finally:
        _active.reset(token)


_collecting: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "mpnb_fit_histories", default=None
)


@contextlib.contextmanager
def collect_histories() -> Iterator[list[Any]]:
    """Collect the :class:`~mpnb.training.history.History` of every trainer that fits in the block
    (once per trainer, in order of its first fit), changing nothing about the fits.

    Example:
        >>> import mpnb.examples as ex
        >>> with collect_histories() as histories:
        ...     trainer, train, _ = ex.example_trainer("fp32", "cpu", widths=(4, 8), dashboard=None)
        ...     _ = trainer.fit(train, max_steps=2)
        >>> [len(history) for history in histories]
        [2]
    """
    histories: list[Any] = []
    token = _collecting.set(histories)
    try:
        yield histories
    finally:
        _collecting.reset(token)


def note_fit(history: Any) -> None:
    """A trainer with this history starts a fit (``Trainer.fit`` calls this)."""
    histories = _collecting.get()
    if histories is not None and all(kept is not history for kept in histories):
        histories.append(history)


#: Makes a fit's sink from (index of its history among those collected, history, the fit's control).
StreamFactory = Callable[[int, Any, Any], Sink]
_streaming: contextvars.ContextVar[StreamFactory | None] = contextvars.ContextVar(
    "mpnb_fit_stream", default=None
)


@contextlib.contextmanager
def stream_fits(factory: StreamFactory) -> Iterator[None]:
    """Inside :func:`collect_histories`: every ``Trainer.fit`` in the block reports to
    ``factory(index, history, control)`` instead of its own dashboard (a launch's workers send
    their rows to the launching process so; see :mod:`mpnb.distributed.channel`).

    Example:
        >>> import mpnb.examples as ex
        >>> from mpnb.training.telemetry import Sink
        >>> class Count(Sink):
        ...     def close(self, history):
        ...         print("fit", self.index, "ended after", len(history), "steps")
        >>> def make(index, history, control):
        ...     sink = Count()
        ...     sink.index = index
        ...     return sink
        >>> with collect_histories(), stream_fits(make):
        ...     trainer, train, _ = ex.example_trainer("fp32", "cpu", widths=(4, 8), dashboard="text")
        ...     _ = trainer.fit(train, max_steps=2)
        fit 0 ended after 2 steps
    """
    token = _streaming.set(factory)
    try:
        yield
    finally:
        _streaming.reset(token)


def streamed(history: Any, control: Any) -> list[Sink] | None:
    """The sinks a fit with ``history`` reports to inside :func:`stream_fits`; None outside."""
    factory, histories = _streaming.get(), _collecting.get()
    if factory is None or histories is None:
        return None
    index = next(i for i, kept in enumerate(histories) if kept is history)
    return [factory(index, history, control)]
