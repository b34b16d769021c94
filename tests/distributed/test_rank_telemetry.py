"""Each rank's telemetry reaches the launching process while the ranks train; a Stop or an
interrupt there stops every rank after the same step (2 gloo processes)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch.distributed as dist
from torch import nn

from mpnb.distributed import RankRows, RanksView, launch

from .test_ddp import batches, build_trainer


class Recorded(RanksView):
    """Keeps how many steps every rank had reported at each update."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.final: RankRows | None = None

    def update(self, rows: RankRows) -> None:
        self.seen.append(rows.common_steps())

    def close(self, rows: RankRows) -> None:
        self.final = rows


def as_text(history) -> dict[str, list[str]]:
    """The columns with each value as its repr: NaN equals NaN."""
    return {name: list(map(repr, values)) for name, values in history.columns.items()}


def slow_steps(model, batch, pause: float = 0.02):
    inputs, targets = batch
    time.sleep(pause * (1 + 2 * dist.get_rank()))  # rank 1 takes three times as long: a straggler
    return nn.functional.mse_loss(model(inputs), targets)


def train_rank(steps: int = 30) -> tuple[int, bool]:
    trainer = build_trainer("ddp", step_fn=slow_steps, dashboard="text", flush_every=5)
    trainer.fit(batches(2 * steps), max_steps=steps)
    return len(trainer.history), trainer.stopped


def test_rows_stream_in_while_the_ranks_train_and_end_equal_to_the_histories():
    view = Recorded()
    launched = launch(train_rank, nproc=2, dashboard=view, timeout=120)
    assert any(0 < seen < 30 for seen in view.seen), f"no rows before the end: {view.seen}"
    rows = view.final
    assert rows.ranks == [0, 1]
    for rank in (0, 1):
        streamed, returned = rows.histories[rank][0], launched.histories[rank][0]
        assert as_text(streamed) == as_text(
            returned
        )  # every row, every column, as the rank recorded it
    assert rows.disagreements() == []
    assert list(rows.stragglers()) == [1]


class StopAtTen(Recorded):
    def __init__(self, control) -> None:
        super().__init__()
        self.control = control

    def update(self, rows: RankRows) -> None:
        super().update(rows)
        if rows.common_steps() >= 10:
            self.control.stop()


def test_a_stop_in_the_launching_process_stops_every_rank_after_the_same_step():
    from mpnb.training.control import FitControl

    control = FitControl()
    launched = launch(
        train_rank, 200, nproc=2, dashboard=StopAtTen(control), control=control, timeout=120
    )
    (steps0, stopped0), (steps1, stopped1) = launched.results
    assert steps0 == steps1 and 10 <= steps0 < 200 and stopped0 and stopped1


def sleep_forever() -> None:
    while True:
        time.sleep(0.1)


def interrupt_once_workers_run(before: set[int], workers: int) -> threading.Thread:
    """Send this process SIGINT once ``workers`` new child processes exist (and have had half a
    second to start running): a fixed delay may land before a busy machine has started any."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            children = {child.pid for child in psutil.Process().children(recursive=True)}
            if len(children - before) >= workers:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_an_interrupt_ends_every_worker_at_once_and_leaves_none_behind():
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    interrupt_once_workers_run(before, workers=2)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="every worker was ended"):
        launch(sleep_forever, nproc=2, dashboard=None, timeout=120)
    assert time.monotonic() - started < 20
    time.sleep(0.5)
    assert {child.pid for child in psutil.Process().children(recursive=True)} - before == set()


#: The signals torch's launcher installs handlers for while workers run.
HANDLED_BY_TORCH = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

#: A launching process whose interrupt arrives while it forks a worker: the signal's handler then
#: runs inside Python's at-fork callback, which prints and drops whatever the handler raises.
INTERRUPTED_WHILE_FORKING = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from mpnb.distributed import launch
from tests.distributed.test_rank_telemetry import sleep_forever

armed = [True]

def interrupt_once():
    if armed:
        armed.clear()
        os.kill(os.getpid(), signal.SIGINT)

os.register_at_fork(after_in_parent=interrupt_once)
started = time.monotonic()
try:
    launch(sleep_forever, nproc=2, dashboard=None, timeout=40)
except KeyboardInterrupt as interrupted:
    print("interrupted after", round(time.monotonic() - started), "s:", interrupted)
"""


def test_an_interrupt_that_lands_while_a_worker_is_forked_still_ends_the_launch():
    script = INTERRUPTED_WHILE_FORKING.format(root=str(pathlib.Path(__file__).parents[2]))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout.strip().splitlines()[-1]
    assert said.endswith("s: launch interrupted: every worker was ended"), result.stdout
    assert int(said.split()[2]) < 20, said


def test_a_launch_puts_back_the_signal_handlers_it_found():
    found = {number: signal.getsignal(number) for number in HANDLED_BY_TORCH}
    launch(print, "ran", nproc=2, dashboard=None, timeout=60)
    assert {number: signal.getsignal(number) for number in HANDLED_BY_TORCH} == found


def test_text_progress_names_every_rank_and_the_straggler(capsys):
    launch(train_rank, nproc=2, dashboard="text", timeout=120)
    printed = capsys.readouterr().out.splitlines()
    final = [line for line in printed if line.startswith("finished: step 30 on 2 ranks")]
    assert final and "same on every rank" in final[0] and "slow: rank 1" in final[0]


def test_a_launch_refuses_an_unknown_dashboard_before_starting():
    from mpnb.errors import InvalidChoiceError

    with pytest.raises(InvalidChoiceError, match="'plot'.*RanksView"):
        launch(sleep_forever, nproc=2, dashboard="plot")


class FailsOnceThenStops(Recorded):
    def __init__(self, control) -> None:
        super().__init__()
        self.control, self.failed = control, False

    def update(self, rows: RankRows) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("the view broke")
        super().update(rows)


def test_a_failing_view_is_said_once_and_left_out_while_the_launch_goes_on():
    from mpnb.training.control import FitControl

    control = FitControl()
    view = FailsOnceThenStops(control)
    with pytest.warns(RuntimeWarning, match="FailsOnceThenStops failed in update.*the view broke"):
        launched = launch(train_rank, 30, nproc=2, dashboard=view, control=control, timeout=120)
    assert [steps for steps, _ in launched.results] == [30, 30]  # the results came back
    assert view.seen == [] and view.final is None  # left out after its failure


def test_the_latest_history_of_a_rank_is_the_one_its_rows_came_to_last():
    rows = RankRows()
    rows.add(0, 0, {"step": [1, 2], "loss": [0.5, 0.4]})  # trainer A
    rows.add(0, 1, {"step": [1], "loss": [0.9]})  # trainer B
    rows.add(0, 0, {"step": [3], "loss": [0.3]})  # A again
    assert rows.latest()[0].step == [1, 2, 3]


def test_a_straggler_is_named_only_once_enough_steps_are_in():
    rows = RankRows()
    for rank, seconds in ((0, 0.010), (1, 0.020)):
        rows.add(rank, 0, {"step": [1, 2, 3, 4, 5], "forward_time": [seconds] * 5})
    assert (
        rows.stragglers() == {}
    )  # 4 steps after warm-up: noise on a shared machine, not a straggler
    for rank, seconds in ((0, 0.010), (1, 0.020)):
        rows.add(rank, 0, {"step": list(range(6, 13)), "forward_time": [seconds] * 7})
    assert rows.stragglers() == {1: 2.0}
