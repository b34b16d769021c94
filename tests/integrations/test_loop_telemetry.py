"""LoopTelemetry, the core every integration shares, driven directly as a hand-written loop would."""

from __future__ import annotations

import math
import time
import warnings

import numpy
import pytest
import torch

from mpnb.errors import InvalidChoiceError
from mpnb.integrations.loop_telemetry import LoopTelemetry


def run_steps(telemetry, model, steps, *, loss=True, autocast=None, epoch=0):
    optimizer = telemetry._run.optimizer
    for _ in range(steps):
        telemetry.window_begin()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            value = (
                model(torch.ones(8, 4, dtype=next(model.parameters()).dtype)).float().pow(2).mean()
            )
        value.backward()
        if loss:
            telemetry.add_loss(value)
        telemetry.add_samples(8)
        telemetry.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        telemetry.step_end(epoch=epoch)


def small_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def begin(telemetry, model, asked=None, **options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    telemetry.begin(model, optimizer, scaler=None, device="cpu", asked=asked, **options)


def linear_run():
    """A begun LoopTelemetry without a dashboard, and the linear model it watches."""
    telemetry = LoopTelemetry("my loop", dashboard=None)
    model = torch.nn.Linear(4, 1)
    begin(telemetry, model)
    return telemetry, model


def recorded_warnings(action):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if str(w.message).startswith("mpnb:")]


@pytest.mark.parametrize("on_nonfinite", ["warn", "stop"])
def test_a_step_with_no_readable_loss_is_unknown_not_nonfinite(on_nonfinite):
    """A framework step that returned no loss mpnb can read (manual optimization, a custom loss)."""
    telemetry = LoopTelemetry("my loop", dashboard=None, on_nonfinite=on_nonfinite)
    model = torch.nn.Linear(4, 1)
    begin(telemetry, model)

    def three_steps():
        run_steps(telemetry, model, 3, loss=False)
        telemetry.end()

    said = recorded_warnings(three_steps)
    history = telemetry.history
    assert len(history) == 3 and history.loss_missing == [True] * 3
    assert not telemetry.stop_requested
    assert not [e for e in history.events if e["kind"] == "nonfinite"]
    assert history.summary()["alarms"] == []
    assert len(said) == 1 and "no loss" in said[0], said


def test_a_real_nan_loss_is_still_reported():
    telemetry = LoopTelemetry("my loop", dashboard=None, on_nonfinite="stop")
    model = torch.nn.Linear(4, 1)
    begin(telemetry, model)
    run_steps(telemetry, model, 1)
    telemetry.window_begin()
    telemetry.add_loss(torch.tensor(float("nan")))
    telemetry.step_end()
    telemetry.end()
    assert telemetry.history.loss_missing == [False, False] and telemetry.stop_requested


def test_a_loss_that_is_not_one_number_is_refused_and_earlier_rows_are_kept():
    telemetry, model = linear_run()
    run_steps(telemetry, model, 2)
    with pytest.raises(ValueError, match=r"one number.*\[8, 1\]"):
        telemetry.add_loss(torch.ones(8, 1))
    telemetry.end()
    assert len(telemetry.history) == 2 and all(v > 0 for v in telemetry.history.loss)


@pytest.mark.parametrize(
    ("dtype", "label"), [(torch.bfloat16, "bf16-true"), (torch.float16, "fp16-true")]
)
def test_low_precision_weights_are_read_as_what_they_are(dtype, label):
    telemetry = LoopTelemetry("my loop", dashboard=None)
    model = torch.nn.Linear(4, 1).to(dtype)
    begin(telemetry, model, asked="fp32")
    said = recorded_warnings(lambda: (run_steps(telemetry, model, 2), telemetry.end()))
    assert telemetry.history.mode == [label] * 2
    assert any(f"asked for fp32 but trains in {label}" in message for message in said), said


def test_asked_is_checked_when_the_run_begins():
    telemetry = LoopTelemetry("my loop", dashboard=None)
    model = torch.nn.Linear(4, 1)
    with pytest.raises(InvalidChoiceError, match="'bf17'.*bf16.*bf16-true"):
        begin(telemetry, model, asked="bf17")
    assert not telemetry.running
    begin(telemetry, model, asked="bf16")
    said = recorded_warnings(
        lambda: (run_steps(telemetry, model, 1, autocast=torch.bfloat16), telemetry.end())
    )
    assert said == [] and telemetry.history.mode == ["bf16"]


