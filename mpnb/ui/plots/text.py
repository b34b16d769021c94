"""Plain-text progress for scripts, CI logs and editors without widgets.

One line every ``interval`` seconds while training runs, each overflow's origin with its remedy
as soon as it is named (a fit's first skipped step), and a summary at the end.

Example:
    >>> import io
    >>> from mpnb.training.history import History
    >>> out = io.StringIO()
    >>> sink = TextProgress("demo", interval=0, stream=out)
    >>> h = History()
    >>> h.extend({"step": [1], "loss": [0.5], "loss_scale": [1024.0], "mode": ["fp16"]})
    >>> sink.update(h)
    >>> print(out.getvalue().splitlines()[1])
    step 1  epoch 0  loss 0.5  scale 1024  skipped 0  - samples/s  mem -
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

from mpnb._render import text_table
from mpnb.precision.backends.base import format_bytes
from mpnb.training.history import History
from mpnb.training.telemetry import Sink

__all__: list[str] = []


class TextProgress(Sink):
    """Periodic one-line progress and a final summary, printed to ``stream`` (stdout)."""

    def __init__(
        self, title: str = "", *, interval: float = 2.0, stream: TextIO | None = None
    ) -> None:
        self.title, self.interval = title, interval
        self.stream = stream
        self._last_line = -math.inf
        self._started = False
        self._events_seen = 0

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def due(self, now: float) -> bool:
        return now - self._last_line >= self.interval

    def update(self, history: History) -> None:
        if not self._started:
            self._started = True
            self._print(f"training {self.title}" if self.title else "training")
            for line in history.meta.get("layers", ()):  # a mode that swaps layers: which
                self._print(f"  {line}")
        self._print_origins(history)
        now = time.perf_counter()
        if self.due(now) and len(history):
            self._last_line = now
            self._print(progress_line(history))

    def _print_origins(self, history: History) -> None:
        """Each new ``"origin"`` event, once, as soon as it is on the history: where an overflow
        began and what to call (a script shows it at the first skip, not at the alarm)."""
        fresh, self._events_seen = history.events[self._events_seen :], len(history.events)
        for event in fresh:
            if event.get("kind") == "origin":
                self._print(f"mpnb: {event['message']}")

    def close(self, history: History) -> None:
        self._print_origins(history)
        if not len(history):
            # nothing to sum up, and the reason is said where it belongs: the error of a run
            # that failed before its first step, the warning of data that gave no batch
            return
        self._print("finished: " + progress_line(history))
        self._print(text_table(("", ""), history.summary_rows()))


def progress_line(history: History) -> str:
    """The latest step in one line: step, epoch, loss, scale, skipped so far, throughput, memory."""
    last = len(history) - 1
    rate, used = history.samples_per_s[last], history.memory_used[last]
    return (
        f"step {history.step[last]}  epoch {history.epoch[last]}  loss {history.loss[last]:.4g}  "
        f"scale {history.loss_scale[last]:g}  skipped {len(history.skipped_steps)}  "
        f"{'-' if math.isnan(rate) else f'{rate:,.0f}'} samples/s  "
        f"mem {format_bytes(used)}"
    )
