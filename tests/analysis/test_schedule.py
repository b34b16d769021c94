"""Interleaved comparisons: each mode's run exact as if alone, memory of its own turns, timings with spread."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from torch import nn

import mpnb
import mpnb.examples as ex
from mpnb.analysis.comparison import compare
from mpnb.analysis.results import NO_EFFECT, Comparison, ModeResult
from mpnb.training.history import History


def dropout_run(mode):
    """A run that draws random numbers every step (dropout), seeded only when it is built."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 10)
    )
    train, _ = ex.digits(batch_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = mpnb.Trainer(
        model, optimizer, nn.functional.cross_entropy, mode=mode, device="cpu", dashboard=None
    )
    return trainer, train


def test_interleaved_turns_train_each_mode_exactly_as_it_trains_alone():
    together = compare(dropout_run, ["fp32", "bf16"], steps=7, warmup=2, block=2, progress=None)
    for mode in ("fp32", "bf16"):
        alone = compare(dropout_run, [mode], steps=7, warmup=2, progress=None)
        assert together.result(mode).history.loss == alone.result(mode).history.loss, mode
    assert together.result("fp32").blocks == [
        (2, 4),
        (4, 6),
        (6, 8),
        (8, 9),
    ]  # rows of each timed turn


def test_one_after_another_is_the_same_runs_too():
    interleaved = compare(dropout_run, ["bf16", "fp32"], steps=5, warmup=1, block=1, progress=None)
    sequential = compare(dropout_run, ["bf16", "fp32"], steps=5, warmup=1, block=5, progress=None)
    assert sequential.result("bf16").blocks == [(1, 6)]
    for mode in ("bf16", "fp32"):
        assert interleaved.result(mode).history.loss == sequential.result(mode).history.loss


def test_the_users_random_state_is_untouched():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    compare(dropout_run, ["fp32", "bf16"], steps=3, warmup=1, block=1, progress=None)
    assert torch.equal(torch.random.get_rng_state(), before)


class _Hungry(nn.Module):
    """Holds a 256 MiB temporary in every fp32 forward (autocast off), nothing extra otherwise."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, images):
        x = images.flatten(1)
        if not torch.is_autocast_enabled("cpu"):
            scratch = torch.ones(64 * 2**20)  # written, so resident: 256 MiB
            x = x + scratch[-1] - 1
            del scratch
        return self.linear(x)


def _hungry_run(mode):
    torch.manual_seed(0)
    model = _Hungry()
    train, _ = ex.digits(batch_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return mpnb.Trainer(
        model, optimizer, nn.functional.cross_entropy, mode=mode, device="cpu", dashboard=None
    ), train


@pytest.mark.parametrize(
    "order", [["fp32", "bf16"], ["bf16", "fp32"]], ids=["fp32-first", "bf16-first"]
)
def test_a_large_temporary_counts_for_its_own_mode_only_whatever_the_order(order):
    result = compare(_hungry_run, order, steps=4, warmup=1, block=1, progress=None)
    rows = {row["mode"]: row for row in result.rows()}
    mib = 2**20
    assert rows["fp32"]["added_memory"] > 200 * mib, rows["fp32"]
    assert rows["bf16"]["added_memory"] < 100 * mib, rows["bf16"]
    assert rows["fp32"]["peak_memory"] - rows["bf16"]["peak_memory"] > 150 * mib
    table = str(result)
    assert "peak memory" in table and "of the run" in table and "added by" in table


def test_each_mode_reports_median_and_iqr_in_table_csv_and_json(tmp_path):
    result = compare(dropout_run, ["fp32", "bf16"], steps=8, warmup=1, progress=None)
    for row in result.rows():
        assert 0 <= row["step_time_iqr_s"] < row["median_step_s"] * 10 and row["timed_steps"] == 8
    assert "IQR" in str(result).splitlines()[0] and "(ms)" in str(result).splitlines()[1]
    result.to_csv(tmp_path / "c.csv")
    result.to_json(tmp_path / "c.json")
    with open(tmp_path / "c.csv", newline="") as file:
        assert all(float(row["step_time_iqr_s"]) >= 0 for row in csv.DictReader(file))
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["block"] == 1 and all(row["step_time_iqr_s"] >= 0 for row in data["modes"])
    assert {"speedup_low", "speedup_high", "speedup_verdict", "added_memory"} <= set(
        data["modes"][1]
    )


def _timed(mode, times, block=2, **fields):
    history = History()
    history.extend(
        {"step": list(range(1, len(times) + 1)), "loss": [1.0] * len(times), "step_time": times}
    )
    blocks = [(i, min(i + block, len(times))) for i in range(0, len(times), block)]
    return ModeResult(mode, history, blocks=blocks, **fields)


def test_a_speedup_whose_interval_holds_one_reads_no_clear_difference():
    fp32 = _timed("fp32", [0.010, 0.010, 0.012, 0.012, 0.010, 0.010, 0.011, 0.011])
    same = _timed("bf16", [0.011, 0.011, 0.011, 0.011, 0.011, 0.011, 0.010, 0.010])
    faster = _timed("fp16", [0.005, 0.005, 0.006, 0.006, 0.005, 0.005, 0.0055, 0.0055])
    rows = {row["mode"]: row for row in Comparison([fp32, same, faster], steps=8, warmup=0).rows()}
    assert rows["bf16"]["speedup_low"] <= 1.0 <= rows["bf16"]["speedup_high"]
    assert rows["bf16"]["speedup_verdict"] == "no clear difference"
    assert rows["fp16"]["speedup_verdict"] == "faster" and rows["fp16"]["speedup_low"] > 1.5
    assert rows["fp32"]["speedup_verdict"] == "" and rows["fp32"]["speedup_vs_fp32"] == 1.0
    text = str(Comparison([fp32, same, faster], steps=8, warmup=0))
    assert "- bf16: no clear difference from fp32" in text and "2.00x (" in text


def test_a_mode_that_changes_nothing_here_says_so_instead_of_a_speedup():
    fp32 = _timed("fp32", [0.010] * 4)
    tf32 = _timed("tf32", [0.009] * 4, verdict=NO_EFFECT)
    comparison = Comparison([fp32, tf32], steps=4, warmup=0)
    assert comparison.rows()[1]["speedup_verdict"] == NO_EFFECT
    assert NO_EFFECT in str(comparison) and "1.11x" not in str(comparison)


def test_tf32_is_inert_exactly_where_fp32_math_has_no_measured_effect():
    result = compare(dropout_run, ["fp32", "tf32"], steps=2, warmup=0, progress=None)
    has_effect = mpnb.precision.backends.backend_for("cpu").has_fast_fp32_math()
    assert result.result("tf32").verdict == ("" if has_effect else NO_EFFECT)


def test_an_unsteady_mode_is_warned_about_with_the_likely_cause():
    wobbly = _timed("fp32", [0.010, 0.020, 0.010, 0.030, 0.010, 0.020])
    notes = Comparison([wobbly], steps=6, warmup=0).rows()[0]["notes"]
    assert any("other load on the machine" in note and "--steps" in note for note in notes)
    steady = _timed("fp32", [0.010, 0.0101, 0.010, 0.0102, 0.010, 0.0101])
    assert Comparison([steady], steps=6, warmup=0).rows()[0]["notes"] == []


def test_one_round_gives_a_speedup_without_an_interval():
    fp32, bf16 = _timed("fp32", [0.01, 0.01], block=2), _timed("bf16", [0.005, 0.005], block=2)
    row = Comparison([fp32, bf16], steps=2, warmup=0).rows()[1]
    assert row["speedup_vs_fp32"] == 2.0 and row["speedup_verdict"] == ""


def test_a_bad_block_runs_nothing():
    calls = []
    with pytest.raises(ValueError, match="block must be a whole number >= 1, got 0"):
        compare(lambda mode: calls.append(mode), ["fp32"], steps=2, block=0)
    assert calls == []


def test_a_run_that_ends_early_keeps_its_rows_and_the_others_go_on():
    def short_run(mode):
        trainer, train = dropout_run(mode)
        return trainer, iter(
            list(train)[:3]
        ) if mode == "bf16" else train  # bf16's data: 3 batches, once

    result = compare(short_run, ["fp32", "bf16"], steps=6, warmup=1, block=2, progress=None)
    assert len(result.result("fp32").history) == 7
    bf16 = result.result("bf16")
    assert not math.isnan(bf16.median_step_s) and len(bf16.history) == 3 and bf16.blocks == [(1, 3)]


def loader_run(mode):
    """A DataLoader that shuffles, and dropout: both draw from torch's random state."""
    trainer, train = dropout_run(mode)
    images, labels = zip(*list(train))
    dataset = torch.utils.data.TensorDataset(torch.cat(images), torch.cat(labels))
    return trainer, torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)


