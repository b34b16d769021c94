"""mpnb.distributed.launch: real worker processes through torch's elastic launcher, gloo, 2 ranks."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from mpnb.distributed import LaunchError, launch
from mpnb.errors import InvalidChoiceError, MpnbError


def no_workers_left() -> bool:
    """Every process the launch started has ended (the elastic agent reaps its workers)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not [child for child in psutil.Process().children(recursive=True) if child.is_running()]:
            return True
        time.sleep(0.1)
    return False


def rank_sum(offset: int) -> tuple[int, int]:
    total = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(total)
    return dist.get_rank(), int(total)


def test_each_rank_runs_in_the_process_group_and_returns_its_value():
    launched = launch(rank_sum, 10, nproc=2)
    assert launched.results == [(0, 21), (1, 21)]
    assert launched.histories == [[], []]
    assert no_workers_left()


def fit_on_each_rank(steps: int) -> int:
    import mpnb.examples as ex

    trainer, train, _ = ex.example_trainer("bf16", "cpu", widths=(4, 8), dashboard=None)
    trainer.fit(train, max_steps=steps)
    return len(trainer.history)


def test_each_ranks_fit_histories_come_back():
    launched = launch(fit_on_each_rank, 3, nproc=2)
    assert launched.results == [3, 3]
    assert [[len(h) for h in histories] for histories in launched.histories] == [[3], [3]]
    assert launched.histories[1][0].mode == ["bf16"] * 3


def fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one's batch is broken")
    time.sleep(60)  # rank 0 would run on: the launch must end it


def test_a_failing_rank_ends_every_rank_and_is_named_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(
        LaunchError, match="rank 1 failed: ValueError: rank one's batch is broken"
    ) as raised:
        launch(fail_on_rank_one, nproc=2)
    assert time.monotonic() - started < 20
    assert raised.value.rank == 1 and "fail_on_rank_one" in raised.value.details
    assert no_workers_left()


def raise_on_rank_one_while_rank_zero_waits_for_it() -> None:
    if dist.get_rank() == 1:
        raise KeyError("no such column")
    dist.barrier()  # fails too, a moment later, when rank 1's connection closes


def test_the_rank_that_failed_first_is_named_not_the_one_its_failure_took_down():
    for _ in range(3):
        with pytest.raises(LaunchError, match="rank 1 failed: KeyError") as raised:
            launch(raise_on_rank_one_while_rank_zero_waits_for_it, nproc=2)
        assert raised.value.rank == 1


def hang_on_rank_one() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def test_a_hung_rank_ends_at_the_timeout_with_a_clear_error():
    started = time.monotonic()
    with pytest.raises(
        LaunchError, match=r"timeout=3 s passed with ranks? .*1.* still running"
    ) as raised:
        launch(hang_on_rank_one, nproc=2, timeout=3)
    assert time.monotonic() - started < 20
    assert "rank 1:" in raised.value.details and "hang_on_rank_one" in raised.value.details
    assert no_workers_left()


def _time_out_after(seconds: float, folder: str, rank: int) -> None:
    from mpnb.distributed.launch_failure import end_after

    end_after(seconds, folder, rank, local_ranks=2)
    time.sleep(600)


