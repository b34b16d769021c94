"""The line between a launch and its workers while they run: telemetry rows in, a stop out.

The launching process keeps a ``torch.distributed.TCPStore`` (torch's key-value store, the kind
torchrun's rendezvous uses) on a free local port. Each worker's trainers push their new rows
into one of its queues at every telemetry flush (every ``flush_every`` steps: no per-step
traffic, no device sync beyond the flush's own), and look every quarter second whether the
launch asked them to stop; the launching process drains the queue while it waits.

Example (both ends in one process):
    >>> launcher = LauncherChannel()
    >>> worker = WorkerChannel(launcher.address, rank=1)
    >>> worker.send(0, {"step": [1, 2], "loss": [0.5, 0.25]})
    >>> launcher.received()
    [(1, 0, {'step': [1, 2], 'loss': [0.5, 0.25]})]
    >>> worker.stop_asked(), launcher.ask_stop(), worker.stop_asked()
    (False, None, True)
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any

import torch.distributed as dist

from mpnb.training.control import FitControl
from mpnb.training.history import History
from mpnb.training.telemetry import Sink

__all__ = ["LauncherChannel", "RankStream", "WorkerChannel"]

_ROWS, _STOP = "mpnb/rows", "mpnb/stop"
#: Seconds between a worker's looks at the stop key (each is one store round trip).
STOP_POLL_S = 0.25


class LauncherChannel:
    """The launching process's end: hosts the store; :attr:`address` is what workers connect to."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self.address = ("127.0.0.1", self.store.port)

    def received(self) -> list[tuple[int, int, dict[str, list[Any]]]]:
        """Every ``(rank, fit index, columns)`` batch that arrived since the last call, in order."""
        batches = []
        for _ in range(self.store.queue_len(_ROWS)):
            batches.append(pickle.loads(self.store.queue_pop(_ROWS, block=False)))
        return batches

    def ask_stop(self) -> None:
        """Ask every worker's running fit to stop (they agree on the step: see ``parallel.agreed_stop``)."""
        self.store.set(_STOP, b"1")


class WorkerChannel:
    """A worker's end: sends its rows, says whether the launch asked to stop."""

    def __init__(self, address: tuple[str, int], rank: int) -> None:
        host, port = address
        self.rank = rank
        self.store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))

    def send(self, index: int, columns: dict[str, list[Any]]) -> None:
        """Rows of this rank's ``index``-th fit history, column-wise."""
        self.store.queue_push(_ROWS, pickle.dumps((self.rank, index, columns)))

    def stop_asked(self) -> bool:
        return self.store.check([_STOP])


class RankStream(Sink):
    """A worker trainer's sink: at each flush, the rows since the last go to the launch (unless
    ``send_rows`` is False: a launch without a dashboard); it also turns the launch's stop into
    this fit's ``control.stop()`` (looked at every :data:`STOP_POLL_S`)."""

    def __init__(
        self, channel: WorkerChannel, index: int, history: History, control: FitControl, send_rows: bool = True
    ) -> None:
        self.channel, self.index, self.control, self.send_rows = channel, index, control, send_rows
        self._sent = len(history)  # a trainer that fits again continues its history: only new rows go
        self._next_look = 0.0
        control.pollers.append(self._look_for_stop)

    def update(self, history: History) -> None:
        end = len(history)
        if self.send_rows and end > self._sent:
            self.channel.send(self.index, {name: values[self._sent : end] for name, values in history.columns.items()})
            self._sent = end

    def close(self, history: History) -> None:
        self.update(history)
        if self._look_for_stop in self.control.pollers:
            self.control.pollers.remove(self._look_for_stop)

    def _look_for_stop(self) -> None:
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + STOP_POLL_S
            if not self.control.stop_requested and self.channel.stop_asked():
                self.control.stop()
