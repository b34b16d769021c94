"""The memory account: a step's bytes by category, counted from storages on a shape-only copy,
the same run after run, adding up, and cross-checked against torch's allocator."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import mpnb
import mpnb.examples as ex
from mpnb.analysis.memory import CATEGORIES, account_step
from tests.child_process import child_environment
from tests.conformance.models import gpt2_model


def cnn_run(mode, widths=(8, 16), batch_size=32):
    torch.manual_seed(0)
    model = ex.DigitsCNN(widths, image_size=28)
    trainer = mpnb.Trainer(
        model,
        torch.optim.Adam(model.parameters()),
        nn.functional.cross_entropy,
        mode=mode,
        device="cpu",
        dashboard=None,
    )
    batch = (torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,)))
    return trainer, [batch]


def bytes_of(tensors):
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def test_torch_still_offers_the_tracker_and_the_events_the_account_reads():
    """The adapter's private torch API: if torch renames it, this fails before any number is wrong."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from mpnb.analysis._torch_memory import _CATEGORY_OF, cpu_allocator_peak

    kinds = {kind.name for kind in _MemRefType}
    assert kinds >= {"PARAM", "BUFFER", "GRAD", "ACT", "TEMP", "OPT"} and kinds <= set(_CATEGORY_OF)
    assert callable(MemTracker().get_tracker_snapshot) and callable(MemTracker.reset_mod_stats)
    assert cpu_allocator_peak(lambda: torch.ones(2**20, dtype=torch.uint8).add_(1)) >= 2**20


def test_parameters_and_adam_state_are_counted_exactly_and_the_categories_add_up():
    trainer, data = cnn_run("fp32")
    account = account_step(trainer, data[0])
    parameters = list(trainer.model.parameters())
    assert account.categories["parameters"] == bytes_of(parameters)
    # Adam: two moments of each parameter's size, and a one-element step count per parameter
    assert account.categories["optimizer state"] == 2 * bytes_of(parameters) + 4 * len(parameters)
    assert account.categories["batch"] == bytes_of(data[0])
    assert account.tracked == sum(account.categories.values()) and set(account.categories) <= set(
        CATEGORIES
    )
    assert account.shape_only and account.batch_size == 32


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_the_optimizer_state_column_holds_its_state_and_the_steps_temporaries_are_workspace(mode):
    """AdamW's foreach step makes temporaries the size of the weights; where the peak falls in
    the step they are the step's workspace, not state the optimizer keeps between steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters()), nn.functional.cross_entropy,
        mode=mode, device="cpu", dashboard=None,
    )  # fmt: skip
    account = account_step(trainer, (torch.randn(16, 32), torch.randint(0, 10, (16,))))
    parameters = list(model.parameters())
    assert account.categories["optimizer state"] == 2 * bytes_of(parameters) + 4 * len(parameters)
    assert account.tracked == sum(account.categories.values())


def test_the_account_leaves_the_run_untouched_and_is_the_same_every_time():
    trainer, data = cnn_run("bf16")
    weights = [parameter.detach().clone() for parameter in trainer.model.parameters()]
    first, second = account_step(trainer, data[0]), account_step(trainer, data[0])
    assert first == second
    assert all(
        torch.equal(before, after) for before, after in zip(weights, trainer.model.parameters())
    )
    assert not trainer.optimizer.state and trainer.amp.steps == 0


def test_bf16_shrinks_the_activations_and_adds_the_bf16_weights_saved_for_backward():
    fp32_trainer, data = cnn_run("fp32")
    fp32 = account_step(fp32_trainer, data[0])
    bf16_trainer, data = cnn_run("bf16")
    bf16 = account_step(bf16_trainer, data[0])
    assert bf16.categories["activations"] < 0.75 * fp32.categories["activations"]
    assert fp32.categories["weight copies"] == 0
    # autocast casts each layer's weight and bias; backward keeps the weight's copy (for the
    # input's gradient), not the bias's
    weights = [
        module.weight
        for module in bf16_trainer.model.modules()
        if isinstance(module, (nn.Conv2d, nn.Linear))
    ]
    assert bf16.categories["weight copies"] == sum(weight.numel() * 2 for weight in weights)


def test_activations_grow_linearly_with_the_batch():
    trainer, data = cnn_run("fp32")
    sizes = (16, 32, 64)
    activations = [
        account_step(trainer, mpnb.training.batches.with_batch_size(data[0], size)).categories[
            "activations"
        ]
        for size in sizes
    ]
    assert activations[2] - activations[1] == 2 * (activations[1] - activations[0]) > 0


class ReadsItsValues(nn.Module):
    """A forward that branches on a value: a shape-only copy cannot run it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        if x.sum().item() > 1e9:
            x = x * 0
        return self.linear(x)


