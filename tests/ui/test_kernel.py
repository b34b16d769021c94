"""The extension in a real Jupyter kernel (ipykernel), the way a notebook drives it,
including ipykernel's async execution path and a real kernel interrupt."""

from __future__ import annotations

import json
import threading
import time

import pytest
from jupyter_client.manager import start_new_kernel

from mpnb.ui.plots.compare_report import MODE_TRACES


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
    reply, _ = execute(
        client,
        "%load_ext mpnb\nimport torch\nlinear = torch.nn.Linear(4, 4)\nx = torch.randn(2, 4)",
    )
    assert reply["status"] == "ok"
    execute(client, "%amp bf16")
    assert execute(client, "print(linear(x).dtype)")[1].strip() == "torch.bfloat16"
    # ipykernel runs cells with top-level await on a different code path.
    assert (
        "torch.bfloat16"
        in execute(client, "import asyncio\nawait asyncio.sleep(0)\nprint(linear(x).dtype)")[1]
    )
    reply, printed = execute(client, "%%autocast -d fp16\nprint(linear(x).dtype)\n1/0")
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError"
    assert "torch.float16" in printed
    assert execute(client, "print(linear(x).dtype)")[1].strip() == "torch.bfloat16"
    reply, printed = execute(client, "%amp int4")
    assert reply["status"] == "error" and "'int4'" in printed
    execute(client, "%unload_ext mpnb")
    printed = execute(client, "print(linear(x).dtype, torch.is_autocast_enabled('cpu'))")[1]
    assert printed.strip() == "torch.float32 False"


def test_kernel_interrupt_inside_an_autocast_cell_restores_state(kernel):
    manager, client = kernel
    execute(client, "%load_ext mpnb\nimport torch, time")
    before = execute(
        client,
        "print(torch.is_autocast_enabled('cpu'), torch.get_autocast_dtype('cpu'), torch.is_autocast_cache_enabled())",
    )[1]
    threading.Timer(2.0, manager.interrupt_kernel).start()
    started = time.monotonic()
    reply, _ = execute(client, "%%autocast -d fp16 --cache\nwhile True:\n    time.sleep(0.05)")
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - started < 30
    after = execute(
        client,
        "print(torch.is_autocast_enabled('cpu'), torch.get_autocast_dtype('cpu'), torch.is_autocast_cache_enabled())",
    )[1]
    assert after == before
    execute(client, "%unload_ext mpnb")


def execute_collecting(
    client, code: str, timeout: float = 120
) -> tuple[dict, list[tuple[float, dict]]]:
    """Run a cell; return the reply content and every iopub message with its arrival time."""
    messages: list[tuple[float, dict]] = []
    reply = client.execute_interactive(
        code, output_hook=lambda m: messages.append((time.monotonic(), m)), timeout=timeout
    )
    return reply["content"], messages


def fit_collecting(client, trainer_arguments: str, fit: str) -> list[tuple[float, dict]]:
    """Make an example trainer in the kernel (``example_trainer(trainer_arguments)``), run the cell
    ``fit``, and return every iopub message of it with its arrival time."""
    execute(
        client,
        f"import mpnb.examples as ex\ntrainer, train, test = ex.example_trainer({trainer_arguments})",
    )
    reply, messages = execute_collecting(client, fit)
    assert reply["status"] == "ok", reply
    return messages


def wire_size(message: dict) -> int:
    return len(json.dumps(message["content"])) + sum(
        len(memoryview(b).tobytes()) for b in message.get("buffers") or []
    )


def test_live_dashboard_updates_reach_the_frontend_while_the_cell_runs(kernel):
    _, client = kernel
    messages = fit_collecting(
        client, "'bf16', 'cpu', widths=(8, 16)", "history = trainer.fit(train, epochs=12)"
    )
    views = [m for _, m in messages if m["msg_type"] == "display_data"]
    assert any("application/vnd.jupyter.widget-view+json" in m["content"]["data"] for m in views)
    updates = [(t, m) for t, m in messages if m["msg_type"] == "comm_msg" and m.get("buffers")]
    assert len(updates) >= 3
    shown = next(
        t for t, m in messages if m["msg_type"] == "display_data"
    )  # after imports: training starts
    run_time = messages[-1][0] - shown
    assert (
        updates[-1][0] - updates[0][0] > 0.5 * run_time
    )  # spread over the run, not sent at the end
    assert max(wire_size(m) for _, m in updates) <= 64 * 1024
    assert execute(client, "print(len(history), history.skipped_steps)")[1].strip() == "276 []"


