"""The panel's *what if* button: the what-if on the last batch of the trainer's fit, shown
under the panel; off without a trainer, a note before the first batch."""

from __future__ import annotations

import pytest

import mpnb.examples as ex
from mpnb.precision.policy import session
from mpnb.ui.widgets.panel import ControlPanel

pytest.importorskip("torchao")


def test_the_button_shows_which_layers_each_format_keeps():
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    control = ControlPanel(trainer=trainer)
    try:
        control.whatif_button.click()
        assert "has taken no batch yet" in control.message_view.value
        trainer.fit(train, max_steps=1)
        control.whatif_button.click()
        shown = control.whatif_view.value
        assert "mpnb what-if" in shown and "classifier" in shown and "nvfp4: keep" in shown
        assert control.message_view.value == ""
    finally:
        control.close()
        session.reset()


def test_without_a_trainer_the_button_is_off():
    control = ControlPanel()
    try:
        assert control.whatif_button.disabled
    finally:
        control.close()
        session.reset()


def test_a_what_if_that_fails_says_so_and_leaves_no_old_result_on_show():
    """A callback's exception is swallowed by ipywidgets: the panel must say it, whatever its
    type, and not leave the previous result on show as if it were this one's."""
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    control = ControlPanel(trainer=trainer)
    try:
        trainer.fit(train, max_steps=1)
        control.whatif_button.click()
        assert "mpnb what-if" in control.whatif_view.value

        def broken_loss(outputs, targets):
            raise RuntimeError("the loss broke")

        trainer.loss_fn = broken_loss
        control.whatif_button.click()
        assert "the loss broke" in control.message_view.value
        assert "RuntimeError" in control.message_view.value
        assert control.whatif_view.value == ""
        trainer.step_fn = lambda model, batch: model(batch[0]).sum()  # an MpnbError case
        trainer.fit(train, max_steps=1)
        control.whatif_button.click()
        assert control.whatif_view.value == ""
    finally:
        control.close()
        session.reset()