def test_a_shuffling_dataloader_gives_the_same_run_whatever_the_turns():
    """A DataLoader draws a seed at each iter(data): no fit calls it just to ask whether the data is
    one-shot, so turns of any length draw the shuffles of one plain fit."""
    losses = {
        block: compare(loader_run, ["fp32"], steps=9, warmup=2, block=block, progress=None)
        .result("fp32")
        .history.loss
        for block in (2, 9)
    }
    torch.manual_seed(0)  # what compare finds, for the plain fit below
    trainer, data = loader_run("fp32")
    trainer.fit(data, epochs=1, max_steps=11)
    assert losses[2] == losses[9] == trainer.history.loss


def unseeded_run(mode):
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 10)
    )  # drawn from whatever random state is in force
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy, mode=mode
    )
    trainer.dashboard = None
    return trainer, ex.digits(batch_size=32)[0]


def test_every_mode_is_built_from_the_random_state_the_comparison_found():
    torch.manual_seed(5)
    together = compare(unseeded_run, ["fp32", "bf16"], steps=3, warmup=1, progress=None)
    torch.manual_seed(5)
    alone = compare(unseeded_run, ["bf16"], steps=3, warmup=1, progress=None)
    assert together.result("bf16").history.loss == alone.result("bf16").history.loss


