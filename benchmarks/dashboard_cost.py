"""What one live-dashboard update costs as a run grows: bytes on the wire and time.

A LiveDashboard first takes in a synthetic history of N recorded steps (1k, 10k, 100k),
then receives updates of 64 new steps each, redrawing every time. Bytes are measured on
the widget's comm (JSON part plus binary buffers, what ipykernel would send); time is the
median of the updates. For contrast, the bytes of sending every point undecimated are
printed too. Target: flat in run length, <= 64 KB per update.
Writes benchmarks/results/dashboard_cost.json.

    python benchmarks/dashboard_cost.py [--updates 30]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np
from results_file import write_results

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mpnb.training.history import History
from mpnb.ui.plots.live import LiveDashboard
from tests.wire import recording_wire

SIZES = (1_000, 10_000, 100_000)
CHUNK = 64
TARGET_BYTES = 64 * 1024


def rows(start: int, count: int) -> dict[str, list]:
    steps = range(start + 1, start + count + 1)
    return {
        "step": list(steps),
        "loss": [2.0 / (1 + s / 500) + 0.01 * (s % 13) for s in steps],
        "loss_scale": [2.0 ** (16 - (s // 5000) % 8) for s in steps],
        "skipped": [s % 2000 == 0 for s in steps],
        "samples_per_s": [5000.0 + (s % 17) * 10 for s in steps],
        "memory_used": [2.0**20 * (400 + s % 11) for s in steps],
        "memory_peak": [2.0**20 * 420.0 for _ in steps],
    }


def measure(size: int, updates: int) -> dict:
    with recording_wire() as sizes:
        dashboard = LiveDashboard("benchmark", min_interval=0.0, max_share=0.0)
        history = History()
        history.extend(rows(0, size))
        dashboard.update(history)
        sent_before = len(sizes)
        times = []
        for index in range(updates):
            history.extend(rows(size + index * CHUNK, CHUNK))
            started = time.perf_counter()
            dashboard.update(history)
            times.append(time.perf_counter() - started)
        update_bytes = [
            b for b in sizes[sent_before:] if b > 200
        ]  # skip the trait-reset echo after each restyle
    undecimated = sum(2 * 8 * len(history) for _ in dashboard.figure.data)
    return {
        "recorded_steps": size,
        "median_update_s": statistics.median(times),
        "max_update_bytes": max(update_bytes),
        "median_update_bytes": int(statistics.median(update_bytes)),
        "points_per_trace": max(len(t.x) for t in dashboard.figure.data),
        "undecimated_update_bytes": undecimated,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=30)
    args = parser.parse_args()
    results = [measure(size, args.updates) for size in SIZES]
    for row in results:
        print(
            f"{row['recorded_steps']:>7} steps: update {row['median_update_s'] * 1e3:6.2f} ms, "
            f"{row['max_update_bytes'] / 1024:5.1f} KB (undecimated would be {row['undecimated_update_bytes'] / 1024:8.1f} KB), "
            f"{row['points_per_trace']} points/trace"
        )
    time_ratio = results[-1]["median_update_s"] / results[0]["median_update_s"]
    bytes_ratio = results[-1]["max_update_bytes"] / results[0]["max_update_bytes"]
    worst_bytes = max(row["max_update_bytes"] for row in results)
    print(
        f"100k/1k ratio: time {time_ratio:.2f}, bytes {bytes_ratio:.2f}; largest update {worst_bytes / 1024:.1f} KB "
        f"(target <= {TARGET_BYTES // 1024} KB)"
    )
    write_results(
        "dashboard_cost",
        {
            "chunk_steps_per_update": CHUNK,
            "results": results,
            "time_ratio_100k_over_1k": time_ratio,
            "bytes_ratio_100k_over_1k": bytes_ratio,
            "largest_update_bytes": worst_bytes,
            "target_bytes": TARGET_BYTES,
            "numpy": np.__version__,
        },
    )


if __name__ == "__main__":
    main()