def test_each_run_says_its_notices_and_is_marked_in_the_history():
    telemetry = LoopTelemetry("my loop", dashboard=None)
    model = torch.nn.Linear(4, 1)
    for _ in range(2):
        begin(telemetry, model)
        said = recorded_warnings(
            lambda: (run_steps(telemetry, model, 2, autocast=torch.float16), telemetry.end())
        )
        assert len(said) == 1 and "without loss scaling" in said[0]
    events = telemetry.history.events
    assert [e["step"] for e in events if e["kind"] == "fp16_without_scaling"] == [1, 3]
    assert [e["step"] for e in events if e["kind"] == "run"] == [0, 2]
    assert telemetry.history.step == [1, 2, 3, 4]


def test_the_epoch_column_holds_the_frameworks_epoch():
    telemetry, model = linear_run()
    run_steps(telemetry, model, 2, epoch=3)
    telemetry.end()
    assert telemetry.history.epoch == [3, 3]


def test_work_outside_the_steps_is_left_out_of_the_next_steps_time():
    telemetry, model = linear_run()
    run_steps(telemetry, model, 1)
    time.sleep(0.3)  # an evaluation, a checkpoint save
    telemetry.outside_steps()
    run_steps(telemetry, model, 1)
    telemetry.end()
    assert telemetry.history.step_time[1] < 0.1


@pytest.mark.parametrize("flush_every", [0, -1, 2.5, "20"])
def test_a_bad_flush_every_is_refused_with_its_value(flush_every):
    with pytest.raises(ValueError, match=f"flush_every.*{flush_every!r}"):
        LoopTelemetry("my loop", dashboard=None, flush_every=flush_every)


def test_with_on_nonfinite_stop_the_framework_is_told_at_the_step_of_the_nan():
    telemetry = LoopTelemetry(
        "my loop", dashboard=None, on_nonfinite="stop"
    )  # the default flush_every
    model = torch.nn.Linear(4, 1)
    begin(telemetry, model)
    telemetry.window_begin()
    telemetry.add_loss(torch.tensor(0.5))
    assert telemetry.step_end() is False
    telemetry.window_begin()
    telemetry.add_loss(torch.tensor(float("nan")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert telemetry.step_end() is True  # the loop must stop after this very step
        assert telemetry.stop_requested
    telemetry.end()


def test_step_end_says_stop_once_stop_is_pressed():
    telemetry, model = linear_run()
    telemetry.window_begin()
    assert telemetry.step_end() is False
    telemetry.control.stop()
    telemetry.window_begin()
    assert (
        telemetry.step_end() is True and telemetry.steps == 2
    )  # the step is recorded all the same
    telemetry.end()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_losses_are_read_exactly_and_summed_in_fp32(dtype):
    """A bf16 / fp16 loss is kept in its dtype until the flush (no cast per step), read exactly
    there even beside a bool flag alone, and a window's losses are added in fp32: 1 + 2**-11
    rounds to 1 in both low precisions."""
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, torch.nn.Linear(4, 1))
    small = 2.0**-11
    for losses in (
        [torch.tensor(0.1, dtype=dtype)],
        [torch.tensor(1.0, dtype=dtype), torch.tensor(small, dtype=dtype)],
    ):
        telemetry.window_begin()
        for loss in losses:
            telemetry.add_loss(loss, normalized=True)
        telemetry.step_end()
    telemetry.end()
    assert telemetry.history.loss == [torch.tensor(0.1, dtype=dtype).item(), 1.0 + small]


def test_a_window_mixing_normalized_and_plain_losses_adds_them_in_fp32():
    """Normalized and plain losses of one window meet in fp32: fp16 40000 + 30000 does not
    overflow, and bf16 1 + 2**-8 does not round away."""
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, torch.nn.Linear(4, 1))
    windows = [
        (torch.tensor(40000.0, dtype=torch.float16), torch.tensor(30000.0, dtype=torch.float16)),
        (torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(2.0**-8, dtype=torch.bfloat16)),
        (0.5, torch.tensor(3.0, dtype=torch.bfloat16)),
    ]
    for normalized, plain in windows:
        telemetry.window_begin()
        telemetry.add_loss(normalized, normalized=True)
        telemetry.add_loss(plain)
        telemetry.step_end()
    telemetry.end()
    assert telemetry.history.loss == [70000.0, 1.0 + 2.0**-8, 3.5]
    assert not [event for event in telemetry.history.events if event["kind"] == "nonfinite"]


