"""The op dtype trace: ops, modules and dtypes of a known model, forward and backward."""

from __future__ import annotations

import copy
import csv
import re

import pytest
import torch
import torch.nn.functional as F

import mpnb
import mpnb.examples as ex
from mpnb.oplists.trace import Trace, TraceRow
from tests.planted import FORMULA_STARTS, assert_link_replaced, files_in, plant_link


def model_and_batch():
    torch.manual_seed(0)
    return ex.DigitsCNN(widths=(4, 8)), torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))


def train_step(model, images, labels, **autocast_options):
    with mpnb.autocast("bf16", "cpu", **autocast_options):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    return loss


def test_trace_lists_ops_modules_and_dtypes_forward_and_backward():
    model, images, labels = model_and_batch()
    with mpnb.trace() as trace:
        train_step(model, images, labels)
    forward = {(row.module, row.op): row for row in trace.filter(phase="forward").ops()}
    assert forward["DigitsCNN.features.0", "convolution"].output == "bf16"
    assert forward["DigitsCNN.features.0", "convolution"].inputs == "bf16, bf16, bf16"
    assert forward["DigitsCNN.features.1", "relu"].output == "bf16"
    assert forward["DigitsCNN.classifier", "addmm"].output == "bf16"
    assert (
        forward["(top level)", "_log_softmax"].inputs == "fp32"
    )  # cross_entropy is on torch's fp32 list
    assert forward["(top level)", "nll_loss_forward"].inputs == "fp32, int64"
    backward = {(row.module, row.op) for row in trace.filter(phase="backward").ops()}
    assert {
        ("DigitsCNN.features.0", "convolution_backward"),
        ("DigitsCNN.features.3", "convolution_backward"),
        ("DigitsCNN.classifier", "mm"),
        ("(top level)", "nll_loss_backward"),
    } <= backward
    casts = {
        (row.phase, row.module, row.inputs, row.output, row.count)
        for row in trace.rows
        if row.kind == "cast"
    }
    assert ("forward", "DigitsCNN.features.0", "fp32", "bf16", 3) in casts  # input, weight, bias
    assert (
        "backward",
        "DigitsCNN.features.0",
        "bf16",
        "fp32",
        2,
    ) in casts  # weight and bias grads back to fp32
    assert re.fullmatch(r"\d+ ops: \d+% bf16, \d+% fp32, \d+ casts", trace.summary())


def test_trace_follows_the_op_lists_and_marks_user_casts_as_ops():
    model, images, labels = model_and_batch()
    with mpnb.trace(model) as trace:
        train_step(model, images, labels, fp32=["linear"])
        images.to(torch.bfloat16)
    classifier = trace.filter(module="classifier", phase="forward")
    assert {row.op: row.output for row in classifier.ops()}["addmm"] == "fp32"
    assert [row.inputs for row in classifier.rows if row.kind == "cast"] == [
        "bf16"
    ]  # the bf16 activations, back up
    user_casts = trace.filter(op="aten::_to_copy", module="(top level)").rows
    assert [(row.kind, row.output) for row in user_casts] == [("op", "bf16")]


def test_tracing_changes_no_result():
    model, images, labels = model_and_batch()
    twin = copy.deepcopy(model)
    plain = train_step(model, images, labels)
    with mpnb.trace():
        traced = train_step(twin, images, labels)
    assert torch.equal(plain, traced)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_trace_views_and_export(tmp_path):
    model, images, labels = model_and_batch()
    with mpnb.trace() as trace:
        train_step(model, images, labels)
    text = str(trace)
    assert text.splitlines()[0] == trace.summary() and "convolution_backward" in text
    html = trace._repr_html_()
    assert html.count("<tr>") == len(trace.rows) + 1 and "DigitsCNN.features.0" in html
    trace.to_csv(tmp_path / "trace.csv")
    with open(tmp_path / "trace.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == len(trace.rows) and int(rows[0]["count"]) == trace.rows[0].count
    assert trace.filter(op="nothing").summary() == "0 ops, 0 casts"


def test_trace_removes_its_hooks_when_the_block_raises():
    model, images, _ = model_and_batch()
    hooks = torch.nn.modules.module
    before = (len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks))
    try:
        with mpnb.trace() as trace:
            model(images)
            raise KeyError("stop")
    except KeyError:
        pass
    assert (len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks)) == before
    assert trace.ops() and not torch._C._is_torch_function_mode_enabled()


