"""Deliver widget messages to a cell that is still running.

A Jupyter kernel handles one request at a time: while a training cell runs, a click on a
widget waits in the kernel's queue until the cell ends. :class:`KernelEventPump`, called
between training steps, handles the widget (comm) messages waiting there and leaves every
other request (a cell the user queued, a completion request...) for after the current cell,
in order. Calls are throttled to one per ``min_interval`` seconds.

How it reaches the queue depends on ipykernel:

- ipykernel 7 receives shell messages on a thread of its own and hands them to the main
  thread through an in-process socket; the pump reads that socket, runs comm messages
  through the kernel's own comm handlers, and re-queues the rest on the kernel's event loop
  for when the cell ends.
- ipykernel 6 and older: jupyter-ui-poll (``kernel.do_one_iteration``).

Both reach into the kernel's internals (there is no public API for this); on a kernel the
pump does not recognise it does nothing, and the buttons act when the cell ends. Frontends
that send no widget messages while a cell runs (some editors) get no live control either.

Example:
    >>> pump = KernelEventPump()
    >>> pump()          # outside a kernel: nothing to deliver, nothing done
    >>> pump.polls
    0
"""

from __future__ import annotations

import time
from typing import Any

from mpnb.ui.environment import in_notebook_kernel

__all__: list[str] = []

_COMM_MESSAGES = frozenset({"comm_open", "comm_msg", "comm_close"})


class _MainShellQueue:
    """ipykernel 7: the socket that carries shell messages to the main thread."""

    def __init__(self, shell: Any) -> None:
        import zmq

        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self.shell = shell
        self.kernel = shell.kernel
        self.socket = self.kernel.shell_channel_thread.manager.get_shell_channel_to_subshell_pair(
            None
        ).to_socket
        self.deferred: list[Any] = []

    def poll(self, limit: int) -> None:
        for _ in range(limit):
            try:
                frames = self.socket.recv_multipart(self._noblock, copy=False)
            except self._again:
                return
            self._handle(frames)

    def _handle(self, frames: Any) -> None:
        kernel = self.kernel
        idents, parts = kernel.session.feed_identities(frames, copy=False)
        message = kernel.session.deserialize(parts, content=True, copy=False)
        msg_type = message["header"]["msg_type"]
        if msg_type not in _COMM_MESSAGES:
            # Runs after the cell, as it would have; the session must accept its signature again.
            signature = parts[0].bytes if hasattr(parts[0], "bytes") else bytes(parts[0])
            kernel.session.digest_history.discard(signature)
            self.deferred.append(frames)
            return
        parent, parent_ident = (
            kernel.get_parent("shell"),
            kernel._get_shell_context_var(kernel._shell_parent_ident),
        )
        kernel.set_parent(idents, message, channel="shell")
        try:
            kernel.shell_handlers[msg_type](kernel.shell_stream, idents, message)
        finally:
            kernel.set_parent(parent_ident, parent, channel="shell")

    def close(self) -> None:
        """Hand the held-back requests to the kernel's event loop, in order: they run once the
        current cell (or widget callback) returns, as they would have without the pump."""
        for frames in self.deferred:
            self.kernel.io_loop.add_callback(self.kernel.shell_main, None, frames)
        self.deferred = []


class _UiPoll:
    """ipykernel 6 and older: jupyter-ui-poll."""

    def __init__(self) -> None:
        from jupyter_ui_poll import ui_events

        self._context = ui_events()
        self._poll = self._context.__enter__()

    def poll(self, limit: int) -> None:
        self._poll(limit)

    def close(self) -> None:
        self._context.__exit__(None, None, None)


def _queue_for(shell: Any) -> _MainShellQueue | _UiPoll | None:
    kernel = shell.kernel
    if getattr(kernel, "shell_channel_thread", None) is not None:
        return _MainShellQueue(shell)
    if hasattr(kernel, "do_one_iteration"):
        return _UiPoll()
    return None


class KernelEventPump:
    """Handle waiting widget messages at most every ``min_interval`` seconds.

    Args:
        min_interval: seconds between two polls.
        batch: messages handled per poll at most.

    Attributes:
        polls: how many polls ran.
    """

    def __init__(self, min_interval: float = 0.1, batch: int = 50) -> None:
        self.min_interval, self.batch = min_interval, batch
        self.polls = 0
        self._queue: Any = None
        self._unsupported = False
        self._last = -float("inf")

    def __call__(self) -> None:
        now = time.perf_counter()
        if self._unsupported or now - self._last < self.min_interval or not in_notebook_kernel():
            return
        if self._queue is None:
            from IPython import get_ipython

            self._queue = _queue_for(get_ipython())
            self._unsupported = self._queue is None
            if self._unsupported:
                return
        self._queue.poll(self.batch)
        self.polls += 1
        self._last = time.perf_counter()

    def close(self) -> None:
        """Stop pumping; messages wait for the cell's end again."""
        if self._queue is not None:
            self._queue.close()
            self._queue = None
