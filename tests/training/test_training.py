"""AmpStep and Trainer on real torch (CPU): exact skipped steps, the scheduler rule, accumulation
and clipping against the hand-written torch.amp recipe, interrupts, checkpoints."""

from __future__ import annotations

import copy
import math
import os
import signal
import time
import warnings

import pytest
import torch
from torch import nn

import mpnb
import mpnb.examples as ex
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.training.control import FitEnd
from mpnb.training.step_precision import TrainingPrecision

SCHEDULER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def linear_problem(seed: int = 0, steps: int = 12, batch: int = 8):
    """A tiny regression: a Linear model and a fixed list of batches."""
    torch.manual_seed(seed)
    model = nn.Linear(6, 3)
    data = [(torch.randn(batch, 6), torch.randn(batch, 3)) for _ in range(steps)]
    return model, data


def mse(output, target):
    return nn.functional.mse_loss(output.float(), target)


def run_amp_step(model, data, amp, overflow_at=frozenset()):
    """The user's own loop through AmpStep; ``overflow_at`` makes those steps' losses infinite."""
    for step, (x, y) in enumerate(data, start=1):
        with amp.autocast():
            loss = mse(model(x), y)
        if step in overflow_at:
            loss = loss * math.inf
        amp.backward(loss)
        amp.step(samples=len(x))
    return amp.close()


def test_fp16_skipped_steps_are_exactly_the_overflowed_ones_and_skip_the_update():
    model, data = linear_problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = mpnb.AmpStep(
        optimizer, mode="fp16", device="cpu", init_scale=1024.0, growth_interval=1000, flush_every=5
    )
    weights = []
    for step, (x, y) in enumerate(data, start=1):
        before = model.weight.detach().clone()
        with amp.autocast():
            loss = mse(model(x), y)
        amp.backward(loss * math.inf if step in (3, 7, 8) else loss)
        amp.step()
        weights.append(torch.equal(before, model.weight))
    history = amp.close()
    assert history.skipped_steps == [3, 7, 8]
    assert [step for step, unchanged in enumerate(weights, start=1) if unchanged] == [3, 7, 8]
    assert history.loss_scale[:9] == [1024.0] * 3 + [512.0] * 4 + [256.0, 128.0]
    assert history.step == list(range(1, 13))
    assert all(mode == "fp16" for mode in history.mode)


def test_bf16_has_no_scaler_and_no_skips():
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(8, 16), dashboard=None)
    history = trainer.fit(train, max_steps=20)
    assert not trainer.amp.scaler.is_enabled()
    assert history.skipped_steps == [] and set(history.loss_scale) == {1.0}
    assert history.loss[-1] < history.loss[0]


