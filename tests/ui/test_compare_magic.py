"""%%compare in a real IPython shell, and the comparison's progress views."""

from __future__ import annotations

import io
import json
import math
from html.parser import HTMLParser

import pytest
import torch

import mpnb
import mpnb.examples as ex
from mpnb.analysis.comparison import compare
from mpnb.precision.policy import session
from mpnb.training.history import History
from mpnb.ui.plots.compare_progress import LiveComparison, TextComparison
from mpnb.ui.plots.compare_report import MODE_TRACES
from tests.conftest import policy_state, run, run_expecting, torch_state, usage_error

TRAIN_CELL = """
trainer, train, test = mpnb.examples.example_trainer(widths=(4, 8), batch_size=32, dashboard="text")
seen_modes.append((mpnb.get_mode().label, torch.is_autocast_enabled("cpu"), torch.get_float32_matmul_precision()))
trainer.fit(train, epochs=50)
"""


@pytest.fixture
def shell(ip):
    run(ip, "import mpnb\nseen_modes = []")
    return ip


def test_the_cell_runs_once_per_mode_in_that_mode_within_the_step_budget(shell, capsys):
    run(shell, "%amp bf16")
    before = torch_state()
    random_before = torch.random.get_rng_state()
    comparison = run(
        shell,
        "%%compare --modes fp32,tf32,bf16 --steps 4 --warmup 2 --progress none "
        "--metric 'mpnb.examples.accuracy(trainer.model, test)'\n" + TRAIN_CELL,
    )
    assert [row["mode"] for row in comparison.rows()] == ["fp32", "tf32", "bf16"]
    assert shell.user_ns["_comparison"] is comparison
    seen = shell.user_ns["seen_modes"]
    assert [mode for mode, _, _ in seen] == ["fp32", "tf32", "bf16"]
    assert [autocast for _, autocast, _ in seen] == [
        False,
        False,
        True,
    ]  # the %amp bf16 cell does not leak
    assert (
        seen[0][2] == "highest" and seen[1][2] != "highest"
    )  # each mode's fp32-math flags while it runs
    for mode in ("fp32", "tf32", "bf16"):
        history = comparison.result(mode).history
        assert len(history) == 6 and set(history.mode) == {mode}  # epochs=50 held to warmup + steps
        assert comparison.result(mode).timed_from == 2
    rows = {row["mode"]: row for row in comparison.rows()}
    assert all(0 <= row["metric"] <= 1 for row in rows.values())
    header = str(comparison).splitlines()[1]
    assert (
        " accuracy " in header and "mpnb.examples" not in header
    )  # a short name, not the expression
    first_losses = [comparison.result(mode).history.loss[0] for mode in ("fp32", "tf32")]
    assert first_losses[0] == first_losses[1]  # same seed, same model, same first batch
    printed = capsys.readouterr().out
    assert (
        "training DigitsCNN" not in printed and "finished:" not in printed
    )  # the trainer's own dashboard gave way
    assert mpnb.get_mode() == "bf16" and torch_state() == before
    assert torch.equal(torch.random.get_rng_state(), random_before)


def test_an_error_in_the_cell_restores_everything(shell):
    run(shell, "%amp fp16")
    before = policy_state()
    run_expecting(
        shell,
        "%%compare --modes fp32,bf16 --steps 2 --progress none\nraise KeyError('boom')",
        KeyError,
    )
    assert policy_state() == before
    run_expecting(
        shell,
        "%%compare --modes tf32 --steps 2 --progress none\nraise KeyboardInterrupt",
        KeyboardInterrupt,
    )
    assert policy_state() == before


def test_a_cell_that_trains_nothing_is_told_how(shell):
    message = usage_error(shell, "%%compare --modes bf16 --steps 2 --progress none\nx = 1")
    assert "trained nothing through mpnb.Trainer.fit" in message


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("--modes fp32,int4", "'int4'"),
        ("--modes ,", "names no mode"),
        ("--steps 0", "--steps must be >= 1, got 0"),
        ("--warmup -1", "--warmup must be >= 0, got -1"),
        ("--block 0", "--block must be >= 1, got 0"),
        ("--progress fancy", "'fancy'"),
        ("--metric 'acc('", "not a Python expression"),
        ("--colour red", "--colour"),
        # a seed torch cannot take, and an --out that is a file, were found after every mode
        # trained (torch's "Overflow when unpacking long long"; a bare FileExistsError)
        ("--seed -1", "--seed must be a whole number from 0 to 18446744073709551615, got -1"),
        ("--seed 99999999999999999999999", "from 0 to 18446744073709551615"),
        ("--out setup.cfg", "--out 'setup.cfg' cannot be created or written"),
    ],
)
def test_bad_input_runs_nothing_and_changes_nothing(shell, line, words, tmp_path, monkeypatch):
    (tmp_path / "setup.cfg").write_text("a file, not a folder")
    monkeypatch.chdir(tmp_path)
    before = policy_state()
    assert words in usage_error(shell, f"%%compare {line}\n" + TRAIN_CELL)
    assert policy_state() == before and shell.user_ns["seen_modes"] == []


