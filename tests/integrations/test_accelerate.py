"""mpnb's loop recorder in a real Accelerate loop on CPU, and in a plain torch loop."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from mpnb.integrations.accelerate import LoopRecorder

accelerate = pytest.importorskip(
    "accelerate", reason="accelerate: pip install 'mpnb[transformers]'"
)


def batches(count: int = 8):
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
        for _ in range(count)
    ]


def prepared(mixed_precision: str, scaler: torch.amp.GradScaler | None = None, accumulate: int = 1):
    accelerator = accelerate.Accelerator(
        mixed_precision=mixed_precision, cpu=True, gradient_accumulation_steps=accumulate
    )
    if scaler is not None:
        # on CPU Accelerate makes none; its own code paths use one given
        accelerator.scaler = scaler
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def run(accelerator, model, optimizer, data, poison_at: int | None = None):
    from mpnb.integrations.accelerate import watch

    losses = []
    with watch(accelerator, model, optimizer, dashboard=None) as recorder:
        for index, (inputs, targets) in enumerate(data):
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(inputs), targets)
                if index == poison_at:
                    loss = loss * float("inf")
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            recorder.record(loss, (inputs, targets))
    return recorder.history, losses


def test_bf16_loop_rows_losses_and_mode():
    accelerator, model, optimizer = prepared("bf16")
    history, losses = run(accelerator, model, optimizer, batches())
    assert len(history) == 8 and history.mode == ["bf16"] * 8
    assert history.loss == pytest.approx(losses, rel=1e-6)


def test_accumulation_makes_one_row_per_optimizer_step():
    accelerator, model, optimizer = prepared("bf16", accumulate=2)
    history, losses = run(accelerator, model, optimizer, batches())
    assert len(history) == 4
    assert history.loss == pytest.approx(
        [(losses[i] + losses[i + 1]) / 2 for i in range(0, 8, 2)], rel=1e-6
    )


def test_skips_are_counted_from_the_scaler_accelerate_really_uses():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    accelerator, model, optimizer = prepared("no", scaler=scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the inf loss warns
        history, _ = run(accelerator, model, optimizer, batches(), poison_at=3)
    assert history.skipped_steps == [4]  # the fourth batch, step 4
    assert history.loss_scale == [1024.0] * 4 + [512.0] * 4  # each row: the scale its step ran with
    assert scaler.get_scale() == 512.0 and accelerator.optimizer_step_was_skipped is False


def test_fp16_on_cpu_says_that_accelerate_trains_something_else():
    accelerator, model, optimizer = prepared("fp16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history, _ = run(accelerator, model, optimizer, batches(2))
    observed = history.mode[0]
    said = [str(w.message) for w in caught if str(w.message).startswith("mpnb:")]
    if observed != "fp16":
        assert said == [
            f"mpnb: Accelerate was asked for fp16 but trains in {observed} (read from autocast and the weights during the forward pass)"
        ]


def test_a_plain_loop_and_a_recorder_used_after_close():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = LoopRecorder.start(
        "my loop", model, optimizer, scaler=None, device="cpu", dashboard=None
    )
    recorder.close()
    with pytest.raises(RuntimeError, match="my loop: no run is being recorded"):
        recorder.record(torch.tensor(1.0))
    assert not optimizer._optimizer_step_post_hooks


def test_a_loop_asks_to_stop_at_a_non_finite_loss_with_on_nonfinite_stop():
    from mpnb.integrations.accelerate import watch

    accelerator, model, optimizer = prepared("bf16")
    stops = []
    with watch(accelerator, model, optimizer, dashboard=None, on_nonfinite="stop") as recorder:
        for index, (inputs, targets) in enumerate(batches(6)):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            if index == 2:
                loss = loss * float("nan")
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            stops.append(recorder.record(loss, (inputs, targets)))
            if stops[-1]:
                break
    assert stops == [False, False, True]  # flushed at each step: the loop stops at the bad one


def test_importing_mpnb_imports_no_framework():
    code = "import sys, mpnb, mpnb.integrations; print(sorted({'transformers', 'lightning', 'accelerate'} & set(sys.modules)))"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "[]"
    )