def test_skips_of_a_fused_optimizer_are_counted_when_the_scaler_updates_before_the_step_ends():
    """Lightning and Accelerate call scaler.update() before mpnb's end of step, and update()
    forgets the found-inf flags a fused optimizer was given: the step hook keeps the flag."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=1024.0
    )  # inputs of 1 never overflow at this scale
    telemetry = LoopTelemetry("my loop", dashboard=None)
    telemetry.begin(model, optimizer, scaler=scaler, device="cpu", asked="fp16")
    for size in (1e4, 1.0, 1e4):
        telemetry.window_begin()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(8, 4) * size).pow(2).mean()
        telemetry.add_loss(loss)
        telemetry.before_optimizer_step()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        telemetry.step_end()
    telemetry.end()
    assert telemetry.history.skipped_steps == [1, 3]
    assert telemetry.history.loss_scale == [1024.0, 512.0, 512.0]


def test_a_compiled_model_has_each_steps_precision_recorded():
    """torch.compile does not watch module hooks come and go (no guards on them): the precision
    hook stays on the model for the whole run, so each step's mode is read, bf16 and fp32 alike.
    (A hook that took itself off between readings left every row at the first reading.)"""
    model = small_mlp()
    compiled = torch.compile(model, backend="aot_eager")
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, compiled)
    for autocast in (torch.bfloat16, None, torch.bfloat16):
        run_steps(telemetry, compiled, 3, autocast=autocast)  # a new autocast state: compiled again
        time.sleep(0.3)  # past any re-reading interval
    telemetry.end()
    assert telemetry.history.mode == ["bf16"] * 3 + ["fp32"] * 3 + ["bf16"] * 3


def test_the_precision_hook_is_off_between_readings_and_a_later_step_reads_its_own_pass():
    """A hook left on a module slows every forward pass (measured 10-40 us a step): after a fast
    step is read the hook comes off; a step that starts 0.25 s after the reading puts it back, so
    that step's own pass is read."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 1))
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, model)
    run_steps(telemetry, model, 2, autocast=torch.bfloat16)
    assert not model[0]._forward_pre_hooks
    time.sleep(0.3)
    run_steps(telemetry, model, 2)
    telemetry.end()
    assert telemetry.history.mode == ["bf16", "bf16", "fp32", "fp32"]
    assert not model[0]._forward_pre_hooks


def test_a_loop_that_records_at_each_steps_end_reads_every_slow_step():
    """LoopRecorder (Accelerate, Fabric) opens the next window as a step ends, right after a
    reading: a step that took long enough has the next one read, whatever the interval."""
    from mpnb.integrations.accelerate import LoopRecorder

    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    plan = [torch.bfloat16, None, torch.bfloat16, None, torch.bfloat16]
    with LoopRecorder.start(
        "my loop", model, optimizer, scaler=None, device="cpu", dashboard=None
    ) as recorder:
        for dtype in plan:
            time.sleep(0.02)  # a 20 ms step: the hook costs under 0.2% of it
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(torch.ones(8, 4)).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            recorder.record(loss)
    assert recorder.history.mode == ["bf16", "fp32", "bf16", "fp32", "bf16"]


def test_a_pass_that_failed_and_was_retried_in_another_precision_is_not_the_steps_reading():
    class FailsInBf16(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            hidden = self.first(x)
            if hidden.dtype == torch.bfloat16:
                raise RuntimeError("no bf16 kernel for the next op")
            return self.second(hidden)

    model = FailsInBf16()
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, model)
    for _ in range(2):
        time.sleep(0.3)
        telemetry.window_begin()
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.ones(8, 4)).pow(2).mean()
        except RuntimeError:
            loss = model(torch.ones(8, 4)).pow(2).mean()  # the step trains in fp32
        loss.backward()
        telemetry.add_loss(loss)
        telemetry.before_optimizer_step()
        telemetry.step_end()
    telemetry.end()
    assert telemetry.history.mode == ["fp32", "fp32"]


