"""Every magic and option, through a real IPython InteractiveShell."""

from __future__ import annotations

import re

import pytest
import torch

import mpnb
from mpnb.precision.policy import session
from tests.conftest import policy_state, run, run_expecting, torch_state, usage_error

OUTPUTS = "(linear(x).dtype, torch.nn.Conv2d(3, 4, 3)(torch.randn(1, 3, 6, 6)).dtype, torch.softmax(x, -1).dtype)"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    "options, expected",
    [
        ("", (BF16, BF16, F32)),
        ("--dtype bf16", (BF16, BF16, F32)),
        ("-d fp16", (F16, F16, F32)),
        ("-d half --device cpu", (F16, F16, F32)),
        ("--dtype bfloat16 --no-cache", (BF16, BF16, F32)),
        ("--off", (F32, F32, F32)),
        ("fp16", (F16, F16, F32)),  # the dtype as a word, as %amp takes its mode
        ("bf16 --device cpu", (BF16, BF16, F32)),
    ],
)
def test_autocast_cell_output_dtypes(ip, options, expected):
    assert run(ip, f"%%autocast {options}\n{OUTPUTS}") == expected
    assert run(ip, OUTPUTS) == (F32, F32, F32)


def test_autocast_cell_refuses_two_different_dtypes(ip):
    assert "two dtypes: 'fp16' and --dtype 'bf16'" in usage_error(ip, "%%autocast fp16 -d bf16\n1")


def test_autocast_cache_option(ip):
    assert run(ip, "%%autocast\ntorch.is_autocast_cache_enabled()") is False
    assert run(ip, "%%autocast --cache\ntorch.is_autocast_cache_enabled()") is True


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("bf16", (BF16, BF16, F32)),
        ("fp16", (F16, F16, F32)),
        ("fp32", (F32, F32, F32)),
        ("tf32", (F32, F32, F32)),
        ("off", (F32, F32, F32)),
    ],
)
def test_amp_mode_applies_to_every_following_cell(ip, mode, expected):
    run(ip, f"%amp {mode}")
    assert run(ip, OUTPUTS) == expected
    assert run(ip, OUTPUTS) == expected
    assert not torch.is_autocast_enabled("cpu")  # between cells, nothing is left entered


def test_autocast_cell_overrides_the_session_mode_for_that_cell_only(ip):
    run(ip, "%amp bf16")
    assert run(ip, "%%autocast -d fp16\nlinear(x).dtype") is F16
    assert run(ip, "%%autocast --off\nlinear(x).dtype") is F32
    assert run(ip, "linear(x).dtype") is BF16


def test_an_autocast_cell_asks_for_autocast_in_a_mode_without_it(ip):
    # `with mpnb.autocast():` follows a mode that runs without autocast; the cell magic is a
    # request for autocast: the device's preferred dtype
    run(ip, "%amp fp32")
    assert run(ip, "%%autocast\nlinear(x).dtype") is BF16
    assert run(ip, "import mpnb\nwith mpnb.autocast():\n    y = linear(x).dtype\ny") is F32


def test_amp_switch_takes_effect_from_the_next_cell(ip):
    assert run(ip, "%amp bf16\nlinear(x).dtype") is F32
    assert run(ip, "linear(x).dtype") is BF16


@pytest.mark.parametrize("error", ["ZeroDivisionError", "KeyboardInterrupt"])
@pytest.mark.parametrize("mode", ["off", "bf16"])
def test_state_is_restored_after_a_failing_cell(ip, capsys, error, mode):
    run(ip, f"%amp {mode}")
    before = torch_state()
    raised = run_expecting(
        ip, f"%%autocast -d fp16 --cache\ny = 1\nraise {error}('from the cell')", BaseException
    )
    assert type(raised).__name__ == error
    assert torch_state() == before
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert out.count(f"{error}: from the cell") == 1  # shown once, with the cell's own line
    assert "line 3" in out


def test_state_is_restored_after_a_failing_session_cell(ip):
    run(ip, "%amp fp16")
    before = torch_state()
    run_expecting(ip, "linear(x)\nraise KeyboardInterrupt", KeyboardInterrupt)
    assert torch_state() == before


def test_cell_value_and_namespace(ip):
    assert run(ip, "%%autocast\nz = linear(x)\nz.shape[0] + 1") == 5
    assert run(ip, "z.dtype") is BF16
    assert run(ip, "%%autocast\nw = 1") is None


def test_autocast_cell_understands_ipython_syntax(ip, capsys):
    capsys.readouterr()
    assert run(ip, "%%autocast\n%amp status\n1 + 1") == 2
    assert "bf16 autocast on cpu" in capsys.readouterr().out


def test_nested_cells_keep_scopes_paired(ip):
    run(ip, "%amp bf16")
    assert (
        run(ip, "%%capture\nr = linear(x).dtype\nget_ipython().run_cell('q = linear(x).dtype')")
        is None
    )
    assert run(ip, "(r, q)") == (BF16, BF16)
    assert not torch.is_autocast_enabled("cpu")


