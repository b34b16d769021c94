"""compare() across modes: the same start per mode, the table, refusals, and every example model."""

from __future__ import annotations

import csv
import json
import math
import warnings

import pytest
import torch
from torch import nn

import mpnb
import mpnb.examples as ex
from mpnb.analysis.comparison import compare
from mpnb.errors import DeviceUnavailableError, InvalidChoiceError


def make_run(mode):
    trainer, train, test = ex.example_trainer(
        mode, "cpu", widths=(4, 8), batch_size=32, dashboard=None
    )
    return trainer, train, lambda fitted: ex.accuracy(fitted.model, test)


def test_compare_runs_each_mode_from_the_same_start_and_fills_the_table(tmp_path):
    result = compare(
        make_run, modes=["fp32", "bf16", "fp16"], steps=6, warmup=2, metric_name="test accuracy"
    )
    rows = {row["mode"]: row for row in result.rows()}
    assert list(rows) == ["fp32", "bf16", "fp16"]
    for mode, row in rows.items():
        assert len(result.result(mode).history) == 8 and set(result.result(mode).history.mode) == {
            mode
        }
        assert (
            row["median_step_s"] > 0
            and 0 <= row["metric"] <= 1
            and math.isfinite(row["final_loss"])
        )
    assert rows["fp32"]["speedup_vs_fp32"] == 1.0
    assert result.result("fp16").history.loss_scale[0] == 2.0**16  # a real scaler in fp16 only
    assert "fp16 convolutions have no fast CPU kernels" in rows["fp16"]["notes"][0]
    first_losses = {mode: result.result(mode).history.loss[0] for mode in rows}
    assert abs(first_losses["fp32"] - first_losses["bf16"]) < 0.05  # same model, same first batch
    text = str(result)
    assert text.splitlines()[1].startswith("mode") and "test accuracy" in text.splitlines()[1]
    result.to_json(tmp_path / "r.json")
    result.to_csv(tmp_path / "r.csv")
    assert [m["mode"] for m in json.loads((tmp_path / "r.json").read_text())["modes"]] == [
        "fp32",
        "bf16",
        "fp16",
    ]
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
    with pytest.raises(InvalidChoiceError, match="unknown mode 'fp5'"):
        compare(lambda mode: calls.append(mode), modes=["bf16", "fp5"])
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
            compare(
                lambda mode: ex.example_trainer(mode, "cpu", dashboard=None)[:2],
                ["fp32"],
                steps=2,
                progress=None,
            )
        except MpnbError as error:
            refusals.append(str(error))

    outer.control.pollers.append(compare_from_a_callback)
    assert len(outer.fit(train, max_steps=2)) == 2
    assert len(refusals) == 3 and "a comparison cannot start inside it" in refusals[0]


def sized_result(mode, sizes, seconds_per_sample, blocks=()):
    """A mode's result whose steps have these sizes and take this long per sample."""
    from mpnb.analysis.results import ModeResult
    from mpnb.training.history import History

    history = History()
    times = [n * seconds_per_sample for n in sizes]
    history.extend(
        {
            "step": list(range(1, len(sizes) + 1)),
            "step_time": times,
            "samples_per_s": [1 / seconds_per_sample] * len(sizes),
        }
    )
    return ModeResult(mode, history, blocks=list(blocks))


def test_an_epochs_short_steps_are_not_timed():
    """An epoch's short last window (``accumulate``) or batch is a quicker step of less work: timed
    beside the full ones, it read as a 30-50% spread blamed on other load on the machine."""
    result = sized_result("bf16", [24, 24, 24, 8] * 4, 1e-4)
    assert (
        result.timed_size == 24
        and result.step_times.count == 12
        and result.step_times.spread_warning == ""
    )
    assert result.samples_per_s == pytest.approx(1e4)


def test_the_full_steps_are_timed_when_short_ones_are_as_many():
    """One full and one short batch an epoch: the full steps are timed, whichever comes first."""
    for sizes in ([438, 1000] * 4, [1000, 438] * 4):
        result = sized_result("fp32", sizes, 1e-6)
        assert result.timed_size == 1000 and result.median_step_s == pytest.approx(1e-3)


def test_every_step_is_timed_where_sizes_vary_or_are_unknown():
    assert (
        sized_result("fp32", list(range(4, 40, 3)), 1e-4).step_times.count == 12
    )  # bucketed lengths
    unknown = sized_result("fp32", [24, 24, 24, 8] * 4, 1e-4)
    unknown.history = type(unknown.history)()
    unknown.history.extend({"step": list(range(1, 17)), "step_time": [0.01] * 16})
    assert unknown.timed_size is None and unknown.step_times.count == 16


