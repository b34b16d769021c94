"""Session op lists: presets and list operations on real ops, %oplist and %%autocast in a real
IPython shell, exact undo, and the Habana port API."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import mpnb
from mpnb import hmp
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.oplists.lists import PRESETS, OpLists
from mpnb.oplists.session_lists import HPU_LIST_VARIABLES, SEMANTICS, SessionOpLists
from mpnb.precision.policy import session
from tests.conftest import dispatcher_state, run, run_expecting, usage_error

torch.manual_seed(0)
_X = torch.randn(4, 8)
_W = torch.randn(8, 8)
_IMG = torch.randn(2, 4, 8, 8)
_TARGET = torch.tensor([1, 0, 3, 2])

# One real call per list entry the presets name (those with an equivalent for these shapes).
SAMPLES = {
    "addmm": lambda: torch.addmm(_X, _X, _W),
    "batch_norm": lambda: F.batch_norm(_IMG, None, None, training=True),
    "bmm": lambda: torch.bmm(_IMG[0], _IMG[0]),
    "conv2d": lambda: F.conv2d(_IMG, _IMG[:, :, :3, :3]),
    "dot": lambda: torch.dot(_X[0], _X[1]),
    "dropout": lambda: F.dropout(_X, 0.5, training=True),
    "group_norm": lambda: F.group_norm(_IMG, 2),
    "layer_norm": lambda: F.layer_norm(_X, (8,)),
    "leaky_relu": lambda: F.leaky_relu(_X),
    "linear": lambda: F.linear(_X, _W),
    "matmul": lambda: _X @ _W,
    "mm": lambda: torch.mm(_X, _W),
    "mul": lambda: _X * _X,
    "mv": lambda: torch.mv(_W, _X[0]),
    "relu": lambda: F.relu(_X),
    "t": lambda: _X.t(),
    "avg_pool2d": lambda: F.avg_pool2d(_IMG, 2),
    "max_pool2d": lambda: F.max_pool2d(_IMG, 2),
    "binary_cross_entropy_with_logits": lambda: F.binary_cross_entropy_with_logits(
        _X, _X.sigmoid()
    ),
    "cross_entropy": lambda: F.cross_entropy(_X, _TARGET),
    "div": lambda: _X / (_X.abs() + 1),
    "truediv": lambda: torch.true_divide(_X, 2.0),
    "log": lambda: torch.log(_X.abs() + 1),
    "log2": lambda: torch.log2(_X.abs() + 1),
    "log_softmax": lambda: F.log_softmax(_X, -1),
    "nll_loss": lambda: F.nll_loss(_X, _TARGET),
    "smooth_l1_loss": lambda: F.smooth_l1_loss(_X, _W[:4]),
    "softmax": lambda: F.softmax(_X, -1),
    "topk": lambda: torch.topk(_X, 2).values,
}


def under_autocast(call, dtype: torch.dtype) -> torch.dtype:
    with torch.autocast("cpu", dtype=dtype):
        return call().dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_give_the_documented_dtypes(preset, dtype):
    lists = OpLists.preset(preset)
    torch_rules = {name: under_autocast(call, dtype) for name, call in SAMPLES.items()}
    session.oplists.preset(preset)
    try:
        for name, call in SAMPLES.items():
            expected = (
                torch.float32
                if name in lists.fp32
                else dtype
                if name in lists.lower
                else torch_rules[name]
            )
            assert under_autocast(call, dtype) == expected, (preset, name)
            assert call().dtype == torch.float32, "lists act only under autocast"
    finally:
        session.oplists.reset()
    assert {name: under_autocast(call, dtype) for name, call in SAMPLES.items()} == torch_rules


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_each_list_operation_is_live_and_undone(dtype):
    pristine = dispatcher_state()
    session.oplists.add("fp32", ["linear", "F.conv2d"])
    assert under_autocast(SAMPLES["linear"], dtype) == torch.float32
    assert under_autocast(SAMPLES["conv2d"], dtype) == torch.float32
    session.oplists.add("bf16", ["aten::softmax", "linear"])  # moves linear to the lower list
    assert (
        under_autocast(SAMPLES["softmax"], dtype) == dtype
        and under_autocast(SAMPLES["linear"], dtype) == dtype
    )
    session.oplists.remove("lower", ["linear"])
    assert under_autocast(SAMPLES["linear"], dtype) == dtype  # torch's own rule again
    session.oplists.remove("fp32", ["conv2d"])
    assert under_autocast(SAMPLES["conv2d"], dtype) == dtype
    session.oplists.reset()
    assert not session.oplists.active and dispatcher_state() == pristine


def test_lists_act_in_the_users_own_autocast_blocks_and_in_backward():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    session.oplists.add("fp32", ["linear"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model[0](_X)
        out = model(_X)
    out.float().sum().backward()
    assert hidden.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_bad_input_changes_nothing():
    session.oplists.add("fp32", ["linear"])
    before, table = session.oplists.lists.copy(), dispatcher_state()
    bad_calls = [
        lambda: session.oplists.add("fp32", ["softmax", "lineer"]),
        lambda: session.oplists.add("fp8", ["softmax"]),
        lambda: session.oplists.remove("fp32", ["softmax"]),
        lambda: session.oplists.preset("bert"),
        lambda: session.oplists.add("lower", ["arange"]),
    ]
    for call in bad_calls:
        with pytest.raises(MpnbError):
            call()
        assert session.oplists.lists == before and dispatcher_state() == table
    with pytest.raises(
        MpnbError, match="aten::arange takes no tensors; torch.autocast never casts"
    ):
        session.oplists.add("lower", ["arange"])


def test_per_block_lists_win_and_vanish_even_when_the_block_raises():
    session.oplists.add("fp32", ["linear"])
    table = dispatcher_state()
    with mpnb.autocast("bf16", "cpu", lower=["linear"], fp32=["softmax"]):
        assert SAMPLES["linear"]().dtype == torch.bfloat16
        assert SAMPLES["softmax"]().dtype == torch.float32
    with pytest.raises(ZeroDivisionError):
        with mpnb.autocast("bf16", "cpu", lower=["linear"]):
            _ = 1 / 0
    assert dispatcher_state() == table
    assert under_autocast(SAMPLES["linear"], torch.bfloat16) == torch.float32
    with pytest.raises(MpnbError, match="'linear' is on both"):
        mpnb.autocast("bf16", "cpu", lower=["linear"], fp32=["F.linear"])
    with pytest.raises(MpnbError, match="only under autocast"):
        mpnb.autocast(enabled=False, fp32=["linear"])


def test_files_for_habanas_own_lists_on_gaudi(tmp_path, monkeypatch):
    for name in HPU_LIST_VARIABLES.values():
        monkeypatch.delenv(name, raising=False)
    lists = SessionOpLists(hpu_present=lambda: True, hpu_directory=tmp_path)
    notes = lists.preset("resnet50")
    assert len(notes) == 1 and "restart the kernel" in notes[0]
    lower_file = os.environ[HPU_LIST_VARIABLES["lower"]]
    fp32_file = os.environ[HPU_LIST_VARIABLES["fp32"]]
    assert os.path.dirname(lower_file) == str(tmp_path)
    assert OpLists.from_files(lower_file, fp32_file) == OpLists.from_files(lower_file, fp32_file)
    assert sorted(OpLists.from_files(None, fp32_file).fp32) == sorted(
        PRESETS["resnet50"][1].split()
    )
    notes = lists.reset()
    assert all(
        name not in os.environ for name in HPU_LIST_VARIABLES.values()
    )  # unset again, as found
    assert len(notes) == 1 and "yours again" in notes[0]
    assert SessionOpLists(hpu_present=lambda: False).preset("hmp") == []
    assert all(name not in os.environ for name in HPU_LIST_VARIABLES.values())


def test_the_users_own_habana_list_files_come_back_on_reset_and_are_untouched_without_a_gaudi(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(HPU_LIST_VARIABLES["fp32"], "/home/me/fp32_ops.txt")
    monkeypatch.delenv(HPU_LIST_VARIABLES["lower"], raising=False)
    elsewhere = SessionOpLists(hpu_present=lambda: False, hpu_directory=tmp_path)
    elsewhere.add("fp32", ["softmax"])
    elsewhere.reset()
    assert os.environ[HPU_LIST_VARIABLES["fp32"]] == "/home/me/fp32_ops.txt" and not list(
        tmp_path.iterdir()
    )
    on_gaudi = SessionOpLists(hpu_present=lambda: True, hpu_directory=tmp_path)
    on_gaudi.add("fp32", ["softmax"])
    on_gaudi.add("lower", ["gelu"])  # a second change keeps the user's values saved at the first
    assert os.environ[HPU_LIST_VARIABLES["fp32"]].startswith(str(tmp_path))
    on_gaudi.reset()
    assert os.environ[HPU_LIST_VARIABLES["fp32"]] == "/home/me/fp32_ops.txt"
    assert HPU_LIST_VARIABLES["lower"] not in os.environ


# --- magics in a real IPython shell ---------------------------------------------------------


def test_oplist_magic_drives_the_session_lists(ip, capsys):
    run(ip, "%oplist preset hmp")
    assert session.oplists.lists == OpLists.preset("hmp")
    run(ip, "%oplist add fp32 layer_norm F.linear")
    run(ip, "%oplist remove fp32 softmax")
    capsys.readouterr()
    run(ip, "%oplist show")
    shown = capsys.readouterr().out
    assert "from user: layer_norm, linear" in shown and "from preset hmp:" in shown
    assert "kernels: C++" in shown or "kernels: Python" in shown
    assert (
        "softmax" not in session.oplists.lists.fp32 and "log_softmax" in session.oplists.lists.fp32
    )
    run(
        ip,
        "%%autocast --dtype bf16 --device cpu\ninside_cell = (linear(x).dtype, torch.nn.functional.layer_norm(x, (8,)).dtype)",
    )
    assert ip.user_ns["inside_cell"] == (torch.float32, torch.float32)
    run(ip, "with torch.autocast('cpu', dtype=torch.bfloat16):\n    own_block = linear(x).dtype")
    assert ip.user_ns["own_block"] == torch.float32
    run(ip, "%amp bf16 --device cpu")
    run(ip, "amp_cell = linear(x).dtype")
    assert ip.user_ns["amp_cell"] == torch.float32
    run(ip, "%oplist reset")
    run(ip, "after_reset = linear(x).dtype")
    assert ip.user_ns["after_reset"] == torch.bfloat16


def test_oplist_magic_rejects_bad_input_and_changes_nothing(ip):
    run(ip, "%oplist add fp32 linear")
    before, table = session.oplists.lists.copy(), dispatcher_state()
    assert "unknown op 'lineer'; valid: linear" in usage_error(
        ip, "%oplist add fp32 softmax lineer"
    )
    assert "unknown %oplist action 'ad'; valid: show, add" in usage_error(ip, "%oplist ad fp32 mm")
    assert "unknown list 'fp33'; valid: lower, fp32" in usage_error(ip, "%oplist add fp33 mm")
    assert "takes a list" in usage_error(ip, "%oplist add fp32")
    assert "unknown preset 'bert'" in usage_error(ip, "%oplist preset bert")
    assert "cannot read op list file" in usage_error(ip, "%oplist load /no/such/file.txt")
    assert "takes no arguments" in usage_error(ip, "%oplist reset now")
    assert "unknown op 'sofmax'" in usage_error(ip, "%%autocast --fp32 sofmax\nnever_run = 1")
    assert "never_run" not in ip.user_ns
    assert session.oplists.lists == before and dispatcher_state() == table


def test_oplist_files_round_trip_through_the_magic(ip, tmp_path, capsys):
    run(ip, "%oplist preset resnet50")
    run(ip, f"%oplist save {tmp_path}")
    assert "wrote" in capsys.readouterr().out
    run(ip, "%oplist reset")
    run(ip, f"%oplist load {tmp_path / 'lower_list.txt'} {tmp_path / 'fp32_list.txt'}")
    assert session.oplists.lists.lower.keys() == OpLists.preset("resnet50").lower.keys()
    assert session.oplists.lists.fp32.keys() == OpLists.preset("resnet50").fp32.keys()
    assert set(session.oplists.lists.fp32.values()) == {"fp32_list.txt"}
    run(ip, f"%oplist load - {tmp_path / 'fp32_list.txt'}")
    assert not session.oplists.lists.lower and session.oplists.lists.fp32


def test_cell_lists_win_for_the_cell_and_vanish_after_it_even_on_error(ip):
    run(ip, "%oplist add fp32 linear")
    table = dispatcher_state()
    run(
        ip,
        "%%autocast --dtype bf16 --device cpu --lower linear --fp32 softmax,log_softmax\ncell = linear(x).dtype",
    )
    assert ip.user_ns["cell"] == torch.bfloat16
    run_expecting(
        ip,
        "%%autocast --dtype fp16 --device cpu --lower linear\nlinear(x)\n1 / 0",
        ZeroDivisionError,
    )
    assert dispatcher_state() == table
    run(ip, "%%autocast --dtype bf16 --device cpu\nnext_cell = linear(x).dtype")
    assert ip.user_ns["next_cell"] == torch.float32


def test_unload_restores_torchs_dispatcher_exactly(ip):
    pristine = dispatcher_state()
    run(ip, "%oplist preset hmp")
    assert dispatcher_state() != pristine
    ip.run_line_magic("unload_ext", "mpnb")
    assert dispatcher_state() == pristine and not session.oplists.lists


def test_help_states_the_semantics(ip):
    for magic in (ip.find_line_magic("oplist"), ip.find_cell_magic("autocast")):
        assert SEMANTICS in magic.__doc__
    assert "Precedence" in SEMANTICS


def test_show_without_lists_reads_torchs_rules(ip, capsys):
    run(ip, "%oplist show")
    shown = capsys.readouterr().out
    assert (
        f"torch's own autocast rules on {session.resolved_device().type}" in shown
    )  # cpu, or cuda on a GPU

    def names(heading: str) -> list[str]:  # "<heading> (N): a, b, c"
        return shown.split(heading)[1].split("\n")[0].split(": ", 1)[1].split(", ")

    assert "mm" in names("lowered to the autocast dtype")
    kept = names("kept in fp32")
    assert "nll_loss" in kept and "linear" not in kept  # (upsample_linear1d is kept on CUDA)


def test_trace_cell_shows_and_keeps_the_trace(ip):
    run(
        ip,
        "%%autocast --dtype bf16 --device cpu --fp32 linear --trace\nout = torch.nn.functional.relu(linear(x))",
    )
    trace = ip.user_ns["_trace"]
    assert {(row.op, row.output) for row in trace.ops()} >= {("addmm", "fp32"), ("relu", "fp32")}
    run_expecting(
        ip, "%%autocast --dtype bf16 --device cpu --trace\nlinear(x)\n1 / 0", ZeroDivisionError
    )
    assert ("addmm", "bf16") in {(row.op, row.output) for row in ip.user_ns["_trace"].ops()}


# --- Habana's hmp API --------------------------------------------------------------------------


def test_hmp_port_trains_a_small_model(tmp_path):
    (tmp_path / "bf16.txt").write_text("# matmuls in bf16\nlinear\naddmm\n")
    (tmp_path / "fp32.txt").write_text("mse_loss\n")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(64, 16)
    targets = inputs[:, :4] * 2 - inputs[:, 4:8]
    lists_before = session.oplists.lists.copy()
    hmp.convert(
        bf16_file_path=str(tmp_path / "bf16.txt"),
        fp32_file_path=str(tmp_path / "fp32.txt"),
        device="cpu",
    )
    try:
        losses = []
        for _ in range(30):
            hidden = model[0](inputs)
            loss = F.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            with hmp.disable_casts():
                assert model[0](inputs).dtype == torch.float32
                optimizer.step()
            losses.append(loss.item())
        assert hidden.dtype == torch.bfloat16 and loss.dtype == torch.float32
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert losses[-1] < 0.5 * losses[0]
    finally:
        hmp.revert()
    assert session.oplists.lists == lists_before and not torch.is_autocast_enabled("cpu")


def test_hmp_defaults_bad_input_and_reset():
    before = dispatcher_state()
    with pytest.raises(InvalidChoiceError, match="unknown opt_level 'O2'; valid: O1"):
        hmp.convert("O2", device="cpu")
    assert dispatcher_state() == before and not torch.is_autocast_enabled("cpu")
    hmp.convert(device="cpu")
    assert session.oplists.lists.fp32.keys() == OpLists.preset("hmp").fp32.keys()
    assert F.softmax(_X, -1).dtype == torch.float32 and F.linear(_X, _W).dtype == torch.bfloat16
    session.reset()  # what %unload_ext does: the conversion goes too
    assert not torch.is_autocast_enabled("cpu") and dispatcher_state() == before


@pytest.mark.parametrize("given", [None, [], {}, 0, "hmp"])
def test_set_oplists_refuses_what_is_not_op_lists_and_changes_nothing(given):
    # None dropped the session's override, then raised with the lists still saying fp32;
    # [] left a list where the session keeps its OpLists
    import mpnb
    from mpnb import OpLists
    from mpnb.errors import MpnbError
    from mpnb.precision.policy import session

    mpnb.set_oplists(OpLists.preset("hmp"))
    try:
        with pytest.raises(MpnbError, match=r"set_oplists takes an OpLists"):
            mpnb.set_oplists(given)
        assert mpnb.get_oplists() == OpLists.preset("hmp") and session.oplists.active
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.log_softmax(torch.randn(4, 4).bfloat16(), 0).dtype == torch.float32
    finally:
        mpnb.set_oplists(OpLists())
