"""The remedy asked for late, after the skips have driven the fp16 loss scale down to where every
gradient underflows: the scale comes back and the model trains again, in mpnb's Trainer and in a
loop of one's own; and the remedy asked for between fits changes nothing until the next fit."""

from __future__ import annotations

import warnings

import torch

import mpnb
from mpnb.integrations.accelerate import LoopRecorder
from tests.numerics.test_origin import gpt2_batches, overflowing_gpt2

PLANTED = "transformer.h.1.mlp.c_proj"
#: Each skip divides the scale by 2**16: four skips take 65536 to 3.6e-15, where a scaled loss
#: of a few units is below fp16's smallest subnormal and every gradient is zero.
COLLAPSING = {"init_scale": 2.0**16, "backoff_factor": 2.0**-16}


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def test_a_late_remedy_in_the_trainer_gives_the_scale_back_and_the_model_trains_again():
    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), mode="fp16", device="cpu",
        dashboard=None, record_grad_norm=True, on_nonfinite="ignore", **COLLAPSING,
    )  # fmt: skip
    moved: list[bool] = []
    before = weights(model)

    def late_remedy_then_watch_the_weights():  # between steps, as a button's click is delivered
        nonlocal before
        if trainer.amp.steps == 4:
            trainer.keep_in_fp32(PLANTED)
        now = weights(model)
        moved.append(not torch.equal(now, before))
        before = now

    trainer.control.pollers.append(late_remedy_then_watch_the_weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = trainer.fit(gpt2_batches(8))
    assert history.skipped == [True] * 4 + [False] * 4
    assert history.loss_scale[3] < 1e-9  # the skips' halvings: 2**-32 for the fourth
    assert history.loss_scale[4:] == [2.0**16] * 4  # given back at the remedy
    assert all(norm > 0 for norm in history.grad_norm[4:]), history.grad_norm
    assert moved[-3:] == [True, True, True]  # polled before steps 6-8: steps 5-7 moved them
    (back,) = [e for e in history.events if e["kind"] == "scale"]
    assert back["step"] == 5 and back["message"].startswith("loss scale back to 65536 from 3.6e-15")
    assert not [e for e in history.events if e["kind"] == "zero_gradients"]
    assert "forward" not in vars(model.transformer.h[1].mlp.c_proj)


def test_steps_taken_at_a_collapsed_scale_are_an_alarm():
    """Without the scale given back (the remedy through the remedy object alone, as no mpnb
    code asks for it), the steps after it train on zero gradients: the health watch says so."""
    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), mode="fp16", device="cpu",
        dashboard=None, record_grad_norm=True, on_nonfinite="ignore", **COLLAPSING,
    )  # fmt: skip

    def remedy_without_the_scale():
        if trainer.amp.steps == 4:
            trainer._instruments.keep_in_fp32(PLANTED, trainer.amp.steps + 1)

    trainer.control.pollers.append(remedy_without_the_scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        history = trainer.fit(gpt2_batches(6))
    assert history.skipped == [True] * 4 + [False] * 2 and history.grad_norm[4:] == [0.0, 0.0]
    (alarm,) = [e for e in history.events if e["kind"] == "zero_gradients"]
    assert alarm["step"] == 5 and "underflow fp16 to zero" in alarm["message"]


def test_a_late_remedy_in_a_loop_of_ones_own_gives_the_frameworks_scale_back():
    model = overflowing_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", **COLLAPSING)
    recorder = LoopRecorder.start(
        "my loop", model, optimizer, scaler=scaler, device="cpu", dashboard=None, flush_every=1
    )
    norms, moved = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step, batch in enumerate(gpt2_batches(8), start=1):
            before = weights(model)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norms.append(
                float(
                    torch.linalg.vector_norm(
                        torch.stack([p.grad.norm() for p in model.parameters()])
                    )
                )
            )
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            moved.append(not torch.equal(weights(model), before))
            recorder.record(loss, batch=batch["input_ids"])
            if step == 4:
                recorder.keep_in_fp32("GPT2LMHeadModel." + PLANTED)
        history = recorder.close()
    assert history.skipped == [True] * 4 + [False] * 4
    assert history.loss_scale[4:] == [2.0**16] * 4
    assert all(norm > 0 for norm in norms[4:]) and moved[4:] == [True] * 4
    (back,) = [e for e in history.events if e["kind"] == "scale"]
    assert back["step"] == 5
    assert "forward" not in vars(model.transformer.h[1].mlp.c_proj)


def test_a_remedy_asked_between_fits_waits_for_the_next_fit_and_lasts_it():
    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), mode="fp16", device="cpu",
        dashboard=None, init_scale=1.0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert trainer.fit(gpt2_batches(2)).skipped == [True, True]
        assert trainer.keep_in_fp32(PLANTED) == PLANTED
        projection = model.transformer.h[1].mlp.c_proj
        assert "forward" not in vars(projection)  # nothing changed between fits
        with torch.autocast("cpu", dtype=torch.float16):  # a %%autocast cell's: fp16 there
            assert projection(torch.ones(1, projection.weight.shape[0])).dtype == torch.float16
        history = trainer.fit(gpt2_batches(3))
    assert history.skipped[2:] == [False, False, False]
    kept = [e for e in history.events if e["kind"] == "switch"]
    assert [(e["step"], e["module"]) for e in kept] == [(3, PLANTED)]
    assert "forward" not in vars(projection)  # the fit it applied to ended


