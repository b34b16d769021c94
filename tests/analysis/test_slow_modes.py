"""Slow modes said up front: the estimate is measured on a copy, and the run is untouched."""

from __future__ import annotations

import json
import re

import torch

import mpnb.examples as ex
from mpnb.analysis.slow_modes import slow_mode_notice, slow_reason
from tests.test_cli import mpnb

# Read here from torch's own CPU probe: whether this CPU computes bf16 natively (AMX-BF16 or
# AVX512-BF16) or emulates it. Either way the tests below check that mpnb says what is so.
_CAPABILITIES = torch.cpu.get_capabilities()
BF16_EMULATED = not (_CAPABILITIES.get("amx_bf16") or _CAPABILITIES.get("avx512_bf16"))
EMULATED = re.compile(r"bf16 is emulated on this CPU \(.+: neither AMX-BF16 nor AVX512-BF16\)")
FP16_EMULATED = not (_CAPABILITIES.get("amx_fp16") or _CAPABILITIES.get("avx512_fp16"))
FP16_SLOW = re.compile(r"fp16 is emulated on this CPU \(.+: neither AMX-FP16 nor AVX512-FP16\)")


def test_the_estimate_leaves_the_model_and_the_random_state_as_they_were():
    trainer, train, _ = ex.example_trainer("fp16", "cpu", widths=(4, 8), dashboard=None)
    weights = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    torch.manual_seed(7)
    random_state = torch.random.get_rng_state()
    notice = slow_mode_notice(trainer, next(iter(train)), steps=3000)
    assert (
        notice.startswith("fp16 convolutions have no fast CPU kernels: about ")
        and "3000 steps take about" in notice
    )
    assert torch.equal(torch.random.get_rng_state(), random_state)
    assert all(
        torch.equal(value, weights[name]) for name, value in trainer.model.state_dict().items()
    )
    assert all(p.grad is None for p in trainer.model.parameters())


def test_modes_that_are_not_slow_here_say_nothing():
    modes = [("fp32", "cnn")] + ([] if BF16_EMULATED else [("bf16", "cnn")])
    modes += [] if FP16_EMULATED else [("fp16", "mlp")]
    for mode, model in modes:
        trainer, train, _ = ex.example_trainer(mode, "cpu", model=model, dashboard=None)
        assert (
            slow_reason(trainer) is None
            and slow_mode_notice(trainer, next(iter(train)), 10) is None
        )


def test_fp16_on_a_cpu_without_fp16_units_is_said_to_be_slow_for_a_transformer_too():
    """Not only convolutions: without AMX-FP16 or AVX512-FP16 a CPU converts fp16 matrix
    products to fp32 and back. The example transformer's fp16 step, measured as the notice
    measures it, was 72 ms beside bf16's 8 ms on an AVX512-BF16 CPU (a ratio a busy shared
    machine makes too noisy to assert here; docs/guide/compare.md has the figures)."""
    trainer, train, _ = ex.example_trainer("fp16", "cpu", model="transformer", dashboard=None)
    batch = next(iter(train))
    reason = slow_reason(trainer)
    assert bool(reason and FP16_SLOW.fullmatch(reason)) is FP16_EMULATED, reason
    notice = slow_mode_notice(trainer, batch, steps=100)
    assert bool(notice and FP16_SLOW.match(notice)) is FP16_EMULATED, notice


def test_bf16_on_a_cpu_without_bf16_units_is_said_to_be_emulated():
    trainer, train, _ = ex.example_trainer("bf16", "cpu", model="mlp", dashboard=None)
    reason = slow_reason(trainer)
    assert bool(reason and EMULATED.fullmatch(reason)) is BF16_EMULATED, reason
    notice = slow_mode_notice(trainer, next(iter(train)), steps=100)
    assert bool(notice and EMULATED.match(notice)) is BF16_EMULATED, notice


def test_train_and_compare_say_bf16_is_emulated_where_it_is(tmp_path):
    trained = mpnb("train", "--mode", "bf16", "--steps", "2", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert bool(EMULATED.match(trained.stdout)) is BF16_EMULATED, trained.stdout
    compared = mpnb(
        "compare",
        "--modes",
        "fp32,bf16",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--model",
        "mlp",
        cwd=tmp_path,
    )
    assert compared.returncode == 0, compared.stderr
    notes_shown = compared.stdout.partition("\nnotes:\n")[2].replace("\n  ", " ")
    said = [line for line in notes_shown.splitlines() if EMULATED.search(line)]
    assert [line.startswith("- bf16: ") for line in said] == ([True] if BF16_EMULATED else []), said
    out = tmp_path / "mpnb-compare"
    notes = {
        row["mode"]: row["notes"]
        for row in json.loads((out / "comparison.json").read_text())["modes"]
    }
    assert any(EMULATED.search(note) for note in notes["bf16"]) is BF16_EMULATED, notes
    assert bool(EMULATED.search((out / "report.html").read_text())) is BF16_EMULATED