def test_out_writes_the_report_files(shell, tmp_path, capsys):
    run(
        shell,
        f"%%compare --modes fp32,bf16 --steps 2 --warmup 0 --progress none --out {tmp_path}\n"
        + TRAIN_CELL,
    )
    assert "report.html" in capsys.readouterr().out
    data = json.loads((tmp_path / "comparison.json").read_text())
    assert [row["mode"] for row in data["modes"]] == ["fp32", "bf16"]
    assert (tmp_path / "report.html").read_text().count("<tr>") == 3


def test_help_names_every_option(shell):
    help_text = shell.magics_manager.magics["cell"]["compare"].__doc__
    assert all(
        option in help_text
        for option in ("--modes", "--steps", "--warmup", "--seed", "--metric", "--out")
    )


def test_unload_removes_compare_too(shell):
    run(shell, "%unload_ext mpnb")
    assert "not found" in usage_error(shell, "%%compare\n1")


def test_mode_scope_restores_the_session_even_when_the_mode_is_refused():
    mpnb.set_mode("tf32")
    before = policy_state()
    with session.mode_scope("fp32"):
        assert mpnb.get_mode() == "fp32" and torch.get_float32_matmul_precision() == "highest"
    assert policy_state() == before
    with pytest.raises(mpnb.InvalidChoiceError), session.mode_scope("int4"):
        pass
    assert policy_state() == before


def make_run(mode):
    trainer, train, _ = ex.example_trainer(
        mode, "cpu", widths=(4, 8), batch_size=32, dashboard=None
    )
    return trainer, train


def test_text_progress_shows_a_bar_per_mode_and_each_end():
    out = io.StringIO()

    def refusing(mode):
        if mode == "fp16":
            raise mpnb.DeviceUnavailableError("no fp16 here", ["bf16"])
        return make_run(mode)

    compare(
        refusing,
        ["fp32", "fp16", "bf16"],
        steps=3,
        warmup=1,
        progress=TextComparison(["fp32", "fp16", "bf16"], interval=0, stream=out),
    )
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("fp32  [#####---------------]  1/4 steps")
    assert any(line.startswith("fp32  [####################]  4/4 steps") for line in lines)
    assert "fp16  not run: no fp16 here; available here: bf16" in lines
    assert lines[-1].startswith("bf16  done: 4 steps, median ")


def test_text_progress_reads_a_cold_first_step_as_that_and_the_rate_from_the_rest():
    out = io.StringIO()
    bar = TextComparison(["bf16"], interval=0, stream=out).sink_for("bf16", 100)
    history = History()
    history.extend({"step": [1], "loss": [2.3], "step_time": [1.2]})  # warming up: 1.2 s
    bar.update(history)
    assert "first step 1200.0 ms" in out.getvalue() and "ms/step" not in out.getvalue()
    history.extend({"step": [2, 3, 4], "loss": [2.2, 2.1, 2.0], "step_time": [0.08, 0.5, 0.09]})
    bar.update(history)
    # the rate of the steps after the first: their median (one slow step moves it little)
    assert out.getvalue().splitlines()[-1].endswith("4/100 steps  90.0 ms/step  loss 2")