def test_a_forward_that_reads_values_is_counted_on_the_real_step():
    model = ReadsItsValues()
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.functional.cross_entropy,
        mode="bf16",
        device="cpu",
        dashboard=None,
    )
    account = account_step(trainer, (torch.randn(16, 8), torch.randint(0, 4, (16,))))
    assert not account.shape_only
    assert account.categories["parameters"] == bytes_of(model.parameters())


def test_a_batchnorm_model_is_counted_shape_only_and_quietly(capfd):
    """BatchNorm's buffers (running statistics, the step count) are copied as fake tensors too:
    copying them as torch copies a buffer failed under the fake mode, logged a traceback to
    stderr at each account and fell back to the real step."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10)
    )
    trainer = mpnb.Trainer(
        model, torch.optim.Adam(model.parameters()), nn.functional.cross_entropy,
        mode="bf16", device="cpu", dashboard=None,
    )  # fmt: skip
    before = {name: t.clone() for name, t in model.state_dict().items()}
    account = account_step(trainer, (torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))))
    assert account.shape_only
    weights = bytes_of([*model.parameters(), *model.buffers()])  # the column counts buffers
    assert account.categories["parameters"] == weights
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    assert "fake_tensor" not in capfd.readouterr().err


def test_memory_measures_what_the_account_cannot_see_on_its_own_lines():
    report = mpnb.memory(lambda mode: cnn_run(mode, widths=(32, 64)), ["fp32", "bf16"])
    for account in report.accounts:
        assert account.allocator is not None and account.process is not None
        # the allocator holds every counted tensor, and kernels' buffers on top
        assert account.allocator >= 0.95 * account.tracked
        assert account.inside_kernels == account.allocator - account.tracked
    text = str(report)
    assert "inside kernels" in text and "outside the allocator" in text and "activations" in text
    assert "<table>" in report._repr_html_()


def test_memory_lists_a_mode_the_device_cannot_run_and_refuses_bad_input():
    def refusing(mode):
        if mode == "fp16":
            raise mpnb.DeviceUnavailableError("no fp16 here", ["bf16"])
        return cnn_run(mode)

    report = mpnb.memory(refusing, ["bf16", "fp16"], measure=False)
    assert report.result("bf16").tracked > 0 and "not run: no fp16 here" in str(report)
    with pytest.raises(KeyError, match="no fp16 here"):
        report.result("fp16")
    with pytest.raises(mpnb.InvalidChoiceError, match="'fp9'"):
        mpnb.memory(refusing, ["fp9"])
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1, got 0"):
        mpnb.memory(refusing, ["bf16"], batch_size=0)


def test_a_make_run_that_returns_only_a_trainer_is_told_what_to_return():
    expected = r"make_run\('bf16'\) returned a Trainer.*\(trainer, data\)"
    for analysis in (mpnb.memory, mpnb.max_batch_size, mpnb.compare):
        with pytest.raises(TypeError, match=expected):
            analysis(lambda mode: cnn_run(mode)[0], ["bf16"])


def test_a_metric_that_is_no_function_is_refused_before_any_mode_trains():
    built = []

    def make_run(mode):
        trainer, data = cnn_run(mode)
        built.append(trainer)
        return trainer, data, 0.5  # a value where metric(trainer) -> float goes

    with pytest.raises(TypeError, match=r"returned a float as its metric.*metric\(trainer\)"):
        mpnb.compare(make_run, ["fp32", "bf16"], steps=2, warmup=0)
    assert len(built) == 1 and len(built[0].history) == 0  # the first run, untrained


def gpt2_run(mode):
    pytest.importorskip("transformers")
    model = gpt2_model(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters()), mode=mode, device="cpu", dashboard=None
    )
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    return trainer, [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}]


def test_a_gpt2_with_dict_batches_is_counted_and_sized():
    report = mpnb.memory(gpt2_run, ["fp32", "bf16"], batch_size=32)
    fp32, bf16 = report.result("fp32"), report.result("bf16")
    assert fp32.shape_only and bf16.shape_only and fp32.batch_size == 32
    assert bf16.categories["activations"] < fp32.categories["activations"]
    assert bf16.categories["weight copies"] > 0
    sizes = mpnb.max_batch_size(gpt2_run, ["fp32", "bf16"], memory_budget="96 MiB", start=8)
    for mode in ("fp32", "bf16"):
        result = sizes.result(mode)
        assert result.batch_size > 8 and result.peak <= sizes.budget, str(sizes)
        assert result.account is not None and result.account.batch_size == result.batch_size
    assert sizes.result("bf16").batch_size > sizes.result("fp32").batch_size


def test_compare_shows_each_modes_memory_by_category_in_its_table_files_and_report(tmp_path):
    import json

    from mpnb.ui.plots.compare_report import write_comparison_files

    comparison = mpnb.compare(cnn_run, ["fp32", "bf16"], steps=2, warmup=1, progress=None)
    fp32, bf16 = comparison.result("fp32").memory, comparison.result("bf16").memory
    assert bf16.categories["activations"] < fp32.categories["activations"]
    assert bf16.categories["weight copies"] > 0 == fp32.categories["weight copies"]
    assert "memory of a step, by category" in str(comparison)
    _, json_path, report_path = write_comparison_files(tmp_path, comparison, "cnn")
    rows = json.loads(pathlib.Path(json_path).read_text())["modes"]
    assert [row["memory activations"] for row in rows] == [
        fp32.categories["activations"],
        bf16.categories["activations"],
    ]
    page = pathlib.Path(report_path).read_text()
    assert "memory of a training step, by category" in page and "weight copies" in page


def test_compare_leaves_a_one_shot_iterator_uncounted_and_its_run_unchanged():
    def one_shot(mode):
        trainer, data = cnn_run(mode)
        return trainer, iter(data * 3)

    comparison = mpnb.compare(one_shot, ["bf16"], steps=2, warmup=1, progress=None)
    assert comparison.result("bf16").memory is None and len(comparison.result("bf16").history) == 3


_MEASURED_IN_A_CHILD = """
import os, torch
import mpnb.examples as ex
import mpnb
from mpnb._stderr import native_stderr_without
from mpnb.analysis._torch_memory import _TRACE_MARK

