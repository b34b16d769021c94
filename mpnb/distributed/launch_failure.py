"""What ended a launch, told from what its workers left behind.

A worker leaves files in the launch's log folder: its threads' stacks when its ``timeout`` ends it
(``rank-N.stack``), its Python stacks when a fatal signal ends it (``rank-N.crash``, written by
faulthandler), and torch's error file when it raises. After a failed launch the launcher reads them
into one :class:`LaunchError` that names the rank and says what happened to it.

Example:
    >>> _signal_named(-11), _signal_named(3)
    (' with SIGSEGV (exit code -11)', ' with exit code 3')
"""

from __future__ import annotations

import faulthandler
import glob
import json
import os
import signal
import threading
import time
from typing import Any

from mpnb.errors import MpnbError

__all__ = ["LaunchError"]

#: The exit code of a worker ended by its ``timeout``.
TIMED_OUT = 124


class LaunchError(MpnbError):
    """A worker failed or timed out; ``rank`` names it (the lowest of those that timed out),
    ``details`` holds its traceback, or the stacks of the ranks that timed out.

    Example:
        >>> error = LaunchError("rank 1 raised ValueError: bad batch", rank=1, details="Traceback ...")
        >>> isinstance(error, MpnbError), error.rank
        (True, 1)
    """

    def __init__(self, message: str, rank: int, details: str) -> None:
        super().__init__(message)
        self.rank, self.details = rank, details


def _stack_file(folder: str, rank: int | str, ending: str) -> str:
    """Where a rank leaves its stacks: ``rank-N.stack`` when its timeout ends it, ``rank-N.crash`` for
    a fatal signal."""
    return os.path.join(folder, f"rank-{rank}{ending}")


def _stacks(folder: str, ending: str = ".stack") -> dict[int, str]:
    """The stacks that workers left, by rank: those ended by their timeout (``.stack``), or those that
    crashed (``.crash``; a file stays empty in a rank that did not)."""
    stacks = {}
    for name in os.listdir(folder):
        if name.startswith("rank-") and name.endswith(ending):
            with open(os.path.join(folder, name)) as file:
                stack = file.read()
            if stack:
                stacks[int(name[5 : -len(ending)])] = stack
    return stacks


def _error_files(folder: str) -> list[tuple[int, int, dict]]:
    """``(written at ns, local rank, error)`` for each error file a worker left: its exception and
    traceback, as ``torch.distributed.elastic``'s ``record`` writes them."""
    found = []
    for path in glob.glob(os.path.join(folder, "*", "attempt_*", "*", "error.json")):
        try:
            with open(path) as file:
                error = json.load(file).get("message", {})
            found.append(
                (os.stat(path).st_mtime_ns, int(os.path.basename(os.path.dirname(path))), error)
            )
        except (OSError, ValueError, AttributeError):
            continue
    return sorted(found, key=lambda entry: entry[:2])


def launch_error(
    failures: dict[int, Any], timeout: float | None, logs: str, first_rank: int
) -> LaunchError:
    """The error that says what ended the launch: the stacks of the ranks that timed out, else the
    first exception a rank raised (the launcher may report first a rank that failed only because
    its peer's connection closed), else the first rank that exited. ``first_rank``: this node's
    first global rank (error files are named by local rank)."""
    stacks = _stacks(logs)
    if stacks:  # ranks blocked in a collective time out too: each one's stack shows where it was
        where = "\n\n".join(f"rank {rank}:\n{stack}" for rank, stack in sorted(stacks.items()))
        ranks = ", ".join(str(rank) for rank in sorted(stacks))
        return LaunchError(
            f"timeout={timeout:g} s passed with rank{'s' * (len(stacks) > 1)} {ranks} still running and ended; "
            f"where each was (a rank waiting in a collective waits for the one that hangs):\n\n{where}",
            min(stacks),
            where,
        )
    errors = _error_files(logs)
    if errors:
        _, local_rank, error = errors[0]
        rank = first_rank + local_rank
        details = error.get("extraInfo", {}).get("py_callstack", "") or str(
            error.get("message", "")
        )
        what = str(error.get("message", "an error"))
        # gloo's word for a peer that went away first, leaving no error of its own
        if "by peer" in what:
            what += (
                "\n(another rank ended first without a Python exception: os._exit, a signal or a crash; "
                "its exit code is in the launcher's log)"
            )
        return LaunchError(f"rank {rank} failed: {what}\n\n{details}", rank, details)
    if not failures:
        return LaunchError(
            "a rank failed and left no readable error (see the launcher's log)", first_rank, ""
        )
    rank, exited = min(failures.items(), key=lambda item: item[1].timestamp)
    crashed = _stacks(logs, ".crash")
    if crashed:  # a fatal signal in native code: where the first rank that crashed was
        rank = rank if rank in crashed else min(crashed)
        code = failures[rank].exitcode if rank in failures else exited.exitcode
        return LaunchError(
            f"rank {rank} crashed{_signal_named(code)} (no Python exception); its Python stacks "
            f"when it crashed:\n\n{crashed[rank]}",
            rank,
            crashed[rank],
        )
    return LaunchError(
        f"rank {rank} ended{_signal_named(exited.exitcode)} and no Python exception (os._exit, a signal or a crash)",
        rank,
        str(exited.message),
    )


def _signal_named(exit_code: int) -> str:
    """`` with SIGSEGV (exit code -11)`` for an exit by a signal, else `` with exit code 3``."""
    if exit_code < 0:
        try:
            return f" with {signal.Signals(-exit_code).name} (exit code {exit_code})"
        except ValueError:
            pass
    return f" with exit code {exit_code}"


def stacks_on_crash(folder: str, rank: int | str) -> None:
    """On a fatal signal (a segfault or an abort in native code), write this worker's Python stacks
    into ``folder`` for the launch's error to show (faulthandler keeps the file open)."""
    faulthandler.enable(open(_stack_file(folder, rank, ".crash"), "w"), all_threads=True)


#: How long a rank that timed out waits for the other ranks on its machine to leave their stacks.
PEERS_GRACE_S = 5.0


def end_after(seconds: float, folder: str, rank: int | str, local_ranks: int = 1) -> None:
    """End this worker (exit code :data:`TIMED_OUT`) once ``seconds`` have passed, leaving the
    stacks of its threads in ``folder``.

    The workers of one machine start one after another, so their timers end moments apart, and the
    launcher ends every worker as soon as one exits. The first to time out therefore waits (at most
    :data:`PEERS_GRACE_S`) until each of the ``local_ranks`` ranks has left its stacks: a rank that
    hangs is named even when a rank waiting for it timed out first."""

    def end() -> None:
        with open(_stack_file(folder, rank, ".stack"), "w") as file:
            faulthandler.dump_traceback(file)
        deadline = time.monotonic() + PEERS_GRACE_S
        while len(_stacks(folder)) < local_ranks and time.monotonic() < deadline:
            time.sleep(0.02)
        os._exit(TIMED_OUT)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()