def test_scheduler_steps_only_after_real_optimizer_steps_and_torch_never_warns():
    model, data = linear_problem(steps=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    amp = mpnb.AmpStep(optimizer, mode="fp16", device="cpu", scheduler=scheduler, init_scale=256.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step")
        history = run_amp_step(model, data, amp, overflow_at={1, 4, 5})
    assert history.skipped_steps == [1, 4, 5]
    assert scheduler.last_epoch == 7
    # The learning rate recorded per step halves only after steps that were taken.
    assert history.lr == [1.0, 1.0, 0.5, 0.25, 0.25, 0.25, 0.125, 0.0625, 0.03125, 0.015625]


def test_accumulation_and_clipping_equal_the_hand_written_recipe_exactly():
    accumulate, clip = 3, 0.05
    model, data = linear_problem(steps=12)
    reference = nn.Linear(6, 3)
    reference.load_state_dict(model.state_dict())

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp = mpnb.AmpStep(
        optimizer,
        mode="fp16",
        device="cpu",
        accumulate=accumulate,
        clip_grad_norm=clip,
        init_scale=2.0**10,
    )
    history = run_amp_step(model, data, amp, overflow_at={5})

    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    norms = []
    for index, (x, y) in enumerate(data, start=1):
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = mse(reference(x), y)
        if index == 5:
            loss = loss * math.inf
        scaler.scale(loss / accumulate).backward()
        if index % accumulate == 0:
            scaler.unscale_(ref_optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
            scaler.step(ref_optimizer)
            scaler.update()
            ref_optimizer.zero_grad()
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)
    assert len(history) == 4 and history.skipped_steps == [2]
    finite = [math.isfinite(n) for n in norms]
    assert finite == [True, False, True, True]
    assert [math.isfinite(n) for n in history.grad_norm] == finite
    assert [n for n in history.grad_norm if math.isfinite(n)] == [
        n for n in norms if math.isfinite(n)
    ]
    assert history.loss_scale == [1024.0, 1024.0, 512.0, 512.0]


def test_record_grad_norm_without_clipping_leaves_gradients_alone():
    model, data = linear_problem(steps=3)
    amp = mpnb.AmpStep(
        torch.optim.SGD(model.parameters(), lr=0.0),
        mode="bf16",
        device="cpu",
        record_grad_norm=True,
    )
    history = run_amp_step(model, data, amp)
    assert all(math.isfinite(v) and v > 0 for v in history.grad_norm)


def test_min_scale_alarm_warns_once_and_notes_the_step():
    model, data = linear_problem(steps=8)
    amp = mpnb.AmpStep(
        torch.optim.SGD(model.parameters(), lr=0.1),
        mode="fp16",
        device="cpu",
        init_scale=8.0,
        min_scale=1.0,
        flush_every=2,
    )
    with pytest.warns(RuntimeWarning, match="loss scale fell to 0.5 at step 5") as caught:
        history = run_amp_step(model, data, amp, overflow_at=set(range(1, 9)))
    assert len([w for w in caught if "loss scale fell" in str(w.message)]) == 1
    assert [e["kind"] for e in history.events] == ["min-scale alarm", "collapse"]  # then below 1
    assert [e["step"] for e in history.events] == [5, 5]


def test_bad_arguments_are_rejected_with_the_valid_choices():
    model, _ = linear_problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"accumulate must be a whole number >= 1 \(micro-batches an optimizer step\), got 0",
    ):
        mpnb.AmpStep(optimizer, accumulate=0)
    with pytest.raises(ValueError, match=r"clip_grad_norm must be a number above 0 .*, got -1"):
        mpnb.AmpStep(optimizer, clip_grad_norm=-1)
    with pytest.raises(
        InvalidChoiceError, match="unknown on_nonfinite 'halt'; valid: warn, stop, ignore"
    ):
        mpnb.AmpStep(optimizer, on_nonfinite="halt")
    with pytest.raises(
        MpnbError,
        match="unknown mode 'int4'; valid: off, fp32, tf32, fp16, bf16, fp8, mxfp8, nvfp4",
    ):
        mpnb.Trainer(model, optimizer, mse, mode="int4")
    with pytest.raises(
        InvalidChoiceError, match="unknown dashboard 'fancy'; valid: auto, live, text"
    ):
        mpnb.Trainer(model, optimizer, mse, mode="fp32", device="cpu", dashboard="fancy")
    with pytest.raises(MpnbError, match="give loss_fn or step_fn, not both"):
        mpnb.Trainer(model, optimizer, mse, step_fn=lambda m, b: m(b).sum())
    trainer = mpnb.Trainer(model, optimizer, mse, mode="fp32", device="cpu", dashboard=None)
    with pytest.raises(ValueError, match="epochs must be a whole number >= 1, got 0"):
        trainer.fit([], epochs=0)
    amp = mpnb.AmpStep(optimizer, mode="fp32", device="cpu")
    with pytest.raises(RuntimeError, match="no backward"):
        amp.step()


def test_trainer_takes_mode_from_the_session_and_sets_fp32_math_only_during_fit():
    seen = []

    def loss_reading_flags(output, target):
        seen.append(torch.get_float32_matmul_precision())
        return mse(output, target)

    model, data = linear_problem(steps=2)
    mpnb.set_mode("bf16", device="cpu")
    assert (
        mpnb.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, dashboard=None).mode
        == "bf16"
    )
    mpnb.set_mode("off")
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_reading_flags,
        mode="tf32",
        device="cpu",
        dashboard=None,
    )
    before = torch.get_float32_matmul_precision()
    trainer.fit(data)
    assert seen == ["medium", "medium"] and torch.get_float32_matmul_precision() == before


