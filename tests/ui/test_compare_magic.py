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
from mpnb.ui.plots.compare_progress import LiveComparison, TextComparison
from tests.conftest import policy_state, run, run_expecting, torch_state, usage_error

TRAIN_CELL = """
trainer, train, test = mpnb.examples.example_trainer(widths=(4, 8), batch_size=32, dashboard="text")
seen_modes.append((mpnb.get_mode().value, torch.is_autocast_enabled("cpu"), torch.get_float32_matmul_precision()))
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
    assert [autocast for _, autocast, _ in seen] == [False, False, True]  # the %amp bf16 cell does not leak
    assert seen[0][2] == "highest" and seen[1][2] != "highest"  # each mode's fp32-math flags while it runs
    for mode in ("fp32", "tf32", "bf16"):
        history = comparison.result(mode).history
        assert len(history) == 6 and set(history.mode) == {mode}  # epochs=50 held to warmup + steps
        assert comparison.result(mode).timed_from == 2
    rows = {row["mode"]: row for row in comparison.rows()}
    assert all(0 <= row["metric"] <= 1 for row in rows.values())
    header = str(comparison).splitlines()[0]
    assert " accuracy " in header and "mpnb.examples" not in header  # a short name, not the expression
    first_losses = [comparison.result(mode).history.loss[0] for mode in ("fp32", "tf32")]
    assert first_losses[0] == first_losses[1]  # same seed, same model, same first batch
    printed = capsys.readouterr().out
    assert "training DigitsCNN" not in printed and "finished:" not in printed  # the trainer's own dashboard gave way
    assert mpnb.get_mode() is mpnb.Mode.BF16 and torch_state() == before
    assert torch.equal(torch.random.get_rng_state(), random_before)


def test_an_error_in_the_cell_restores_everything(shell):
    run(shell, "%amp fp16")
    before = policy_state()
    run_expecting(shell, "%%compare --modes fp32,bf16 --steps 2 --progress none\nraise KeyError('boom')", KeyError)
    assert policy_state() == before
    run_expecting(shell, "%%compare --modes tf32 --steps 2 --progress none\nraise KeyboardInterrupt", KeyboardInterrupt)
    assert policy_state() == before


def test_a_cell_that_trains_nothing_is_told_how(shell):
    message = usage_error(shell, "%%compare --modes bf16 --steps 2 --progress none\nx = 1")
    assert "trained nothing through mpnb.Trainer.fit" in message


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("--modes fp32,fp8", "'fp8'"),
        ("--modes ,", "names no mode"),
        ("--steps 0", "--steps must be >= 1, got 0"),
        ("--warmup -1", "--warmup must be >= 0, got -1"),
        ("--block 0", "--block must be >= 1, got 0"),
        ("--progress fancy", "'fancy'"),
        ("--metric 'acc('", "not a Python expression"),
        ("--colour red", "--colour"),
    ],
)
def test_bad_input_runs_nothing_and_changes_nothing(shell, line, words):
    before = policy_state()
    assert words in usage_error(shell, f"%%compare {line}\n" + TRAIN_CELL)
    assert policy_state() == before and shell.user_ns["seen_modes"] == []


def test_out_writes_the_report_files(shell, tmp_path, capsys):
    run(shell, f"%%compare --modes fp32,bf16 --steps 2 --warmup 0 --progress none --out {tmp_path}\n" + TRAIN_CELL)
    assert "report.html" in capsys.readouterr().out
    data = json.loads((tmp_path / "comparison.json").read_text())
    assert [row["mode"] for row in data["modes"]] == ["fp32", "bf16"]
    assert (tmp_path / "report.html").read_text().count("<tr>") == 3


def test_help_names_every_option(shell):
    help_text = shell.magics_manager.magics["cell"]["compare"].__doc__
    assert all(option in help_text for option in ("--modes", "--steps", "--warmup", "--seed", "--metric", "--out"))


def test_unload_removes_compare_too(shell):
    run(shell, "%unload_ext mpnb")
    assert "not found" in usage_error(shell, "%%compare\n1")


def test_mode_scope_restores_the_session_even_when_the_mode_is_refused():
    mpnb.set_mode("tf32")
    before = policy_state()
    with session.mode_scope("fp32"):
        assert mpnb.get_mode() is mpnb.Mode.FP32 and torch.get_float32_matmul_precision() == "highest"
    assert policy_state() == before
    with pytest.raises(mpnb.InvalidChoiceError), session.mode_scope("fp8"):
        pass
    assert policy_state() == before


def make_run(mode):
    trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), batch_size=32, dashboard=None)
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


class _Tables(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.cells: list[str] = []

    def handle_data(self, data: str) -> None:
        self.cells.append(data)


def test_live_progress_overlays_each_mode_as_it_trains():
    view = LiveComparison(["fp32", "bf16"], "demo", min_interval=0, max_share=0)
    drawn_when_fp32_ended = []

    def on_result(result):
        if result.mode == "fp32":
            drawn_when_fp32_ended.extend(len(trace.x) for trace in view.figure.data)

    result = compare(make_run, ["fp32", "bf16"], steps=5, warmup=1, block=1, progress=view, on_result=on_result)
    # Turns alternate fp32, bf16 | bf16, fp32 | ...: when fp32 ends (round 5) bf16 has 4 of its 5 timed steps.
    # fp32 is drawn with its 1 + 5 losses and 5 timed step times, bf16 as far as it got.
    assert drawn_when_fp32_ended == [6, 5, 5, 4]
    loss_fp32, time_fp32, loss_bf16, time_bf16 = view.figure.data
    assert list(loss_fp32.x) == list(range(1, 7)) and list(loss_bf16.x) == list(range(1, 7))
    assert list(loss_bf16.y) == result.result("bf16").history.loss
    assert math.isclose(time_fp32.y[-1], result.result("fp32").history.step_time[-1] * 1e3, rel_tol=1e-6)
    assert loss_fp32.line.color != loss_bf16.line.color and loss_fp32.name == "fp32"
    parser = _Tables()
    parser.feed(view.table.value)
    assert "fp32" in parser.cells and "bf16" in parser.cells and "speedup vs fp32" in parser.cells
    assert view.status.value == "done: 2 of 2 mode(s) ran"
