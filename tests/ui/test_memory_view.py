"""The dashboard's memory view: a click during a fit counts a step of it by category, between
optimizer steps, and the fit trains exactly as it would have without it."""

from __future__ import annotations

import torch

import mpnb.examples as ex
from mpnb.ui.views import make_dashboard
from mpnb.ui.widgets.memory_view import MemoryView


def test_a_count_asked_for_mid_fit_is_drawn_and_leaves_the_fit_exact():
    reference, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    reference.fit(train, max_steps=6)
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    view = MemoryView(trainer)

    def click_at_step_three():  # a poller runs at each checkpoint, as a delivered click does
        if trainer.amp.steps == 3 and view.figure is None:  # the bars are made at the first count
            view.button.click()

    trainer.control.pollers.append(click_at_step_three)
    trainer.fit(train, max_steps=6)
    assert view.note.value == "step 3, bf16, counted on shape-only tensors"
    drawn = {trace.name: trace.x[0] for trace in view.figure.data}
    assert drawn["weight copies"] > 0 and drawn["activations"] > 0
    assert all(
        torch.equal(mine, theirs)
        for mine, theirs in zip(trainer.model.parameters(), reference.model.parameters())
    )
    assert trainer.history.loss == reference.history.loss


def test_a_live_dashboard_of_a_trainer_carries_the_memory_view(capsys, monkeypatch):
    trainer, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    # drawn as in a notebook kernel, where display() shows the widgets (here: prints their text)
    monkeypatch.setattr("mpnb.ui.views.in_notebook_kernel", lambda: True)
    make_dashboard("live", "digits", trainer.control)
    shown = capsys.readouterr().out
    assert "description='Stop'" in shown and "description='Memory by category'" in shown


def test_a_live_dashboard_asked_for_in_a_script_shows_the_run_as_text(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import mpnb.examples as ex\n"
        "trainer, data, _ = ex.example_trainer('bf16', 'cpu', widths=(4, 8), dashboard='live')\n"
        "trainer.fit(data, max_steps=3)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "description=" not in result.stdout  # no widget's repr
    assert "draws in a notebook kernel" in result.stdout and "finished" in result.stdout


def test_the_remedy_button_offered_for_a_named_overflow_stops_the_skips_mid_fit():
    import warnings

    from mpnb.ui.widgets.remedy_view import RemedyView
    from tests.numerics.test_origin import gpt2_batches, gpt2_trainer

    trainer = gpt2_trainer()
    view = RemedyView(trainer, waits_between_fits=True)
    trainer.amp.recorder.attach(view)
    notes = []

    def click_when_offered():  # a poller runs at each checkpoint, as a delivered click does
        if view.module is not None and not view.button.disabled:
            view.button.click()
        notes.append(view.note.value)

    trainer.control.pollers.append(click_when_offered)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = trainer.fit(gpt2_batches(4))
    assert view.button.description == "Run transformer.h.1.mlp.c_proj in fp32"
    assert history.skipped == [True, False, False, False]
    assert "runs in fp32 from the next step, until the fit ends" in notes[1]
    assert view.note.value.startswith("the fit ended: a click runs")  # offered for the next
