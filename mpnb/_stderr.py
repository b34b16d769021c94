"""What native code writes to the process's stderr, and what libraries log there, kept out of a
notebook where it means nothing.

C++ code (torch's kernels, its profiler library) writes to file descriptor 2 directly, past
Python's ``sys.stderr``, and Jupyter shows that descriptor in the notebook as red output.
:func:`native_stderr_without` runs a block with the descriptor caught and writes back what the
block's writes held, less the lines it is told to drop; the descriptor is put back whatever the
block raises.

:func:`quiet_loggers` raises Python loggers' levels for a block (a library's import warnings
about kernels this build does not load), each put back afterwards.

Example:
    >>> with native_stderr_without(lambda line: line.startswith(b"noise")):
    ...     _ = os.write(2, b"noise from a kernel\\n")
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator

__all__: list[str] = []


@contextlib.contextmanager
def native_stderr_without(dropped: Callable[[bytes], object] | None = None) -> Iterator[None]:
    """Run the block with file descriptor 2 caught, then write back each line (with its line
    end) for which ``dropped`` is false: nothing else is lost, only held to the block's end.
    ``dropped=None`` drops every line (the descriptor goes to the null device). Meant for short
    blocks: another thread's native writes meanwhile are held too."""
    sys.stderr.flush()  # what Python holds for stderr goes out before, not into, the block
    try:
        saved = os.dup(2)
    except OSError:  # this process has no stderr
        yield
        return
    with open(os.devnull, "wb") if dropped is None else tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if dropped is not None:
                caught.seek(0)
                lines = caught.read().splitlines(keepends=True)
                kept = b"".join(line for line in lines if not dropped(line))
                while kept:
                    kept = kept[os.write(2, kept) :]


@contextlib.contextmanager
def quiet_loggers(names: tuple[str, ...], level: int) -> Iterator[None]:
    """The loggers ``names`` at ``level`` (logging.ERROR: warnings dropped) for the block, each
    logger's own level put back on any exit."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, saved in zip(loggers, levels, strict=True):
            logger.setLevel(saved)
