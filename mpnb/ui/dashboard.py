"""Choose how a training run is shown: live widget in a notebook, text progress elsewhere.

Example:
    >>> [type(sink).__name__ for sink in make_dashboard("text", "demo")]
    ['TextProgress']
"""

from __future__ import annotations

import sys
import warnings

from mpnb.errors import InvalidChoiceError
from mpnb.telemetry import Sink
from mpnb.training.control import FitControl

__all__ = ["DASHBOARD_KINDS", "WIDGETS_INSTALL", "make_dashboard"]

DASHBOARD_KINDS = ("auto", "live", "text")
WIDGETS_INSTALL = "pip install ipywidgets plotly anywidget"


def in_notebook_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets can be shown), without importing IPython."""
    ipython_module = sys.modules.get("IPython")
    shell = ipython_module.get_ipython() if ipython_module is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def make_dashboard(kind: str, title: str = "", control: FitControl | None = None) -> list[Sink]:
    """Sinks for ``kind``: ``"live"`` (FigureWidget, displayed now), ``"text"``, or ``"auto"``.

    ``"auto"`` picks live in a notebook kernel and text elsewhere; if the widget libraries
    are missing it warns once, naming the install command, and falls back to text. With a
    ``control``, the live dashboard has Stop and Pause / Resume buttons above the plot.

    Raises:
        InvalidChoiceError: an unknown kind.
        ImportError: ``"live"`` without ipywidgets / plotly / anywidget.
    """
    from mpnb.ui.text import TextProgress

    if kind not in DASHBOARD_KINDS:
        raise InvalidChoiceError(
            "dashboard", kind, DASHBOARD_KINDS, "Pass one of these, None for no display, or a Sink."
        )
    if kind == "text" or (kind == "auto" and not in_notebook_kernel()):
        return [TextProgress(title)]
    try:
        from IPython.display import display

        from mpnb.ui.live import LiveDashboard
    except ImportError as error:
        if kind == "live":
            raise ImportError(f"the live dashboard needs widgets: {WIDGETS_INSTALL} ({error})") from error
        warnings.warn(
            f"no live dashboard ({error}); showing text progress instead. For the live plot: {WIDGETS_INSTALL}",
            stacklevel=3,
        )
        return [TextProgress(title)]
    dashboard = LiveDashboard(title)
    if control is None:
        display(dashboard.figure)
        return [dashboard]
    from ipywidgets import VBox

    from mpnb.ui.fit_controls import FitButtons

    buttons = FitButtons(control)
    display(VBox([buttons.widget, dashboard.figure]))
    return [dashboard, buttons]
