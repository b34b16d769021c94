"""Control of a running fit: stop, pause / resume, and switches that take effect between steps.

A :class:`FitControl` belongs to a :class:`~mpnb.Trainer`. Buttons (the live dashboard's
Stop and Pause) and code call :meth:`~FitControl.stop`, :meth:`~FitControl.pause` and
:meth:`~FitControl.resume`; the training loop calls :meth:`~FitControl.checkpoint` between
optimizer steps, where nothing is half-updated. A checkpoint first runs the *pollers*,
functions that deliver pending user-interface events (the notebook layer adds one that
processes widget messages waiting in the kernel), waits there while paused, and reports
whether the session's precision changed since the last one.

Example:
    >>> control = FitControl()
    >>> control.stop()
    >>> control.checkpoint().stop
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mpnb.errors import MpnbError
from mpnb.precision.policy import session

if TYPE_CHECKING:
    from mpnb.training.trainer_protocols import Described

__all__ = ["FitControl", "FitEnd"]

PAUSE_POLL_S = 0.05


class _TextEnum(str, enum.Enum):
    """An enum whose members stand for their text everywhere a text would go: compared,
    printed, formatted, and as a dict key."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__
    __hash__ = str.__hash__


class FitState(_TextEnum):
    """Where a fit is, as its :class:`FitControl` (and every view of it) sees it.

    A state equals its name in lower case, so ``control.state == "paused"`` reads as it says.

    Example:
        >>> FitState.PAUSED == "paused", str(FitState.RUNNING)
        (True, 'running')
    """

    IDLE = "idle"  # no fit runs (before the first one, and after each one ends)
    RUNNING = "running"
    PAUSED = "paused"  # held at a step boundary until resumed or stopped
    STOPPING = "stopping"  # asked to stop: the step under way finishes, then the fit ends
    # for a moment: the code that drove the fit is gone (see FitControl.abandon)
    ABANDONED = "abandoned"