def test_fp32_trainer_forward_stays_fp32_inside_an_amp_cell(ip):
    ip.run_line_magic("amp", "bf16 --device cpu")
    ip.run_cell(
        "import mpnb\n"
        "dtypes = []\n"
        "def loss_fn(out, y):\n"
        "    dtypes.append(out.dtype)\n"
        "    return ((out - y) ** 2).mean()\n"
        "model = torch.nn.Linear(8, 8)\n"
        "t = mpnb.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, mode='fp32', dashboard=None)\n"
        "t.fit([(x, x)] * 3)\n"
        "bf16_cell = linear(x).dtype"
    ).raise_error()
    assert ip.user_ns["dtypes"] == [torch.float32] * 3
    assert ip.user_ns["bf16_cell"] == torch.bfloat16


class InterruptingBatches(ex.Batches):
    """Digits batches that deliver a real SIGINT to this process while yielding batch ``at``."""

    def __init__(self, base: ex.Batches, at: int, times: int = 1) -> None:
        super().__init__(base.inputs, base.targets, base.batch_size, seed=base.seed)
        self.at, self.times, self.armed = at, times, True

    def __iter__(self):
        for index, batch in enumerate(super().__iter__()):
            if self.armed and index == self.at:
                self.armed = False
                for _ in range(self.times):
                    os.kill(os.getpid(), signal.SIGINT)
            yield batch


def test_interrupt_stops_after_the_step_keeps_history_and_resume_matches_an_uninterrupted_run():
    full, train, _ = ex.example_trainer(
        "fp16", "cpu", widths=(4, 8), batch_size=256, dashboard=None, init_scale=2.0**8
    )
    full.fit(train, epochs=2)

    trainer, _, _ = ex.example_trainer(
        "fp16", "cpu", widths=(4, 8), batch_size=256, dashboard=None, init_scale=2.0**8
    )
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(
        mpnb.FitInterrupted, match="fit stopped after step 3 .epoch 0, batch 3."
    ) as stopped:
        trainer.fit(InterruptingBatches(train, at=3), epochs=2)
    assert signal.getsignal(signal.SIGINT) is handler
    assert len(stopped.value.history) == 3 and stopped.value.history.step == [1, 2, 3]
    assert [e["kind"] for e in trainer.history.events] == ["interrupt"]
    history = trainer.fit(train)  # no epochs: finish the interrupted run
    assert history.step == full.history.step
    for mine, theirs in zip(trainer.model.parameters(), full.model.parameters()):
        assert torch.equal(mine, theirs)
    assert trainer.amp.scaler.state_dict() == full.amp.scaler.state_dict()


def test_a_second_interrupt_stops_at_once():
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as stopped:
        trainer.fit(InterruptingBatches(train, at=2, times=2))
    assert type(stopped.value) is KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is handler
    assert len(trainer.history) == 2  # the steps finished before the batch that was interrupted


def test_checkpoint_round_trip_continues_like_an_unbroken_run(tmp_path):
    options = {"widths": (4, 8), "batch_size": 128, "dashboard": None}
    full, train, _ = ex.example_trainer("fp16", "cpu", **options)
    full.fit(train, max_steps=10)

    first, _, _ = ex.example_trainer("fp16", "cpu", **options)
    first.fit(train, max_steps=6)
    first.save(tmp_path / "run.pt")
    second, _, _ = ex.example_trainer("fp16", "cpu", seed=99, **options)
    second.load(tmp_path / "run.pt")
    assert second.history.step == [1, 2, 3, 4, 5, 6]
    second.fit(train, max_steps=4)
    for mine, theirs in zip(second.model.parameters(), full.model.parameters()):
        assert torch.equal(mine, theirs)
    assert second.history.loss == full.history.loss


def _dropout_run(steps: int, data: list) -> mpnb.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 3))
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy,
        mode="bf16", device="cpu", dashboard=None,
    )  # fmt: skip
    if steps:
        trainer.fit(data, max_steps=steps)
    return trainer


def test_a_checkpoint_keeps_the_random_state_so_dropout_resumes_bit_for_bit(tmp_path):
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator))
        for _ in range(8)
    ]
    full = _dropout_run(8, data)
    first = _dropout_run(3, data)
    first.save(tmp_path / "run.pt")
    torch.manual_seed(1234)  # another process, another stream: the checkpoint puts its own back
    second = _dropout_run(0, data)
    second.load(tmp_path / "run.pt")
    second.fit(data)
    assert second.history.loss == full.history.loss
    for mine, theirs in zip(second.model.parameters(), full.model.parameters()):
        assert torch.equal(mine, theirs)


