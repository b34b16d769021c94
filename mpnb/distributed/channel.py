"""The line between a launch and its workers while they run: telemetry rows in, a stop out.

The launching process listens on a Unix-domain socket in the launch's private folder (mode 0700,
see :func:`mpnb.distributed.launch`): only its own user can reach it, no TCP port is opened, and
what crosses it is not visible to anyone else. On several machines each node's launch has its
own channel for its own workers, on its own machine, the same way. Each worker connects once; its
trainers send their new rows at every telemetry flush (every ``flush_every`` steps: no per-step
traffic, no device sync beyond the flush's own), and look every quarter second whether a stop
arrived; the launching process reads what arrived while it waits.

A message is a 4-byte big-endian length and that many bytes; one longer than
:data:`~mpnb.distributed.rows_message.MAX_MESSAGE_BYTES` (plus its tag) ends its connection
unread, so the launching process never holds more than one message a connection, and never more
than :data:`MAX_CONNECTIONS` connections. Nothing read is trusted all the same: rows are JSON
signed with the launch's secret and checked whole (:mod:`mpnb.distributed.rows_message`), a stop
counts only if it carries the secret's tag. What fails is dropped, counted and said once.

Example (both ends in one process):
    >>> import tempfile
    >>> from mpnb.distributed.signing import new_secret
    >>> secret = new_secret()
    >>> launcher = LauncherChannel(secret, ranks=range(2), folder=tempfile.mkdtemp())
    >>> worker = WorkerChannel(launcher.address, secret, rank=1)
    >>> worker.send(0, {"step": [1, 2], "loss": [0.5, 0.25]})
    >>> launcher.received()
    [(1, 0, {'step': [1, 2], 'loss': [0.5, 0.25]})]
    >>> worker.stop_asked(), launcher.ask_stop(), worker.stop_asked()
    (False, None, True)
    >>> launcher.close()
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import struct
import tempfile
import time
import weakref
from collections import Counter
from typing import Any

from mpnb.distributed.rows_message import MAX_MESSAGE_BYTES, Refused, RowsMessage, decode, encode
from mpnb.distributed.signing import TAG_BYTES, Signer
from mpnb.errors import warn_user
from mpnb.training.control import FitControl
from mpnb.training.history import History
from mpnb.training.telemetry import Sink

__all__: list[str] = []

_STOP_WORDS = b"mpnb: stop every rank"
#: Seconds between a worker's looks for a stop (each is one non-blocking read of its socket).
STOP_POLL_S = 0.25
#: The most messages one look at the channel takes (the workers send one a flush each).
MAX_MESSAGES_PER_LOOK = 10_000
#: Seconds a worker's send waits for the launching process to read before it gives up.
SEND_TIMEOUT_S = 30.0
#: The most connections the launching process keeps open (its workers connect once each).
MAX_CONNECTIONS = 256
#: The longest message a frame may carry: a rows message and its tag.
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + TAG_BYTES
_LENGTH = struct.Struct(">I")
#: The longest path a Unix-domain socket may have (``sun_path``, less its final NUL).
_MAX_SOCKET_PATH = 107


def frame(payload: bytes) -> bytes:
    """``payload`` as it crosses the channel: its length, then itself.

    >>> frame(b"abc")
    b'\\x00\\x00\\x00\\x03abc'
    """
    return _LENGTH.pack(len(payload)) + payload


class _Frames:
    """The frames arriving on one connection, read without blocking, one frame held at most."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.buffer = bytearray()
        self.open = True

    def read(self, limit: int) -> tuple[list[bytes], str | None]:
        """Up to ``limit`` whole frames that have arrived, and why the connection must end (or
        None). Frames read before the other end closed are still returned."""
        found: list[bytes] = []
        while len(found) < limit:
            frame_end = self._frame_end()
            if frame_end is None:
                return found, (
                    f"a message of more than {MAX_FRAME_BYTES} bytes (its connection was closed unread)"
                )
            if frame_end and len(self.buffer) >= frame_end:
                found.append(bytes(self.buffer[_LENGTH.size : frame_end]))
                del self.buffer[:frame_end]
                continue
            if not self.open:
                break
            try:
                data = self.connection.recv(1 << 16)
            except (BlockingIOError, InterruptedError, TimeoutError):
                break
            except OSError:
                data = b""
            if not data:
                self.close()
            self.buffer += data
        return found, None

    @property
    def finished(self) -> bool:
        """Closed, with no whole frame left to read."""
        frame_end = self._frame_end()
        return not self.open and not (frame_end and len(self.buffer) >= frame_end)

    def _frame_end(self) -> int | None:
        """Where the frame at the buffer's start ends: 0 while its length is unknown, None when
        it is longer than a frame may be."""
        if len(self.buffer) < _LENGTH.size:
            return 0
        (length,) = _LENGTH.unpack_from(self.buffer)
        return None if length > MAX_FRAME_BYTES else _LENGTH.size + length

    def close(self) -> None:
        self.open = False
        self.connection.close()


