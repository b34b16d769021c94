"""The instruments a fit asks for, built in one place: the one door from a training loop into
:mod:`mpnb.numerics`.

:func:`fit_instruments` turns a fit's options (``watch_numerics``, ``locate_overflow``) into a
list of :class:`~mpnb.training.step_record.Instrument`\\ s, which the loop hands to its
:class:`~mpnb.training.step_record.StepAccount` (the step's moments) and its recorder (the
flushes, the run's end) without naming any of them. The run's remedy (``keep_in_fp32``) is one
of them, first: a module asked for between runs is kept from the next run's first step. The
same object holds the watch's log. :class:`mpnb.Trainer` and the integrations'
``LoopTelemetry`` both build theirs here; a new per-layer statistic is a measure of the watch
and a column of its figure, nothing here.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> instruments = fit_instruments(model, "cpu", watch_numerics=2, locate_overflow=True)
    >>> [type(instrument).__name__ for instrument in instruments]
    ['Fp32Modules', 'FirstSkipLocator', 'NextStepsLocator', 'NumericsWatch']
    >>> instruments.numerics.modules
    ['0', '1']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from mpnb.numerics.fp32_modules import Fp32Modules

if TYPE_CHECKING:
    from mpnb.numerics.watch import NumericsLog
    from mpnb.training.history import History
    from mpnb.training.step_record import Instrument

__all__: list[str] = []


class FitInstruments(list["Instrument"]):
    """A run's instruments, in the order they are called, with the run's remedy and the watch's
    log beside them.

    Attributes:
        numerics: the numerics watch's log (None without ``watch_numerics``).
    """

    def __init__(
        self, instruments: list[Instrument], remedy: Fp32Modules, numerics: NumericsLog | None
    ) -> None:
        super().__init__(instruments)
        self.numerics = numerics
        self._remedy = remedy

    @property
    def kept(self) -> list[str]:
        """The modules kept in float32 now."""
        return self._remedy.names

    @property
    def running(self) -> bool:
        """A run is on: a remedy asked for now applies from the next step."""
        return self._remedy.running

    def keep_in_fp32(self, module: str, step: int) -> str:
        """Run ``module`` in float32 from step ``step`` until the run ends, or from the next
        run's first step when none is on (:meth:`Fp32Modules.keep`); its name."""
        return self._remedy.keep(module, step)

    def module_name(self, module: str) -> str:
        """``module`` as the model names it (:meth:`Fp32Modules.resolve`), or an error listing
        the closest names."""
        return self._remedy.resolve(module)

    def undo_for_reset(self, history: History, step: int) -> None:
        """The session was reset: the modules kept in float32 are put back, noted on ``history``."""
        self._remedy.undo_for_reset(history, step)

    def release(self) -> None:
        """The run ended: every module kept in float32 is put back."""
        self._remedy.release()


def check_watch_numerics(watch_numerics: object) -> int | None:
    """The sampling interval ``watch_numerics`` asks for (None: off), refused early when it is
    not an option the watch takes.

    Raises:
        ValueError: it is not None, a bool or a whole number of steps >= 1.
    """
    from mpnb.numerics.watch import NumericsWatch  # see fit_instruments

    return NumericsWatch.interval(watch_numerics)


def fit_instruments(
    model: nn.Module,
    device_type: str,
    *,
    watch_numerics: int | bool | None = None,
    locate_overflow: bool = True,
    replays: bool = True,
) -> FitInstruments:
    """The instruments a run of ``model`` asked for, in the order they are called.

    Args:
        model: the model the run trains (wrapped as it runs).
        device_type: where it runs (the remedy's autocast).
        watch_numerics: the numerics watch's sampling interval (see
            :class:`~mpnb.numerics.watch.NumericsWatch`); None or False: no watch.
        locate_overflow: name where an inf/NaN began.
        replays: the loop holds its batches, so a skipped step can be replayed (mpnb's Trainer);
            otherwise (a framework's loop) a skip, like a non-finite loss, arms the next steps.

    Raises:
        ValueError: ``watch_numerics`` is not an option the watch takes.
    """
    # imported here: mpnb.training imports this module as it loads, and the instruments
    # themselves import mpnb.training (their base, the history)
    from mpnb.numerics.origin import FirstSkipLocator, NextStepsLocator
    from mpnb.numerics.watch import NumericsWatch

    every = check_watch_numerics(watch_numerics)
    remedy = Fp32Modules(model, device_type)
    instruments: list[Instrument] = [remedy]
    if locate_overflow:
        if replays:
            instruments.append(FirstSkipLocator(model))
        # its remedy names the object to call: the Trainer (which replays), else the callback
        owner = "trainer" if replays else "callback"
        instruments.append(NextStepsLocator(model, on_skips=not replays, owner=owner))
    # last: at a step's end the locator's instrument is off before the watch stacks its rows
    watch = None if every is None else NumericsWatch(model, every)
    if watch is not None:
        instruments.append(watch)
    return FitInstruments(instruments, remedy, None if watch is None else watch.log)
