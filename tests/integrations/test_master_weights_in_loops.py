"""The weights' own dtype in the loops mpnb does not drive: fp16 weights under an fp16 scaler are
refused when the loop is attached (torch's GradScaler would stop at the first step with
"Attempting to unscale FP16 gradients."), and bf16 weights trained under autocast with no fp32
master copy draw a notice at the first step."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mpnb.integrations.accelerate import LoopRecorder
from mpnb.training.master_weights import LOW_PRECISION_WEIGHTS, UnscalableWeightsError

L = pytest.importorskip("lightning", reason="the lightning extra: pip install 'mpnb[lightning]'")

from mpnb.integrations.lightning import MpnbCallback  # noqa: E402
from tests.integrations.test_lightning import (  # noqa: E402
    Classifier,
    fp16_with_scaler,
    loader,
    quiet_trainer,
)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_a_hand_loop_with_fp16_weights_and_a_scaler_is_refused_when_attached():
    model = mlp().half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        UnscalableWeightsError, match=r"4 parameters \(0\.weight, 0\.bias, 2\.weight"
    ):
        LoopRecorder.start(
            "my loop",
            model,
            optimizer,
            scaler=torch.amp.GradScaler("cpu"),
            device="cpu",
            dashboard=None,
        )
    # nothing attached: no hook on the model or the optimizer
    assert not model[0]._forward_pre_hooks and not model._forward_pre_hooks
    assert optimizer._optimizer_step_post_hooks == {}


def test_lightning_with_an_fp16_module_and_its_fp16_scaler_stops_with_mpnbs_words():
    module = Classifier().half()
    callback = MpnbCallback(dashboard=None)
    trainer = quiet_trainer(callback, plugins=[fp16_with_scaler()], max_steps=2)
    with pytest.raises(UnscalableWeightsError, match=r"net\.0\.weight.*model\.float\(\)"):
        trainer.fit(module, loader())
    assert len(callback.history) == 0


def test_a_bf16_model_under_bf16_autocast_in_a_hand_loop_draws_the_notice_once():
    model = mlp().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    recorder = LoopRecorder.start(
        "my loop", model, optimizer, scaler=None, device="cpu", dashboard=None
    )
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            recorder.record(loss, batch=x)
        history = recorder.close()
    said = [str(w.message) for w in caught if "no fp32 master copy" in str(w.message)]
    assert len(said) == 1 and "about 1/256 of its weight" in said[0], said
    (notice,) = [e for e in history.events if e["kind"] == LOW_PRECISION_WEIGHTS]
    assert notice["step"] == 1 and "0.weight" in notice["message"]


def test_an_fp32_model_under_bf16_autocast_draws_no_notice():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = LoopRecorder.start(
        "my loop", model, optimizer, scaler=None, device="cpu", dashboard=None
    )
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.step()
    recorder.record(loss, batch=x)
    assert not [e for e in recorder.close().events if e["kind"] == LOW_PRECISION_WEIGHTS]


@pytest.mark.parametrize(("setting", "said"), [("bf16-mixed", True), ("bf16-true", False)])
def test_lightning_says_it_for_a_bf16_module_under_bf16_mixed_not_under_bf16_true(setting, said):
    """bf16-true is training in bf16 weights by choice; bf16-mixed meant an fp32 master copy."""
    callback = MpnbCallback(dashboard=None)
    module = Classifier().to(torch.bfloat16) if setting == "bf16-mixed" else Classifier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer(callback, precision=setting, max_steps=2).fit(module, loader())
    kinds = [e["kind"] for e in callback.history.events]
    assert (LOW_PRECISION_WEIGHTS in kinds) is said, callback.history.events