def test_a_fits_dashboard_sends_plotlys_bundle_to_the_page_once(kernel):
    """Each plotly FigureWidget carries plotly.js (about 5 MB) in its state: a figure nobody has
    asked for yet (the memory-by-category bars) is made when first drawn."""
    _, client = kernel
    messages = fit_collecting(
        client, "'fp32', 'cpu', widths=(4, 8)", "_ = trainer.fit(train, max_steps=2)"
    )
    opened = [m for _, m in messages if m["msg_type"] == "comm_open"]
    bundles = [m for m in opened if "_esm" in m["content"]["data"].get("state", {})]
    assert len(bundles) == 1, [m["content"]["data"]["state"].get("_model_name") for m in bundles]
    assert sum(wire_size(m) for m in opened) < 1.5 * wire_size(bundles[0])


def test_kernel_interrupt_during_fit_keeps_history_and_fit_continues(kernel):
    manager, client = kernel
    # one step first: the dashboard's libraries are imported before the interrupt's timer starts (their
    # first import can take seconds, and an interrupt before the fit is running is not one during it)
    execute(
        client,
        "import mpnb.examples as ex\ntrainer, train, test = ex.example_trainer('fp16', 'cpu', widths=(8, 16))\n"
        "_ = trainer.fit(train, max_steps=1)",
    )
    threading.Timer(3.0, manager.interrupt_kernel).start()
    reply, printed = execute(client, "trainer.fit(train, epochs=500)")
    assert reply["status"] == "error" and reply["ename"] == "FitInterrupted", reply
    assert "trainer.history keeps every finished step" in printed
    steps = int(execute(client, "print(len(trainer.history))")[1])
    assert steps > 0
    assert (
        execute(client, "print(trainer.history.step == list(range(1, len(trainer.history) + 1)))")[
            1
        ].strip()
        == "True"
    )
    reply, _ = execute(client, "h = trainer.fit(train, max_steps=3)")
    assert reply["status"] == "ok"
    assert int(execute(client, "print(len(h))")[1]) == steps + 3
    assert (
        execute(
            client,
            "import signal\nprint(signal.getsignal(signal.SIGINT) is signal.default_int_handler)",
        )[1].strip()
        == "True"
    )


def test_without_widget_libraries_fit_warns_once_and_prints_text_progress(kernel):
    _, client = kernel
    execute(
        client,
        "import sys\nhidden = {n: sys.modules.pop(n) for n in ['mpnb.ui.plots.live'] if n in sys.modules}\n"
        "sys.modules['plotly'] = None",
    )
    try:
        execute(
            client,
            "import mpnb.examples as ex\ntrainer, train, _ = ex.example_trainer('bf16', 'cpu', widths=(4, 8))",
        )
        reply, printed = execute(client, "trainer.fit(train, max_steps=5)\nNone")
        assert reply["status"] == "ok"
        assert printed.count("pip install ipywidgets plotly anywidget") == 1
        assert "Traceback" not in printed and "finished: step 5" in printed
    finally:
        execute(
            client,
            "del sys.modules['plotly']\nimport plotly.graph_objects\nsys.modules.update(hidden)",
        )


def widget_comms(messages: list[tuple[float, dict]]) -> dict[str, dict]:
    """comm id -> the state a widget was opened with, from a cell's iopub messages."""
    return {
        m["content"]["comm_id"]: m["content"]["data"]["state"]
        for _, m in messages
        if m["msg_type"] == "comm_open" and "state" in m["content"].get("data", {})
    }


def send_comm(client, comm_id: str, data: dict) -> None:
    """What the browser sends when a widget is clicked or changed."""
    client.shell_channel.send(client.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))


