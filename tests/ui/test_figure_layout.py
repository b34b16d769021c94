"""The figures' layout as a reader meets it: log-axis tick labels, where the legend sits, which
line is which. Checked on plotly's own figure objects, and rendered in Chromium where it is here."""

from __future__ import annotations

import shutil

import pytest

from mpnb.analysis.results import Comparison, ModeResult
from mpnb.training.history import History
from mpnb.ui.plots.compare_report import MODE_TRACES, comparison_figure, empty_comparison_figure
from mpnb.ui.plots.figure import empty_figure
from mpnb.ui.plots.memory_figure import memory_figure

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: Loss scales under 1 and over it: a log axis then has ticks at 0.3 ... 0.9 and 1, 2.
SCALES = [2.0, 1.0, 0.5, 0.25]


def _history(scales=SCALES) -> History:
    history = History()
    steps = list(range(1, len(scales) + 1))
    history.extend(
        {
            "step": steps,
            "loss": [1.0 / s for s in steps],
            "loss_scale": scales,
            "step_time": [0.02] * len(steps),
            "memory_used": [2.0**20] * len(steps),
        }
    )
    return history


def _comparison() -> Comparison:
    results = [ModeResult(mode, _history(), timed_from=0) for mode in ("fp32", "bf16", "fp16")]
    return Comparison(results, steps=len(SCALES), warmup=0)


def _log_axes(figure) -> dict[str, object]:
    layout = figure.layout.to_plotly_json()
    return {
        name: axis
        for name, axis in layout.items()
        if name.startswith("yaxis") and axis.get("type") == "log"
    }


@pytest.mark.parametrize(
    "build", [lambda: empty_figure("run"), lambda: empty_comparison_figure(["fp32", "bf16"])]
)
def test_loss_scale_axes_label_ticks_with_their_whole_value(build):
    axes = _log_axes(build())
    assert axes, "the loss scale has a log axis"
    # plotly's default log ticks label 0.5 as "5" and 0.2 as "2": a number format labels the value
    assert all(axis.get("tickformat") for axis in axes.values()), axes


def test_comparison_legend_sits_outside_every_panel():
    figure = empty_comparison_figure(["fp32", "bf16"], "a title")
    legend = figure.layout.legend
    titles = [a for a in figure.layout.annotations]
    assert legend.x >= 1 and legend.xanchor == "left", legend
    assert all(a.x <= 1 for a in titles)


def test_step_time_lines_say_which_mode_and_which_series_they_are():
    figure = comparison_figure(_comparison())
    per_mode = len(MODE_TRACES)
    names = [
        figure.data[index * per_mode + offset].name
        for index in range(3)
        for offset, trace in enumerate(MODE_TRACES)
        if trace.startswith("step time")
    ]
    assert names == [
        f"{mode}, {series}"
        for mode in ("fp32", "bf16", "fp16")
        for series in ("each step", "median of 9 steps")
    ]
    step_time_title = [a.text for a in figure.layout.annotations if a.text.startswith("step time")]
    assert step_time_title == ["step time (ms): faint, each step; bold, median of 9 steps"]
    assert [t.name for t in figure.data if t.showlegend] == ["fp32", "bf16", "fp16"]


def _rendered(figure, script: str, width: int = 1200):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=shutil.which("chromium"), args=CHROMIUM_FLAGS
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.set_content(figure.to_html(include_plotlyjs=True, full_html=True))
            page.wait_for_selector(".ytick", state="attached")
            return page.evaluate(script)
        finally:
            browser.close()


_BROWSER = pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)"
)


@_BROWSER
def test_in_a_browser_the_loss_scale_ticks_read_as_their_values():
    pytest.importorskip("playwright")
    dashboard = empty_figure("run")
    dashboard.data[1].update(x=[1, 2, 3, 4], y=SCALES)  # the loss scale, panel 2 (log)
    labels = _rendered(
        dashboard, "[...document.querySelectorAll('.y2tick text')].map(e => e.textContent)"
    )
    values = [float(label) for label in labels]
    assert 0.5 in values and all(0.2 <= v <= 2.5 for v in values), labels
    figure = comparison_figure(_comparison())
    axis = next(iter(_log_axes(figure))).removeprefix("yaxis")  # "3": row 2, column 1
    labels = _rendered(
        figure, f"[...document.querySelectorAll('.y{axis}tick text')].map(e => e.textContent)"
    )
    assert 0.5 in [float(label) for label in labels], labels


def _legend_and_titles(figure, titles: str, width: int = 1200):
    """The rendered boxes (left, top, right, bottom) of the legend and of the elements the CSS
    selector ``titles`` picks."""
    boxes = _rendered(
        figure,
        """(() => {
            const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
            return {legend: box(document.querySelector('.legend')),
                    titles: [...document.querySelectorAll('TITLES')].map(box)};
        })()""".replace("TITLES", titles),
        width=width,
    )
    return boxes["legend"], boxes["titles"]


def _apart(box, other) -> bool:
    left, top, right, bottom = box
    o_left, o_top, o_right, o_bottom = other
    return right <= o_left or o_right <= left or bottom <= o_top or o_bottom <= top


@_BROWSER
def test_in_a_browser_the_comparison_legend_covers_no_panel_title():
    pytest.importorskip("playwright")
    legend, titles = _legend_and_titles(comparison_figure(_comparison()), ".annotation")
    assert len(titles) == 5
    assert all(_apart(legend, title) for title in titles), (legend, titles)


def _memory_report():
    import mpnb
    import mpnb.examples as ex

    def make_run(mode):
        trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)
        return trainer, train

    return mpnb.memory(make_run, ["fp32", "bf16", "fp16"], batch_size=64, measure=True)


@_BROWSER
@pytest.mark.parametrize("width", [1200, 640])  # a wide notebook, the docs' column
def test_in_a_browser_the_memory_legend_covers_no_axis_title(width):
    pytest.importorskip("playwright")
    figure = memory_figure(_memory_report())
    legend, titles = _legend_and_titles(figure, ".xtitle, .g-gtitle", width)
    assert len(titles) == 2
    assert all(_apart(legend, title) for title in titles), (legend, titles)