def test_ranks_whose_timers_started_apart_all_leave_their_stacks(tmp_path):
    """Workers start one after another, so their timers end apart; the launcher ends the others as
    soon as the first one exits. Each rank still running at the timeout must have left its stack."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    first = fork.Process(target=_time_out_after, args=(0.5, str(tmp_path), 0))
    second = fork.Process(target=_time_out_after, args=(1.0, str(tmp_path), 1))
    first.start(), second.start()
    first.join(30)
    second.kill()  # as torch's elastic agent does once a worker has exited
    second.join(30)
    assert first.exitcode == 124
    stacks = {path.name: path.read_text() for path in tmp_path.glob("rank-*.stack")}
    assert sorted(stacks) == ["rank-0.stack", "rank-1.stack"]
    assert all("_time_out_after" in stack for stack in stacks.values())


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"nproc": 0}, MpnbError, "nproc must be a whole number >= 1, got 0"),
        ({"backend": "glue"}, InvalidChoiceError, "'glue'.*gloo"),
        ({"timeout": -1}, MpnbError, "timeout must be a positive, finite number"),
        ({"nnodes": 2}, MpnbError, "rdzv_endpoint"),
        ({"start_method": "thread"}, InvalidChoiceError, "'thread'.*fork"),
        ({"timeout": float("nan")}, MpnbError, "timeout must be a positive, finite number"),
        ({"timeout": float("inf")}, MpnbError, "timeout must be a positive, finite number"),
        (
            {"rdzv_endpoint": "nonsense"},
            MpnbError,
            "rdzv_endpoint must be 'host:port', got 'nonsense'",
        ),
        ({"nproc": 10**6}, MpnbError, "nproc must be at most"),
        (
            {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:0", "secret": "s" * 32},
            MpnbError,
            "needs a port from 1 to 65535",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(options, error, named):
    with pytest.raises(error, match=named):
        launch(rank_sum, 0, **options)
    assert no_workers_left()


def test_a_function_defined_in_a_notebook_cell_runs_in_the_workers():
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        cell = (
            "import torch, torch.distributed as dist\n"
            "from mpnb.distributed import launch\n"
            "scale = 3\n"
            "def scaled_rank():\n"
            "    return dist.get_rank() * scale\n"
            "print(launch(scaled_rank, nproc=2).results)"
        )
        printed: list[str] = []
        reply = client.execute_interactive(
            cell, timeout=120, output_hook=lambda m: printed.append(m["content"].get("text", ""))
        )
        assert reply["content"]["status"] == "ok", printed
        assert "[0, 3]" in "".join(printed)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def exit_on_rank_one(how: str) -> None:
    if dist.get_rank() == 1:
        if how == "sys.exit(0)":
            sys.exit(0)
        os._exit(3)
    dist.barrier()


@pytest.mark.parametrize(
    ("how", "named"),
    [
        (
            "sys.exit(0)",
            r"rank 1 failed: RuntimeError: the function ended its rank with sys.exit\(0\)",
        ),
    ],
)
def test_a_rank_that_ends_without_returning_is_named_and_does_not_hang_the_launch(how, named):
    started = time.monotonic()
    with pytest.raises(LaunchError, match=named) as raised:
        launch(exit_on_rank_one, how, nproc=2, timeout=60)
    assert raised.value.rank == 1 and time.monotonic() - started < 20
    assert no_workers_left()


def test_a_rank_that_exits_without_an_exception_ends_the_launch_and_is_said_to():
    """Which rank is named is a race: the one that exited, or a peer that gloo then crashed (SIGSEGV seen
    in CI), or a peer's error that says another rank ended first. None hangs, none is left running."""
    started = time.monotonic()
    with pytest.raises(LaunchError, match="no Python exception|without a Python exception"):
        launch(exit_on_rank_one, "os._exit(3)", nproc=2, timeout=60)
    assert time.monotonic() - started < 20 and no_workers_left()


def crash_in_native_code() -> None:
    ctypes.string_at(0)  # reads address 0: SIGSEGV, no Python exception


def test_a_rank_that_crashes_is_named_with_its_signal_and_where_it_crashed():
    """A crash (here a segfault in native code, as a broken extension would) leaves no Python exception:
    the error names the signal and shows the Python stack the rank was in."""
    with pytest.raises(LaunchError, match="SIGSEGV") as raised:
        launch(crash_in_native_code, nproc=2, timeout=60)
    # the stack is there unless a fatal-signal handler of another library, installed in the worker after
    # mpnb's, took the signal first (seen once the same process had run many other tests)
    message = str(raised.value)
    assert "Python stacks" not in message or "crash_in_native_code" in message
    assert no_workers_left()


def inherited_objects_frozen() -> int:
    return gc.get_freeze_count()


def test_a_forked_worker_never_collects_the_objects_it_inherited():
    """The launching process's objects, its garbage included, stay out of a forked worker's garbage
    collection: their finalizers are not safe in a child (a worker crashed in the collector, SIGSEGV,
    after the same process had crashed a launch, and in a session that had run Lightning, transformers
    and torch.compile)."""
    frozen = launch(inherited_objects_frozen, nproc=2, start_method="fork", timeout=60).results
    assert all(count > 1000 for count in frozen), frozen


def launch_from_a_worker() -> None:
    launch(rank_sum, 0, nproc=2)


def test_launch_inside_a_worker_is_refused_with_the_reason():
    with pytest.raises(LaunchError, match="launch was called inside a process group"):
        launch(launch_from_a_worker, nproc=2)


def test_the_launchers_loggers_are_as_found_after_a_failed_launch():
    import logging

    loggers = [
        logging.getLogger(name)
        for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn")
    ]
    loggers[0].setLevel(logging.INFO)  # a user's own choice, to be kept
    before = [logger.level for logger in loggers]
    try:
        with pytest.raises(LaunchError):
            launch(fail_on_rank_one, nproc=2)
        assert [logger.level for logger in loggers] == before
    finally:
        loggers[0].setLevel(logging.NOTSET)


class _Unusual(BaseException):
    """Raised by user code: a BaseException that is neither SystemExit nor KeyboardInterrupt."""


def raise_unusual() -> None:
    if dist.get_rank() == 1:
        raise _Unusual("deep in the user's code")


def test_a_rank_raising_an_unusual_base_exception_is_named_with_it():
    with pytest.raises(LaunchError, match="rank 1") as failure:
        launch(raise_unusual, nproc=2, timeout=60)
    assert "_Unusual: deep in the user's code" in str(failure.value) + failure.value.details
