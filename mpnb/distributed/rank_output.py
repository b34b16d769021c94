"""What a worker prints, as whole lines marked with its rank.

Forked workers write to the notebook's own output streams (ipykernel forwards a forked child's
output to the cell), but two ranks printing at once interleave word by word. A worker's
``sys.stdout`` / ``sys.stderr`` are wrapped so that each line goes out whole, once complete,
led by ``[rank N]``. (Spawned workers write to the kernel's terminal, not to the cell.)

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> stream = RankLines(out, 1)
    >>> _ = stream.write("loss ")
    >>> _ = stream.write("0.25\\nstep 2")
    >>> out.getvalue()
    '[rank 1] loss 0.25\\n'
    >>> stream.flush()  # print(..., flush=True): a line still goes out whole
    >>> stream.finish()
    >>> out.getvalue()
    '[rank 1] loss 0.25\\n[rank 1] step 2\\n'
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO

__all__: list[str] = []


class RankLines:
    """A text stream that passes whole lines to ``stream``, each led by ``[rank N]``; what is
    left of an unfinished line goes out (ended) at :meth:`finish`."""

    def __init__(self, stream: TextIO, rank: int) -> None:
        self.stream, self.prefix = stream, f"[rank {rank}] "
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        if lines:
            self.stream.write("".join(f"{self.prefix}{line}\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def finish(self) -> None:
        """Send the unfinished line, if any, ended."""
        if self._partial:
            self.stream.write(f"{self.prefix}{self._partial}\n")
            self._partial = ""
        self.stream.flush()

    def __getattr__(self, name: str) -> object:  # encoding, isatty, fileno...: the wrapped stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def rank_lines(rank: int) -> Iterator[None]:
    """Mark this process's printed lines with ``rank`` while the block runs; everything is flushed at its end."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RankLines(sys.stdout, rank), RankLines(sys.stderr, rank)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, RankLines):
                stream.finish()
        sys.stdout, sys.stderr = saved
