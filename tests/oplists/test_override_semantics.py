"""List kernels keep torch's semantics: what an op writes reaches the caller, views stay views,
and only the tensors torch.autocast itself would cast are cast."""

from __future__ import annotations

import pytest
import torch

from mpnb.errors import MpnbError
from mpnb.oplists import OpListOverride, OpLists


@pytest.fixture(autouse=True, params=["compiled", "python"])
def kernels(request, monkeypatch):
    """Every semantic holds for both kernel implementations (C++ and Python)."""
    monkeypatch.setenv("MPNB_LIST_KERNELS", request.param)
    return request.param


def _lists_then_plain(module_factory, lists, x):
    """Train-mode forward of two identical modules: one under the lists, one under plain autocast."""
    torch.manual_seed(0)
    listed, plain = module_factory(), module_factory()
    plain.load_state_dict(listed.state_dict())
    with OpListOverride(lists, ["cpu"]), torch.autocast("cpu", dtype=torch.bfloat16):
        listed(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x)
    return listed, plain


@pytest.mark.parametrize(
    "module_factory",
    [
        lambda: torch.nn.BatchNorm2d(3),
        lambda: torch.nn.InstanceNorm2d(3, track_running_stats=True),
        lambda: torch.nn.BatchNorm1d(3),
    ],
    ids=["batch_norm_2d", "instance_norm", "batch_norm_1d"],
)
@pytest.mark.parametrize("which", ["lower", "fp32"])
def test_running_statistics_update_under_the_lists_as_without_them(module_factory, which):
    x = torch.randn(4, 3, 5, 5) * 3 + 2
    if isinstance(module_factory(), torch.nn.BatchNorm1d):
        x = x[..., 0, 0]
    names = ["batch_norm", "instance_norm"]
    listed, plain = _lists_then_plain(module_factory, OpLists.of(**{which: names}), x)
    assert listed.running_mean.abs().sum() > 0, "the statistics must move"
    for name, buffer in plain.state_dict().items():
        assert listed.state_dict()[name].dtype == buffer.dtype, name
        if which == "fp32":  # torch runs batch_norm in fp32 on CPU too: same numbers exactly
            assert torch.equal(listed.state_dict()[name], buffer), name
        else:
            torch.testing.assert_close(listed.state_dict()[name], buffer, atol=0.05, rtol=0.05)


