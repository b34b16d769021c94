"""Another process on the machine can neither grow the launching process's memory through the
launch's channel nor delay a stop; another user cannot even connect to it, so cannot read the
rows either (2 gloo processes; one attacker as the test's own user, one as 'nobody' where the
test runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import psutil
import pytest
import torch.distributed as dist

from mpnb.distributed import RankRows, RanksView, launch
from mpnb.training.control import FitControl

from .test_ddp import batches, build_trainer
from .test_security import NOBODY, Attacker, Listeners, paced_steps

FLOOD_ATTACKER = os.path.join(os.path.dirname(__file__), "flood_attacker.py")
#: 8 MiB values the attacker tries to leave with the launching process: 320 MiB in all.
FLOOD_COUNT = 40
#: How much the launching process's resident memory may grow during the launch.
ALLOWED_GROWTH_MIB = 100
#: Steps a rank would take unstopped (0.05 s each): the launch is stopped long before.
STEPS = 400


def long_fit_rank(steps: int) -> tuple[int, bool]:
    trainer = build_trainer("ddp", step_fn=paced_steps, dashboard="text", flush_every=2)
    trainer.fit(batches(2 * steps), max_steps=steps)
    return len(trainer.history), trainer.stopped


class StopOnceStreaming(RanksView):
    """Asks the launch to stop once every rank has streamed 10 rows; notes when."""

    def __init__(self, control: FitControl) -> None:
        self.control, self.asked_at = control, None

    def update(self, rows: RankRows) -> None:
        latest = rows.latest()
        if self.asked_at is None and len(latest) == 2:
            if all(len(history) >= 10 for history in latest.values()):
                self.asked_at = time.monotonic()
                self.control.stop()

    def close(self, rows: RankRows) -> None:
        pass


class PeakMemory:
    """This process's resident memory, sampled every 20 ms: its peak over the baseline."""

    def __init__(self) -> None:
        self.baseline = psutil.Process().memory_info().rss
        self.peak = self.baseline
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._done.wait(0.02):
            self.peak = max(self.peak, me.memory_info().rss)

    def growth_mib(self) -> float:
        self._done.set()
        self._thread.join()
        return (self.peak - self.baseline) / (1 << 20)


class OtherUser:
    """The flood attacker as user 'nobody', in the system's own Python (this test's virtual
    environment is out of that user's reach: it attacks the sockets only). None of it where this
    test does not run as root."""

    PYTHON = "/usr/bin/python3"

    def __init__(self, prefix: str) -> None:
        self.process = None
        if os.getuid() != 0 or not os.access(self.PYTHON, os.X_OK):
            return
        self.folder = tempfile.mkdtemp(prefix="mpnb-other-user-")
        os.chmod(self.folder, 0o777)
        # the checkout may sit in a folder only its owner reads (a CI's mktemp -d): the other
        # user runs copies of the attacker and the module it imports, from its own folder
        for script in (
            FLOOD_ATTACKER,
            os.path.join(os.path.dirname(FLOOD_ATTACKER), "attacker.py"),
        ):
            os.chmod(shutil.copy(script, self.folder), 0o644)
        attacker = os.path.join(self.folder, os.path.basename(FLOOD_ATTACKER))
        command = [self.PYTHON, attacker, self.folder, "-", str(FLOOD_COUNT), prefix]
        self.process = subprocess.Popen(command, user=NOBODY)
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(self.folder, "ready")):
            assert self.process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

    def finish(self) -> dict | None:
        if self.process is None:
            return None
        open(os.path.join(self.folder, "stop"), "w").close()
        assert self.process.wait(timeout=60) == 0
        with open(os.path.join(self.folder, "report.json")) as file:
            report = json.load(file)
        shutil.rmtree(self.folder)
        return report


@pytest.fixture
def launches_made_here(monkeypatch):
    """A folder that the launch makes its private folder in (the attackers watch it, and no other
    launch on the machine), open to 'nobody' so that only the launch's own folder keeps it out."""
    folder = tempfile.mkdtemp(prefix="mpnb-flood-", dir="/tmp")
    os.chmod(folder, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield folder + os.sep
    shutil.rmtree(folder, ignore_errors=True)


def test_another_user_can_neither_flood_the_channel_nor_delay_a_stop(launches_made_here):
    launch(long_fit_rank, 1, nproc=2, dashboard=None)  # torch's launcher imported and warm
    prefix = launches_made_here
    control = FitControl()
    view = StopOnceStreaming(control)
    attacker = Attacker(str(FLOOD_COUNT), prefix, script=FLOOD_ATTACKER)
    other_user = OtherUser(prefix)
    memory, listeners = PeakMemory(), Listeners()
    try:
        with pytest.warns(RuntimeWarning, match="a message of more than 4194336 bytes"):
            launched = launch(long_fit_rank, STEPS, nproc=2, dashboard=view, control=control)
        ended_at = time.monotonic()
    finally:
        growth, seen = memory.growth_mib(), listeners.stop()
        report, other = attacker.finish(), other_user.finish()
    assert view.asked_at is not None, "the ranks' rows never reached the view"
    stop_delay = ended_at - view.asked_at
    assert [stopped for _, stopped in launched.results] == [True, True], report
    assert all(steps < STEPS for steps, _ in launched.results)
    assert stop_delay < 5, (
        f"the stop took {stop_delay:.1f} s: {report['stop_overwrites']} overwrites"
    )
    assert growth < ALLOWED_GROWTH_MIB, (
        f"the launching process grew by {growth:.0f} MiB; the attacker stored "
        f"{report['stored_bytes'] >> 20} MiB and sent {report['sent_bytes'] >> 20} MiB"
    )
    assert not {port for who, _, port in seen if who == "launcher"}, "the launcher listens on TCP"
    assert report["stored_bytes"] == 0 and report["stop_overwrites"] == 0, report
    # a process of the launch's own user may connect, and is cut off at its first 8 MiB message
    assert report["unix"] and all("cut off" in said for said in report["unix"].values()), report
    if other is not None:  # another user: the launch's folder (0700) keeps it out
        assert other["unix"], "the other user found no channel to attack"
        assert all("Permission denied" in said for said in other["unix"].values()), other
        assert other["sent_bytes"] == 0
    assert not dist.is_initialized()
