"""Where output can go: a notebook kernel (live widgets) or a terminal (text progress).

Example:
    >>> in_notebook_kernel()
    False
    >>> display_kind("auto")
    'text'
"""

from __future__ import annotations

import sys
import warnings

from mpnb.errors import InvalidChoiceError

__all__: list[str] = []

DASHBOARD_KINDS = ("auto", "live", "text")
WIDGETS_INSTALL = "pip install ipywidgets plotly anywidget"


def in_notebook_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets can be shown), without importing IPython."""
    ipython_module = sys.modules.get("IPython")
    shell = ipython_module.get_ipython() if ipython_module is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def display_kind(kind: str, what: str = "dashboard") -> str:
    """``"live"`` or ``"text"``: how to show progress for ``kind`` (``"auto"``, ``"live"``, ``"text"``).

    ``"auto"`` picks live in a notebook kernel and text elsewhere; if the widget libraries
    are missing it warns once, naming the install command, and falls back to text.

    Raises:
        InvalidChoiceError: an unknown kind.
        ImportError: ``"live"`` without ipywidgets / plotly / anywidget.
    """
    if kind not in DASHBOARD_KINDS:
        raise InvalidChoiceError(
            what, kind, DASHBOARD_KINDS, "Pass one of these, None for no display, or a Sink."
        )
    if kind == "text" or (kind == "auto" and not in_notebook_kernel()):
        return "text"
    try:
        import anywidget  # noqa: F401  (plotly's FigureWidget needs it)
        import ipywidgets  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as error:
        if kind == "live":
            raise ImportError(
                f"the live {what} needs widgets: {WIDGETS_INSTALL} ({error})"
            ) from error
        warnings.warn(
            f"no live {what} ({error}); showing text progress instead. For the live plot: {WIDGETS_INSTALL}",
            stacklevel=4,
        )
        return "text"
    return "live"
