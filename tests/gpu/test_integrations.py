"""The framework integrations on a CUDA GPU: fp16 with the real GradScaler, and no added sync."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: fp16 scalers run only there"
)
accelerate = pytest.importorskip(
    "accelerate", reason="accelerate: pip install 'mpnb[transformers]'"
)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_accelerate_fp16_skips_match_the_scalers_backoffs_and_recording_adds_no_sync():
    from accelerate.utils import GradScalerKwargs

    from mpnb.integrations.accelerate import watch

    # a scale so high that the first steps overflow fp16 gradients: GradScaler skips them and halves it
    accelerator = accelerate.Accelerator(
        mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2.0**40)]
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = [
        (torch.randn(32, 64, device="cuda"), torch.randint(0, 8, (32,), device="cuda"))
        for _ in range(30)
    ]
    with watch(accelerator, model, optimizer, dashboard=None) as recorder:
        for inputs, targets in data:
            loss = nn.functional.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            rows = recorder.telemetry.recorder
            flushing = (
                rows.pending + 1 >= rows.flush_every
            )  # the flush copies to the host: one sync, by design
            torch.cuda.set_sync_debug_mode("default" if flushing else "error")
            try:
                recorder.record(loss, (inputs, targets))  # between flushes: no host-device sync
            finally:
                torch.cuda.set_sync_debug_mode("default")
    history = recorder.history
    assert history.mode == ["fp16"] * 30
    backoffs = [i + 1 for i in range(29) if history.loss_scale[i + 1] < history.loss_scale[i]]
    assert history.skipped_steps and history.skipped_steps == [
        step for step in history.step if step in backoffs
    ]
    # a scaler is there: no fp16-without-scaling notice, only the mark of the run's start
    assert [event["kind"] for event in history.events] == ["run"]


def test_transformers_trainer_bf16_on_cuda(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from mpnb.integrations.transformers import MpnbCallback, precision_args
    from tests.conformance.models import gpt2_model

    ids = torch.randint(0, 96, (64, 12), generator=torch.Generator().manual_seed(0))
    callback = MpnbCallback(dashboard=None)
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=8, max_steps=5, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, **precision_args("bf16", device="cuda"),
    )  # fmt: skip
    trainer = Trainer(
        model=gpt2_model(),
        args=args,
        train_dataset=[{"input_ids": r, "labels": r} for r in ids],
        callbacks=[callback],
    )
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert callback.history.loss == pytest.approx(logged, rel=1e-6)
    assert callback.history.mode == ["bf16"] * 5
