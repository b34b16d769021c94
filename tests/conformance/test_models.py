"""Op lists on third-party models: every model x preset x dtype trains one step, and the lists
change only what they name.

For each case, one training step runs under plain torch.autocast and once more, from the same
weights and seed, under the preset's lists. Then:
- forward and backward ran, the loss is finite and every parameter has a gradient;
- every aten op no list names that received bitwise the same inputs gave bitwise the same outputs;
- every torch function the model called that a list names returned the listed dtype;
- buffers (BatchNorm statistics) changed exactly where they changed without lists, same dtypes;
- outside autocast the lists change nothing;
- the dispatcher is as torch made it afterwards (conftest's fixture checks every listed op).
The figures of each case are appended to test-artifacts/conformance.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib

import pytest
import torch

from mpnb.oplists import OpListOverride, OpLists
from mpnb.oplists.lists import canonical_name
from tests.conformance.models import MODELS, Case
from tests.conformance.recording import AtenRecorder, FunctionRecorder, compare_unlisted, same

pytest.importorskip("transformers")

ARTIFACTS = pathlib.Path(__file__).resolve().parents[2] / "test-artifacts"
PRESETS = ("torch", "hmp", "resnet50")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _step(case: Case, lists: OpLists | None, dtype: torch.dtype):
    """One training step (forward under autocast, backward after it), recorded."""
    aten, functions = AtenRecorder(), FunctionRecorder()
    torch.manual_seed(1)  # the same dropout masks in both runs
    with contextlib.ExitStack() as stack:
        if lists:
            stack.enter_context(OpListOverride(lists, ["cpu"]))
        with torch.autocast("cpu", dtype=dtype), functions, aten:
            loss = case.loss(case.model, case.batch)
        with aten:
            loss.backward()
    return loss, aten.calls, functions.calls


def _named(lists: OpLists, name: str) -> str | None:
    """Which list names the function ``name`` (``lower`` or ``fp32``), if any."""
    entry = canonical_name(name)
    return "fp32" if entry in lists.fp32 else "lower" if entry in lists.lower else None


@pytest.fixture(scope="module")
def report():
    rows: list[dict] = []
    yield rows
    ARTIFACTS.mkdir(exist_ok=True)
    with open(ARTIFACTS / "conformance.jsonl", "a") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_lists_change_only_what_they_name(model_name, preset, dtype_name, report):
    dtype, lists = DTYPES[dtype_name], OpLists.preset(preset)
    plain_case, listed_case = MODELS[model_name](), MODELS[model_name]()
    start = {k: v.clone() for k, v in plain_case.model.state_dict().items()}

    plain_loss, plain_ops, _ = _step(plain_case, None, dtype)
    listed_loss, listed_ops, functions = _step(listed_case, lists, dtype)

    assert math.isfinite(listed_loss.item())
    assert all(p.grad is not None for p in listed_case.model.parameters() if p.requires_grad)

    comparison = compare_unlisted(plain_ops, listed_ops, lists)
    assert comparison.mismatches == [], comparison.mismatches[:10]
    if preset == "torch":  # no lists: the two runs are the same run
        assert comparison.unaligned == 0 and comparison.checked == len(plain_ops) - sum(
            c.seeded for c in plain_ops
        )

    wrong_dtypes = []
    for call in functions:
        which = _named(lists, call.name)
        eligible = call.input_dtypes and torch.float64 not in call.input_dtypes
        if which and eligible and call.output_dtypes:
            expected = torch.float32 if which == "fp32" else dtype
            if any(out != expected for out in call.output_dtypes):
                wrong_dtypes.append((call.name, call.input_dtypes, call.output_dtypes))
    assert wrong_dtypes == []

    plain_state, listed_state = plain_case.model.state_dict(), listed_case.model.state_dict()
    for name, before in start.items():
        if name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            moved = not torch.equal(plain_state[name], before)
            assert listed_state[name].dtype == before.dtype, name
            assert (not torch.equal(listed_state[name], before)) == moved, name

    listed_case.model.eval()
    plain_case.model.eval()
    listed_case.model.load_state_dict(plain_case.model.state_dict())
    with torch.no_grad():
        without = plain_case.loss(plain_case.model, plain_case.batch)
        with OpListOverride(lists, ["cpu"]):
            outside = listed_case.loss(listed_case.model, listed_case.batch)
    assert same(without, outside), "outside autocast the lists must change nothing"

    report.append(
        {
            "model": model_name,
            "preset": preset,
            "dtype": dtype_name,
            "aten ops": len(listed_ops),
            "checked": comparison.checked,
            "bitwise equal": comparison.equal,
            "mismatches": len(comparison.mismatches),
            "listed or downstream": comparison.listed_or_downstream,
            "listed functions called": sum(_named(lists, c.name) is not None for c in functions),
            "loss plain": round(plain_loss.item(), 5),
            "loss listed": round(listed_loss.item(), 5),
        }
    )
