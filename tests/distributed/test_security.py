"""A launch on a shared machine: another local process, knowing no secret, runs no code in it,
forges no rows, stops nothing; the launching process listens on no TCP port, and the workers'
sockets stay on loopback (2 gloo processes)."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
import torch.distributed as dist
from torch import nn

from mpnb.distributed import LaunchError, RankRows, RanksView, launch
from mpnb.distributed.channel import (
    MAX_FRAME_BYTES,
    LauncherChannel,
    RankStream,
    WorkerChannel,
    frame,
)
from mpnb.distributed.rows_message import MAX_MESSAGE_BYTES, Refused, RowsMessage, decode, encode
from mpnb.distributed.signing import Signer, new_secret
from mpnb.distributed.supervise import Supervisor
from mpnb.errors import MpnbError
from mpnb.training.control import FitControl
from mpnb.training.history import History
from tests.child_process import child_environment

from .attacker import Payload
from .test_ddp import batches, build_trainer

ATTACKER = os.path.join(os.path.dirname(__file__), "attacker.py")
ERROR_FILE_ATTACKER = os.path.join(os.path.dirname(__file__), "error_file_attacker.py")
NODE = os.path.join(os.path.dirname(__file__), "launch_node.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = 65534


class Final(RanksView):
    """Keeps each rank's streamed losses at the last update, and the rows of the last look."""

    def __init__(self) -> None:
        self.streamed: dict[int, list[float]] = {}
        self.final: RankRows | None = None

    def update(self, rows: RankRows) -> None:
        self.streamed = {rank: list(history.loss) for rank, history in rows.latest().items()}

    def close(self, rows: RankRows) -> None:
        self.final = rows


def paced_steps(model, batch):
    time.sleep(0.05)  # long enough for the attacker to strike while the ranks train
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


def train_rank(steps: int) -> tuple[int, bool]:
    trainer = build_trainer("ddp", step_fn=paced_steps, dashboard="text", flush_every=2)
    trainer.fit(batches(2 * steps), max_steps=steps)
    return len(trainer.history), trainer.stopped


def only_real_rows(streamed: list[float], returned: list[float]) -> bool:
    """Whether the streamed losses are the rank's own, in order. The attacker takes rows off the
    queue too: the view may miss some (the channel says so), never hold one the rank did not send."""
    remaining = iter(returned)
    return bool(streamed) and all(any(loss == real for real in remaining) for loss in streamed)


def attacker_user() -> int | None:
    """Attack as the unprivileged user 'nobody' where this process may switch to it and that user
    can run this Python (a CI virtual environment in a private folder is out of its reach)."""
    if os.getuid() != 0:
        return None
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import torch"], user=NOBODY, capture_output=True
        )
    except OSError:
        return None
    return NOBODY if probe.returncode == 0 else None


class Attacker:
    """An attacker script (tests/distributed/attacker.py unless told) in its own process, with a
    folder it can write to."""

    def __init__(self, *options: str, script: str = ATTACKER) -> None:
        self.folder = tempfile.mkdtemp(prefix="mpnb-attacker-")
        os.chmod(self.folder, 0o777)
        self.marker = os.path.join(self.folder, "marker")
        command = [sys.executable, script, self.folder, self.marker, *options]
        self.process = subprocess.Popen(command, user=attacker_user())
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(self.folder, "ready")):
            assert self.process.poll() is None and time.monotonic() < deadline, (
                "the attacker did not start"
            )
            time.sleep(0.05)

    def finish(self) -> dict:
        open(os.path.join(self.folder, "stop"), "w").close()
        assert self.process.wait(timeout=60) == 0
        with open(os.path.join(self.folder, "report.json")) as file:
            report = json.load(file)
        shutil.rmtree(self.folder)
        return report