def socket_path(folder: str) -> str:
    """Where a launch's channel listens: in ``folder`` (the launch's private folder), or, where
    that path is too long for a socket, in a new private folder of the system's own ``/tmp``."""
    path = os.path.join(folder, "channel.sock")
    if len(os.fsencode(path)) <= _MAX_SOCKET_PATH:
        return path
    return os.path.join(tempfile.mkdtemp(prefix="mpnb-", dir="/tmp"), "channel.sock")


class LauncherChannel:
    """The launching process's end: listens; :attr:`address` is what workers connect to.

    Args:
        secret: the launch's secret; the workers sign with it.
        ranks: the global ranks whose rows this channel takes (this node's workers).
        folder: a private folder (mode 0700) for the socket; a new one if not given.

    Attributes:
        refused: how many messages were dropped, by reason.
    """

    def __init__(self, secret: bytes, ranks: range, folder: str | None = None) -> None:
        self._made = None if folder is not None else tempfile.mkdtemp(prefix="mpnb-channel-")
        self.address = socket_path(folder or self._made or "")
        if os.path.dirname(self.address) != (folder or self._made):
            self._made = os.path.dirname(self.address)
        if stat.S_IMODE(os.stat(os.path.dirname(self.address)).st_mode) & 0o077:
            raise PermissionError(
                f"{os.path.dirname(self.address)!r} is open to other users: a launch's channel "
                "listens only in a folder of mode 0700"
            )
        self.ranks = ranks
        self.refused: Counter[str] = Counter()
        self._signer = Signer(secret)
        self._next_seq: dict[tuple[int, int], int] = {}
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        os.chmod(self.address, 0o600)
        self._listener.listen(MAX_CONNECTIONS)
        self._listener.setblocking(False)
        if self._made is not None:  # a folder of its own: gone with the channel, closed or not
            weakref.finalize(self, shutil.rmtree, self._made, True)
        self._connections: list[_Frames] = []
        self._stop: bytes | None = None

    def received(self) -> list[tuple[int, int, dict[str, list[Any]]]]:
        """Every ``(rank, fit index, columns)`` batch that arrived since the last call and
        passed the checks, in order; the others are counted in :attr:`refused`.

        What has arrived is read, at most :data:`MAX_MESSAGES_PER_LOOK` messages a call.
        """
        self._accept()
        batches = []
        budget = MAX_MESSAGES_PER_LOOK
        for connection in self._connections:
            messages, ended = connection.read(budget)
            budget -= len(messages)
            for data in messages:
                try:
                    message = decode(self._signer, data, self.ranks)
                    self._check_order(message)
                except Refused as refused:
                    self._refuse(str(refused))
                    continue
                batches.append((message.rank, message.fit, message.columns))
            if ended is not None:
                connection.close()
                connection.buffer.clear()
                self._refuse(ended)
        self._connections = [
            connection for connection in self._connections if not connection.finished
        ]
        return batches

    def ask_stop(self) -> None:
        """Ask every worker's running fit to stop (they agree on the step: see ``parallel.agreed_stop``).
        A worker that connects later is told when it does."""
        if self._stop is None:
            self._stop = frame(self._signer.sign(_STOP_WORDS))
            for connection in self._connections:
                self._tell_stop(connection)
        self._accept()

    def close(self) -> None:
        """Stop listening and close every connection (what arrived and was not read is dropped)."""
        for connection in self._connections:
            connection.close()
        self._connections = []
        self._listener.close()
        try:
            os.unlink(self.address)
            if self._made is not None:  # a folder this channel made: nothing else is in it
                os.rmdir(self._made)
        except FileNotFoundError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            if len(self._connections) >= MAX_CONNECTIONS:
                connection.close()
                self._refuse(f"more than {MAX_CONNECTIONS} connections at once")
                continue
            connection.setblocking(False)
            frames = _Frames(connection)
            self._connections.append(frames)
            if self._stop is not None:
                self._tell_stop(frames)

    def _tell_stop(self, connection: _Frames) -> None:
        try:
            connection.connection.sendall(self._stop or b"")
        except OSError:  # a worker that has ended; or a full buffer no worker reads
            pass

    def _check_order(self, message: RowsMessage) -> None:
        key = (message.rank, message.fit)
        expected = self._next_seq.get(key, 0)
        if message.seq < expected:
            raise Refused(
                f"rank {message.rank} sent batch {message.seq} of fit {message.fit} again (a replay)"
            )
        if message.seq > expected:  # rows lost on the way: the view misses them until the end
            self._refuse(
                f"{message.seq - expected} batch(es) of rank {message.rank}'s rows never arrived"
            )
        self._next_seq[key] = message.seq + 1

    def _refuse(self, reason: str) -> None:
        if not self.refused:
            warn_user(
                f"the launch dropped a message on its telemetry channel: {reason}. What it carried "
                "was not applied (the results and histories the launch returns do not travel "
                "this way, and the view ends showing those)."
            )
        self.refused[reason] += 1


