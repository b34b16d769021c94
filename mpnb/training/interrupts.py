"""Turn Ctrl-C / a kernel interrupt into a request to stop at the next consistent point.

A KeyboardInterrupt raised in the middle of ``optimizer.step()`` can leave half the
parameters updated. While a :class:`StopRequest` is active, the first SIGINT only sets
:attr:`StopRequest.requested`; the training loop checks it between optimizer steps. A
second SIGINT raises KeyboardInterrupt at once, for when the user really means now.
The previous SIGINT handler is restored exactly on exit. Off the main thread (where
Python delivers no signals) it does nothing.

Example:
    >>> with StopRequest() as stop:
    ...     stop.requested
    False
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

__all__: list[str] = []


class StopRequest:
    """Context manager that defers the first SIGINT to the caller's next check."""

    def __init__(
        self, message: str = "Stopping after the current step (interrupt again to stop at once)..."
    ) -> None:
        self.message = message
        self.requested = False
        self._previous: Any = None
        self._installed = False
        self._pid = os.getpid()  # a DataLoader worker forked inside the block inherits the handler

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            # signal() hands back the handler it replaces: no getsignal() first (each call turns
            # a Python handler into an enum and back, ~10 us of every fit)
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def request(self) -> None:
        """Ask the loop to stop at its next check (what the first SIGINT does)."""
        self.requested = True

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.request()
        if os.getpid() == self._pid:  # said once, by the process that trains: a worker keeps on
            print(self.message, file=sys.stderr, flush=True)  # quietly until the fit ends it
