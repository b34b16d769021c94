"""Per-layer numerics inside the loops mpnb does not drive: the sampled watch, and where an fp16
overflow began, named from the steps after the first skip (no batch to replay there), with the
remedy applied from the next step and taken back at the run's end."""

from __future__ import annotations

import warnings

import pytest
import torch

from mpnb.integrations.accelerate import LoopRecorder
from tests.numerics.test_origin import LogOfNegatives, gpt2_batches, overflowing_gpt2

PLANTED = "GPT2LMHeadModel.transformer.h.1.mlp.c_proj"


def fp16_loop(
    batches, *, remedy: bool, model=None, optimizer=None, scaler=None, started=None, **options
):
    """A hand-written fp16 loop (GradScaler, autocast on the CPU) recorded by mpnb, as
    ``mpnb.integrations.accelerate.watch`` records an Accelerate loop; by default on the GPT-2
    whose MLP projection overflows, at a scale of 1. ``remedy``: keep the named module in fp32.
    ``started``: called with the recorder before the first batch; ``options``: the recorder's
    (no dashboard unless asked)."""
    model = model or overflowing_gpt2()
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = scaler or torch.amp.GradScaler("cpu", init_scale=1.0)
    options = {"dashboard": None} | options
    recorder = LoopRecorder.start(
        "my loop", model, optimizer, scaler=scaler, device="cpu", **options
    )
    if started is not None:
        started(recorder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            recorder.record(loss, batch=batch["input_ids"])
            origins = [e for e in recorder.history.events if e["kind"] == "origin"]
            if (
                remedy
                and origins
                and not any(e["kind"] == "switch" for e in recorder.history.events)
            ):
                recorder.keep_in_fp32(origins[0]["module"])
        history = recorder.close()
    return model, recorder, history


def test_the_origin_is_named_from_the_step_after_the_first_skip_in_a_loop_of_ones_own():
    model, recorder, history = fp16_loop(gpt2_batches(3), remedy=False, flush_every=1)
    (origin,) = [e for e in history.events if e["kind"] == "origin"]
    assert (origin["module"], origin["phase"], origin["op"]) == (PLANTED, "forward", "aten.addmm")
    assert origin["step"] == 2 and "watched after step 1 skipped" in origin["message"]
    assert history.skipped == [True, True, True]
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch._C._len_torch_dispatch_stack() == 0  # the instrument came off


def test_the_remedy_stops_the_skips_from_the_next_step_and_is_taken_back_at_the_end():
    model, _, history = fp16_loop(gpt2_batches(5), remedy=True, flush_every=1)
    assert history.skipped == [True, True, False, False, False]
    switch = next(e for e in history.events if e["kind"] == "switch")
    assert switch["module"] == "transformer.h.1.mlp.c_proj" and switch["step"] == 3
    assert "forward" not in vars(model.transformer.h[1].mlp.c_proj)  # put back


def test_a_session_reset_undoes_the_remedy_in_a_loop_of_ones_own():
    from mpnb.precision.policy import session

    def reset_after_step_three(recorder):
        recorder.control.pollers.append(
            lambda: session.reset() if recorder.telemetry.steps == 3 else None
        )

    model, _, history = fp16_loop(
        gpt2_batches(5), remedy=True, started=reset_after_step_three, flush_every=1
    )
    assert history.skipped == [True, True, False, True, True]
    undone = [e for e in history.events if e["kind"] == "switch"][-1]
    assert undone["step"] == 4 and "runs under autocast again" in undone["message"]
    assert "forward" not in vars(model.transformer.h[1].mlp.c_proj)


def test_without_locating_no_origin_is_noted_and_the_watch_samples_densely_after_a_skip():
    _, recorder, history = fp16_loop(
        gpt2_batches(4), remedy=False, flush_every=1, locate_overflow=False, watch_numerics=2
    )
    assert not [e for e in history.events if e["kind"] == "origin"]
    log = recorder.numerics
    assert log.steps == [2, 3, 4]  # every 2nd step, and each one after step 1's skip
    assert log.nonfinite["transformer.h.1.mlp.c_proj"][0] > 0
    assert log.nonfinite["transformer.h.0.mlp.c_proj"] == [0.0, 0.0, 0.0]


def test_a_skip_the_lowered_scale_cures_is_said_to_be_in_the_scaled_gradients():
    """A scale of 2**40 overflows the scaled backward of a plain GPT-2 once; GradScaler's
    backoff brings the gradients back in range, and the watched steps stay finite."""
    from tests.conformance.models import gpt2_model

    model = gpt2_model(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    _, _, history = fp16_loop(
        gpt2_batches(5),
        remedy=False,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-4),
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30),
        flush_every=1,
    )
    assert history.skipped[0] and not any(history.skipped[1:])
    (note,) = [e for e in history.events if e["kind"] == "origin"]
    assert "3 steps watched after it stayed finite" in note["message"]
    assert "module" not in note