class FitEnd(_TextEnum):
    """How a trainer's last ``fit`` ended (``Trainer.ended``).

    Example:
        >>> FitEnd.STOPPED == "stopped", FitEnd.STOPPED.stopped, FitEnd.MAX_STEPS.stopped
        (True, True, False)
    """

    NOT_RUN = "not run"  # no fit yet
    FINISHED = "finished"  # the planned epochs are done
    # max_steps (or a comparison's step budget) was reached; fit(data) goes on
    MAX_STEPS = "max steps"
    STOPPED = "stopped"  # the dashboard's Stop, control.stop()
    # on_nonfinite="stop" ended it at a NaN / inf loss or a collapsed scale
    NONFINITE = "non-finite"
    PEER_STOPPED = "stopped by another rank"  # strategy="ddp" / "fsdp": another rank asked to stop
    INTERRUPTED = "interrupted"  # Ctrl-C / a kernel interrupt: fit raised FitInterrupted
    FAILED = "failed"  # fit raised

    @property
    def stopped(self) -> bool:
        """Ended at a stop someone or something asked for (not at the plan's end, nor an error)."""
        return self in (FitEnd.STOPPED, FitEnd.NONFINITE, FitEnd.PEER_STOPPED)

    @classmethod
    def ended_by(cls, error: BaseException) -> FitEnd:
        """How a fit that raised ``error`` ended: interrupted by a Ctrl-C, else failed.

        >>> FitEnd.ended_by(KeyboardInterrupt()), FitEnd.ended_by(RuntimeError())
        (<FitEnd.INTERRUPTED: 'interrupted'>, <FitEnd.FAILED: 'failed'>)
        """
        return cls.INTERRUPTED if isinstance(error, KeyboardInterrupt) else cls.FAILED


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What the loop must do at a step boundary.

    Attributes:
        stop: end the fit now (every finished step kept).
        changed: what changed in the session since the last checkpoint (``"mode"``, ``"oplists"``...).
        paused_s: how long the loop waited while paused.
    """

    stop: bool
    changed: tuple[str, ...]
    paused_s: float


#: The usual step boundary: nothing changed, no pause, no stop (one object: a loop may ask
#: ``checkpoint is GO_ON`` and skip reading its fields).
GO_ON = Checkpoint(stop=False, changed=(), paused_s=0.0)
_PAUSED, _STOPPING = FitState.PAUSED, FitState.STOPPING  # read at every step: a global each
_STOP = Checkpoint(stop=True, changed=(), paused_s=0.0)


class FitControl:
    """Stop, pause and resume requests for a fit, and the session changes made meanwhile.

    Attributes:
        pollers: called at every checkpoint, and repeatedly while paused.
        state: a :class:`FitState`; views show it.
        on_state: called with the new state after each change of :attr:`state`.
        subject: what the control steers (a :class:`~mpnb.Trainer`, or the
            :class:`~mpnb.integrations.loop_telemetry.LoopTelemetry` of a framework's loop), for
            views that show more of it than its telemetry (its numerics, an overflow's remedy);
            None for a bare control.

    Example (what a training loop and a Pause / Stop button do with it):
        >>> control = FitControl()
        >>> seen = []
        >>> control.on_state.append(lambda state: seen.append(str(state)))
        >>> control.begin()
        >>> control.pause()
        >>> control.stop()
        >>> control.checkpoint().stop
        True
        >>> control.end()
        >>> seen
        ['running', 'paused', 'stopping', 'idle']
    """

    def __init__(self) -> None:
        self.pollers: list[Callable[[], None]] = []
        self.on_state: list[Callable[[FitState], None]] = []
        self.state = FitState.IDLE
        self.abandoned_because: str | None = None
        self.subject: Any = None
        self._changed: list[str] = []
        self._unsubscribe: Callable[[], None] | None = None

    def stop(self) -> None:
        """Finish the current step, then end the fit and return its history."""
        self._set_state(FitState.STOPPING)

    def pause(self) -> None:
        """Hold the fit at the next step boundary until :meth:`resume` (or :meth:`stop`)."""
        if self.state is not FitState.STOPPING:
            self._set_state(FitState.PAUSED)

    def resume(self) -> None:
        """Let a paused fit go on."""
        if self.state is FitState.PAUSED:
            self._set_state(FitState.RUNNING)

    @property
    def stop_requested(self) -> bool:
        """Whether a stop was asked for and the fit has not ended yet."""
        return self.state is FitState.STOPPING

    def abandon(self, reason: str) -> None:
        """The code that drove the fit is gone without ending it (the notebook cell that started it
        raised inside a framework that tells its callbacks nothing): listeners hear ``"abandoned"``
        and the fit's owner ends it (``reason`` says why); the state is idle after, whoever ends it."""
        if self.state is FitState.IDLE:
            return
        self.abandoned_because = reason
        self._set_state(FitState.ABANDONED)
        if self.state is not FitState.IDLE:
            self.end()

    def begin(self) -> None:
        """A fit starts: listen to the session; earlier requests are forgotten."""
        self._changed = []
        self._unsubscribe = session.subscribe(self._changed.append)
        self._set_state(FitState.RUNNING)

    def end(self) -> None:
        """The fit ended, however it ended."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._set_state(FitState.IDLE)

    def checkpoint(self, interrupted: Callable[[], bool] = lambda: False) -> Checkpoint:
        """Deliver pending events, wait while paused, and say whether to stop and what changed.

        Args:
            interrupted: ends a pause too (the fit's Ctrl-C check).
        """
        if self.pollers:
            self._poll()
        state = self.state
        if state is not _PAUSED and not self._changed:  # the usual step: nothing to tell
            return _STOP if state is _STOPPING else GO_ON
        waited_from = time.perf_counter()
        while self.state is FitState.PAUSED and not interrupted():
            time.sleep(PAUSE_POLL_S)
            self._poll()
        changed = tuple(dict.fromkeys(self._changed))
        self._changed.clear()
        stop = self.state is FitState.STOPPING
        return Checkpoint(stop, changed, time.perf_counter() - waited_from)

    def _poll(self) -> None:
        for poll in self.pollers:
            poll()

    def _set_state(self, state: FitState) -> None:
        self.state = state
        for callback in list(self.on_state):
            callback(state)


#: The fit running on each thread: training started inside it (from a widget callback) is refused.
_running = threading.local()


def refuse_inside_a_fit(what: str) -> None:
    """Raise if a fit is running on this thread: ``what`` (a fit, a comparison) cannot start inside it.

    A widget callback delivered during a fit (the fit's event pump) runs on the fit's thread;
    starting training there would borrow and then release the running fit's switches.

    Raises:
        MpnbError: naming the running fit and what to do.
    """
    running = getattr(_running, "trainer", None)
    if running is not None:
        raise MpnbError(
            f"another fit is running on this thread ({running.describe()}); {what} cannot start inside it. "
            "Wait for it to end, or stop it (trainer.control.stop(), the dashboard's Stop button)"
        )


@contextlib.contextmanager
def running_on_this_thread(trainer: Described) -> Iterator[None]:
    """Mark ``trainer``'s fit as the one running on this thread, refusing if another one runs.

    Raises:
        MpnbError: as :func:`refuse_inside_a_fit`.
    """
    refuse_inside_a_fit("a fit")
    _running.trainer = trainer
    try:
        yield
    finally:
        _running.trainer = None
