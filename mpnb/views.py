"""How the core shows its work without knowing the UI: the views it asks for, by name.

Training and analysis run in plain scripts and never import IPython, ipywidgets or plotly.
Where they show something, they ask this module for a view factory:

- ``dashboard(kind, title, control) -> list[Sink]``: the sinks that show one training run
  (``kind`` is ``"auto"``, ``"live"`` or ``"text"``; ``control`` is the run's
  :class:`~mpnb.training.control.FitControl`, or None). Used by ``Trainer.fit``.
- ``history_figure(history) -> figure``: a static figure of a finished run. Used by
  ``History.plot``.
- ``comparison_progress(kind, modes, title) -> ComparisonProgress``: how ``compare`` shows
  its modes while they train.
- ``advice_figure(advice) -> figure``: the numerics advisor's heatmap (``Advice.figure``).

``import mpnb`` installs the Jupyter implementations from :mod:`mpnb.ui.views` (they import
their libraries only when called). Another front end, or a test, can :func:`provide` its own.

Example:
    >>> import mpnb
    >>> with provided(history_figure=lambda history: f"a figure of {len(history)} steps"):
    ...     mpnb.History().plot()
    'a figure of 0 steps'
    >>> provide(nothing=print)
    Traceback (most recent call last):
    ...
    mpnb.errors.InvalidChoiceError: unknown view 'nothing'; valid: dashboard, history_figure, comparison_progress, advice_figure
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from mpnb.errors import InvalidChoiceError, MpnbError

__all__ = ["VIEW_NAMES", "provide", "provided", "view"]

#: The views the core asks for.
VIEW_NAMES = ("dashboard", "history_figure", "comparison_progress", "advice_figure")

_factories: dict[str, Callable[..., Any] | None] = dict.fromkeys(VIEW_NAMES)


def provide(**factories: Callable[..., Any] | None) -> dict[str, Callable[..., Any] | None]:
    """Install view factories by name (None removes one); returns the ones they replace.

    Raises:
        InvalidChoiceError: a name that is not a view; nothing is installed then.
    """
    for name in factories:
        if name not in _factories:
            raise InvalidChoiceError("view", name, VIEW_NAMES)
    previous = {name: _factories[name] for name in factories}
    _factories.update(factories)
    return previous


@contextlib.contextmanager
def provided(**factories: Callable[..., Any] | None) -> Iterator[None]:
    """The given view factories for one block; the previous ones are back after it, on any exit."""
    previous = provide(**factories)
    try:
        yield
    finally:
        _factories.update(previous)


def view(name: str) -> Callable[..., Any]:
    """The factory installed for view ``name``.

    Raises:
        MpnbError: no factory is installed for it (only when mpnb's own were removed).
    """
    factory = _factories[name]
    if factory is None:
        raise MpnbError(f"no {name!r} view is installed: mpnb.views.provide({name}=...) installs one")
    return factory
