"""%%distributed in a real Jupyter kernel: the cell runs on 2 ranks, rank 0's names come back."""

from __future__ import annotations

import queue

import pytest
from jupyter_client.manager import start_new_kernel


@pytest.fixture(scope="module")
def client():
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=60)
    yield client
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def execute(client, code: str, late_s: float = 0.0) -> tuple[dict, str]:
    """Run ``code``; its reply and what it printed. ``late_s``: also take the cell's output that
    arrives up to that long after the kernel went idle (a forked worker's last prints travel
    through the kernel's I/O thread; a front-end still shows them in the cell they belong to)."""
    printed: list[str] = []

    def collect(message):
        content = message["content"]
        if message["msg_type"] == "stream":
            printed.append(content["text"])
        elif message["msg_type"] == "error":
            printed.append(f"{content['ename']}: {content['evalue']}")

    reply = client.execute_interactive(code, output_hook=collect, timeout=120)
    while late_s:
        try:
            message = client.get_iopub_msg(timeout=late_s)
        except queue.Empty:
            break
        if message["parent_header"].get("msg_id") == reply["parent_header"]["msg_id"]:
            collect(message)
    return reply["content"], "".join(printed)


def test_the_cell_runs_on_each_rank_in_the_session_mode_and_rank_zeros_names_come_back(client):
    reply, _ = execute(
        client,
        "%load_ext mpnb\n%amp bf16\nimport threading, torch, torch.distributed as dist\nlayer = torch.nn.Linear(4, 4)",
    )
    assert reply["status"] == "ok"
    reply, printed = execute(
        client,
        "%%distributed --nproc 2\n"
        "rank, world = dist.get_rank(), dist.get_world_size()\n"
        "total = torch.tensor([rank + 1.0]); dist.all_reduce(total)\n"
        "dtype = str(layer(torch.ones(1, 4)).dtype)\n"
        "lock = threading.Lock()",
    )
    assert reply["status"] == "ok", printed
    assert (
        "from rank 0: rank, world, total, dtype; not brought back (cannot be pickled): lock"
        in printed
    )
    _, printed = execute(
        client,
        "print(rank, world, float(total), dtype, 'lock' in globals(), type(_distributed).__name__)",
    )
    assert printed.split() == ["0", "2", "3.0", "torch.bfloat16", "False", "Launched"]


def test_a_failing_rank_fails_the_cell_with_its_traceback(client):
    reply, printed = execute(
        client,
        "%%distributed --nproc 2\nif dist.get_rank() == 1:\n    raise ValueError('only on rank one')\n",
    )
    assert reply["status"] == "error" and "rank 1 failed: ValueError: only on rank one" in printed
    assert printed.startswith(
        "RuntimeError: %%distributed: rank 1 failed"
    )  # not shown as a usage error


def test_a_name_bound_again_comes_back_even_if_the_new_object_reuses_the_old_ones_id(client):
    execute(client, "numbers = [1]")
    reply, printed = execute(client, "%%distributed --nproc 2\ndel numbers\nnumbers = [42]")
    assert reply["status"] == "ok" and "from rank 0: numbers" in printed, printed
    assert execute(client, "print(numbers)")[1].strip() == "[42]"


def test_bad_arguments_are_a_usage_error(client):
    reply, printed = execute(client, "%%distributed --nproc 0\nx = 1")
    assert reply["status"] == "error" and "nproc must be a whole number >= 1, got 0" in printed


def test_each_ranks_prints_reach_the_cell_as_whole_lines_marked_with_the_rank(client):
    execute(client, "%load_ext mpnb\nimport torch.distributed as dist")
    reply, printed = execute(
        client,
        "%%distributed --nproc 2\n"
        "import sys\n"
        "for word in ('loss', 'of', 'rank', str(dist.get_rank())):\n"
        "    print(word, end=' ', flush=True)\n"
        "print()\n"
        "print('unfinished', dist.get_rank(), end='')",
        late_s=1.0,
    )
    assert reply["status"] == "ok", printed
    lines = printed.splitlines()
    for rank in (0, 1):
        assert (
            f"[rank {rank}] loss of rank {rank} " in lines
        )  # not interleaved word by word with the other rank
        assert (
            f"[rank {rank}] unfinished {rank}" in lines
        )  # a last line without its newline is not lost


def test_a_launch_in_a_kernel_shows_the_ranks_live_and_brings_their_histories_back(client):
    shown: list[str] = []

    def collect(message):
        if message["msg_type"] == "display_data":
            shown.extend(message["content"]["data"])

    code = (
        "import torch, torch.distributed as dist, mpnb.examples as ex\n"
        "from mpnb.distributed import launch\n"
        "from mpnb.training import Trainer\n"
        "def train():\n"
        "    torch.manual_seed(0)\n"
        "    model = ex.DigitsCNN(widths=(4, 8))\n"
        "    trainer = Trainer(model, torch.optim.Adam(model.parameters(), 1e-3), torch.nn.functional.cross_entropy,\n"
        "                      mode='bf16', device='cpu', strategy='ddp', flush_every=2)\n"
        "    images, labels = ex.load_digits()\n"
        "    trainer.fit([(images[i:i + 16], labels[i:i + 16]) for i in range(0, 320, 16)])\n"
        "    return len(trainer.history)\n"
        "launched = launch(train, nproc=2)\n"
        "print(launched.results, [len(h[0]) for h in launched.histories])"
    )
    printed: list[str] = []

    def hook(message):
        collect(message)
        if message["msg_type"] == "stream":
            printed.append(message["content"]["text"])

    reply = client.execute_interactive(code, output_hook=hook, timeout=180)
    assert reply["content"]["status"] == "ok", "".join(printed)
    assert "application/vnd.jupyter.widget-view+json" in shown  # the live per-rank figure
    assert "[10, 10] [10, 10]" in "".join(printed)