def test_new_parameter_objects_and_a_replaced_first_module_are_followed():
    model = small_mlp()
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, model)
    run_steps(telemetry, model, 1)
    model.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, assign=True
    )
    time.sleep(0.3)
    run_steps(telemetry, model, 1)
    model[0], model[2] = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    time.sleep(0.3)
    run_steps(telemetry, model, 1, autocast=torch.bfloat16)
    telemetry.end()
    assert telemetry.history.mode == ["fp32", "bf16-true", "bf16"]
    assert not any(module._forward_pre_hooks for module in model.modules())


def test_a_model_compiled_and_trained_before_mpnb_attached_has_unseen_rows_and_says_why():
    """Code torch.compile traced without mpnb's hook never runs it: no reading can be true, so the
    rows say 'unseen' (not a stale mode) and a notice says what to do."""
    model = small_mlp()
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(torch.ones(8, 4)).float().sum().backward()  # trained a little without mpnb
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, compiled)
    said = recorded_warnings(lambda: run_steps(telemetry, compiled, 2, autocast=torch.bfloat16))
    telemetry.end()
    assert telemetry.history.mode == ["unseen", "unseen"]
    assert len(said) == 1 and "torch._dynamo.reset()" in said[0], said


def test_a_second_run_on_a_compiled_model_reads_its_own_precision():
    """The first run's hook is compiled into the model's code; the second run's observer must
    still see each step (not leave its rows unread, or read by the first run's observer)."""
    model = small_mlp()
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.reset()  # code traced for another Sequential of this shape would be used again
    for _ in range(2):
        telemetry = LoopTelemetry("my loop", dashboard=None)
        begin(telemetry, compiled)
        run_steps(telemetry, compiled, 2, autocast=torch.bfloat16)
        telemetry.end()
        assert telemetry.history.mode == ["bf16", "bf16"]


def test_a_compiled_step_function_around_an_eager_model_has_each_steps_precision_recorded():
    """The model is not compiled, the function calling it is: the hook runs inside traced code."""
    model = small_mlp()

    @torch.compile(backend="aot_eager")
    def forward(x):
        return model(x)

    torch._dynamo.reset()
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, model)
    for autocast in (torch.bfloat16, None, torch.bfloat16):
        for _ in range(2):
            telemetry.window_begin()
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                value = forward(torch.ones(8, 4)).float().pow(2).mean()
            value.backward()
            telemetry.add_loss(value)
            telemetry.before_optimizer_step()
            telemetry.step_end()
        time.sleep(0.3)
    telemetry.end()
    assert telemetry.history.mode == ["bf16"] * 2 + ["fp32"] * 2 + ["bf16"] * 2


@pytest.mark.parametrize("autocast", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_the_precision_hook_adds_no_graph_break_or_recompile_to_a_compiled_model(autocast):
    """Traced, the hook stays on and reads nothing a trace cannot hold (no clock, no removal, no
    matmul-precision query): one graph, compiled once, however often eager mode would re-read."""
    from torch._dynamo.utils import counters

    model = small_mlp()
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.reset()  # no code compiled by an earlier test
    counters.clear()
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, compiled)
    telemetry._run.observer.interval = 0.0  # re-read at every step
    run_steps(telemetry, compiled, 4, autocast=autocast)
    telemetry.end()
    assert telemetry.history.mode == ["bf16" if autocast else "fp32"] * 4
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["frames"]["total"] == 1, dict(counters["frames"])


def test_a_recorded_loss_holds_no_graph_and_a_detached_one_is_not_copied():
    """Pending losses wait for the flush (up to 64 steps): none may keep its step's autograd graph."""
    model = torch.nn.Linear(4, 1)
    telemetry = LoopTelemetry("my loop", dashboard=None)
    begin(telemetry, model)
    telemetry.window_begin()
    loss = model(torch.ones(2, 4)).pow(2).mean()
    telemetry.add_loss(loss)
    kept = telemetry._run.account.loss
    assert kept.grad_fn is None and not kept.requires_grad and kept.data_ptr() == loss.data_ptr()
    telemetry.step_end()
    telemetry.window_begin()
    detached = loss.detach()
    telemetry.add_loss(detached)  # as Lightning hands it: detached already
    assert telemetry._run.account.loss is detached
    telemetry.step_end()
    telemetry.end()
    assert telemetry.history.loss == [pytest.approx(loss.item())] * 2