def test_panel_and_stop_clicks_reach_a_running_fit(kernel):
    _, client = kernel
    reply, messages = execute_collecting(
        client,
        "%load_ext mpnb\nimport mpnb, mpnb.examples as ex\n"
        "trainer, train, test = ex.example_trainer('bf16', 'cpu', widths=(8, 16))\n_ = mpnb.panel()",
    )
    assert reply["status"] == "ok", reply
    panel_modes = next(
        cid
        for cid, st in widget_comms(messages).items()
        if st["_model_name"] == "ToggleButtonsModel"
    )
    options = next(
        st for st in widget_comms(messages).values() if st["_model_name"] == "ToggleButtonsModel"
    )
    fp16_index = list(options["_options_labels"]).index("fp16")

    msg_id = client.execute("history = trainer.fit(train, epochs=200)")
    stop_button, updates, queued = None, 0, None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        message = client.get_iopub_msg(timeout=30)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "comm_open":
            state = message["content"]["data"].get("state", {})
            if state.get("_model_name") == "ButtonModel" and state.get("description") == "Stop":
                stop_button = message["content"]["comm_id"]
        if message["msg_type"] == "comm_msg" and message.get("buffers"):
            updates += 1  # a dashboard redraw: training is running
            if updates == 2:
                send_comm(
                    client,
                    panel_modes,
                    {"method": "update", "state": {"index": fp16_index}, "buffer_paths": []},
                )
                queued = client.execute(
                    "queued = len(history)"
                )  # a cell queued meanwhile runs after this one
            if updates == 6:
                send_comm(client, stop_button, {"method": "custom", "content": {"event": "click"}})
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            break
    reply = client.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = client.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert stop_button is not None and queued is not None, (stop_button, updates, queued)
    printed = execute(
        client,
        "print(len(history) < 200 * len(train), history.events[-1]['message'], sorted(set(history.mode)), "
        "[e['message'] for e in history.events if e['kind'] == 'switch'])",
    )[1]
    assert printed.strip() == "True stopped ['bf16', 'fp16'] ['mode bf16 -> fp16']"
    assert execute(client, "print(queued == len(history))")[1].strip() == "True"
    execute(client, "%unload_ext mpnb")


def _restyled_traces(message: dict) -> list[int] | None:
    state = message["content"]["data"].get("state", {})
    restyle = state.get("_py2js_restyle")
    return (
        restyle.get("restyle_traces") or restyle.get("trace_indexes")
        if isinstance(restyle, dict)
        else None
    )


def test_compare_cell_draws_each_mode_live_then_the_table(kernel):
    _, client = kernel
    execute(client, "%load_ext mpnb\nimport mpnb")
    reply, messages = execute_collecting(
        client,
        "%%compare --modes fp32,bf16 --steps 150 --warmup 2\n"
        "trainer, train, test = mpnb.examples.example_trainer(widths=(8, 16), dashboard='text')\n"
        "trainer.fit(train, epochs=20)",
    )
    assert reply["status"] == "ok", reply
    per_mode = len(MODE_TRACES)
    restyles = [
        (t, _restyled_traces(m))
        for t, m in messages
        if m["msg_type"] == "comm_msg" and _restyled_traces(m)
    ]
    fp32 = [t for t, traces in restyles if traces == list(range(per_mode))]
    bf16 = [t for t, traces in restyles if traces == list(range(per_mode, 2 * per_mode))]
    assert len(fp32) >= 2 and len(bf16) >= 2, [traces for _, traces in restyles]
    assert min(bf16) < max(fp32) and min(fp32) < max(bf16)  # drawn in turns, while both train
    assert not any(
        "training" in m["content"].get("text", "") for _, m in messages if m["msg_type"] == "stream"
    )
    tables = [
        m
        for _, m in messages
        if m["msg_type"] == "comm_msg" and "speedup vs fp32" in json.dumps(m["content"])
    ]
    assert tables, "the table reaches the front end"
    results = [m for _, m in messages if m["msg_type"] in ("execute_result", "display_data")]
    shown = [m for m in results if "speedup vs fp32" in json.dumps(m["content"])]
    assert shown == [], "the table is shown once: in the live view, not again as the cell's value"
    assert (
        execute(client, "print([len(r.history) for r in _comparison.results])")[1].strip()
        == "[152, 152]"
    )
    execute(client, "%unload_ext mpnb")