def test_the_summary_shares_count_floating_ops_and_list_the_rest_apart():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    with mpnb.trace(model) as recorded, torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 3, 8, 8))  # BatchNorm's num_batches_tracked += 1 is an int64 op
    summary = recorded.summary()
    shares, _, rest = summary.partition(" (+")
    assert "int64" not in shares and re.fullmatch(
        r"\d+ ops: (\d+% (bf16|fp32)(, )?)+, \d+ casts", shares
    ), summary
    assert re.fullmatch(r"\d+ non-floating: int64 \d+(, \w+ \d+)*\)", rest), summary
    floating = sum(r.count for r in recorded.ops() if r.output in ("bf16", "fp32"))
    assert shares.startswith(f"{floating} ops: ")


def test_module_names_that_look_like_formulas_open_in_a_spreadsheet_as_text(tmp_path):
    modules = ["=HYPERLINK(0)", "+1", "-2+3", "@SUM(A1)", "\tx", "\rx", "'quoted"]
    Trace(
        [TraceRow("forward", module, "op", "addmm", "bf16", "bf16", 1) for module in modules]
    ).to_csv(tmp_path / "trace.csv")
    with open(tmp_path / "trace.csv", newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    assert [row["module"] for row in rows] == [f"'{module}" for module in modules]
    assert not [cell for row in rows for cell in row.values() if cell.startswith(FORMULA_STARTS)]


def test_trace_csv_replaces_a_planted_link_and_leaves_its_target_alone(tmp_path):
    destination = tmp_path / "shared" / "trace.csv"
    victim = plant_link(destination)
    Trace([TraceRow("forward", "Net.fc", "op", "addmm", "bf16", "bf16", 3)]).to_csv(destination)
    assert "Net.fc" in assert_link_replaced(destination, victim)


def test_a_trace_csv_that_cannot_be_written_leaves_the_old_file_whole(tmp_path):
    Trace([TraceRow("forward", "Net.fc", "op", "addmm", "bf16", "bf16", 3)]).to_csv(
        tmp_path / "trace.csv"
    )
    before = (tmp_path / "trace.csv").read_bytes()
    rows = [TraceRow("forward", f"Net.{i}", "op", "addmm", "bf16", "bf16", 1) for i in range(1000)]
    rows.append(
        TraceRow("forward", "Net.\ud800", "op", "addmm", "bf16", "bf16", 1)
    )  # no UTF-8 for it
    with pytest.raises(UnicodeEncodeError):
        Trace(rows).to_csv(tmp_path / "trace.csv")
    assert (tmp_path / "trace.csv").read_bytes() == before and files_in(tmp_path) == ["trace.csv"]


def test_the_op_whose_fp16_output_overflowed_is_marked_and_named_in_the_summary():
    from tests.ui.planted_encoder import encoder_batch, planted_encoder

    model = planted_encoder()
    with mpnb.trace(model) as trace, torch.autocast("cpu", dtype=torch.float16):
        model(encoder_batch()[0])
    overflowed = trace.first_nonfinite  # in the order the calls ran
    assert (overflowed.module, overflowed.op, overflowed.output) == (
        "EncoderClassifier.encoder.layers.1.linear2",
        "addmm",
        "fp16",
    )
    assert "gave inf/NaN, first addmm in EncoderClassifier.encoder.layers.1.linear2" in (
        trace.summary()
    )
    cells = next(
        line.split()
        for line in str(trace).splitlines()[1:]  # under the summary
        if "layers.1.linear2" in line and "addmm" in line
    )
    assert cells[-2:] == ["1", "1"]  # count, non-finite
    assert '<tr style="color:#c0392b' in trace._repr_html_()
    clean = [row for row in trace.rows if "layers.0" in row.module]
    assert clean and not any(row.nonfinite for row in clean)