def test_a_learning_rate_held_in_a_tensor_is_recorded_as_it_was_at_each_step():
    telemetry = LoopTelemetry("my loop", dashboard=None)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    telemetry.begin(model, optimizer, scaler=None, device="cpu", asked=None)
    for _ in range(3):
        telemetry.window_begin()
        model(torch.ones(2, 4)).mean().backward()
        telemetry.before_optimizer_step()
        optimizer.step()
        scheduler.step()
        telemetry.step_end()
    telemetry.end()
    assert telemetry.history.lr == pytest.approx([0.01, 0.005, 0.0025], rel=1e-6)  # fp32 values


def test_a_step_ended_without_before_optimizer_step_is_said_to_be_unknown():
    """Without before_optimizer_step nothing tells the scale, rate or skip of the step: said once, not guessed silently."""
    telemetry, model = linear_run()

    def two_steps():
        for _ in range(2):
            telemetry.window_begin()
            telemetry.add_loss(torch.tensor(0.5))
            telemetry.step_end()
        telemetry.end()

    said = [
        message for message in recorded_warnings(two_steps) if "before_optimizer_step" in message
    ]
    assert len(said) == 1 and "step 1 ended without before_optimizer_step()" in said[0]
    assert [e["kind"] for e in telemetry.history.events].count("not_prepared") == 1
    assert math.isnan(telemetry.history.lr[0]) and telemetry.history.loss == [0.5, 0.5]


def test_a_run_begun_in_one_cell_outlives_an_error_in_a_later_one(ip):
    """A loop fed from several cells (a LoopRecorder made in one, records from the next) is not
    ended by a later cell's error: only the cell that began a run ends it by raising."""
    from tests.conftest import run_expecting

    model = torch.nn.Linear(4, 1)
    telemetry = LoopTelemetry("my loop", dashboard="text")
    ip.user_ns.update(telemetry=telemetry, model=model, torch=torch)
    ip.run_cell(
        "telemetry.begin(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=None, device='cpu', asked=None)"
    )
    run_expecting(ip, "raise ValueError('a typo in the loop')", ValueError)
    assert telemetry.running
    telemetry.end()


def test_a_pause_between_steps_is_left_out_of_the_next_steps_time():
    """Pause on the dashboard holds the framework in step_end; that wait is no step's work."""
    telemetry, model = linear_run()
    run_steps(telemetry, model, 1)
    paused_at = time.perf_counter()
    telemetry.control.pollers.append(
        lambda: time.perf_counter() - paused_at > 0.3 and telemetry.control.resume()
    )
    telemetry.control.pause()
    run_steps(telemetry, model, 2)  # the first of them waits in its step_end until resumed
    telemetry.end()
    assert telemetry.history.step_time[2] < 0.1, telemetry.history.step_time


def test_bad_values_for_a_row_are_refused_with_their_value():
    from mpnb.integrations.accelerate import LoopRecorder

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LoopRecorder.start(
        "my loop", model, optimizer, scaler=None, device="cpu", dashboard=None
    ) as recorder:
        with pytest.raises(TypeError, match="ends_step.*'no'"):
            recorder.record(1.0, ends_step="no")
        with pytest.raises(TypeError, match="epoch.*'x'"):
            recorder.record(1.0, epoch="x")
        with pytest.raises(TypeError, match="loss.*None"):
            recorder.record(None)
        with pytest.raises(TypeError, match="epoch.*True"):
            recorder.record(1.0, epoch=True)
        recorder.record(torch.tensor(0.5), ends_step=True, epoch=numpy.int64(1))  # a whole number
    assert (
        recorder.history.loss == [0.5]
        and recorder.history.epoch == [1]
        and type(recorder.history.epoch[0]) is int
    )
