"""One instrument interface: the moments a step's account calls, in the Trainer and in a framework
loop's telemetry alike; one fp16 vocabulary for the watch and the advisor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpnb
import mpnb.examples as ex
from mpnb.integrations.loop_telemetry import LoopTelemetry
from mpnb.numerics import advisor, limits, watch
from mpnb.training.step_record import Instrument, WatchedRun
from mpnb.training.telemetry import Sink


class Moments(Instrument):
    """Notes each moment it is called at, with its step number."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def begin(self, run: WatchedRun) -> None:
        self.seen.append(("begin",))

    def before_forward(self, step: int, first: bool) -> None:
        self.seen.append(("before_forward", step, first))

    def step_end(self, step: int) -> None:
        self.seen.append(("step_end", step))

    def update(self, history) -> None:
        self.seen.append(("flush", len(history)))

    def close(self, history) -> None:
        self.seen.append(("close", len(history)))

    def detach(self) -> None:
        self.seen.append(("detach",))


def test_an_instrument_on_a_trainer_sees_each_moment_in_order_with_its_step():
    trainer, train, _ = ex.example_trainer(
        "bf16", "cpu", widths=(4, 8), dashboard=None, accumulate=2, batch_size=16
    )
    toy = Moments()
    trainer._instruments.append(toy)  # where the builder's instruments go
    trainer.fit(train, max_steps=2)
    assert toy.seen == [
        ("begin",),
        ("before_forward", 1, True),
        ("before_forward", 1, False),
        ("step_end", 1),
        ("before_forward", 2, True),
        ("before_forward", 2, False),
        ("step_end", 2),
        ("flush", 2),
        ("close", 2),
        ("detach",),
    ]
    toy.seen.clear()
    trainer.fit(train, max_steps=1)  # a second fit numbers on
    assert [moment for moment in toy.seen if moment[0] == "step_end"] == [("step_end", 3)]


def test_an_instrument_on_a_framework_loops_telemetry_sees_the_same_moments():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    telemetry = LoopTelemetry("my loop", dashboard=None)
    telemetry.begin(model, optimizer, scaler=None, device="cpu", asked=None)
    toy = Moments()
    run = telemetry._run
    run.account.watch([*run.instruments, toy], run.watched(telemetry.history), telemetry.steps + 1)
    run.sinks.append(toy)
    telemetry.recorder.attach(toy)
    for _ in range(2):
        telemetry.window_begin()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.ones(8, 4)).float().pow(2).mean()
        loss.backward()
        telemetry.add_loss(loss)
        telemetry.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        telemetry.step_end()
    telemetry.end()
    assert toy.seen == [
        ("begin",),
        ("before_forward", 1, True),
        ("step_end", 1),
        ("before_forward", 2, True),
        ("step_end", 2),
        ("flush", 2),
        ("close", 2),
        ("detach",),
    ]


class EveryThird(Moments):
    """Watches steps 3, 6, 9...; asks for the next step at once when told to (a flush's trouble)."""

    def __init__(self) -> None:
        super().__init__()
        self.urgent = False
        self.run: WatchedRun | None = None

    def begin(self, run: WatchedRun) -> None:
        super().begin(run)
        self.run = run

    def next_watched_step(self, step: int) -> int:
        return step if self.urgent else step + (-step % 3)


def test_an_instrument_is_called_only_at_the_steps_it_watches():
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    toy = EveryThird()
    trainer._instruments.append(toy)
    trainer.fit(train, max_steps=7)
    assert [moment for moment in toy.seen if moment[0] == "step_end"] == [
        ("step_end", 3),
        ("step_end", 6),
    ]
    assert ("before_forward", 4, True) not in toy.seen
    assert ("before_forward", 6, True) in toy.seen


def test_an_instrument_that_asks_again_is_called_from_the_next_step():
    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    toy = EveryThird()
    trainer._instruments.append(toy)

    class Urgent(Sink):  # at step 4's end, the instrument wants every step from then on
        def due(self, now: float) -> bool:
            return True

        def update(self, history) -> None:
            if len(history) == 4 and not toy.urgent:
                toy.urgent = True
                toy.run.reschedule()

    trainer.amp.recorder.attach(Urgent())
    trainer.fit(train, max_steps=6)
    ends = [moment[1] for moment in toy.seen if moment[0] == "step_end"]
    assert ends == [3, 5, 6]


def test_a_moment_no_instrument_overrides_is_never_called():
    called = []

    class OnlyEnds(Instrument):
        def step_end(self, step: int) -> None:
            called.append(step)

    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    only = OnlyEnds()
    trainer._instruments.append(only)
    account = trainer.amp.account
    trainer.fit(train, max_steps=2)
    assert called == [1, 2]
    account.watch([only], WatchedRun(trainer.history, torch.device("cpu")), next_step=3)
    assert account._moments.before_forward == [] and account._moments.step_end == [only.step_end]
    account.unwatch()


def test_the_fp16_limits_are_torchs_and_the_watch_and_the_advisor_share_them():
    fp16 = torch.finfo(torch.float16)
    assert limits.FP16_LARGEST_FINITE == fp16.max == 65504.0
    assert limits.FP16_SMALLEST_NORMAL == fp16.smallest_normal == fp16.tiny == 2.0**-14
    assert limits.FP16_SMALLEST_SUBNORMAL == 2.0**-24
    assert torch.tensor(2.0**-24, dtype=torch.float16).item() == 2.0**-24  # fp16 holds it
    assert torch.tensor(2.0**-26, dtype=torch.float16).item() == 0.0  # and loses what is far below
    assert watch.FP16_SMALLEST_SUBNORMAL is limits.FP16_SMALLEST_SUBNORMAL
    assert watch.underflow_counts is limits.underflow_counts  # one definition of the share
    assert watch.NumericsLog([]).limit == limits.FP16_LARGEST_FINITE
    assert advisor.FP16_LARGEST_FINITE is limits.FP16_LARGEST_FINITE
    # the watch's engine (which the advisor runs) counts what limits.underflow_share counts
    values = torch.tensor([[0.0, 1e-9, 2.0**-25, 1.0, float("inf"), float("nan"), 1e-3, -1e-8]])
    layer = torch.nn.Identity()
    measures = watch.ModuleMeasures(layer, [""])
    measures.start()
    layer(values)
    row = dict(zip(watch.MEASURES, measures.stop()[0].tolist()))
    assert row["underflow_share"] == pytest.approx(float(limits.underflow_share(values)))


def test_the_underflow_share_counts_nonzero_values_below_the_smallest_subnormal():
    values = torch.tensor([0.0, 0.0, 2.0**-30, 2.0**-25, 2.0**-24, 1.0, float("inf")])
    assert limits.underflow_share(values).item() == pytest.approx(
        2 / 5
    )  # of five nonzero, two below 2**-24
    assert limits.underflow_share(torch.zeros(4)).item() == 0.0


def test_advise_reports_the_watchs_engine_figures_for_its_one_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    report = mpnb.advise(model, (x, y), lambda out, t: F.cross_entropy(out, t) * 1e-6, device="cpu")
    engine = watch.ModuleMeasures(model, ["0", "1", "2"])
    engine.start()
    (F.cross_entropy(model(x), y) * 1e-6).backward()
    rows = engine.stop()
    model.zero_grad(set_to_none=True)
    for row, measured in zip(report.rows, rows.tolist(), strict=True):
        figures = dict(zip(watch.MEASURES, measured, strict=True))
        assert row.max_activation == figures["activation_max"]
        assert row.max_gradient == figures["gradient_max"]
        assert row.underflow_share == figures["gradient_underflow_share"]