def test_a_checkpoint_without_a_random_state_loads_and_a_bad_one_changes_nothing(tmp_path):
    trainer = _dropout_run(2, [(torch.randn(8, 6), torch.randint(0, 3, (8,)))] * 2)
    state = torch.load(_saved(trainer, tmp_path), weights_only=True)
    del state["random"]  # as an mpnb before 0.4 wrote it
    torch.save(state, tmp_path / "old.pt")
    stream = torch.get_rng_state()
    trainer.load(tmp_path / "old.pt")
    assert torch.equal(torch.get_rng_state(), stream)  # nothing saved: the stream goes on
    state["random"] = {"device_type": "cpu", "cpu": torch.zeros(3, dtype=torch.uint8)}
    torch.save(state, tmp_path / "bad.pt")
    steps = trainer.amp.steps
    with pytest.raises(MpnbError, match="its random state is not what Trainer.save writes"):
        trainer.load(tmp_path / "bad.pt")
    assert torch.equal(torch.get_rng_state(), stream) and trainer.amp.steps == steps


def _as_found(trainer: mpnb.Trainer) -> tuple:
    """What a refused load must leave as it was: weights, optimizer, position, history, stream."""
    return (
        copy.deepcopy(trainer.model.state_dict()),
        copy.deepcopy(trainer.optimizer.state_dict()),
        trainer.position,
        list(trainer.history.step),
        torch.get_rng_state(),
    )


def _same(found: tuple, now: tuple) -> bool:
    weights, optimizer, position, steps, stream = found
    return (
        all(torch.equal(weights[key], value) for key, value in now[0].items())
        and repr(optimizer) == repr(now[1])
        and (position, steps) == now[2:4]
        and torch.equal(stream, now[4])
    )


@pytest.mark.parametrize(
    "damage",
    [
        "a zeroed generator state",  # the right dtype and shape, but no mt19937 state
        "a strided generator state",
        "device states on a cpu run",
        "an optimizer moment that is a string",
        "an optimizer entry that is a list",
        "a sparse weight",
        "a position past the planned end",
    ],
)
def test_a_checkpoint_torch_would_refuse_halfway_is_refused_first_and_changes_nothing(
    tmp_path, damage
):
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,)))] * 4

    def adam_run() -> mpnb.Trainer:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 3))
        optimizer = torch.optim.Adam(model.parameters(), 1e-2)
        return mpnb.Trainer(model, optimizer, nn.functional.cross_entropy, dashboard=None)

    source = adam_run()
    source.fit(data, epochs=2, max_steps=3)
    state = torch.load(_saved(source, tmp_path), weights_only=True)
    cpu = state["random"]["cpu"]
    changes = {
        "a zeroed generator state": lambda: state["random"].update(cpu=torch.zeros_like(cpu)),
        "a strided generator state": lambda: state["random"].update(
            cpu=torch.zeros(2 * cpu.numel(), dtype=torch.uint8)[::2]
        ),
        "device states on a cpu run": lambda: state["random"].update(
            devices=[torch.zeros(8, dtype=torch.uint8)]
        ),
        "an optimizer moment that is a string": lambda: state["optimizer"]["state"][0].update(
            exp_avg="x"
        ),
        "an optimizer entry that is a list": lambda: state["optimizer"]["state"].update({0: [1]}),
        "a sparse weight": lambda: state["model"].update(
            {"2.weight": state["model"]["2.weight"].to_sparse()}
        ),
        "a position past the planned end": lambda: state.update(position=[5, 0, 2]),
    }
    changes[damage]()
    torch.save(state, tmp_path / "damaged.pt")
    trainer = adam_run()
    trainer.fit(data, epochs=2, max_steps=2)
    torch.manual_seed(123)
    found = _as_found(trainer)
    with pytest.raises(MpnbError, match=r"damaged\.pt.*nothing was loaded"):
        trainer.load(tmp_path / "damaged.pt")
    assert _same(found, _as_found(trainer))


def _saved(trainer: mpnb.Trainer, folder) -> str:
    trainer.save(folder / "run.pt")
    return str(folder / "run.pt")


