"""mpnb.views: the core shows its work through views it asks for by name; any front end can provide them."""

from __future__ import annotations

import pytest

import mpnb
import mpnb.examples as ex
from mpnb import views
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.training.telemetry import Sink
from mpnb.ui import views as ui_views


class RecordingSink(Sink):
    def __init__(self) -> None:
        self.updates: list[int] = []
        self.closed_with: int | None = None

    def update(self, history):
        self.updates.append(len(history))

    def close(self, history):
        self.closed_with = len(history)


def test_import_mpnb_installs_the_jupyter_views():
    assert {name: views.view(name) for name in views.VIEW_NAMES} == {
        "dashboard": ui_views.make_dashboard,
        "history_figure": ui_views.history_figure,
        "comparison_progress": ui_views.comparison_progress,
        "advice_figure": ui_views.advice_figure,
        "memory_figure": ui_views.memory_figure,
        "numerics_figure": ui_views.numerics_figure,
        "rank_dashboard": ui_views.make_rank_dashboard,
        "whatif_figure": ui_views.whatif_figure,
        "cell_end": ui_views.end_with_its_cell,
    }


def test_a_provided_dashboard_receives_the_run_and_the_default_comes_back():
    sink, asked = RecordingSink(), []

    def dashboard(kind, title, control):
        asked.append((kind, control is not None))
        return [sink]

    trainer, train, _ = ex.example_trainer(
        "bf16", "cpu", widths=(4, 8), batch_size=32, dashboard="auto"
    )
    with views.provided(dashboard=dashboard):
        history = trainer.fit(train, max_steps=5)
    assert asked == [("auto", True)]
    assert sink.closed_with == len(history) == 5
    assert views.view("dashboard") is ui_views.make_dashboard


def test_provided_views_are_restored_after_an_error():
    with pytest.raises(RuntimeError), views.provided(history_figure=lambda history: 1 / 0):
        raise RuntimeError("the block failed")
    assert views.view("history_figure") is ui_views.history_figure


def test_a_bad_view_name_installs_nothing():
    with pytest.raises(
        InvalidChoiceError, match="unknown view 'dashbord'; valid: dashboard, history_figure"
    ):
        views.provide(history_figure=print, dashbord=print)
    assert views.view("history_figure") is ui_views.history_figure


def test_a_removed_view_is_a_clear_error_not_a_silent_nothing():
    with (
        views.provided(history_figure=None),
        pytest.raises(MpnbError, match="no 'history_figure' view is installed"),
    ):
        mpnb.History().plot()