def make_run(mode):
    trainer, train, _ = ex.example_trainer(mode, "cpu", widths=(4, 8), dashboard=None)
    return trainer, train

mpnb.memory(make_run, ["fp32"], batch_size=8, measure=True)
with native_stderr_without(_TRACE_MARK.fullmatch):
    os.write(2, b"USDT:2026-11-27 18:00:00 1:1 Handler.cpp:52] profiler_start\\nkept\\n")
os.write(2, b"after\\n")
"""


def test_a_measured_step_leaves_no_profiler_marks_on_stderr_and_nothing_else_is_lost():
    """torch 2.13's profiler writes "USDT: ... profiler_start" (and stop) to stderr around each
    trace; in a notebook that is red output for every step mpnb measures."""
    child = subprocess.run(
        [sys.executable, "-c", _MEASURED_IN_A_CHILD],
        capture_output=True,
        env=child_environment(),
        timeout=120,
    )
    assert child.returncode == 0, child.stderr.decode()
    assert child.stderr == b"kept\nafter\n"


def test_fp8s_account_counts_its_layers_backward_and_warns_nothing():
    """fp8's layers are swapped in for the forward: its backward runs while they are still in
    place, so torch's tracker finds each module alive (it warned "Module is None. Skipping
    PRE_BW hook." for every one, twice per compare)."""
    import warnings

    pytest.importorskip("torchao")
    trainer, train, _ = ex.example_trainer("fp8", "cpu", model="mlp", dashboard=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        account = account_step(trainer, next(iter(train)))
    assert [str(w.message) for w in caught] == []
    assert account.categories["gradients"] > 0 or account.categories["activations"] > 0


def test_the_memory_table_says_what_each_column_counts_and_when_it_is_read():
    import html

    from mpnb.analysis.memory import MemoryAccount, MemoryReport

    accounts = [
        MemoryAccount("fp32", 8, "cpu", {"parameters": 4096, "gradients": 4096, "activations": 9}),
        MemoryAccount("fp16", 8, "cpu", {"parameters": 4096, "gradients": 0, "activations": 99}),
    ]
    report = MemoryReport(accounts, {})
    for shown in (" ".join(str(report).split()), html.unescape(report._repr_html_())):
        assert "read at the step's peak" in shown, shown
        assert "gradients: " in shown and "activations: " in shown and "parameters: " in shown
        assert "workspace: " not in shown  # a column no mode shows is not explained


@pytest.mark.parametrize("ask", ["memory", "memory at a size", "max_batch_size"])
def test_a_first_batch_of_no_samples_is_named_as_such_not_as_unresizable(ask):
    # said "cannot resize a batch without a tensor of samples: got a tuple of 2"
    def make_run(mode):
        trainer, _ = cnn_run(mode)
        return trainer, [(torch.randn(0, 1, 28, 28), torch.randint(0, 10, (0,)))]

    call = {
        "memory": lambda: mpnb.memory(make_run, ["fp32"], measure=False),
        "memory at a size": lambda: mpnb.memory(make_run, ["fp32"], batch_size=8, measure=False),
        "max_batch_size": lambda: mpnb.max_batch_size(make_run, ["fp32"], memory_budget="64 MiB"),
    }[ask]
    with pytest.raises(mpnb.MpnbError, match=r"first batch holds no samples \(a tuple of 2"):
        call()


@pytest.mark.parametrize("size", [1, 3, 9])
def test_a_batch_grown_or_cut_to_a_size_holds_that_many_samples_bytes(size):
    # the slice of a repeated tensor kept the whole repeated storage: batch_size=1 of an
    # 8-sample batch counted 8 samples' bytes, 9 counted 16
    def make_run(mode):
        trainer, _ = cnn_run(mode)
        return trainer, [(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))]

    sample_bytes = 28 * 28 * 4 + 8
    account = mpnb.memory(make_run, ["fp32"], batch_size=size, measure=False).result("fp32")
    assert account.categories["batch"] == size * sample_bytes
    grown = mpnb.training.batches.with_batch_size((torch.zeros(8, 4),), size)[0]
    assert grown.untyped_storage().nbytes() == size * 4 * 4