def test_runs_that_are_not_the_modes_own_are_refused_with_the_reason():
    shared = dropout_run("fp32")
    with pytest.raises(ValueError, match="share one Trainer"):
        compare(lambda mode: shared, ["fp32", "tf32"], steps=2, warmup=0, progress=None)
    with pytest.raises(ValueError, match="built for mode 'bf16' trains in 'fp32'"):
        compare(
            lambda mode: dropout_run("fp32"), ["fp32", "bf16"], steps=2, warmup=0, progress=None
        )
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def same_model(mode):
        optimizer = torch.optim.SGD(model.parameters(), 0.1)
        trainer = mpnb.Trainer(
            model, optimizer, nn.functional.cross_entropy, mode=mode, dashboard=None
        )
        return trainer, ex.digits(batch_size=32)[0]

    with pytest.raises(ValueError, match="share one model"):
        compare(same_model, ["fp32", "bf16"], steps=1, warmup=0, progress=None)


def test_a_stop_on_a_nonfinite_loss_is_not_undone_by_the_next_turn():
    def nan_at_step_3(mode):
        trainer, train = dropout_run(mode)
        trainer.amp.health.on_nonfinite = "stop"
        batches = list(train)
        x, y = batches[2]
        batches[2] = (torch.full_like(x, float("nan")), y)
        return trainer, batches

    result = compare(nan_at_step_3, ["fp32"], steps=4, warmup=1, block=2, progress=None).result(
        "fp32"
    )
    assert (
        len(result.history) == 3 and [e["kind"] for e in result.history.events].count("stop") == 1
    )
    assert any("ended after 2 of 4 timed steps" in note for note in result.notes)


def test_epochs_are_planned_in_optimizer_steps_and_loaders_without_length_work():
    def accumulating(mode):
        trainer, train = dropout_run(mode)
        trainer.amp.accumulate = 3
        return trainer, list(train)[:6]  # 2 optimizer steps an epoch

    result = compare(accumulating, ["fp32"], steps=5, warmup=1, progress=None).result("fp32")
    assert len(result.history) == 6 and result.notes == []

    class Stream(torch.utils.data.IterableDataset):  # a DataLoader over it has no length
        def __iter__(self):
            return iter([(x, y) for x, y in list(ex.digits(batch_size=32)[0])[:4]])

    def streaming(mode):
        return dropout_run(mode)[0], torch.utils.data.DataLoader(Stream(), batch_size=None)

    short = compare(streaming, ["fp32"], steps=5, warmup=1, progress=None).result("fp32")
    assert len(short.history) == 4 and any(
        "ended after 3 of 5 timed steps" in note for note in short.notes
    )


def test_a_warmup_longer_than_the_data_leaves_no_warmup_step_timed():
    def two_batches(mode):
        trainer, train = dropout_run(mode)
        return trainer, iter(list(train)[:2])

    result = compare(two_batches, ["fp32", "bf16"], steps=4, warmup=3, progress=None)
    row = result.rows()[1]
    assert (
        math.isnan(row["median_step_s"])
        and math.isnan(row["speedup_vs_fp32"])
        and row["timed_steps"] == 0
    )


def test_mode_lists_are_checked_before_anything_runs():
    calls = []
    for modes, words in (
        (["bf16", "bf16"], "'bf16' is named twice"),
        ([], "names no mode"),
        (",", "names no mode"),
    ):
        with pytest.raises(ValueError, match=words):
            compare(lambda mode: calls.append(mode), modes, steps=2)
    for kwargs, words in (
        ({"block": 2.5}, "block must be a whole number >= 1, got 2.5"),
        ({"steps": "3"}, "got '3'"),
    ):
        with pytest.raises(ValueError, match=words):
            compare(lambda mode: calls.append(mode), ["fp32"], **kwargs)
    assert calls == []
    assert [
        r.mode for r in compare(dropout_run, "fp32, bf16", steps=1, warmup=0, progress=None).results
    ] == [
        "fp32",
        "bf16",
    ]