class WorkerChannel:
    """A worker's end: sends its rows, says whether the launch asked to stop.

    Args:
        address: the launch's socket (:attr:`LauncherChannel.address`).
        secret: the launch's secret.
        rank: this worker's global rank.
        send_timeout_s: how long a send may wait for the launch to read before it fails with
            ``TimeoutError`` (the socket's buffer holds some 200 kB: many flushes).
    """

    def __init__(
        self, address: str, secret: bytes, rank: int, send_timeout_s: float = SEND_TIMEOUT_S
    ) -> None:
        self.rank = rank
        self._timeout = send_timeout_s
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.settimeout(send_timeout_s)
        self._socket.connect(address)
        self._signer = Signer(secret)
        self._seq: Counter[int] = Counter()
        self._arrived = _Frames(self._socket)
        self._stopped = False

    def send(self, index: int, columns: dict[str, list[Any]]) -> None:
        """Rows of this rank's ``index``-th fit history, column-wise."""
        message = RowsMessage(self.rank, index, self._seq[index], columns)
        self._seq[index] += 1
        self._socket.sendall(frame(encode(self._signer, message)))

    def stop_asked(self) -> bool:
        """Whether the launch asked to stop (read without waiting; only a signed stop counts)."""
        if not self._stopped and self._arrived.open:
            self._socket.setblocking(False)
            try:
                messages, _ = self._arrived.read(MAX_MESSAGES_PER_LOOK)
            finally:
                if self._arrived.open:
                    self._socket.settimeout(self._timeout)
            self._stopped = any(self._signer.open(data) == _STOP_WORDS for data in messages)
        return self._stopped


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
            try:
                self.channel.send(
                    self.index,
                    {name: values[self._sent : end] for name, values in history.columns.items()},
                )
            except OSError:  # the launch reads no more (its view failed, or it ends): train on
                self.send_rows = False  # the view ends showing the histories the ranks return
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