class Listeners:
    """Every listening socket of this process and its children, sampled while a launch runs."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str, int]] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        me = psutil.Process()
        while not self._done.wait(0.05):
            for process in [me, *me.children(recursive=True)]:
                try:
                    for connection in process.net_connections(kind="inet"):
                        if connection.status == psutil.CONN_LISTEN:
                            who = "launcher" if process.pid == me.pid else "worker"
                            self.seen.add((who, connection.laddr.ip, connection.laddr.port))
                except psutil.Error:
                    pass

    def stop(self) -> set[tuple[str, str, int]]:
        self._done.set()
        self._thread.join()
        return self.seen


def test_a_local_attacker_runs_no_code_forges_no_rows_and_stops_nothing():
    steps = 30
    attacker = Attacker()
    listeners = Listeners()
    view = Final()
    try:
        launched = launch(train_rank, steps, nproc=2, dashboard=view, timeout=180)
    finally:
        seen = listeners.stop()
        report = attacker.finish()
    assert not os.path.exists(attacker.marker), "the attacker's pickle ran"
    assert launched.results == [
        (steps, False),
        (steps, False),
    ]  # every rank ran every step, none was stopped
    for rank, streamed in view.streamed.items():  # no row lost or made up on the way
        assert streamed == launched.histories[rank][0].loss
    assert view.final.ranks == [0, 1]
    for rank in (0, 1):
        assert view.final.histories[rank][0].loss == launched.histories[rank][0].loss
    assert seen and all(ip == "127.0.0.1" for _, ip, _ in seen), (
        f"listening beyond loopback: {sorted(seen)}"
    )
    # mpnb's channel is a Unix-domain socket in the launch's private folder; torch's rendezvous
    # and the workers' store have no socket: the launching process listens on no TCP port at all
    assert not {port for who, _, port in seen if who == "launcher"}
    assert report["listeners"], "the attacker found no port to attack"  # the workers' gloo ports
    assert report["pushed"] == 0 and report["stops"] == 0, report  # none of them is a store


def dies_without_a_word() -> None:
    time.sleep(1)  # the attacker has had its chance by now
    os._exit(3)  # no traceback written: torch's launcher reads whatever is at the error file's path


def torch_launch_files() -> set[str]:
    return {
        name
        for name in os.listdir(tempfile.gettempdir())
        if name.startswith(("torchelastic_", "pytorch-errorfile-"))
    }


def test_a_pickle_planted_where_torch_reads_a_failed_workers_error_never_runs():
    before = torch_launch_files()
    attacker = Attacker(tempfile.gettempdir(), script=ERROR_FILE_ATTACKER)
    try:
        with pytest.raises(LaunchError, match="exit code 3"):
            launch(dies_without_a_word, nproc=2, dashboard=None, timeout=120)
    finally:
        marker_made = os.path.exists(attacker.marker)
        report = attacker.finish()
        for planted in report["planted"]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(planted)
    assert not marker_made, f"the attacker's pickle ran; it planted {report['planted']}"
    assert torch_launch_files() == before  # and the launch left nothing in the shared folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_nodes_drop_rows_that_lack_the_secret(tmp_path):
    """Two launch calls on this machine form one two-node launch (a loopback endpoint); the
    attacker pushes unsigned rows and stop keys into every store it finds (torch's rendezvous
    store: mpnb's channel is no store)."""
    steps, endpoint = 30, f"127.0.0.1:{free_port()}"
    environment = child_environment(MPNB_LAUNCH_SECRET=new_secret().hex())
    attacker = Attacker("--rows-only")
    try:
        nodes = [
            subprocess.Popen(
                [
                    sys.executable,
                    NODE,
                    str(rank),
                    endpoint,
                    str(steps),
                    str(tmp_path / f"node{rank}.json"),
                ],
                env=environment,
                cwd=ROOT,
            )
            for rank in (0, 1)
        ]
        assert [node.wait(timeout=300) for node in nodes] == [0, 0]
    finally:
        report = attacker.finish()
    assert not os.path.exists(attacker.marker)
    assert report["pushed"] > 0
    for rank in (0, 1):
        with open(tmp_path / f"node{rank}.json") as file:
            node = json.load(file)
        assert node["results"] == [[steps, False]]  # each launch returns its own node's rank
        assert node["streamed_ranks"] == [rank] and node["streamed_losses"] == node["losses"]
        # each node's channel is a socket in its launch's private folder: nothing reached it
        assert not any("dropped a message" in text for text in node["warnings"]), node


def test_a_node_given_another_secret_is_refused_at_the_rendezvous(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [sys.executable, NODE, str(rank), endpoint, "1", str(tmp_path / f"node{rank}.json")],
            env=child_environment(MPNB_LAUNCH_SECRET=new_secret().hex()),
            cwd=ROOT,
        )
        for rank in (0, 1)
    ]
    deadline = time.monotonic() + 120
    try:
        # the node that reads the other's state first ends
        while all(node.poll() is None for node in nodes):
            assert time.monotonic() < deadline, "neither node refused the other's rendezvous state"
            time.sleep(0.1)
    finally:
        for node in nodes:
            node.kill()
            node.wait()  # reaped: no zombie left for the next test's count of children
    # the node that refused ends first, and the other may end before the poll sees it (its
    # rendezvous store gone): whichever node it was, one of those that ended says why
    said = []
    for rank, node in enumerate(nodes):
        if node.returncode == 0:
            with open(tmp_path / f"node{rank}.json") as file:
                said.append(json.load(file)["error"])
    assert any(
        "could not meet its other nodes" in error
        and "not signed with this launch's secret" in error
        for error in said
    ), said


