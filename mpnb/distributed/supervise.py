"""What the launching process does while its workers run: show their telemetry, pass on a stop.

torch's elastic launcher supervises the workers from the calling thread, as in ``torchrun``
(its signal handlers need the main thread: an interrupt ends every worker). Meanwhile a
helper thread drains the rows the workers stream (:mod:`mpnb.distributed.channel`) into a
:class:`~mpnb.distributed.rank_rows.RankRows`, shows it (a :class:`RanksView`), and passes a
``control.stop()`` on to the workers, whose fits then stop after the same step.

Example:
    >>> import time
    >>> from mpnb.distributed.signing import new_secret
    >>> supervisor = Supervisor(LauncherChannel(new_secret(), ranks=range(2)), view=None)
    >>> supervisor.run(lambda: time.sleep(0.2) or "done")
    'done'
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

import psutil

from mpnb.distributed.channel import LauncherChannel
from mpnb.distributed.rank_rows import RankRows, RanksView
from mpnb.errors import warn_user
from mpnb.training.control import FitControl

__all__: list[str] = []

#: Seconds between two looks at the workers' rows and at the control.
POLL_S = 0.1
#: Seconds left-over workers get between SIGTERM and SIGKILL.
END_GRACE_S = 2.0


class Supervisor:
    """Runs ``start`` (the elastic launch, blocking) here and looks after the workers from a helper thread.

    Attributes:
        rows: what the workers streamed so far.
        control: its ``stop()`` is passed on to every rank.
    """

    def __init__(
        self, channel: LauncherChannel, view: RanksView | None, control: FitControl | None = None
    ) -> None:
        self.channel: LauncherChannel | None = channel
        self.view = view
        self.control = control or FitControl()
        self.rows = RankRows()

    def run(self, start: Callable[[], Any]) -> Any:
        """``start()``'s return value (or its exception), watched meanwhile; no worker outlives it."""
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        done = threading.Event()
        watcher = threading.Thread(
            target=self._watch, args=(done,), name="mpnb-launch-watch", daemon=True
        )
        self.control.begin()
        watcher.start()
        try:
            return start()
        finally:
            done.set()
            watcher.join()
            _end_workers(
                before
            )  # none should be left; one that is (torch's launcher failed) goes now
            self.control.end()
            self._take_rows()
            self._show("close")

    def _watch(self, done: threading.Event) -> None:
        while not done.wait(POLL_S):
            self._take_rows()
            if self.control.stop_requested:
                self._ask_stop()  # at every look: another process could delete the key

    def _take_rows(self) -> None:
        """Drain the channel into :attr:`rows` (the watcher's, and once more after it has joined).
        A channel that fails is said once and read no more: the launch's result does not depend on it."""
        if self.channel is None:
            return
        try:
            arrived = self.channel.received()
        except Exception as error:
            warn_user(
                f"the launch's telemetry channel failed and is read no more (the ranks go on): {error!r}"
            )
            self.channel = None
            return
        for rank, index, columns in arrived:
            self.rows.add(rank, index, columns)
        if arrived:
            self._show("update")

    def _ask_stop(self) -> None:
        if self.channel is None:
            return
        try:
            self.channel.ask_stop()
        # the ranks' own stop still works: a worker's interrupt, the timeout
        except Exception as error:
            warn_user(
                f"the launch's stop could not reach the ranks (its channel failed): {error!r}"
            )
            self.channel = None

    def _show(self, what: str) -> None:
        """Call the view's ``update`` or ``close``. A view that fails is said once and left out
        from then on: the rows, the stop and the launch's result do not depend on it."""
        if self.view is None:
            return
        try:
            getattr(self.view, what)(self.rows)
        except Exception as error:
            warn_user(
                f"the launch's view {type(self.view).__name__} failed in {what}() and is left out: {error!r}"
            )
            self.view = None


def _end_workers(before: set[int]) -> None:
    """End the processes this one started since ``before`` was taken (the workers), SIGTERM then SIGKILL."""
    started = [
        child for child in psutil.Process().children(recursive=True) if child.pid not in before
    ]
    if not started:
        return
    for child in started:
        try:
            child.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(started, timeout=END_GRACE_S)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=END_GRACE_S)
