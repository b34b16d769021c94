"""The extension in a real Jupyter kernel (ipykernel), the way a notebook drives it,
including ipykernel's async execution path and a real kernel interrupt."""

from __future__ import annotations

import threading
import time

import pytest
from jupyter_client.manager import start_new_kernel



@pytest.fixture(scope="module")
def kernel():
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=60)
    yield manager, client
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def execute(client, code: str, timeout: float = 60) -> tuple[dict, str]:
    """Run a cell; return the reply content and everything it printed."""
    printed: list[str] = []

    def collect(message):
        content = message["content"]
        if message["msg_type"] == "stream":
            printed.append(content["text"])
        elif message["msg_type"] in ("execute_result", "display_data"):
            printed.append(content["data"].get("text/plain", ""))
        elif message["msg_type"] == "error":
            printed.append(f"{content['ename']}: {content['evalue']}")

    reply = client.execute_interactive(code, output_hook=collect, timeout=timeout)
    return reply["content"], "".join(printed)


def test_modes_persist_across_kernel_cells_and_unload_restores(kernel):
    _, client = kernel
    reply, _ = execute(client, "%load_ext mpnb\nimport torch\nlinear = torch.nn.Linear(4, 4)\nx = torch.randn(2, 4)")
    assert reply["status"] == "ok"
    execute(client, "%amp bf16")
    assert execute(client, "print(linear(x).dtype)")[1].strip() == "torch.bfloat16"
    # ipykernel runs cells with top-level await on a different code path.
    assert "torch.bfloat16" in execute(client, "import asyncio\nawait asyncio.sleep(0)\nprint(linear(x).dtype)")[1]
    reply, printed = execute(client, "%%autocast -d fp16\nprint(linear(x).dtype)\n1/0")
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError"
    assert "torch.float16" in printed
    assert execute(client, "print(linear(x).dtype)")[1].strip() == "torch.bfloat16"
    reply, printed = execute(client, "%amp fp8")
    assert reply["status"] == "error" and "'fp8'" in printed
    execute(client, "%unload_ext mpnb")
    printed = execute(client, "print(linear(x).dtype, torch.is_autocast_enabled('cpu'))")[1]
    assert printed.strip() == "torch.float32 False"


def test_kernel_interrupt_inside_an_autocast_cell_restores_state(kernel):
    manager, client = kernel
    execute(client, "%load_ext mpnb\nimport torch, time")
    before = execute(client, "print(torch.is_autocast_enabled('cpu'), torch.get_autocast_dtype('cpu'), "
                             "torch.is_autocast_cache_enabled())")[1]
    threading.Timer(2.0, manager.interrupt_kernel).start()
    started = time.monotonic()
    reply, _ = execute(client, "%%autocast -d fp16 --cache\nwhile True:\n    time.sleep(0.05)")
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - started < 30
    after = execute(client, "print(torch.is_autocast_enabled('cpu'), torch.get_autocast_dtype('cpu'), "
                            "torch.is_autocast_cache_enabled())")[1]
    assert after == before
    execute(client, "%unload_ext mpnb")