def test_amp_status_shows_the_status_wherever_it_stands_in_a_cell(ip, capsys):
    capsys.readouterr()
    assert run(ip, "%amp status\n1 + 1") == 2  # not the cell's last line: shown all the same
    assert "mode" in capsys.readouterr().out and mpnb.status().mode == "off"
    run(ip, "%amp half")
    capsys.readouterr()
    run(ip, "%amp")  # status, the default
    assert "fp16 autocast on cpu" in capsys.readouterr().out


def test_amp_prints_the_mode_and_warnings(ip, capsys):
    run(ip, "%amp fp16 --device cpu")
    out = capsys.readouterr().out
    assert "mode fp16 on cpu" in out and "47x" in out


def test_tf32_magic(ip, capsys):
    run(ip, "%tf32 on")
    assert torch.get_float32_matmul_precision() == "medium"
    run(ip, "%tf32 status")
    assert "fp32 math on cpu: reduced" in capsys.readouterr().out
    run(ip, "%tf32 off")
    assert torch.get_float32_matmul_precision() == "highest"
    run(ip, "%tf32 --device cpu")
    assert "exact" in capsys.readouterr().out


def test_tf32_magic_in_fp32_mode_switches_mode(ip):
    run(ip, "%amp fp32")
    run(ip, "%tf32 on")
    assert mpnb.get_mode() == "tf32"


@pytest.mark.parametrize(
    "cell, words",
    [
        ("%amp fp5", "'fp5'"),
        ("%amp bf16 extra", "extra"),
        ("%amp bf16 --device tpu", "'tpu'"),
        ("%amp status --device cpu", "--device goes with a mode"),
        ("%amp status --recipe rowwise --keep a", "--recipe and --keep go with a mode"),
        ("%amp --colour red", "--colour"),
        ("%tf32 maybe", "'maybe'"),
        ("%tf32 on --device tpu", "'tpu'"),
        ("%tf32 on off", "off"),
        ("%%autocast -d fp8\nlinear(x)", "'fp8'"),
        ("%%autocast -d fp32\nlinear(x)", "turn autocast off"),
        ("%%autocast --device tpu\nlinear(x)", "'tpu'"),
        ("%%autocast --off -d bf16\nlinear(x)", "--off"),
        ("%%autocast --bogus\nlinear(x)", "--bogus"),
        ("%%autocast extra\nlinear(x)", "extra"),
        ("%amp 'bf16", "bf16"),
    ],
)
def test_bad_input_is_a_usage_error_that_changes_nothing(ip, cell, words):
    run(ip, "%amp tf32")
    run(ip, "ran = False")
    before = policy_state()
    message = usage_error(ip, cell.replace("linear(x)", "ran = True"))
    assert words in message
    assert policy_state() == before
    assert run(ip, "ran") is False


def test_unload_removes_everything_and_restores_every_switch(ip):
    hooks_before = {e: list(ip.events.callbacks[e]) for e in ("pre_run_cell", "post_run_cell")}
    run(ip, "%amp tf32")
    run(ip, "%tf32 on")
    run(ip, "%amp bf16")
    run(ip, "%unload_ext mpnb")
    assert mpnb.get_mode() == "off" and torch.get_float32_matmul_precision() == "highest"
    assert run(ip, "linear(x).dtype") is F32
    for magic in ("%amp", "%tf32"):
        assert "not found" in usage_error(ip, f"{magic} status")
    assert "not found" in usage_error(ip, "%%autocast\n1")
    loaded_hooks = {e: list(ip.events.callbacks[e]) for e in hooks_before}
    assert all(len(loaded_hooks[e]) == len(hooks_before[e]) - 1 for e in hooks_before)
    assert not session.cell_hooks


def test_unload_inside_an_amp_cell_closes_that_cell_scope_at_its_end(ip):
    run(ip, "%amp bf16")
    assert (
        run(ip, "%unload_ext mpnb\nlinear(x).dtype") is BF16
    )  # the cell that unloads ends as it began
    assert not torch.is_autocast_enabled("cpu")
    assert run(ip, "linear(x).dtype") is F32


def test_reload_and_double_load(ip, capsys):
    run(ip, "%load_ext mpnb")
    run(ip, "%amp bf16")
    capsys.readouterr()
    run(ip, "%reload_ext mpnb")
    assert mpnb.get_mode() == "off"  # a reload starts again, and says so
    assert "mpnb: unloaded; mode bf16 ended" in capsys.readouterr().out
    run(ip, "%amp bf16")
    assert run(ip, "linear(x).dtype") is BF16


def test_help_text_comes_from_the_docstrings_and_arguments(ip):
    help_text = ip.magics_manager.magics["cell"]["autocast"].__doc__
    assert "--dtype" in help_text and "--no-cache" in help_text and "--off" in help_text
    assert "fp32, tf32, fp16, bf16" in ip.magics_manager.magics["line"]["amp"].__doc__


