"""max_batch_size: against a memory budget measured on CPU, and against a real allocation failure."""

from __future__ import annotations

import math

import numpy
import pytest
import torch

import mpnb
import mpnb.examples as ex
from mpnb.analysis.batch_size import parse_bytes


def make_run(mode):
    trainer, train, _ = ex.example_trainer(mode, "cpu", model="mlp", batch_size=32, dashboard=None)
    return trainer, train


def test_the_answer_fits_the_budget_and_the_next_size_tried_does_not():
    report = mpnb.max_batch_size(make_run, ["fp32", "bf16"], memory_budget="16 MiB", start=64)
    for mode in ("fp32", "bf16"):
        result = report.result(mode)
        assert result.limited_by == "budget" and result.batch_size >= 64
        best = next(t for t in result.trials if t.batch_size == result.batch_size)
        assert best.fits and best.peak <= parse_bytes("16 MiB") == report.budget
        too_big = [t for t in result.trials if not t.fits]
        assert too_big and all(
            t.batch_size > result.batch_size and t.peak > report.budget for t in too_big
        )
        assert min(t.batch_size for t in too_big) - result.batch_size <= max(
            1, result.batch_size // 32
        )
    assert report.ratio_to_fp32("fp32") == 1.0
    assert math.isclose(
        report.ratio_to_fp32("bf16"),
        report.result("bf16").batch_size / report.result("fp32").batch_size,
    )
    text = str(report)
    assert (
        text.splitlines()[0].startswith("mode  max batch size  vs fp32")
        and "budget 16.0 MiB" in text
    )
    assert "<table>" in report._repr_html_()


class Hungry(torch.nn.Module):
    """A model that asks for a terabyte when its batch is larger than ``threshold``."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold, self.linear = threshold, torch.nn.Linear(64, 10)

    def forward(self, x):
        if len(x) > self.threshold:
            torch.empty(
                2**60, dtype=torch.uint8
            )  # a real allocation failure, even where memory is overcommitted
        return self.linear(x.flatten(1))


def test_an_allocation_failure_is_caught_and_bisected_to_the_largest_size_that_runs():
    def hungry_run(mode):
        model = Hungry(threshold=100)
        trainer = mpnb.Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.nn.functional.cross_entropy,
            mode=mode,
            device="cpu",
            dashboard=None,
        )
        return trainer, [(torch.randn(8, 1, 8, 8), torch.arange(8) % 10)]

    report = mpnb.max_batch_size(hungry_run, ["fp32"], memory_budget="1 TB", start=16)
    result = report.result("fp32")
    assert result.limited_by == "out of memory"
    assert 98 <= result.batch_size <= 100
    assert [t.batch_size for t in result.trials[:4]] == [16, 32, 64, 128] and result.trials[
        3
    ].out_of_memory


def test_slow_trials_end_in_an_extrapolation_along_the_measured_peaks():
    budget = parse_bytes("256 MiB")
    report = mpnb.max_batch_size(
        make_run, ["fp32"], memory_budget=budget, start=4096, limit=10**6, trial_seconds=0
    )
    result = report.result("fp32")
    assert [t.batch_size for t in result.trials] == [
        4096,
        8192,
        16384,
    ]  # three sizes, then the line
    slope, intercept = numpy.polyfit([4096, 8192, 16384], [t.peak for t in result.trials], 1)
    assert result.limited_by == "extrapolated" and result.batch_size > 16384
    assert abs(result.batch_size - (budget - intercept) / slope) <= 1
    assert math.isclose(result.peak, intercept + slope * result.batch_size, rel_tol=1e-6)


def test_a_mode_the_device_cannot_run_is_listed_and_bad_input_runs_nothing():
    def refusing(mode):
        if mode == "fp16":
            raise mpnb.DeviceUnavailableError("no fp16 here", ["bf16"])
        return make_run(mode)

    report = mpnb.max_batch_size(refusing, ["fp16"], memory_budget="40 MiB", limit=32)
    assert report.result("fp16").skipped_reason.startswith("no fp16 here")
    assert "not run: no fp16 here" in str(report)
    calls = []
    with pytest.raises(mpnb.InvalidChoiceError, match="'fp8'"):
        mpnb.max_batch_size(lambda mode: calls.append(mode), ["bf16", "fp8"])
    with pytest.raises(ValueError, match="start <= limit"):
        mpnb.max_batch_size(lambda mode: calls.append(mode), ["bf16"], start=64, limit=32)
    with pytest.raises(ValueError, match="'lots'"):
        mpnb.max_batch_size(lambda mode: calls.append(mode), ["bf16"], memory_budget="lots")
    assert calls == []


@pytest.mark.parametrize(
    ("text", "size"), [("4 GiB", 4 * 2**30), ("500MB", 500 * 10**6), ("1.5kib", 1536), (2048, 2048)]
)
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


def test_the_cpu_peak_restarts_from_the_current_resident_memory():
    backend = mpnb.precision.backends.backend_for(torch.device("cpu"))
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    del block
    if not backend.reset_peak_memory():
        pytest.skip(
            "this system cannot reset the peak resident memory (needs Linux /proc/self/clear_refs)"
        )
    snapshot = backend.memory()
    assert snapshot.peak - snapshot.used < 32 * 2**20
