"""How the core shows its work without knowing the UI: the views it asks for, by name.

Training and analysis run in plain scripts and never import IPython, ipywidgets or plotly.
Where they show something, they ask this module for a view factory:

- ``dashboard(kind, title, control) -> list[Sink]``: called once per ``Trainer.fit`` call
  whose ``dashboard=`` is a string (``"auto"``, ``"live"`` or ``"text"``, passed on as
  ``kind``; a factory should refuse other values). It displays whatever it shows, and returns
  :class:`~mpnb.training.telemetry.Sink` objects: each gets ``update(history)`` as rows
  arrive (sooner when its ``due(now)`` says so) and ``close(history)`` when that ``fit`` call
  ends; they are dropped afterwards. ``control`` is the run's
  :class:`~mpnb.training.control.FitControl`: buttons call its ``stop`` / ``pause`` /
  ``resume``; to be heard while the fit holds the kernel, add a function that delivers your
  UI's pending events to ``control.pollers``, and follow ``control.on_state`` to show the state.
- ``history_figure(history) -> figure``: a static figure of a finished run (``History.plot``).
- ``comparison_progress(kind, modes, title) -> ComparisonProgress``: how ``compare`` shows
  its modes while they train; see :class:`~mpnb.analysis.comparison.ComparisonProgress`
  (``sink_for(mode, steps, warmup)``, ``finished(result)``, ``close(comparison)``).
- ``advice_figure(advice) -> figure``: the numerics advisor's heatmap (``Advice.figure``).
- ``whatif_figure(result) -> figure``: the what-if's heatmap, layer x format (``WhatIf.figure``).
- ``cell_end(control)``: where a front end runs code in cells, ends a framework's run with the
  cell that started it when that cell raises and leaves it open (``control.abandon``):
  ``transformers.Trainer`` tells its callbacks nothing when ``train()`` raises. Asked once per
  run of a framework's loop (:class:`~mpnb.integrations.loop_telemetry.LoopTelemetry`), whatever
  its dashboard; a front end without cells can leave it out.
- ``rank_dashboard(kind, title, control) -> RanksView``: how :func:`mpnb.distributed.launch`
  shows every rank's telemetry while they train (``kind`` as for ``dashboard``); see
  :class:`~mpnb.distributed.rank_rows.RanksView`. A Stop button calls ``control.stop()``.

``import mpnb`` installs the Jupyter implementations from :mod:`mpnb.ui.views` (they import
their libraries only when called; ``mpnb.ui.views.install()`` puts them back). A front end or
a test can :func:`provide` its own for the whole process, or for one block with
:func:`provided`.

Example:
    >>> import mpnb
    >>> with provided(history_figure=lambda history: f"a figure of {len(history)} steps"):
    ...     mpnb.History().plot()
    'a figure of 0 steps'
    >>> provide(nothing=print)
    Traceback (most recent call last):
    ...
    mpnb.errors.InvalidChoiceError: unknown view 'nothing'; valid: dashboard, history_figure, comparison_progress, advice_figure, memory_figure, numerics_figure, rank_dashboard, whatif_figure, cell_end
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from mpnb.errors import InvalidChoiceError, MpnbError

__all__ = ["provide", "provided"]

#: The views the core asks for.
VIEW_NAMES = (
    "dashboard",
    "history_figure",
    "comparison_progress",
    "advice_figure",
    "memory_figure",
    "numerics_figure",
    "rank_dashboard",
    "whatif_figure",
    "cell_end",
)

_factories: dict[str, Callable[..., Any] | None] = dict.fromkeys(VIEW_NAMES)


def provide(**factories: Callable[..., Any] | None) -> dict[str, Callable[..., Any] | None]:
    """Install view factories by name (None removes one); returns the ones they replace.

    Raises:
        InvalidChoiceError: a name that is not a view; nothing is installed then.

    Example:
        >>> import mpnb
        >>> replaced = provide(history_figure=lambda history: f"{len(history)} steps, no plot")
        >>> mpnb.History().plot()
        '0 steps, no plot'
        >>> _ = provide(**replaced)  # mpnb's own figure again
        >>> view("history_figure").__module__
        'mpnb.ui.views'
    """
    for name in factories:
        if name not in _factories:
            raise InvalidChoiceError("view", name, VIEW_NAMES)
    previous = {name: _factories[name] for name in factories}
    _factories.update(factories)
    return previous


@contextlib.contextmanager
def provided(**factories: Callable[..., Any] | None) -> Iterator[None]:
    """The given view factories for one block; the previous ones are back after it, on any exit.

    Example:
        >>> with provided(advice_figure=None):  # no factory for this view in the block
        ...     view("advice_figure")
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: no 'advice_figure' view is installed: mpnb.views.provide(advice_figure=...) installs one
        >>> view("advice_figure").__module__
        'mpnb.ui.views'
    """
    previous = provide(**factories)
    try:
        yield
    finally:
        _factories.update(previous)


def installed(name: str) -> Callable[..., Any] | None:
    """The factory installed for view ``name``, or None (a view a front end may leave out).

    >>> with provided(cell_end=None):
    ...     installed("cell_end") is None
    True
    """
    return _factories[name]


def view(name: str) -> Callable[..., Any]:
    """The factory installed for view ``name``.

    Raises:
        MpnbError: no factory is installed for it (only when mpnb's own were removed).
    """
    factory = _factories[name]
    if factory is None:
        raise MpnbError(
            f"no {name!r} view is installed: mpnb.views.provide({name}=...) installs one"
        )
    return factory
