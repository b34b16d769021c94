"""Several machines: node 0's rendezvous store is served by a child process with its memory capped,
so a flood of it from another process stays there (issue 53, point 4)."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from mpnb.distributed.store_server import HostedStore
from mpnb.errors import MpnbError

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