def test_the_hmp_preset_keeps_a_cnns_statistics():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    with (
        OpListOverride(OpLists.preset("hmp"), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        model(torch.randn(8, 3, 6, 6) + 1)
    assert model[1].num_batches_tracked == 1
    assert model[1].running_mean.abs().min() > 0 and not torch.equal(
        model[1].running_var, torch.ones(4)
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("t", "returns a view of its input"),
        ("transpose", "returns a view of its input"),
        ("relu_", "writes into its input"),
        ("add.out", "writes into its input"),
        ("mul_", "writes into its input"),
    ],
)
def test_ops_whose_results_alias_their_inputs_are_refused_with_the_reason(name, reason):
    with pytest.raises(MpnbError, match=reason):
        OpLists.of(lower=[name])


def test_presets_hold_only_castable_ops_so_views_stay_views():
    assert "t" not in OpLists.preset("hmp").lower
    w = torch.randn(3, 4)
    with (
        OpListOverride(OpLists.preset("hmp"), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        view = w.t()
    assert view._base is w and view.dtype == torch.float32


@pytest.mark.parametrize("which", ["lower", "fp32"])
def test_float64_and_integer_tensors_are_left_as_torch_autocast_leaves_them(which):
    x64, ints = torch.randn(3, 3, dtype=torch.float64), torch.arange(9).reshape(3, 3)
    with (
        OpListOverride(OpLists.of(**{which: ["mm", "add"]}), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        listed = torch.mm(x64, x64), torch.add(ints, ints)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = torch.mm(x64, x64), torch.add(ints, ints)
    assert [t.dtype for t in listed] == [t.dtype for t in plain] == [torch.float64, torch.int64]
    assert all(torch.equal(a, b) for a, b in zip(listed, plain))


def test_the_other_low_dtype_is_cast_as_torch_casts_it():
    half = torch.randn(3, 3, dtype=torch.float16)
    with (
        OpListOverride(OpLists.of(lower=["add"], fp32=["mm"]), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        assert torch.add(half, half).dtype == torch.bfloat16
        assert torch.mm(half, half).dtype == torch.float32


def _has_mpnb_kernel(op_name: str) -> bool:
    """Whether mpnb holds the op's AutocastCPU kernel (other devices' keys are not probed here)."""
    lines = torch._C._dispatch_dump(op_name).splitlines()
    mpnb_files = ("override.py", "list_kernel.cpp")  # the Python or the C++ kernels
    return any(
        line.startswith("AutocastCPU") and any(f in line for f in mpnb_files) for line in lines
    )


def test_an_op_torch_already_runs_as_listed_gets_no_kernel_of_mpnbs():
    """mm is lowered by torch's own CPU autocast: a lower-list entry for it would only cost time."""
    with OpListOverride(OpLists.of(lower=["mm", "relu"], fp32=["nll_loss"]), ["cpu"]):
        assert not _has_mpnb_kernel("aten::mm") and not _has_mpnb_kernel("aten::nll_loss")
        assert _has_mpnb_kernel("aten::relu")  # torch leaves relu alone: the list changes it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16


def test_a_blocks_list_still_wins_where_the_session_moved_an_op_torch_lowers():
    x = torch.randn(2, 2)
    with (
        OpListOverride(OpLists.of(fp32=["mm"]), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        assert torch.mm(x, x).dtype == torch.float32
        with OpListOverride(OpLists.of(lower=["mm"]), ["cpu"]):
            assert torch.mm(x, x).dtype == torch.bfloat16
        assert torch.mm(x, x).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_stateful_ops_keep_their_statistics_in_their_own_precision(dtype):
    """Kept in fp16, running_var would overflow to inf; kept in bf16, small momentum updates would
    round away: the statistics stay in the buffers' own precision."""
    torch.manual_seed(0)
    x = (
        torch.randn(16, 3, 4, 4) * 400
        if dtype == torch.float16
        else torch.randn(64, 3, 8, 8) * 1.2 + 0.5
    )
    plain, listed = torch.nn.BatchNorm2d(3, momentum=0.01), torch.nn.BatchNorm2d(3, momentum=0.01)
    for _ in range(30):
        with torch.autocast("cpu", dtype=dtype):
            plain(x)
        with OpListOverride(OpLists.preset("hmp"), ["cpu"]), torch.autocast("cpu", dtype=dtype):
            out = listed(x)
    assert out.dtype == dtype and listed.running_var.dtype == torch.float32
    torch.testing.assert_close(listed.running_var, plain.running_var, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(listed.running_mean, plain.running_mean, rtol=1e-3, atol=1e-3)


def test_eval_mode_statistics_are_left_bit_for_bit_even_with_a_nan():
    bn = torch.nn.BatchNorm2d(3).eval()
    bn.running_mean[:] = torch.tensor([float("nan"), 0.7654321, -1.2345678])
    before = bn.running_mean.clone()
    with (
        OpListOverride(OpLists.preset("hmp"), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        bn(torch.randn(2, 3, 4, 4))
    assert torch.equal(bn.running_mean[1:], before[1:]) and bn.running_mean[0].isnan()


@pytest.mark.parametrize("name", ["eq", "ne", "index", "index_put", "copy", "_unsafe_index"])
def test_every_name_a_list_accepts_can_be_applied(name):
    with (
        OpListOverride(OpLists.of(fp32=[name]), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        pass


@pytest.mark.parametrize("name", ["_to_copy", "to"])
def test_the_cast_itself_cannot_be_listed(name):
    with pytest.raises(MpnbError, match="autocast casts with it"):
        OpLists.of(fp32=[name])


def test_an_entry_gets_the_same_kernels_however_the_lists_were_edited():
    from mpnb.oplists import SessionOpLists

    lists = SessionOpLists()
    try:
        lists.add("fp32", ["mm"])
        lists.add("lower", ["mm"])  # now the same lists as a fresh lower=[mm]
        assert not _has_mpnb_kernel("aten::mm")
    finally:
        lists.reset()


def test_torchs_rule_is_never_read_off_an_mpnb_kernel():
    """Replacing fp32=[mm] by lower=[mm] must not probe mm while the old fp32 kernel is still there."""
    from mpnb.oplists import SessionOpLists
    from mpnb.oplists.torch_rules import torch_rule

    torch_rule.cache_clear()
    lists = SessionOpLists()
    try:
        lists.add("fp32", ["mm"])
        lists.add("lower", ["mm"])
        lists.reset()
        x = torch.randn(2, 2)
        with (
            OpListOverride(OpLists.of(fp32=["mm"]), ["cpu"]),
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            assert torch.mm(x, x).dtype == torch.float32
    finally:
        lists.reset()


@pytest.mark.parametrize("which", ["lower", "fp32"])
def test_lists_work_under_inference_mode(which):
    """Casts made in inference mode are inference tensors, which keep no version counter."""
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    lists = OpLists.of(**{which: ["relu", "mm"]})
    with (
        OpListOverride(lists, ["cpu"]),
        torch.inference_mode(),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        listed = torch.relu(x), torch.mm(x, w)
    dtype = torch.bfloat16 if which == "lower" else torch.float32
    assert [t.dtype for t in listed] == [dtype, dtype]
    assert torch.equal(listed[1], torch.mm(x.to(dtype), w.to(dtype)))


def test_a_listed_call_reads_a_weight_changed_in_place_within_the_same_autocast_region(kernels):
    """The cast is made at each call, as the Python kernel makes it: no stale cached copy."""
    weight = torch.ones(4, requires_grad=True)
    with (
        OpListOverride(OpLists.of(lower=["relu"]), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        torch.relu(weight)
        with torch.no_grad():
            weight.add_(1)  # an optimizer step inside the region
        assert torch.relu(weight).tolist() == [2.0] * 4


def test_a_float_argument_named_like_a_state_does_not_stop_the_other_tensors_being_cast():
    """scaled_dot_product_attention's keyword ``scale`` is a float, not a running statistic."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    lists = OpLists.of(fp32=["scaled_dot_product_attention"])
    with OpListOverride(lists, ["cpu"]), torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.5)
    assert out.dtype == torch.float32
    assert torch.equal(
        out,
        torch.nn.functional.scaled_dot_product_attention(
            q.float(), q.float(), q.float(), scale=0.5
        ),
    )


def test_an_override_dropped_without_release_leaves_no_holds_behind():
    import gc

    from mpnb.oplists import override

    relu = (torch.ops.aten.relu.default, "cpu")
    before = override._HELD[relu]
    dropped = OpListOverride(OpLists.of(lower=["relu"]), ["cpu"])
    dropped.apply()
    assert override._HELD[relu] == before + 1
    del dropped
    gc.collect()
    assert override._HELD[relu] == before
