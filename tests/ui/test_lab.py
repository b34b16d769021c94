"""The precision lab (widgets/precision_lab.ipynb's app) driven headless, by its own buttons."""

from __future__ import annotations

from mpnb.ui.widgets.lab import PrecisionLab


def test_the_lab_runs_the_chosen_modes_and_shows_the_table():
    lab = PrecisionLab()
    lab.dashboard = None
    lab.model.value, lab.modes.value, lab.steps.value, lab.batch_size.value = (
        "mlp",
        ("fp32", "bf16"),
        5,
        32,
    )
    lab.run_button.click()
    assert [row["mode"] for row in lab.comparison.rows()] == ["fp32", "bf16"]
    assert "<table>" in lab.table.value and "test accuracy" in lab.table.value
    assert lab.status.value.startswith("done: 2 mode(s)") and not lab.run_button.disabled
    assert type(lab.comparison.result("bf16").history.meta["model"]).__name__ == "str"
    assert lab.comparison.result("bf16").history.meta["model"].startswith("DigitsMLP")
    lab.modes.value = ()
    lab.run_button.click()
    assert "pick at least one mode" in lab.status.value


def test_run_pressed_during_a_fit_is_refused_in_the_status_line_and_the_fit_goes_on():
    import torch

    import mpnb.examples as ex

    lab = PrecisionLab()
    lab.dashboard = None
    lab.model.value, lab.modes.value, lab.steps.value, lab.batch_size.value = (
        "mlp",
        ("bf16",),
        3,
        32,
    )
    trainer, train, _ = ex.example_trainer("tf32", "cpu", widths=(4, 8), dashboard=None)
    precision = []

    def press_run_once():  # what the kernel's event pump does when Run is clicked during a fit
        if trainer.amp.steps == 1:
            lab.run_button.click()
        precision.append(torch.get_float32_matmul_precision())

    trainer.control.pollers.append(press_run_once)
    history = trainer.fit(train, max_steps=3)
    assert (
        "not run: another fit is running on this thread" in lab.status.value
        and lab.comparison is None
    )
    assert not lab.run_button.disabled
    assert history.mode == ["tf32"] * 3 and precision[1:] == ["medium"] * (len(precision) - 1)
