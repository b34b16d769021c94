"""The precision lab (widgets/precision_lab.ipynb's app) driven headless, by its own buttons."""

from __future__ import annotations

from mpnb.ui.widgets.lab import PrecisionLab


def test_the_lab_runs_the_chosen_modes_and_shows_the_table():
    lab = PrecisionLab()
    lab.dashboard = None
    lab.model.value, lab.modes.value, lab.steps.value, lab.batch_size.value = "mlp", ("fp32", "bf16"), 5, 32
    lab.run_button.click()
    assert [row["mode"] for row in lab.comparison.rows()] == ["fp32", "bf16"]
    assert "<table>" in lab.table.value and "test accuracy" in lab.table.value
    assert lab.status.value.startswith("done: 2 mode(s)") and not lab.run_button.disabled
    assert type(lab.comparison.result("bf16").history.meta["model"]).__name__ == "str"
    assert lab.comparison.result("bf16").history.meta["model"].startswith("DigitsMLP")
    lab.modes.value = ()
    lab.run_button.click()
    assert "pick at least one mode" in lab.status.value