class _Tables(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.cells: list[str] = []

    def handle_data(self, data: str) -> None:
        self.cells.append(data)


def test_live_progress_overlays_each_mode_as_it_trains():
    view = LiveComparison(["fp32", "bf16"], "demo", min_interval=0, max_share=0)
    per_mode = len(MODE_TRACES)
    drawn_when_fp32_ended = {}

    def traces(figure, mode_index):
        return dict(
            zip(MODE_TRACES, figure.data[mode_index * per_mode : (mode_index + 1) * per_mode])
        )

    def on_result(result):
        if result.mode == "fp32":
            drawn_when_fp32_ended.update(
                {m: len(traces(view.figure, i)["loss"].x) for i, m in enumerate(["fp32", "bf16"])}
            )

    result = compare(
        make_run, ["fp32", "bf16"], steps=5, warmup=1, block=1, progress=view, on_result=on_result
    )
    # Turns alternate fp32, bf16 | bf16, fp32 | ...: when fp32 ends (round 5) bf16 has 4 of its 5 timed steps.
    assert drawn_when_fp32_ended == {"fp32": 6, "bf16": 5}
    fp32, bf16 = traces(view.figure, 0), traces(view.figure, 1)
    assert list(fp32["loss"].x) == list(range(1, 7)) and list(bf16["loss"].x) == list(range(1, 7))
    assert list(bf16["loss"].y) == result.result("bf16").history.loss
    fp32_loss = result.result("fp32").history.loss
    assert list(bf16["loss - fp32"].y) == [
        b - a for a, b in zip(fp32_loss, result.result("bf16").history.loss)
    ]
    assert len(fp32["loss - fp32"].x) == 0  # fp32 is the reference
    assert list(fp32["step time"].x) == list(range(2, 7))  # the timed steps
    assert math.isclose(
        fp32["step time"].y[-1], result.result("fp32").history.step_time[-1] * 1e3, rel_tol=1e-6
    )
    assert len(fp32["step time (smoothed)"].y) == 5 and len(fp32["memory in use"].y) == 6
    assert (
        fp32["loss"].line.color != bf16["loss"].line.color
        and fp32["loss"].line.dash != bf16["loss"].line.dash
    )
    assert [t.name for t in view.figure.data if t.showlegend] == [
        "fp32",
        "bf16",
    ]  # one legend entry per mode
    parser = _Tables()
    parser.feed(view.table.value)
    assert "fp32" in parser.cells and "bf16" in parser.cells and "speedup vs fp32" in parser.cells
    assert view.status.value == "done: 2 of 2 mode(s) ran"


def test_each_modes_metric_reads_the_names_that_mode_bound(shell):
    comparison = run(
        shell,
        "%%compare --modes fp32,bf16 --steps 3 --warmup 1 --block 1 --progress none "
        "--metric \"trainer.history.mode[-1] == 'bf16'\" --metric-name 'is bf16'\n" + TRAIN_CELL,
    )
    rows = {row["mode"]: row for row in comparison.rows()}
    assert (rows["fp32"]["metric"], rows["bf16"]["metric"]) == (0.0, 1.0)
    assert "is bf16" in str(comparison).splitlines()[1]
    assert (
        shell.user_ns["trainer"].mode.label == "bf16"
    )  # the namespace ends as the last mode left it


def test_the_timed_turns_continue_the_cells_fit_exactly(shell):
    """Interleaved turns of the cell's fit give the losses one uninterrupted fit gives."""
    interleaved = run(
        shell,
        "%%compare --modes fp32,bf16 --steps 6 --warmup 2 --block 1 --progress none\n" + TRAIN_CELL,
    )
    alone = run(
        shell,
        "%%compare --modes bf16 --steps 6 --warmup 2 --block 6 --progress none\n" + TRAIN_CELL,
    )
    assert interleaved.result("bf16").history.loss == alone.result("bf16").history.loss
    assert len(interleaved.result("bf16").blocks) == 6


def test_no_warmup_still_times_every_step(shell):
    comparison = run(
        shell, "%%compare --modes fp32,bf16 --steps 3 --warmup 0 --progress none\n" + TRAIN_CELL
    )
    assert [len(r.history) for r in comparison.results] == [3, 3] and comparison.rows()[1][
        "timed_steps"
    ] == 3


def test_a_metric_with_its_own_scope_reads_the_modes_names_too(shell):
    comparison = run(
        shell,
        "%%compare --modes fp32,bf16 --steps 2 --warmup 0 --progress none "
        "--metric \"sum(1 for m in [trainer.mode.label] if m == 'bf16')\"\n" + TRAIN_CELL,
    )
    assert [row["metric"] for row in comparison.rows()] == [0.0, 1.0]


def test_a_trainer_built_outside_the_cell_is_refused(shell):
    run(shell, "outside, train, _ = mpnb.examples.example_trainer(widths=(4, 8), dashboard=None)")
    error = run_expecting(
        shell,
        "%%compare --modes fp32,bf16 --steps 2 --progress none\noutside.fit(train)",
        ValueError,
    )
    assert "share one Trainer" in str(error) and "inside the cell" in str(error)
