"""Dashboards: the live FigureWidget sends bounded, throttled updates; text progress in scripts;
the HTML report of a run is self-contained."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import time

import pytest
import torch

import mpnb.examples as ex
from mpnb.errors import InvalidChoiceError
from mpnb.training.history import History
from mpnb.ui.plots.live import LiveDashboard
from mpnb.ui.plots.report import report_html
from mpnb.ui.views import make_dashboard
from tests.wire import recording_wire

MAX_MESSAGE_BYTES = 64 * 1024


@pytest.fixture
def wire():
    """Message sizes of widgets created in the test."""
    with recording_wire() as sizes:
        yield sizes


def synthetic_history(steps: int) -> History:
    history = History()
    history.extend(
        {
            "step": list(range(1, steps + 1)),
            "loss": [1.0 / s for s in range(1, steps + 1)],
            "loss_scale": [2.0 ** (16 - (s // 1000)) for s in range(1, steps + 1)],
            "skipped": [s % 1000 == 0 for s in range(1, steps + 1)],
            "samples_per_s": [1000.0 + s % 7 for s in range(1, steps + 1)],
            "memory_used": [2.0**20 * (100 + s % 5) for s in range(1, steps + 1)],
            "memory_peak": [2.0**20 * 105] * steps,
        }
    )
    return history


def feed(dashboard: LiveDashboard, source: History, chunk: int) -> History:
    """Grow a history ``chunk`` rows at a time, updating the dashboard after each, as the recorder does."""
    history = History()
    for start in range(0, len(source), chunk):
        history.extend(
            {name: values[start : start + chunk] for name, values in source.columns.items()}
        )
        dashboard.update(history)
    dashboard.close(history)
    return history


def test_live_updates_stay_small_however_long_the_run(wire):
    dashboard = LiveDashboard("long run", min_interval=0, max_share=0, max_points=500)
    opened = len(wire)
    feed(dashboard, synthetic_history(30_000), chunk=250)
    updates = wire[opened:]
    assert dashboard.redraws == 121 and updates
    assert max(updates) <= MAX_MESSAGE_BYTES
    assert all(len(trace.x) <= 500 for trace in dashboard.figure.data)
    assert dashboard.figure.data[0].x[-1] == 30_000  # the newest step is always drawn
    assert len(dashboard.figure.data[2].x) == 30  # every skipped step is marked


def test_live_redraws_are_throttled():
    dashboard = LiveDashboard("", min_interval=0.25)
    history = synthetic_history(10)
    started = time.perf_counter()
    while time.perf_counter() - started < 0.6:
        dashboard.update(history)
    dashboard.close(history)
    assert 2 <= dashboard.redraws <= 5  # one at once, one per 0.25 s, one final


def test_trainer_feeds_a_live_dashboard_while_it_trains(wire):
    dashboard = LiveDashboard("digits", min_interval=0, max_share=0)
    trainer, train, _ = ex.example_trainer(
        "bf16", "cpu", widths=(4, 8), dashboard=dashboard, flush_every=5
    )
    trainer.fit(train, max_steps=20)
    # A sink that is due makes the recorder flush early: here after every step, plus the final redraw.
    assert dashboard.redraws == 21 and trainer.amp.recorder.host_transfers == 20
    assert dashboard.figure.data[0].x.tolist() == list(range(1, 21))


def test_text_progress_in_a_plain_script():
    code = (
        "import mpnb.examples as ex\n"
        "trainer, train, _ = ex.example_trainer('bf16', 'cpu', widths=(4, 8))\n"
        "trainer.fit(train, max_steps=15)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "training DigitsCNN, bf16 on cpu, 666 parameters"
    assert lines[1].startswith("step 1  epoch 0  loss ")
    assert any(line.startswith("finished: step 15  epoch 0") for line in lines)
    assert any(line.startswith("steps") and "15 (0 skipped)" in line for line in lines)
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr


def test_text_progress_prints_nothing_above_the_error_of_a_fit_that_failed_before_its_first_step():
    trainer, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard="text")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(RuntimeError, match="shapes|size"):
        trainer.fit([(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))])
    assert out.getvalue() == ""  # the error says what happened; a summary of nothing adds noise


def test_dashboard_kinds():
    assert [type(sink).__name__ for sink in make_dashboard("auto")] == [
        "TextProgress"
    ]  # not in a notebook kernel
    with pytest.raises(
        InvalidChoiceError, match="unknown dashboard 'plot'; valid: auto, live, text"
    ):
        make_dashboard("plot")


def test_html_report_is_self_contained_and_has_the_summary():
    page = report_html(synthetic_history(50), "demo <run>", [("test accuracy", "97.0%")])
    assert "<title>demo &lt;run&gt;</title>" in page
    assert "<script src=" not in page and "cdn.plot.ly" not in page.split("<script")[0]
    assert "test accuracy" in page and "97.0%" in page and "50 (0 skipped)" in page
    assert "Plotly.newPlot" in page


def test_redraw_interval_stretches_so_redrawing_stays_a_small_share_of_the_run():
    dashboard = LiveDashboard("", min_interval=0.0, max_share=0.01)
    history = synthetic_history(2000)
    dashboard.update(history)
    assert (
        dashboard.redraws == 1 and dashboard.pacer.interval == 0.0
    )  # the first redraw's one-time costs do not count
    dashboard.update(history)
    assert (
        dashboard.redraws == 2 and dashboard.pacer.interval > 0.0
    )  # min_interval 0, stretched to 100 x the cost
    assert not dashboard.due(time.perf_counter())