def test_a_rendezvous_state_written_without_the_secret_is_refused_unread(tmp_path):
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from mpnb.distributed.rendezvous import SignedBackend

    marker = tmp_path / "marker"
    store = dist.HashStore()
    signed = SignedBackend(C10dRendezvousBackend(store, "run"), new_secret())
    state, token, _ = signed.set_state(b"the real state")
    assert signed.get_state() == (b"the real state", token)
    evil = pickle.dumps(Payload(str(marker)))
    C10dRendezvousBackend(store, "run").set_state(
        evil, token
    )  # what another process could write into the store
    with pytest.raises(RendezvousStateError, match="not signed with this launch's secret"):
        signed.get_state()
    assert not marker.exists()


# The channel's checks, message by message


@pytest.fixture
def channel(tmp_path):
    secret = new_secret()
    folder = tmp_path / "launch"
    folder.mkdir(mode=0o700)
    launcher = LauncherChannel(secret, ranks=range(2, 4), folder=str(folder))
    yield launcher, WorkerChannel(launcher.address, secret, rank=2), secret
    launcher.close()


def raw_connection(launcher: LauncherChannel) -> socket.socket:
    """A connection of the launch's own user, writing whatever it likes."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(launcher.address)
    return connection


def test_rows_signed_with_the_launch_secret_arrive_in_order(channel):
    launcher, worker, _ = channel
    worker.send(0, {"step": [1], "loss": [0.5]})
    worker.send(0, {"step": [2], "loss": [float("nan")]})
    arrived = launcher.received()
    assert [rows["step"] for _, _, rows in arrived] == [[1], [2]] and not launcher.refused


def hostile_messages(secret: bytes) -> dict[str, bytes]:
    signer, other = Signer(secret), Signer(new_secret())
    rows = {"step": [1], "loss": [0.5]}
    signed = lambda fields: signer.sign(json.dumps(fields).encode())  # noqa: E731
    return {
        "not signed with this launch's secret": encode(other, RowsMessage(2, 0, 0, rows)),
        "not signed with this launch's secret ": pickle.dumps(rows),
        "rank 5 is not one of this node's ranks": encode(signer, RowsMessage(5, 0, 0, rows)),
        "unknown column": signed({"rank": 2, "fit": 0, "seq": 0, "columns": {"__class__": [1]}}),
        "column loss holds 'x'": signed(
            {"rank": 2, "fit": 0, "seq": 0, "columns": {"loss": ["x"]}}
        ),
        "column step holds True; it takes whole numbers": signed(
            {"rank": 2, "fit": 0, "seq": 0, "columns": {"step": [True]}}
        ),
        "columns of different lengths": signed(
            {"rank": 2, "fit": 0, "seq": 0, "columns": {"step": [1, 2], "loss": [1.0]}}
        ),
        "not a rows message": signed({"rank": 2, "fit": 0, "seq": 0, "columns": rows, "extra": 1}),
        "seq must be a whole number": signed({"rank": 2, "fit": 0, "seq": -1, "columns": rows}),
        "not JSON": signer.sign(b"[" * 100_000),
        "more than the": b"\0" * (MAX_MESSAGE_BYTES + 100),
    }


@pytest.mark.parametrize("reason", list(hostile_messages(b"s" * 32)))
def test_a_message_that_fails_a_check_is_refused_with_its_reason(reason):
    secret = b"s" * 32
    with pytest.raises(Refused, match=reason.strip()):
        decode(Signer(secret), hostile_messages(secret)[reason], ranks=range(2, 4))


def sent_while_read(launcher: LauncherChannel, messages: list[bytes]) -> list:
    """``messages`` sent by another connection of the launch's user, from a thread (the socket's
    buffer holds less than they take), while this one reads the channel; what arrived."""
    connection = raw_connection(launcher)

    def send() -> None:
        with contextlib.suppress(OSError):  # an oversized message ends the connection
            for message in messages:
                connection.sendall(frame(message))
        connection.close()

    sender = threading.Thread(target=send)
    sender.start()
    arrived = []
    while sender.is_alive():
        arrived += launcher.received()
        time.sleep(0.01)
    sender.join()
    return arrived + launcher.received()


def test_refused_and_replayed_messages_are_dropped_counted_and_said_once(channel):
    launcher, worker, secret = channel
    worker.send(0, {"step": [1], "loss": [0.5]})
    replay = encode(Signer(secret), RowsMessage(2, 0, 0, {"step": [1], "loss": [0.5]}))
    hostile = hostile_messages(secret)
    oversized = hostile.pop("more than the")  # last: it ends its connection
    with pytest.warns(RuntimeWarning, match="dropped a message") as said:
        # a replay: batch 0 again, twice
        arrived = sent_while_read(launcher, [replay, replay, *hostile.values(), oversized])
    assert [rows["loss"] for _, _, rows in arrived] == [[0.5]]
    assert sum(launcher.refused.values()) == 3 + len(hostile)
    assert len(said) == 1


def test_a_message_longer_than_a_frame_ends_its_connection_unread(channel):
    launcher, worker, _ = channel
    with raw_connection(launcher) as connection:
        connection.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"\0" * 1024)
        with pytest.warns(RuntimeWarning, match="a message of more than 4194336 bytes"):
            launcher.received()
        with pytest.raises(OSError):  # cut off: what it writes next goes nowhere
            for _ in range(64):
                connection.sendall(b"\0" * (1 << 20))
    worker.send(0, {"step": [1], "loss": [0.5]})  # the workers' own connections go on
    assert [rows["step"] for _, _, rows in launcher.received()] == [[1]]


def test_the_views_last_look_holds_the_rows_that_never_arrived(channel):
    launcher, worker, secret = channel
    whole = History()
    whole.extend({"step": [1, 2], "loss": [0.9, 0.7]})

    def ranks_train() -> dict[int, list[History]]:
        signer = Signer(secret)  # step 1's batch is lost on the way: batch 1 arrives alone
        with raw_connection(launcher) as connection:
            rows = {"step": [2], "loss": [0.7]}
            connection.sendall(frame(encode(signer, RowsMessage(2, 0, 1, rows))))
        return {2: [whole]}  # what rank 2 returned when it ended

    view = Final()
    with pytest.warns(RuntimeWarning, match="1 batch\\(es\\) of rank 2's rows never arrived"):
        Supervisor(launcher, view).run(ranks_train, exact_rows=lambda returned: returned)
    assert view.streamed == {2: [0.7]}
    assert view.final.ranks == [2] and view.final.latest()[2].loss == [0.9, 0.7]


def test_a_stop_reaches_a_worker_only_when_the_launch_asks_even_one_that_connects_later(channel):
    launcher, worker, secret = channel
    launcher.received()
    assert not worker.stop_asked()
    launcher.ask_stop()
    assert worker.stop_asked()
    later = WorkerChannel(launcher.address, secret, rank=3)
    launcher.ask_stop()  # the launch's next look
    assert later.stop_asked()


def test_a_worker_whose_launch_reads_no_more_trains_on_without_streaming(channel):
    launcher, _, secret = channel
    worker = WorkerChannel(launcher.address, secret, rank=2, send_timeout_s=0.2)
    history = History()
    stream = RankStream(worker, 0, history, FitControl())
    for step in range(1, 2001):  # the launcher never reads: its socket's buffer fills
        history.extend({"step": [step], "loss": [0.5], "mode": ["x" * 1000]})
        stream.update(history)
        if not stream.send_rows:
            break
    assert not stream.send_rows and step < 2000  # gave up streaming, raised nothing


def test_the_channel_is_a_socket_only_its_user_reaches_and_opens_no_tcp_port(channel, tmp_path):
    launcher, _, secret = channel
    assert launcher.address == str(tmp_path / "launch" / "channel.sock")
    assert stat.S_ISSOCK(os.stat(launcher.address).st_mode)
    assert stat.S_IMODE(os.stat(tmp_path / "launch").st_mode) == 0o700
    listening = [
        c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
    ]
    assert listening == []
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    with pytest.raises(PermissionError, match="open to other users"):
        LauncherChannel(secret, ranks=range(2), folder=str(open_folder))


def test_several_machines_need_a_shared_secret_and_it_must_be_long_enough(monkeypatch):
    monkeypatch.delenv("MPNB_LAUNCH_SECRET", raising=False)
    with pytest.raises(MpnbError, match="needs a secret shared by every node"):
        launch(train_rank, 1, nnodes=2, rdzv_endpoint="127.0.0.1:29999")
    with pytest.raises(MpnbError, match="fewer than 16"):
        launch(train_rank, 1, nnodes=2, rdzv_endpoint="127.0.0.1:29999", secret="short")
    assert not dist.is_initialized()


SHARE_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@pytest.mark.parametrize("found", [None, "0"], ids=["unset", "the user's own value"])
def test_torchs_store_switch_is_put_back_after_a_launch_and_after_a_failed_one(monkeypatch, found):
    """A one-machine launch sets torch's switch that keeps the workers' store server from starting;
    it is as found afterwards, however the launch ended, and no launch stays registered."""
    from mpnb.distributed import LaunchError
    from mpnb.distributed.rendezvous import _LAUNCHES

    from .test_launch import fail_on_rank_one, rank_sum

    if found is None:
        monkeypatch.delenv(SHARE_STORE_SWITCH, raising=False)
    else:
        monkeypatch.setenv(SHARE_STORE_SWITCH, found)
    assert launch(rank_sum, 0, nproc=2, dashboard=None).results == [(0, 1), (1, 1)]
    assert os.environ.get(SHARE_STORE_SWITCH) == found
    with pytest.raises(LaunchError):
        launch(fail_on_rank_one, nproc=2, dashboard=None, timeout=60)
    assert os.environ.get(SHARE_STORE_SWITCH) == found and not _LAUNCHES