def test_modes_are_taken_as_trainer_mode_takes_them_dtypes_included():
    # compare and max_batch_size raised AttributeError: 'torch.dtype' object has no attribute 'strip'
    from mpnb.analysis.comparison import mode_labels
    from mpnb.errors import InvalidChoiceError

    assert mode_labels([torch.float32, torch.bfloat16]) == ["fp32", "bf16"]
    assert mode_labels(torch.float16) == ["fp16"]
    with pytest.raises(InvalidChoiceError, match="unknown mode 'None'"):
        mode_labels(["fp32", None])


def test_asking_for_a_mode_that_was_not_compared_names_the_ones_that_were(tmp_path):
    comparison = Comparison([_timed("fp32", [0.01] * 2)], steps=2, warmup=0)
    with pytest.raises(KeyError, match=r"'fp16' was not compared; this comparison has \['fp32'\]"):
        comparison.result("fp16")
    comparison.results[0].metric = math.inf
    comparison.to_json(tmp_path / "c.json")
    assert (
        json.loads((tmp_path / "c.json").read_text(), parse_constant=lambda c: pytest.fail(c))[
            "modes"
        ][0]["metric"]
        is None
    )


def test_runs_sharing_a_data_iterator_or_a_module_are_refused_naming_what():
    # each mode trained on the batches the other left, or on the other's trained backbone, and
    # the table printed as if they were comparable
    batches = [(x, y) for x, y in ex.digits(batch_size=32)[0]]
    shared_batches = (batch for batch in batches * 3)

    def fresh_trainer(mode, model):
        optimizer = torch.optim.SGD(model.parameters(), 0.1)
        return mpnb.Trainer(
            model, optimizer, nn.functional.cross_entropy, mode=mode, dashboard=None
        )

    def one_generator(mode):
        return fresh_trainer(mode, nn.Sequential(nn.Flatten(), nn.Linear(64, 10))), shared_batches

    with pytest.raises(ValueError, match="share one data iterator"):
        compare(one_generator, ["fp32", "bf16"], steps=2, warmup=0, progress=None)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(64, 16))

    def shared_backbone(mode):
        return fresh_trainer(mode, nn.Sequential(backbone, nn.Linear(16, 10))), batches

    with pytest.raises(ValueError, match=r"share the parameter '0\.1\.weight'"):
        compare(shared_backbone, ["fp32", "bf16"], steps=2, warmup=0, progress=None)
    # each with its own generator over the same list: fine
    own = compare(
        lambda mode: (fresh_trainer(mode, nn.Sequential(nn.Flatten(), nn.Linear(64, 10))), iter(batches)),
        ["fp32", "bf16"], steps=2, warmup=0, progress=None,
    )  # fmt: skip
    assert [len(result.history) for result in own.results] == [2, 2]


def test_a_metric_that_fails_for_one_mode_keeps_the_comparison_and_names_the_mode():
    # a metric that raised threw the whole finished comparison away, with no mode named
    def make_run(mode):
        trainer, data = dropout_run(mode)

        def metric(trained):
            if trained.mode.label == "bf16":
                raise ZeroDivisionError("division by zero")
            return 0.5

        return trainer, data, metric

    with pytest.warns(RuntimeWarning, match="bf16: its metric raised ZeroDivisionError"):
        result = compare(make_run, ["fp32", "bf16"], steps=2, warmup=0, progress=None)
    assert result.result("fp32").metric == 0.5 and math.isnan(result.result("bf16").metric)
    assert any("metric raised ZeroDivisionError" in note for note in result.result("bf16").notes)


@pytest.mark.parametrize(
    ("value", "said"),
    [("0.5", "a str"), (None, "a NoneType"), (torch.ones(2), "a tensor of 2 values")],
)
def test_a_metric_that_returns_no_number_is_said_to_return_it(value, said):
    # "0.5" was taken as 0.5, and None read "its metric raised TypeError" (float's error)
    def make_run(mode):
        trainer, data = dropout_run(mode)
        return trainer, data, lambda trained: value

    with pytest.warns(RuntimeWarning, match=f"fp32: its metric returned {said}, not a number"):
        result = compare(make_run, ["fp32"], steps=1, warmup=0, progress=None)
    assert math.isnan(result.result("fp32").metric)


@pytest.mark.parametrize("ask", ["compare", "memory", "max_batch_size"])
def test_a_make_run_of_no_parameter_is_named_before_it_is_called(ask):
    # met Python's "<lambda>() takes 0 positional arguments but 1 was given"
    from mpnb.errors import MpnbError

    call = {
        "compare": lambda f: compare(f, ["fp32"], steps=1),
        "memory": lambda f: mpnb.memory(f, ["fp32"], measure=False),
        "max_batch_size": lambda f: mpnb.max_batch_size(f, ["fp32"]),
    }[ask]
    with pytest.raises(MpnbError, match=r"make_run takes a function, make_run\(mode\) .*<lambda>\(\) "
                       r"cannot be called with one argument: give it one parameter"):  # fmt: skip
        call(lambda: dropout_run("fp32"))
