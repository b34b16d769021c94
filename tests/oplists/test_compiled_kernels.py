"""The C++ list kernels: used where they can be built, the same results as the Python ones,
and a clear fallback where they cannot be built."""

from __future__ import annotations

import shutil

import pytest
import torch

from mpnb.errors import InvalidChoiceError
from mpnb.oplists import OpListOverride, OpLists, compiled_kernels
from tests.conformance.models import MODELS


def _autocast_cpu_kernel(op_name: str) -> str:
    return next(
        line
        for line in torch._C._dispatch_dump(op_name).splitlines()
        if line.startswith("AutocastCPU")
    )


@pytest.mark.skipif(
    shutil.which("c++") is None,
    reason="no C++ compiler on this machine: the Python kernels are used",
)
def test_the_compiled_kernels_are_used_where_a_compiler_is(monkeypatch):
    monkeypatch.delenv("MPNB_LIST_KERNELS", raising=False)
    assert compiled_kernels.kind() == "compiled", compiled_kernels.unavailable_reason()
    with OpListOverride(OpLists.of(lower=["relu"]), ["cpu"]):
        assert "list_kernel.cpp" in _autocast_cpu_kernel("aten::relu")
    monkeypatch.setenv("MPNB_LIST_KERNELS", "python")
    with OpListOverride(OpLists.of(lower=["relu"]), ["cpu"]):
        assert "override.py" in _autocast_cpu_kernel("aten::relu")


def test_a_bad_choice_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv("MPNB_LIST_KERNELS", "fast")
    with pytest.raises(InvalidChoiceError, match="'fast'.*compiled.*python"):
        OpListOverride(OpLists.of(lower=["relu"]), ["cpu"]).apply()


@pytest.mark.parametrize("preset", ["hmp", "resnet50"])
@pytest.mark.parametrize("model_name", ["resnet", "gpt2"])
def test_compiled_and_python_kernels_train_bit_for_bit_alike(monkeypatch, preset, model_name):
    """Forward, backward and the running statistics of third-party models under a preset."""
    results = {}
    for kind in ("compiled", "python"):
        monkeypatch.setenv("MPNB_LIST_KERNELS", kind)
        case = MODELS[model_name]()
        torch.manual_seed(0)
        with (
            OpListOverride(OpLists.preset(preset), ["cpu"]),
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            loss = case.loss(case.model, case.batch)
        loss.backward()
        results[kind] = [
            loss.detach(),
            *(p.grad for p in case.model.parameters()),
            *case.model.buffers(),
        ]
    assert all(
        torch.equal(a, b) for a, b in zip(results["compiled"], results["python"], strict=True)
    )


def test_a_failed_build_falls_back_to_the_python_kernels_and_says_why(monkeypatch, tmp_path):
    broken = tmp_path / "list_kernel.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(compiled_kernels, "SOURCE", broken)
    monkeypatch.setattr(compiled_kernels, "EXTENSION", "mpnb_list_kernels_broken_test")
    monkeypatch.setattr(compiled_kernels._Build, "loaded", False)
    monkeypatch.setattr(compiled_kernels._Build, "failure", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    monkeypatch.delenv("MPNB_LIST_KERNELS", raising=False)
    with pytest.warns(RuntimeWarning, match="Python kernels .* could not be built: .*Error"):
        assert compiled_kernels.kind() == "python"
    assert "Error" in compiled_kernels.unavailable_reason()
    with (
        OpListOverride(OpLists.of(lower=["relu"]), ["cpu"]),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        assert torch.relu(torch.ones(2)).dtype == torch.bfloat16
