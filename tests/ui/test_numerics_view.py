"""The dashboard's numerics view: a watching trainer's heatmaps drawn while the fit runs, and an
overflow's named origin marked on them."""

from __future__ import annotations

import warnings

import torch

import mpnb
import mpnb.examples as ex
from mpnb.ui.views import make_dashboard
from mpnb.ui.widgets.numerics_view import NumericsView
from tests.numerics.test_origin import gpt2_batches, overflowing_gpt2


def test_the_heatmaps_are_drawn_while_the_fit_runs_not_only_at_its_end():
    trainer, train, _ = ex.example_trainer(
        "bf16", "cpu", widths=(4, 8), dashboard=None, watch_numerics=2, flush_every=2
    )
    view = trainer.dashboard = NumericsView(trainer)  # after the watch, as a live dashboard is
    drawn_mid_fit = []
    trainer.control.pollers.append(
        lambda: drawn_mid_fit.append(tuple(view.figure.data[0].x) if view.figure else ())
    )
    trainer.fit(train, max_steps=8)
    assert drawn_mid_fit[0] == ()  # no figure (and no plotly.js sent) before a sampled step
    assert any(drawn_mid_fit[:7]), "nothing drawn before the fit's last step"
    assert view.figure.data[0].x == (2, 4, 6, 8)
    assert list(view.figure.data[0].y) == trainer.numerics.modules


def test_a_live_dashboard_of_a_watching_trainer_carries_the_numerics_view(capsys):
    watching, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None,
                                        watch_numerics=5)  # fmt: skip
    sinks = make_dashboard("live", "digits", watching.control)
    assert any(isinstance(sink, NumericsView) for sink in sinks)
    plain, _, _ = ex.example_trainer(
        "bf16", "cpu", widths=(4, 8), dashboard=None, watch_numerics=False
    )
    assert not any(isinstance(s, NumericsView) for s in make_dashboard("live", "", plain.control))
    capsys.readouterr()


def test_the_origin_of_an_fp16_overflow_is_marked_on_the_heatmap_at_its_module():
    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), mode="fp16", device="cpu",
        dashboard=None, init_scale=1.0, watch_numerics=1,
    )  # fmt: skip
    view = trainer.dashboard = NumericsView(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer.fit(gpt2_batches(3))
    (marked,) = [trace for trace in view.figure.data if trace.name == "origin of the overflow"][:1]
    assert (marked.y[0], marked.x[0]) == ("transformer.h.1.mlp.c_proj", 1)
    assert "overflow began in transformer.h.1.mlp.c_proj at step 1" in view.note.value
    row = trainer.numerics.modules.index("transformer.h.1.mlp.c_proj")
    assert view.figure.data[0].z[row][0] == 0.0  # drawn at the limit: it overflowed there
