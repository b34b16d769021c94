"""What the launching process does while its workers run: show their telemetry, pass on a stop.

torch's elastic launcher supervises the workers from the calling thread, as in ``torchrun``
(its signal handlers need the main thread: an interrupt ends every worker). Meanwhile a
helper thread drains the rows the workers stream (:mod:`mpnb.distributed.channel`) into a
:class:`~mpnb.distributed.rank_rows.RankRows`, shows it (a :class:`RanksView`), and passes a
``control.stop()`` on to the workers, whose fits then stop after the same step.

An interrupt (Ctrl-C, a kernel interrupt) is noted before it is raised (:func:`interrupts_noted`),
and the helper thread ends the workers when it sees the note. torch raises its
``SignalException`` from the signal handler, and a signal that lands while a worker is being
forked runs that handler inside Python's at-fork callbacks, which print and drop what they
raise: the interrupt was lost and the launch ran on to its timeout. The signal handlers torch
installs for a launch are put back as they were when it ends.

Example:
    >>> import time
    >>> from mpnb.distributed.signing import new_secret
    >>> supervisor = Supervisor(LauncherChannel(new_secret(), ranks=range(2)), view=None)
    >>> supervisor.run(lambda: time.sleep(0.2) or "done")
    'done'
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import psutil

from mpnb.distributed.channel import LauncherChannel
from mpnb.distributed.rank_rows import RankRows, RanksView
from mpnb.errors import warn_user
from mpnb.training.control import FitControl
from mpnb.training.history import History

__all__: list[str] = []

#: Seconds between two looks at the workers' rows and at the control.
POLL_S = 0.1
#: Seconds left-over workers get between SIGTERM and SIGKILL.
END_GRACE_S = 2.0
#: Where torch's launcher reads the signals it turns into ``SignalException``, and its default.
TORCH_SIGNALS_ENV, TORCH_SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def torch_handled_signals() -> str:
    """The signals torch's launcher is to handle during a launch: its own list (or the one set in
    the environment) without SIGINT, which :func:`interrupts_noted` handles.

    Example:
        >>> torch_handled_signals()
        'SIGTERM,SIGHUP,SIGQUIT'
    """
    return ",".join(name for name in _signal_names() if name != "SIGINT")


def _signal_names() -> list[str]:
    """The signal names torch's launcher would handle: the environment's list, or its default."""
    return [
        name.strip() for name in (os.environ.get(TORCH_SIGNALS_ENV) or TORCH_SIGNALS).split(",")
    ]


@contextlib.contextmanager
def interrupts_noted() -> Iterator[threading.Event]:
    """For a launch: SIGINT handled by mpnb (noted in the event yielded, then raised as torch's
    launcher raises it), and every signal handler torch's launcher installs put back after.

    Off the main thread nothing is installed (torch installs nothing there either).

    Example:
        >>> found = signal.getsignal(signal.SIGINT)
        >>> with interrupts_noted() as noted:
        ...     try:
        ...         signal.raise_signal(signal.SIGINT)
        ...     except Exception as raised:
        ...         print(type(raised).__name__, noted.is_set())
        SignalException True
        >>> signal.getsignal(signal.SIGINT) is found
        True
    """
    noted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    from torch.distributed.elastic.multiprocessing.api import SignalException

    wanted = os.environ.get(TORCH_SIGNALS_ENV)
    numbers = {name: getattr(signal, name) for name in _signal_names() if hasattr(signal, name)}
    previous = {name: signal.getsignal(number) for name, number in numbers.items()}

    def on_interrupt(number: int, frame: object) -> None:
        noted.set()
        raised = signal.Signals(number)
        raise SignalException(f"Process {os.getpid()} got signal: {raised}", sigval=raised)

    os.environ[TORCH_SIGNALS_ENV] = torch_handled_signals()
    if "SIGINT" in numbers:
        signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield noted
    finally:
        if wanted is None:
            os.environ.pop(TORCH_SIGNALS_ENV, None)
        else:
            os.environ[TORCH_SIGNALS_ENV] = wanted
        for name, handler in previous.items():
            if handler is not None:  # None: not set from Python, nothing to put back
                signal.signal(numbers[name], handler)


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
        #: Set when the launch was interrupted (see :func:`interrupts_noted`).
        self.interrupted = threading.Event()

    def run(
        self,
        start: Callable[[], Any],
        exact_rows: Callable[[Any], Mapping[int, Sequence[History]]] | None = None,
    ) -> Any:
        """``start()``'s return value (or its exception), watched meanwhile; no worker outlives it.

        ``exact_rows``, given what ``start()`` returned, says each rank's histories as the rank
        returned them: the view's last look (``close``) shows those, whole, rather than what
        streamed in (another process on the machine can take rows off the channel's queue).
        """
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        done = threading.Event()
        returned, finished = None, False
        with interrupts_noted() as self.interrupted:
            watcher = threading.Thread(
                target=self._watch, args=(done, before), name="mpnb-launch-watch", daemon=True
            )
            self.control.begin()
            watcher.start()
            try:
                returned = start()
                finished = True
                return returned
            finally:
                done.set()
                watcher.join()
                # none should be left; one that is (torch's launcher failed) goes now
                _end_workers(before)
                self.control.end()
                self._take_rows()
                if finished and exact_rows is not None:
                    self.rows.settle(exact_rows(returned))
                self._show("close")

    def _watch(self, done: threading.Event, before: set[int]) -> None:
        while not done.wait(POLL_S):
            self._take_rows()
            if self.control.stop_requested:
                self._ask_stop()  # at every look: another process could delete the key
            if self.interrupted.is_set():
                # whether or not torch's launcher got the exception; at every look, as a worker
                # could still be starting. Not waited for here: torch's launcher collects them.
                _terminate(_started_since(before))

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
    started = _started_since(before)
    if not started:
        return
    _terminate(started)
    _, alive = psutil.wait_procs(started, timeout=END_GRACE_S)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=END_GRACE_S)


def _started_since(before: set[int]) -> list[psutil.Process]:
    return [child for child in psutil.Process().children(recursive=True) if child.pid not in before]


def _terminate(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