def test_a_speedup_compares_steps_of_the_same_size():
    """A mode that stopped early (a diverging run) timed fewer steps: the speedup still sets full
    steps against full steps. Both run at the same speed per sample: no speedup."""
    from mpnb.analysis.results import Comparison

    fp32 = sized_result("fp32", [4, 8, 8, 4, 8, 8], 1e-4, blocks=[(0, 3), (3, 6)])
    bf16 = sized_result("bf16", [4, 8], 1e-4, blocks=[(0, 2)])
    assert Comparison([fp32, bf16], steps=6, warmup=0).speedup("bf16").median == pytest.approx(1.0)


def test_compare_with_accumulation_times_full_windows_only():
    def accumulating_run(mode):
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        generator = torch.Generator().manual_seed(1)
        data = [
            (torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
            for _ in range(7)
        ]
        trainer = mpnb.Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss, mode=mode, device="cpu",
            dashboard=None, accumulate=3,
        )  # fmt: skip
        return trainer, data

    row = compare(accumulating_run, ["fp32"], steps=9, warmup=0, progress=None).rows()[0]
    assert row["timed_steps"] == 6  # three epochs of two full windows and a short one


def _noisy_result(mode, seconds, notes=()):
    from mpnb.analysis.results import ModeResult
    from mpnb.training.history import History

    history = History()
    steps = 12
    times = [seconds * (1 + (i % 4)) for i in range(steps)]  # a spread of ~70%: a busy machine
    history.extend({"step": list(range(1, steps + 1)), "loss": [2.0] * steps, "step_time": times})
    blocks = [(i, i + 2) for i in range(0, steps, 2)]
    return ModeResult(mode, history, blocks=blocks, notes=list(notes), metric=0.5)


def test_the_terminal_table_fits_120_columns_and_says_a_shared_note_once(tmp_path):
    from mpnb.analysis.results import Comparison, ModeResult
    from mpnb.precision.modes.base import EMULATED

    slow = "fp16 convolutions on a CPU run slowly: measured 3.1x bf16's step here"
    comparison = Comparison(
        [
            _noisy_result("fp32", 0.020),
            _noisy_result("tf32", 0.020),
            _noisy_result("fp16", 0.020, [slow]),
            _noisy_result("bf16", 0.010),
            ModeResult("fp8", None, skipped_reason="torchao is not installed: pip install torchao"),
        ],
        steps=12,
        warmup=0,
        metric_name="a long metric name: validation accuracy",
    )
    text = str(comparison)
    assert max(len(line) for line in text.splitlines()) <= 120, text
    assert text.count("other load on the machine") == 1, text  # said once, under the table
    assert text.count(slow) == 1 and "torchao is not installed" in text, text
    emulated = Comparison(
        [_noisy_result("fp32", 0.02), _noisy_result("fp8", 0.05, ["fp8 is emulated here"])],
        steps=12,
        warmup=0,
    )
    emulated.results[1].verdict = EMULATED  # as the fp8 mode gives it on a CPU
    assert str(emulated).count("emulated") == 1, str(emulated)
    # HTML, CSV and JSON keep every column and every row's own notes
    page = comparison._repr_html_()
    assert page.count("other load on the machine") == 4 and "peak memory of the run" in page
    comparison.to_csv(tmp_path / "c.csv")
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    assert all("other load" in row["notes"] for row in rows[:4]) and slow in rows[2]["notes"]


@pytest.mark.parametrize("first", [["fp32", "bf16"], "trainer"])
def test_a_list_of_modes_or_a_trainer_in_make_runs_place_is_named_with_the_order(first):
    if first == "trainer":
        first, _, _ = ex.example_trainer("fp32", "cpu", widths=(4, 8), dashboard=None)
    with pytest.raises(mpnb.MpnbError, match=r"make_run takes a function, make_run\(mode\).*"
                       r"compare\(make_run, modes, steps\)"):  # fmt: skip
        compare(first, ["fp32"], steps=2)


def test_a_diverged_runs_final_loss_reads_nan_and_a_note_says_it_diverged():
    # its final loss read "-", the mark of no value, and no note said the run diverged
    def make_run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        trainer = mpnb.Trainer(
            model, torch.optim.SGD(model.parameters(), 10.0), nn.functional.mse_loss,
            mode=mode, device="cpu", dashboard=None,
        )  # fmt: skip
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(8, 4, generator=g) * 10, torch.randn(8, 1, generator=g) * 100)] * 8
        return trainer, data, lambda trainer: math.inf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the health watch's own warning of the NaN loss
        result = mpnb.compare(make_run, ["fp32"], steps=6, warmup=1, progress=None)
    cells = result._text_table().splitlines()[2].split()
    assert cells[-3:] == ["nan", "inf", "0"]  # final loss, metric, skipped steps
    assert any("its loss is not finite from step" in note and "diverged" in note
               for note in result.result("fp32").notes)  # fmt: skip
