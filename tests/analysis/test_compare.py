"""compare() across modes: the same start per mode, the table, refusals, and every example model."""

from __future__ import annotations

import csv
import json
import math

import pytest

import mpnb.examples as ex
from mpnb.analysis.comparison import compare
from mpnb.errors import DeviceUnavailableError, InvalidChoiceError


def make_run(mode):
    trainer, train, test = ex.example_trainer(mode, "cpu", widths=(4, 8), batch_size=32, dashboard=None)
    return trainer, train, lambda fitted: ex.accuracy(fitted.model, test)


def test_compare_runs_each_mode_from_the_same_start_and_fills_the_table(tmp_path):
    result = compare(make_run, modes=["fp32", "bf16", "fp16"], steps=6, warmup=2, metric_name="test accuracy")
    rows = {row["mode"]: row for row in result.rows()}
    assert list(rows) == ["fp32", "bf16", "fp16"]
    for mode, row in rows.items():
        assert len(result.result(mode).history) == 8 and set(result.result(mode).history.mode) == {mode}
        assert row["median_step_s"] > 0 and 0 <= row["metric"] <= 1 and math.isfinite(row["final_loss"])
    assert rows["fp32"]["speedup_vs_fp32"] == 1.0
    assert result.result("fp16").history.loss_scale[0] == 2.0**16  # a real scaler in fp16 only
    assert "fp16 convolutions have no fast CPU kernels" in rows["fp16"]["notes"][0]
    first_losses = {mode: result.result(mode).history.loss[0] for mode in rows}
    assert abs(first_losses["fp32"] - first_losses["bf16"]) < 0.05  # same model, same first batch
    text = str(result)
    assert text.splitlines()[0].startswith("mode") and "test accuracy" in text.splitlines()[0]
    result.to_json(tmp_path / "r.json")
    result.to_csv(tmp_path / "r.csv")
    assert [m["mode"] for m in json.loads((tmp_path / "r.json").read_text())["modes"]] == ["fp32", "bf16", "fp16"]
    with open(tmp_path / "r.csv", newline="") as file:
        assert [row["mode"] for row in csv.DictReader(file)] == ["fp32", "bf16", "fp16"]


def test_a_mode_the_device_cannot_run_is_listed_with_the_reason():
    def refusing(mode):
        if mode == "fp16":
            raise DeviceUnavailableError("this device cannot autocast to fp16", ["bf16"])
        return make_run(mode)

    result = compare(refusing, modes=["bf16", "fp16"], steps=2, warmup=0)
    assert result.result("fp16").skipped_reason.startswith("this device cannot autocast to fp16")
    assert "not run: this device cannot autocast to fp16" in str(result)
    assert math.isnan(result.rows()[0]["speedup_vs_fp32"])  # no fp32 run to compare with


def test_bad_arguments_run_nothing():
    calls = []
    with pytest.raises(InvalidChoiceError, match="unknown mode 'fp8'"):
        compare(lambda mode: calls.append(mode), modes=["bf16", "fp8"])
    with pytest.raises(ValueError, match="steps must be a whole number >= 1, got 0"):
        compare(lambda mode: calls.append(mode), modes=["bf16"], steps=0)
    assert calls == []


@pytest.mark.parametrize("name", list(ex.MODELS))
def test_every_example_model_trains(name):
    trainer, train, _ = ex.example_trainer("bf16", "cpu", model=name, batch_size=32, dashboard=None)
    history = trainer.fit(train, max_steps=12)
    assert history.loss[-1] < history.loss[0]


def test_compare_inside_a_running_fit_is_refused_before_any_mode_runs():
    from mpnb.errors import MpnbError

    outer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    refusals = []

    def compare_from_a_callback():
        try:
            compare(lambda mode: ex.example_trainer(mode, "cpu", dashboard=None)[:2], ["fp32"], steps=2, progress=None)
        except MpnbError as error:
            refusals.append(str(error))

    outer.control.pollers.append(compare_from_a_callback)
    assert len(outer.fit(train, max_steps=2)) == 2
    assert len(refusals) == 3 and "a comparison cannot start inside it" in refusals[0]