def test_memory_takes_and_checks_its_modes_as_compare_does():
    # "fp32,bf16" was read letter by letter (unknown mode 'f'), fp32 and float32 gave two fp32
    # rows, and a make_run that ignored its mode gave two fp32 rows read as fp32 and bf16
    report = mpnb.memory(cnn_run, "fp32, bf16", measure=False)
    assert [account.mode for account in report.accounts] == ["fp32", "bf16"]
    with pytest.raises(ValueError, match="'fp32' is named twice"):
        mpnb.memory(cnn_run, ["fp32", "float32"], measure=False)
    with pytest.raises(ValueError, match="the run built for mode 'bf16' trains in 'fp32'"):
        mpnb.memory(lambda mode: cnn_run("fp32"), ["fp32", "bf16"], measure=False)


def _bn_run(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy,
        mode=mode, device="cpu", dashboard=None,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    return trainer, [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))] * 6


def test_a_batchnorm1d_model_is_counted_and_compared():
    # the warm-up step ran one sample, which BatchNorm1d refuses in training: compare lost
    # every finished mode's result at its end
    assert mpnb.memory(_bn_run, ["fp32"], measure=False).result("fp32").categories["parameters"]
    result = mpnb.compare(_bn_run, ["fp32", "bf16"], steps=3, warmup=1, progress=None)
    assert [r.memory is not None for r in result.results] == [True, True]


def test_compare_measures_the_metric_on_the_run_as_trained_and_leaves_it_so():
    # a forward that reads values is counted on real steps, which trained the run two more
    # steps before its metric was measured (weights 0.32 away from the same run alone)
    def make_run(mode):
        torch.manual_seed(0)
        model = ReadsItsValues()
        trainer = mpnb.Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.5), nn.functional.cross_entropy,
            mode=mode, device="cpu", dashboard=None,
        )  # fmt: skip
        g = torch.Generator().manual_seed(2)
        data = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g))] * 4
        return trainer, data, lambda t: float(t.model.linear.weight.sum())

    alone, data, metric = make_run("fp32")
    alone.fit(data, epochs=1, max_steps=3)
    kept = {}
    result = mpnb.compare(
        lambda mode: (run := make_run(mode)) and kept.setdefault(mode, run[0]) and run,
        ["fp32"], steps=3, warmup=0, progress=None,
    )  # fmt: skip
    assert result.result("fp32").metric == metric(alone)
    assert torch.equal(kept["fp32"].model.linear.weight, alone.model.linear.weight)


def test_a_step_that_cannot_be_counted_leaves_the_comparison_with_a_note():
    class EightOnly(nn.Linear):  # refuses any batch but its data's
        def forward(self, x):
            if x.shape[0] != 8:
                raise RuntimeError(f"wants 8 samples, got {x.shape[0]}")
            return super().forward(x)

    def make_run(mode):
        trainer, data = _bn_run(mode)
        trainer.model[0] = EightOnly(4, 8)
        trainer.optimizer.add_param_group({"params": trainer.model[0].parameters()})
        return trainer, data

    with pytest.warns(RuntimeWarning, match="fp32: its step.s memory could not be counted"):
        result = mpnb.compare(make_run, ["fp32"], steps=2, warmup=0, progress=None)
    fp32 = result.result("fp32")
    assert fp32.memory is None and len(fp32.history) == 2
    assert any("memory could not be counted (RuntimeError: wants 8" in n for n in fp32.notes)
