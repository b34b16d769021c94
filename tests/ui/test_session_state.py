"""Session state through real IPython cells: a cell's own precision holds for everything run
inside it, and unloading puts every torch switch back as it was before ``%load_ext``."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("inner", ["%%capture captured", "%%time"])
@pytest.mark.parametrize("options, expected", [("--dtype fp16", F16), ("--off", F32)])
def test_a_cells_own_choice_holds_for_cells_run_inside_it(ip, inner, options, expected):
    run(ip, "%amp bf16")
    run(ip, f"%%autocast {options}\n{inner}\ninner_dtype = linear(x).dtype")
    assert ip.user_ns["inner_dtype"] is expected
    assert run(ip, "linear(x).dtype") is BF16  # the next cell follows %amp again


def test_a_nested_cell_under_amp_alone_runs_in_the_session_mode(ip):
    run(ip, "%amp bf16")
    run(ip, "%%capture captured\ninner_dtype = linear(x).dtype")
    assert ip.user_ns["inner_dtype"] is BF16


HMP_THEN_AMP = [
    "from mpnb import hmp\n_ = hmp.convert(device='cpu')",
    "%amp bf16",
    "%oplist add fp32 linear",
]


@pytest.mark.parametrize(
    "cells",
    [
        HMP_THEN_AMP,
        ["%amp bf16", "from mpnb import hmp\n_ = hmp.convert(device='cpu')", "hmp.revert()"],
        ["%amp bf16", "from mpnb import hmp\n_ = hmp.convert(device='cpu')\nhmp.revert()"],
        ["%amp fp16", "from mpnb import hmp\n_ = hmp.convert(device='cpu')", "%amp off"],
    ],
    ids=[
        "convert-amp-lists",
        "convert-then-revert-under-amp",
        "both-in-one-amp-cell",
        "convert-under-fp16",
    ],
)
def test_unload_puts_every_torch_switch_back_as_before_load_whatever_happened(ip, cells):
    from tests.conftest import torch_state

    run(ip, "%unload_ext mpnb")
    before = torch_state()
    run(ip, "%load_ext mpnb")
    for cell in cells:
        run(ip, cell)
    run(ip, "%unload_ext mpnb")
    assert torch_state() == before
    assert run(ip, "linear(x).dtype") is F32


def test_hmp_revert_under_amp_puts_the_thread_back_as_before_convert(ip):
    from tests.conftest import torch_state

    run(ip, "%amp bf16")
    outside = torch_state()  # between cells: the session mode is applied per cell only
    run(ip, "from mpnb import hmp\n_ = hmp.convert(device='cpu')")
    run(ip, "hmp.revert()")
    assert torch_state() == outside
    assert run(ip, "%amp off\nlinear(x).dtype") is BF16  # the %amp cell itself still began in bf16
    assert run(ip, "linear(x).dtype") is F32