def test_checkpoint_loading_refuses_pickled_code(tmp_path):
    trainer, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    torch.save(
        {"format": "mpnb-trainer", "payload": ex.Batches(torch.zeros(2), torch.zeros(2))},
        tmp_path / "bad.pt",
    )
    with pytest.raises(MpnbError, match=r"bad\.pt' refused: it holds `mpnb\.examples\.Batches`"):
        trainer.load(tmp_path / "bad.pt")
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(MpnbError, match="is not an mpnb trainer checkpoint"):
        trainer.load(tmp_path / "other.pt")


def test_example_model_learns_the_digits():
    trainer, train, test = ex.example_trainer("bf16", "cpu", widths=(16, 32), dashboard=None)
    trainer.fit(train, epochs=3)
    assert ex.accuracy(trainer.model, test) > 0.8


def test_max_steps_ending_an_epoch_completes_it_and_the_next_fit_starts_a_new_one():
    trainer, train, _ = ex.example_trainer(
        "bf16", "cpu", widths=(4, 8), batch_size=512, dashboard=None
    )
    assert len(train) == 3
    trainer.fit(train, max_steps=3)
    history = trainer.fit(train)
    assert history.step == [1, 2, 3, 4, 5, 6] and history.epoch == [0, 0, 0, 1, 1, 1]


def test_interrupt_waits_for_the_end_of_an_accumulation_window():
    trainer, train, _ = ex.example_trainer(
        "bf16", "cpu", widths=(4, 8), batch_size=128, dashboard=None, accumulate=4
    )
    with pytest.raises(mpnb.FitInterrupted, match="fit stopped after step 2 .epoch 0, batch 8."):
        trainer.fit(InterruptingBatches(train, at=5))
    assert trainer.amp.between_steps and all(p.grad is None for p in trainer.model.parameters())


def test_an_error_mid_window_drops_the_partial_window_and_fit_resumes_at_its_start():
    calls = []

    def failing_once(output, target):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("bad batch")
        return nn.functional.cross_entropy(output, target)

    trainer, train, _ = ex.example_trainer(
        "bf16", "cpu", widths=(4, 8), batch_size=128, dashboard=None, accumulate=4
    )
    trainer.loss_fn = failing_once
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit(train)
    assert trainer.amp.between_steps and all(p.grad is None for p in trainer.model.parameters())
    assert len(trainer.history) == 1 and trainer.position[1] == 4
    history = trainer.fit(train)
    assert history.step == [1, 2, 3] and len(calls) == 6 + 8


class _AutocastInBackward(torch.autograd.Function):
    """Identity whose backward notes whether CPU autocast was on while it ran."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _AutocastInBackward.seen.append(torch.is_autocast_enabled("cpu"))
        return grad


@pytest.mark.parametrize("inside", [False, True], ids=["after the block", "inside the block"])
def test_backward_runs_with_autocast_off_wherever_it_is_called(inside):
    """amp.backward runs the backward pass outside autocast, also when called inside the
    forward's autocast block; the autocast state is as before once it returns."""
    model = nn.Linear(4, 1)
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cpu")
    _AutocastInBackward.seen = []
    with amp.autocast():
        loss = _AutocastInBackward.apply(model(torch.ones(2, 4))).float().mean()
        if inside:
            amp.backward(loss)
            assert torch.is_autocast_enabled("cpu")
    if not inside:
        amp.backward(loss)
    assert not torch.is_autocast_enabled("cpu")
    amp.step()
    assert _AutocastInBackward.seen == [False]


