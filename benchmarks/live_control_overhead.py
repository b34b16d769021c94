"""What live control (Stop / Pause buttons, switches between steps) costs per training step.

Runs in a real Jupyter kernel, where the cost exists: the example CNN trained in bf16 twice,
in alternating blocks, both with a live dashboard; one fit has the Stop / Pause buttons and
the kernel event pump (polling for widget messages between steps, at most every 0.1 s), the
other a plain dashboard. Prints the ratio of median step times. Target: <= 1.02.
Writes benchmarks/results/live_control_overhead.json.

    python benchmarks/live_control_overhead.py [--rounds 10] [--block 25]
"""

from __future__ import annotations

import argparse
import json

from jupyter_client.manager import start_new_kernel
from results_file import write_results

TARGET = 1.02

KERNEL_CODE = """
import json, statistics
import mpnb.examples as ex
from IPython.display import display
from mpnb.ui.widgets.events import KernelEventPump
from mpnb.ui.plots.live import LiveDashboard

polls = []
original_call = KernelEventPump.__call__
def counted(pump):
    original_call(pump)
    polls.append((id(pump), pump.polls))
KernelEventPump.__call__ = counted

controlled, train, _ = ex.example_trainer("bf16", "cpu", dashboard="live")
plain, _, _ = ex.example_trainer("bf16", "cpu", dashboard=None)
plain.dashboard = LiveDashboard("no live control")
display(plain.dashboard.figure)
with_control, without = [], []
for round_index in range({rounds} + 1):  # round 0 warms up
    a = controlled.fit(train, max_steps={block}).step_time[-{block} + 1:]
    b = plain.fit(train, max_steps={block}).step_time[-{block} + 1:]
    if round_index:
        with_control += a
        without += b
print(json.dumps({{"with": statistics.median(with_control), "without": statistics.median(without),
                  "steps_each": len(with_control), "pump_calls": len(polls), "polls": sum(dict(polls).values())}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=25)
    args = parser.parse_args()
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=60)
    printed: list[str] = []
    try:
        code = KERNEL_CODE.format(rounds=args.rounds, block=args.block)
        reply = client.execute_interactive(
            code,
            timeout=1200,
            output_hook=lambda m: (
                printed.append(m["content"]["text"]) if m["msg_type"] == "stream" else None
            ),
        )
        if reply["content"]["status"] != "ok":
            raise SystemExit(f"benchmark cell failed: {reply['content']}")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    result = json.loads("".join(printed).strip().splitlines()[-1])
    ratio = result["with"] / result["without"]
    print(
        f"digits CNN bf16 in a kernel: live control {result['with'] * 1e3:.2f} ms/step, without "
        f"{result['without'] * 1e3:.2f} ms/step, ratio {ratio:.3f} (target <= {TARGET}); "
        f"{result['polls']} kernel polls in {result['pump_calls']} step boundaries"
    )
    write_results(
        "live_control_overhead",
        {
            "median_step_s_with_live_control": result["with"],
            "median_step_s_without": result["without"],
            "ratio": ratio,
            "target_ratio": TARGET,
            "steps_each": result["steps_each"],
            "kernel_polls": result["polls"],
            "step_boundaries": result["pump_calls"],
        },
    )


if __name__ == "__main__":
    main()