def test_a_comment_after_a_magics_arguments_is_a_comment(ip):
    # IPython hands a line magic the rest of its line, comment included
    run(ip, "%amp bf16            # every following cell runs under bf16 autocast")
    assert mpnb.get_mode() == "bf16"
    run(ip, "%oplist add fp32 layer_norm   # per-op lists")
    assert "layer_norm" in str(mpnb.get_oplists())
    assert run(ip, "%%autocast -d fp16   # this cell only\nlinear(x).dtype") is F16
    assert "'#'" in usage_error(ip, "%amp '#'")  # quoted, it is an argument
    # a backslash-escaped quote opens no quotation: the comment after it is one
    run(ip, '%amp fp8 --keep "a\\"b"  # c')
    assert session.mode.keep == ('a"b',)  # not 'a"b', '#', 'c'
    run(ip, "%amp off")
    assert "don't" in usage_error(ip, "%amp don\\'t  # a note")


def test_dash_h_shows_a_magics_help_and_cell_magics_say_their_double_percent(ip):
    help_text = usage_error(ip, "%amp --help")
    assert help_text.startswith("%amp [") and "one of off, fp32" in help_text
    assert usage_error(ip, "%amp bf16 -h") == help_text  # among other words too
    assert "usage: %%autocast [" in usage_error(ip, "%%autocast --bogus\n1")
    assert ip.magics_manager.magics["cell"]["autocast"].__doc__.startswith("::\n\n  %%autocast [")
    assert "%%compare [" in usage_error(ip, "%%compare -h\n1")


def run_ipython_script(tmp_path, text: str) -> str:
    """What a real ``ipython file.ipy`` of ``text`` prints (it must exit 0)."""
    import subprocess
    import sys

    script = tmp_path / "session.ipy"
    script.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "IPython", "--quick", "--no-banner", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def said_by(ip, capsys, cell: str) -> str:
    """What running ``cell`` in the shell prints."""
    capsys.readouterr()
    run(ip, cell)
    return capsys.readouterr().out


def test_amp_status_prints_in_a_script_that_ipython_runs_as_one_cell(tmp_path):
    """``ipython file.ipy`` runs the file as one cell: the status is printed there too."""
    printed = run_ipython_script(
        tmp_path, "%load_ext mpnb\n%amp bf16\n%amp status\nprint('end of script')\n"
    )
    shown = printed[: printed.index("end of script")]
    assert "bf16" in shown and "mode" in shown.split("mpnb: mode bf16", 1)[1], printed


def test_a_mode_set_in_a_script_says_its_autocast_stays_off_there(tmp_path, ip, capsys):
    """``ipython file.ipy`` runs a script silently, without the cell hooks that enter the mode's
    autocast: the mode never applies to the script's own code, and %amp says so (a notebook
    cell does not hear it)."""
    printed = run_ipython_script(
        tmp_path,
        "%load_ext mpnb\n%amp bf16\nimport torch\n"
        "print('dtype', torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype)\n",
    )
    assert "dtype torch.float32" in printed
    assert "autocast follows the mode from the next cell: here autocast stays off" in printed
    said = said_by(ip, capsys, "%amp bf16")
    assert "mpnb: mode bf16" in said and "stays off" not in said
    run(ip, "%amp off")


def test_a_notebooks_first_cell_that_loads_and_sets_the_mode_hears_no_script_note(ip, capsys):
    """The extension loaded and the mode set in one cell (a notebook's usual first cell): the
    cell began before mpnb's hook, and is no script for that."""
    run(ip, "%unload_ext mpnb")
    said = said_by(ip, capsys, "%load_ext mpnb\n%amp bf16")
    assert "mpnb: mode bf16" in said and "ipython file.ipy" not in said
    run(ip, "%amp off")


def test_code_after_amp_in_its_own_cell_hears_that_it_runs_as_the_cell_began(ip, capsys):
    said = said_by(ip, capsys, "%amp bf16\nout = torch.nn.Linear(2, 2)(torch.ones(1, 2))")
    assert "autocast follows the mode from the next cell" in said
    assert ip.user_ns["out"].dtype == torch.float32  # as the note says
    run(ip, "%amp off")


def test_code_after_amp_in_a_cell_begun_under_bf16_hears_bf16_stays_on(ip, capsys):
    """The cell began under the last mode's autocast: the rest of it keeps that, as said."""
    run(ip, "import torch")
    run(ip, "%amp bf16")
    said = said_by(ip, capsys, "%amp fp32\nout = torch.nn.Linear(2, 2)(torch.ones(1, 2))")
    assert "here bf16 autocast stays on for the rest of this one" in said
    assert ip.user_ns["out"].dtype == torch.bfloat16  # as the note says
    run(ip, "%amp off")