@pytest.mark.parametrize("mode, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_an_accumulated_steps_loss_is_the_mean_of_its_micro_batch_losses_in_fp32(mode, dtype):
    """The recorded loss is the fp32 mean of the micro-batches' losses, not a sum of losses each
    divided in their own low precision (1/3 rounds in bf16 and fp16)."""
    weight = nn.Parameter(torch.ones(1))
    amp = mpnb.AmpStep(torch.optim.SGD([weight], lr=0.0), mode=mode, device="cpu", accumulate=3)
    for _ in range(3):
        with amp.autocast():
            loss = (weight * 1.0).to(dtype).sum()
        amp.backward(loss)
        amp.step()
    assert amp.history.loss == [1.0]


def test_a_discarded_windows_forward_time_is_not_counted_in_the_next_step():
    model = nn.Linear(4, 1)
    amp = mpnb.AmpStep(
        torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cpu", accumulate=2
    )
    with amp.autocast():
        loss = model(torch.ones(2, 4)).float().mean()
        time.sleep(0.3)
    amp.backward(loss)
    amp.discard_window()  # what the Trainer does after an error mid-window
    for _ in range(2):
        with amp.autocast():
            loss = model(torch.ones(2, 4)).float().mean()
        amp.backward(loss)
        amp.step()
    assert amp.history.forward_time[0] < 0.2


@pytest.mark.parametrize("mode", ["fp16", "bf16", "fp32"])
def test_train_step_does_what_the_three_calls_do(mode):
    """One train_step per micro-batch trains and records exactly as autocast / backward / step:
    the same weights, losses, scales, gradient norms, skips and modes (with accumulation and
    clipping; in fp16 with a micro-batch that overflows)."""
    model, data = linear_problem(steps=8)
    twin = copy.deepcopy(model)
    overflow_at = {3} if mode == "fp16" else set()
    options = dict(mode=mode, device="cpu", init_scale=1024.0, accumulate=2, clip_grad_norm=1.0)
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), **options)
    history = run_amp_step(model, data, amp, overflow_at)
    one_call = mpnb.AmpStep(torch.optim.SGD(twin.parameters(), lr=0.1), **options)
    for step, (x, y) in enumerate(data, start=1):
        one_call.train_step(
            lambda x=x, y=y, step=step: (
                mse(twin(x), y) * (math.inf if step in overflow_at else 1.0)
            ),
            samples=len(x),
        )
    assert torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)
    assert one_call.close().mode == history.mode
    for name in ("step", "loss", "loss_scale", "skipped", "grad_norm"):
        assert getattr(one_call.history, name) == pytest.approx(
            getattr(history, name), rel=0, abs=0, nan_ok=True
        )
    assert one_call.history.skipped_steps == ([2] if mode == "fp16" else [])


def test_train_step_runs_the_forward_under_the_mode_and_the_backward_outside_any_autocast():
    """The forward runs in the helper's mode, switched with set_precision; backward runs with
    autocast off, also when the call sits inside an autocast block (a %%autocast cell), whose
    state is as before once it returns."""
    model = nn.Linear(4, 1)
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cpu")
    dtypes = []

    def forward():
        output = _AutocastInBackward.apply(model(torch.ones(2, 4)))
        dtypes.append(output.dtype)
        return output.float().mean()

    _AutocastInBackward.seen = []
    amp.train_step(forward)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp.train_step(forward)
        assert (
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        )
    amp.set_precision(TrainingPrecision.resolve("fp32", "cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp.train_step(forward)
    assert not torch.is_autocast_enabled("cpu")
    assert dtypes == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert _AutocastInBackward.seen == [False, False, False]
    assert amp.history.mode == ["bf16", "bf16", "fp32"]


def test_a_train_step_inside_another_ones_forward_is_refused_and_changes_nothing():
    """The forward's context is one object, entered once at a time: a train_step called from inside
    the forward of another is refused (entering it again would lose the outer autocast state), and a
    forward that fails leaves the helper ready for the next step with autocast as it was."""
    model = nn.Linear(4, 1)
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cpu")
    loss = lambda: model(torch.ones(2, 4)).float().mean()  # noqa: E731
    with pytest.raises(RuntimeError, match="inside the forward of another"):
        amp.train_step(lambda: amp.train_step(loss))
    with pytest.raises(ZeroDivisionError):
        amp.train_step(lambda: 1 / 0)
    assert not torch.is_autocast_enabled("cpu") and amp.between_steps
    assert amp.train_step(loss) and amp.history.step == [1]
    with pytest.raises(MpnbError, match="must be a tensor"):
        amp.train_step(lambda: 0.5)
    assert amp.between_steps and amp.history.step == [1]


def test_a_learning_rate_held_in_a_tensor_is_recorded_as_it_was_at_each_step():
    """A scheduler changes a tensor learning rate in place: each row keeps the rate its step used,
    not the rate at the flush."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    amp = mpnb.AmpStep(
        optimizer,
        mode="bf16",
        device="cpu",
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
    )
    for _ in range(3):
        amp.train_step(lambda: model(torch.ones(2, 4)).float().mean())
    assert amp.history.lr == pytest.approx([0.01, 0.005, 0.0025], rel=1e-6)  # fp32 values


def test_a_precision_switch_inside_a_train_step_forward_is_refused():
    """Switching inside the forward would train a forward in one mode and step it with another
    mode's scaler (an fp16 overflow not skipped): refused, as mid-window."""
    model = nn.Linear(4, 1)
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="fp16", device="cpu")

    def forward():
        amp.set_precision(TrainingPrecision.resolve("bf16", "cpu"))
        return model(torch.ones(2, 4)).float().mean()

    with pytest.raises(RuntimeError, match="only between optimizer steps"):
        amp.train_step(forward)
    assert amp.precision.mode.label == "fp16" and amp.between_steps


def test_train_step_given_no_function_says_what_it_wants():
    model = nn.Linear(4, 1)
    amp = mpnb.AmpStep(torch.optim.SGD(model.parameters(), lr=0.1), mode="bf16", device="cpu")
    loss = model(torch.ones(2, 4)).mean()
    with pytest.raises(TypeError, match=r"a function that returns the loss.*got a Tensor"):
        amp.train_step(loss)
    assert amp.between_steps and amp.steps == 0


def test_an_optimizer_of_another_model_is_refused_before_training():
    model, other = nn.Linear(4, 1), nn.Linear(4, 1)
    with pytest.raises(MpnbError, match=r"holds none of Linear's parameters.*model.parameters\(\)"):
        mpnb.Trainer(
            model,
            torch.optim.SGD(other.parameters(), lr=0.1),
            mse,
            mode="fp16",
            device="cpu",
            dashboard=None,
        )
    frozen_head = nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 1)
    )  # an optimizer over part of the model is fine
    mpnb.Trainer(
        frozen_head,
        torch.optim.SGD(frozen_head[1].parameters(), lr=0.1),
        mse,
        device="cpu",
        dashboard=None,
    )


