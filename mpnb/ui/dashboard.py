"""Choose how a training run is shown: live widget in a notebook, text progress elsewhere.

Example:
    >>> type(make_dashboard("text", "demo")).__name__
    'TextProgress'
"""

from __future__ import annotations

import sys
import warnings

from mpnb.errors import InvalidChoiceError
from mpnb.telemetry import Sink

__all__ = ["make_dashboard", "DASHBOARD_KINDS", "WIDGETS_INSTALL"]

DASHBOARD_KINDS = ("auto", "live", "text")
WIDGETS_INSTALL = "pip install ipywidgets plotly anywidget"


def in_notebook_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets can be shown), without importing IPython."""
    ipython_module = sys.modules.get("IPython")
    shell = ipython_module.get_ipython() if ipython_module is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def make_dashboard(kind: str, title: str = "") -> Sink:
    """A sink for ``kind``: ``"live"`` (FigureWidget, displayed now), ``"text"``, or ``"auto"``.

    ``"auto"`` picks live in a notebook kernel and text elsewhere; if the widget libraries
    are missing it warns once, naming the install command, and falls back to text.

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
        return TextProgress(title)
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
        return TextProgress(title)
    dashboard = LiveDashboard(title)
    display(dashboard.figure)
    return dashboard