def test_a_switch_of_op_lists_that_ends_the_overflow_gives_the_scale_back():
    from mpnb.oplists.lists import OpLists

    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), mode="fp16", device="cpu",
        dashboard=None, record_grad_norm=True, on_nonfinite="ignore", **COLLAPSING,
    )  # fmt: skip
    trainer.control.pollers.append(
        lambda: mpnb.set_oplists(OpLists(fp32=["addmm"])) if trainer.amp.steps == 4 else None
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            history = trainer.fit(gpt2_batches(6))
    finally:
        mpnb.set_oplists(OpLists())
    assert history.skipped == [True] * 4 + [False] * 2
    assert history.loss_scale[4:] == [2.0**16] * 2
    assert all(norm > 0 for norm in history.grad_norm[4:])
    (back,) = [e for e in history.events if e["kind"] == "scale"]
    assert back["step"] == 5 and back["message"].endswith("the precision changed")


def test_a_remedy_asked_between_fits_gives_the_lowered_scale_back_for_the_next_fit():
    """The simple path of lesson 12: fit, read the origin, keep_in_fp32, fit again. The skips of
    the first fit lowered the scale (1.0 to 0.25); the next fit starts from the initial scale, so
    its gradients do not underflow and no alarm is raised."""
    model = overflowing_gpt2()
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), mode="fp16", device="cpu",
        dashboard=None, init_scale=1.0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer.fit(gpt2_batches(2))
    trainer.keep_in_fp32(PLANTED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.fit(gpt2_batches(3))
    assert history.skipped[2:] == [False, False, False] and history.loss_scale[2] == 1.0
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == []
    later = [e["kind"] for e in history.events if e["step"] > 2]
    assert "zero_gradients" not in later and "collapse" not in later, history.events


def test_a_module_shared_by_two_parents_is_kept_by_either_name_once():
    # keep_in_fp32("p2.lin") was refused: "no module named 'p2.lin'; closest: p1.lin, p2"
    class Parent(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x)

    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(Parent(shared), Parent(shared), torch.nn.Linear(4, 1))
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.0), torch.nn.MSELoss(),
        mode="bf16", device="cpu", dashboard=None,
    )  # fmt: skip
    assert trainer.keep_in_fp32(["1.lin", "0.lin"]) == ["0.lin", "0.lin"]
    history = trainer.fit([(torch.ones(2, 4), torch.zeros(2, 1))] * 2)
    switches = [event["message"] for event in history.events if event["kind"] == "switch"]
    assert switches == ["0.lin runs in fp32 (autocast off inside it)"]
    assert "forward" not in vars(shared)