def test_a_state_dict_that_does_not_fit_is_refused_and_changes_nothing():
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    other, _, _ = ex.example_trainer("bf16", "cpu", widths=(4, 16), dashboard=None)
    trainer.fit(train, max_steps=2)
    before = copy.deepcopy(trainer.state_dict())
    with pytest.raises(MpnbError, match="the state does not fit this trainer"):
        trainer.load_state_dict(other.state_dict())
    assert trainer.position == tuple(before["position"]) and len(trainer.history) == 2
    assert all(
        torch.equal(a, b)
        for a, b in zip(trainer.model.state_dict().values(), before["model"].values())
    )


def test_a_fit_says_how_it_ended():
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    assert trainer.ended is FitEnd.NOT_RUN
    trainer.fit(train, max_steps=2)
    assert trainer.ended is FitEnd.MAX_STEPS and not trainer.stopped and trainer.resumable
    trainer.fit(train)  # the rest of the planned epoch
    assert trainer.ended is FitEnd.FINISHED and not trainer.resumable

    def stop_at_once(model, batch):
        trainer.control.stop()
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    trainer.step_fn, trainer.loss_fn = stop_at_once, None
    trainer.fit(train)
    assert trainer.ended is FitEnd.STOPPED and trainer.stopped and trainer.ended == "stopped"
    trainer.step_fn = lambda model, batch: 1 / 0
    with pytest.raises(ZeroDivisionError):
        trainer.fit(train)
    assert trainer.ended is FitEnd.FAILED


def test_a_process_forked_inside_a_fit_keeps_quiet_at_the_first_interrupt(capfd):
    """A DataLoader worker inherits the fit's SIGINT handler: a Ctrl-C sent to the whole
    process group is said once, by the process that trains."""
    from mpnb.training.interrupts import StopRequest

    with StopRequest() as stop:
        pid = os.fork()
        if pid == 0:  # the worker: it keeps on until the fit ends it
            os.kill(os.getpid(), signal.SIGINT)
            os._exit(0 if stop.requested else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert "Stopping after" not in capfd.readouterr().err
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
    assert capfd.readouterr().err.count("Stopping after the current step") == 1
