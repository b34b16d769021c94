"""The UI's side of :mod:`mpnb.views`: the training dashboard, figures, compare progress.

``import mpnb`` calls :func:`install`. Each factory imports its widget and plotting libraries
only when it is called, so installing them keeps ``import mpnb`` free of IPython, ipywidgets
and plotly.

Example:
    >>> [type(sink).__name__ for sink in make_dashboard("text", "demo")]
    ['TextProgress']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mpnb import views
from mpnb.ui.cell_end import end_with_its_cell
from mpnb.ui.environment import display_kind, in_notebook_kernel

if TYPE_CHECKING:
    from mpnb.analysis.comparison import ComparisonProgress
    from mpnb.analysis.memory import MemoryReport
    from mpnb.distributed.rank_rows import RanksView
    from mpnb.numerics.advisor import Advice
    from mpnb.numerics.watch import NumericsLog
    from mpnb.numerics.whatif import WhatIf
    from mpnb.training.control import FitControl
    from mpnb.training.history import History
    from mpnb.training.telemetry import Sink

__all__ = ["install"]

#: Said where a live dashboard is asked for outside a notebook kernel.
LIVE_ELSEWHERE = (
    "the live dashboard draws in a notebook kernel (Jupyter); here the run shows as text"
)


def make_dashboard(kind: str, title: str = "", control: FitControl | None = None) -> list[Sink]:
    """Sinks for ``kind`` (see :func:`~mpnb.ui.environment.display_kind`); a live dashboard is displayed now.

    With a ``control``, the live dashboard has Stop and Pause / Resume buttons above the plot (and,
    when the control steers a Trainer or a framework's telemetry, the remedy for a named overflow
    and, when it watches numerics, their live heatmaps below, with a memory-by-category view for
    a Trainer: :mod:`mpnb.ui.widgets.remedy_view`, :mod:`mpnb.ui.widgets.numerics_view`,
    :mod:`mpnb.ui.widgets.memory_view`).
    """
    from mpnb.ui.plots.text import TextProgress

    if display_kind(kind) == "text":
        return [TextProgress(title)]
    from IPython.display import display

    from mpnb.ui.plots.live import LiveDashboard

    dashboard = LiveDashboard(title)
    # outside a notebook kernel there is nowhere to draw widgets (a script would print their
    # repr, a terminal IPython nothing): they are made, for code to read, and text shows the run
    elsewhere = [] if in_notebook_kernel() else [TextProgress(title)]
    if elsewhere:
        print(f"mpnb: {LIVE_ELSEWHERE}")
    if control is None:
        if not elsewhere:
            display(dashboard.figure)
        return [dashboard, *elsewhere]
    from ipywidgets import VBox

    from mpnb.ui.widgets.fit_controls import FitButtons

    buttons = FitButtons(control)
    shown, sinks = [buttons.widget, dashboard.figure], [dashboard, buttons]
    subject = control.subject
    if subject is not None:  # a Trainer or a framework's telemetry: a named overflow remedied
        from mpnb.training.trainer import Trainer
        from mpnb.ui.widgets.remedy_view import RemedyView

        # a Trainer keeps a remedy asked for between fits for the next; a loop's run is over
        remedy = RemedyView(subject, waits_between_fits=isinstance(subject, Trainer))
        shown.append(remedy.widget)
        sinks.append(remedy)
        if isinstance(subject, Trainer):  # mpnb drives the steps: one can be counted by category
            from mpnb.ui.widgets.memory_view import MemoryView

            shown.append(MemoryView(subject).widget)
        if subject.numerics is not None:  # it watches numerics: their heatmaps, live
            from mpnb.ui.widgets.numerics_view import NumericsView

            numerics = NumericsView(subject)
            shown.append(numerics.widget)
            sinks.append(numerics)
    if not elsewhere:
        display(VBox(shown))
    return [*sinks, *elsewhere]


def make_rank_dashboard(kind: str, title: str = "", control: FitControl | None = None) -> RanksView:
    """How a launch shows its ranks (see ``kind`` above); a live one is displayed now. It has no
    Stop button: the kernel's thread is inside torch's launcher and cannot take clicks (interrupt
    the kernel, or call ``control.stop()`` from code).

    >>> type(make_rank_dashboard("text", "demo")).__name__
    'TextRanks'
    """
    if display_kind(kind) == "text":
        from mpnb.ui.plots.ranks import TextRanks

        return TextRanks(title)
    from IPython.display import display

    from mpnb.ui.plots.ranks import LiveRanks

    live = LiveRanks(title)
    display(live.figure)
    return live


def history_figure(history: History) -> Any:
    """A static plotly figure of a run: loss, loss scale with skipped steps, memory, throughput."""
    from mpnb.ui.plots.figure import dashboard_figure

    return dashboard_figure(history)


def comparison_progress(kind: str, modes: Sequence[str], title: str = "") -> ComparisonProgress:
    """Overlaid live curves in a notebook, a progress bar per mode elsewhere (see ``kind`` above)."""
    from mpnb.ui.plots.compare_progress import make_comparison_progress

    return make_comparison_progress(kind, modes, title)


def memory_figure(report: MemoryReport) -> Any:
    """Where a step's memory goes, per mode, as stacked bars (plotly)."""
    from mpnb.ui.plots.memory_figure import memory_figure as figure

    return figure(report)


def numerics_figure(log: NumericsLog) -> Any:
    """The numerics watch's heatmaps: module x sampled step, headroom to the limit and
    fp16-underflow share (plotly)."""
    from mpnb.ui.plots.numerics_figure import numerics_heatmap

    return numerics_heatmap(log)


def advice_figure(advice: Advice) -> Any:
    """The numerics advisor's heatmap (plotly)."""
    from mpnb.ui.plots.advice_figure import advice_heatmap

    return advice_heatmap(advice)


def whatif_figure(result: WhatIf) -> Any:
    """The what-if's heatmap, layer x format (plotly)."""
    from mpnb.ui.plots.whatif_figure import whatif_heatmap

    return whatif_heatmap(result)


def install() -> None:
    """Make these the views the core uses.

    Example:
        >>> from mpnb import views
        >>> with views.provided(history_figure=None):  # a front end took the figure away...
        ...     install()  # ...and mpnb's own views are back
        ...     views.view("history_figure") is history_figure
        True
    """
    views.provide(
        dashboard=make_dashboard,
        history_figure=history_figure,
        comparison_progress=comparison_progress,
        advice_figure=advice_figure,
        memory_figure=memory_figure,
        numerics_figure=numerics_figure,
        rank_dashboard=make_rank_dashboard,
        whatif_figure=whatif_figure,
        cell_end=end_with_its_cell,
    )
