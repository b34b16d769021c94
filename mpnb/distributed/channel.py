"""The line between a launch and its workers while they run: telemetry rows in, a stop out.

The launching process keeps a ``torch.distributed.TCPStore`` (torch's key-value store, the kind
torchrun's rendezvous uses) on a free port of the loopback interface: the workers are on the
same machine (on several machines each node's launch has its own channel for its own workers).
Each worker's trainers push their new rows into one of its queues at every telemetry flush
(every ``flush_every`` steps: no per-step traffic, no device sync beyond the flush's own), and
look every quarter second whether the launch asked them to stop; the launching process drains
the queue while it waits.

Another process on the machine can reach the store, so nothing read from it is trusted: rows
are JSON signed with the launch's secret and checked whole (:mod:`mpnb.distributed.rows_message`),
a stop counts only if it carries the secret's tag. What fails is dropped, counted and said once.

Example (both ends in one process):
    >>> from mpnb.distributed.signing import new_secret
    >>> secret = new_secret()
    >>> launcher = LauncherChannel(secret, ranks=range(2))
    >>> worker = WorkerChannel(launcher.address, secret, rank=1)
    >>> worker.send(0, {"step": [1, 2], "loss": [0.5, 0.25]})
    >>> launcher.received()
    [(1, 0, {'step': [1, 2], 'loss': [0.5, 0.25]})]
    >>> worker.stop_asked(), launcher.ask_stop(), worker.stop_asked()
    (False, None, True)
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections import Counter
from typing import Any

import torch.distributed as dist

from mpnb.distributed.rows_message import Refused, RowsMessage, decode, encode
from mpnb.distributed.signing import Signer
from mpnb.errors import warn_user
from mpnb.training.control import FitControl
from mpnb.training.history import History
from mpnb.training.telemetry import Sink

__all__: list[str] = []

_ROWS, _STOP = "mpnb/rows", "mpnb/stop"
_STOP_WORDS = b"mpnb: stop every rank"
#: Seconds between a worker's looks at the stop key (each is one store round trip).
STOP_POLL_S = 0.25
#: The most messages one look at the queue takes (the workers send one a flush each).
MAX_MESSAGES_PER_LOOK = 10_000
#: What a look at the stop key gets back when there is none (never a signed stop).
_NO_STOP = b"\0"


def loopback_store(**options: Any) -> dist.TCPStore:
    """A ``TCPStore`` server that listens on 127.0.0.1 only, on a free port.

    torch binds a server to every interface whatever host it is given; handed a socket already
    bound to loopback (``master_listen_fd``), it listens there and nowhere else.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        fd = listener.detach()
    try:
        return dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=fd, **options)
    except BaseException:
        os.close(fd)
        raise


class LauncherChannel:
    """The launching process's end: hosts the store; :attr:`address` is what workers connect to.

    Args:
        secret: the launch's secret; the workers sign with it.
        ranks: the global ranks whose rows this channel takes (this node's workers).

    Attributes:
        refused: how many messages were dropped, by reason.
    """

    def __init__(self, secret: bytes, ranks: range) -> None:
        self.store = loopback_store(wait_for_workers=False, use_libuv=True)
        self.address = ("127.0.0.1", self.store.port)
        self.ranks = ranks
        self.refused: Counter[str] = Counter()
        self._signer = Signer(secret)
        self._next_seq: dict[tuple[int, int], int] = {}

    def received(self) -> list[tuple[int, int, dict[str, list[Any]]]]:
        """Every ``(rank, fit index, columns)`` batch that arrived since the last call and
        passed the checks, in order; the others are counted in :attr:`refused`.

        The queue is read until it is empty, at most :data:`MAX_MESSAGES_PER_LOOK` messages a call:
        another process may empty or flood it between two reads.
        """
        batches = []
        for _ in range(MAX_MESSAGES_PER_LOOK):
            try:
                data = self.store.queue_pop(_ROWS, block=False)
            except dist.QueueEmptyError:
                break
            try:
                message = decode(self._signer, data, self.ranks)
                self._check_order(message)
            except Refused as refused:
                self._refuse(str(refused))
                continue
            batches.append((message.rank, message.fit, message.columns))
        return batches

    def ask_stop(self) -> None:
        """Ask every worker's running fit to stop (they agree on the step: see ``parallel.agreed_stop``)."""
        self.store.set(_STOP, self._signer.sign(_STOP_WORDS))

    def _check_order(self, message: RowsMessage) -> None:
        key = (message.rank, message.fit)
        expected = self._next_seq.get(key, 0)
        if message.seq < expected:
            raise Refused(
                f"rank {message.rank} sent batch {message.seq} of fit {message.fit} again (a replay)"
            )
        # taken off the queue by someone else: the view misses those rows until the launch ends
        if message.seq > expected:
            self._refuse(
                f"{message.seq - expected} batch(es) of rank {message.rank}'s rows never arrived"
            )
        self._next_seq[key] = message.seq + 1

    def _refuse(self, reason: str) -> None:
        if not self.refused:
            warn_user(
                f"the launch dropped a message on its telemetry channel: {reason}. Another process on this "
                "machine may be writing to it; what it sent was not applied (the results and histories "
                "the launch returns do not travel this way, and the view ends showing those)."
            )
        self.refused[reason] += 1


class WorkerChannel:
    """A worker's end: sends its rows, says whether the launch asked to stop."""

    def __init__(self, address: tuple[str, int], secret: bytes, rank: int) -> None:
        host, port = address
        self.rank = rank
        self.store = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=60)
        )
        self._signer = Signer(secret)
        self._seq: Counter[int] = Counter()

    def send(self, index: int, columns: dict[str, list[Any]]) -> None:
        """Rows of this rank's ``index``-th fit history, column-wise."""
        message = RowsMessage(self.rank, index, self._seq[index], columns)
        self._seq[index] += 1
        self.store.queue_push(_ROWS, encode(self._signer, message))

    def stop_asked(self) -> bool:
        """Whether the launch asked to stop (a stop key someone else wrote does not count)."""
        # One round trip that never waits: the key's value, or _NO_STOP where there is none (a check
        # then a get would wait for a key another process deleted in between).
        found = self.store.compare_set(_STOP, _NO_STOP, _NO_STOP)
        return self._signer.open(found) == _STOP_WORDS


class RankStream(Sink):
    """A worker trainer's sink: at each flush, the rows since the last go to the launch (unless
    ``send_rows`` is False: a launch without a dashboard); it also turns the launch's stop into
    this fit's ``control.stop()`` (looked at every :data:`STOP_POLL_S`)."""

    def __init__(
        self,
        channel: WorkerChannel,
        index: int,
        history: History,
        control: FitControl,
        send_rows: bool = True,
    ) -> None:
        self.channel, self.index, self.control, self.send_rows = channel, index, control, send_rows
        self._sent = len(
            history
        )  # a trainer that fits again continues its history: only new rows go
        self._next_look = 0.0
        control.pollers.append(self._look_for_stop)

    def update(self, history: History) -> None:
        end = len(history)
        if self.send_rows and end > self._sent:
            self.channel.send(
                self.index,
                {name: values[self._sent : end] for name, values in history.columns.items()},
            )
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