def test_lightnings_trainer_names_the_origin_with_its_own_fp16_scaler():
    lightning = pytest.importorskip(
        "lightning", reason="the lightning extra: pip install 'mpnb[lightning]'"
    )
    from lightning.pytorch.plugins.precision import MixedPrecision

    from mpnb.integrations.lightning import MpnbCallback

    class Gpt2(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = overflowing_gpt2()

        def training_step(self, batch, index):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    callback = MpnbCallback(dashboard=None, flush_every=1, watch_numerics=1)
    trainer = lightning.Trainer(
        accelerator="cpu", max_steps=3, callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1.0))],
    )  # fmt: skip
    data = gpt2_batches(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Gpt2(), torch.utils.data.DataLoader(data, batch_size=None))
    (origin,) = [e for e in callback.history.events if e["kind"] == "origin"]
    assert origin["module"] == "Gpt2.model.transformer.h.1.mlp.c_proj"
    assert origin["phase"] == "forward"
    assert callback.numerics.steps == [1, 2, 3]
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_non_finite_bf16_loss_is_followed_to_where_the_next_step_makes_it():
    """No scaler, no skip: a NaN loss arms the locator too, and the next step names the module
    and op that make the NaN (the head's weights turned NaN in the update; the log's input did
    not, and the log makes the first NaN again)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), LogOfNegatives(), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[0].bias.fill_(-10.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = LoopRecorder.start(
        "my loop", model, optimizer, scaler=None, device="cpu", dashboard=None, flush_every=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.ones(8, 4)).float().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            recorder.record(loss, batch=torch.ones(8, 4))
        history = recorder.close()
    (origin,) = [e for e in history.events if e["kind"] == "origin"]
    assert origin["step"] == 2 and "watched after step 1's loss was nan" in origin["message"]
    assert (origin["module"], origin["op"], origin["problem"]) == (
        "Sequential.1",
        "aten.log",
        "nan",
    )
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_loops_live_dashboard_offers_the_remedy_and_draws_the_heatmaps(capsys):
    """Inside a loop mpnb does not drive, the live dashboard has the Trainer's numerics views:
    the heatmaps with the origin marked, and the remedy's button, whose click (delivered at a
    step's checkpoint, as a notebook delivers it) stops the skips from the next step."""
    from mpnb.ui.widgets.numerics_view import NumericsView
    from mpnb.ui.widgets.remedy_view import RemedyView

    views, clicks = [], []

    def click_when_offered(recorder):
        (remedy,) = [view for view in views if isinstance(view, RemedyView)]
        if remedy.module is not None and not remedy.button.disabled:
            remedy.button.click()
            clicks.append(recorder.telemetry.steps)

    def started(recorder):  # a poller runs at each checkpoint, as a delivered click does
        views.extend(recorder.telemetry.recorder.sinks)
        recorder.control.pollers.append(lambda: click_when_offered(recorder))

    _, _, history = fp16_loop(gpt2_batches(5), remedy=False, started=started, dashboard="live",
                              flush_every=1, watch_numerics=1)  # fmt: skip
    capsys.readouterr()  # outside a notebook, display() prints the widgets' text
    assert clicks == [2]
    assert history.skipped == [True, True, False, False, False]
    (heatmaps,) = [view for view in views if isinstance(view, NumericsView)]
    marked = next(t for t in heatmaps.figure.data if t.name == "origin of the overflow")
    assert (marked.y[0], marked.x[0]) == ("transformer.h.1.mlp.c_proj", 2)


def test_a_loop_whose_skips_come_from_a_parameter_gradient_names_it_instead_of_an_all_clear():
    """Only the second layer's weight gradient overflows (its input is large): every step
    skips, and the steps watched after the first one must say where, not that they fit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, backoff_factor=0.99)
    recorder = LoopRecorder.start(
        "my loop", model, optimizer, scaler=scaler, device="cpu", dashboard=None, flush_every=1
    )
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(4):
            x = torch.randn(32, 64, generator=generator) * 30
            y = torch.randint(0, 4, (32,), generator=generator)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            recorder.record(loss, batch=x)
        history = recorder.close()
    assert all(history.skipped)
    (origin,) = [e for e in history.events if e["kind"] == "origin"]
    assert (origin["module"], origin["phase"]) == ("Sequential.1", "backward"), origin["message"]
    assert "stayed finite" not in origin["message"]
