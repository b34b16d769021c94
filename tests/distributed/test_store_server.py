"""Several machines: node 0's rendezvous store is served by a child process with its memory capped,
so a flood of it from another process stays there (issue 53, point 4)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from mpnb.distributed.signing import new_secret
from mpnb.distributed.store_server import HostedStore
from mpnb.errors import MpnbError
from tests.child_process import child_environment

from .test_security import NODE, ROOT, free_port

MiB = 2**20

#: Another process on the network: stores 8 MiB values under new keys until the store refuses.
FLOOD = """
import datetime, json, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=30))
stored = 0
try:
    for index in range(40):
        store.set(f"flood/{index}", b"x" * (8 * 2**20))
        stored += 1
except Exception as error:
    refused = type(error).__name__
else:
    refused = None
print(json.dumps({"stored": stored, "refused": refused}))
"""


def test_a_flood_of_the_rendezvous_store_stays_in_its_capped_process():
    me = psutil.Process()
    with HostedStore(port=0, cap_bytes=32 * MiB) as hosted:
        own = hosted.client()
        own.set("rendezvous/state", b"signed state")
        store = psutil.Process(hosted._child.pid)
        before_here, before_there = me.memory_info().rss, store.memory_info().rss
        attacker = subprocess.run(
            [sys.executable, "-c", FLOOD, str(hosted.port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = json.loads(attacker.stdout.strip().splitlines()[-1])
        grown_there = store.memory_info().rss - before_there
        assert said["refused"] is not None and said["stored"] <= 4, said  # 320 MiB asked for
        assert grown_there <= 40 * MiB  # the cap, and what a refused message held for a moment
        assert me.memory_info().rss - before_here < 8 * MiB  # nothing of it here
        assert not hosted.ended and hosted.why_ended() is None  # refused, not ended
        assert own.get("rendezvous/state") == b"signed state"  # and still serving
    assert hosted.ended


def test_the_store_process_ends_with_the_launch():
    with HostedStore(port=0) as hosted:
        child = psutil.Process(hosted._child.pid)
        assert child.is_running()
    assert hosted.ended and not child.is_running()


def test_a_port_already_taken_is_said():
    with HostedStore(port=0) as first:
        with pytest.raises(MpnbError, match=f"could not listen on port {first.port}"):
            HostedStore(port=first.port).__enter__()


def test_a_launch_on_node_0_must_be_given_node_0s_address():
    from mpnb.distributed import launch

    with pytest.raises(MpnbError, match="must name node 0's machine"):
        launch(
            print, nproc=1, nnodes=2, node_rank=0, rdzv_endpoint="192.0.2.1:29500", secret="s" * 32
        )


def test_a_store_that_ends_under_a_launch_is_named_by_node_0(tmp_path):
    """Node 0's store process killed while node 0 waits at the rendezvous for node 1: its launch
    ends at once with mpnb's error naming the store (before: torch's traceback, or a rank's
    gloo error, depending on which part noticed first). A node 1 coming to the dead store says
    it lost the rendezvous too, after torch's connection timeouts (about two minutes: not run
    here)."""
    out = tmp_path / "node0.json"
    node = subprocess.Popen(
        [sys.executable, NODE, "0", f"127.0.0.1:{free_port()}", "1", str(out)],
        env=child_environment(MPNB_LAUNCH_SECRET=new_secret().hex()),
        cwd=ROOT,
    )
    try:
        deadline, store = time.monotonic() + 90, None
        while store is None and time.monotonic() < deadline:  # the store started and listening
            children = psutil.Process(node.pid).children(recursive=True)
            store = next(
                (
                    child
                    for child in children
                    if "mpnb.distributed.store_server" in child.cmdline()
                    and any(c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp"))
                ),
                None,
            )
            time.sleep(0.2)
        assert store is not None, "node 0's store never listened"
        time.sleep(2)  # node 0's launch waits at the rendezvous
        store.kill()
        assert node.wait(timeout=60) == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    said = json.loads(out.read_text())["error"]
    assert said.startswith(
        "the launch lost its rendezvous: the rendezvous store's process on this node ended"
    )
