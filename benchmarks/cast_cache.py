"""What mpnb's default (autocast without the cast cache) costs per training step.

Runs the same small CNN training step under bf16 autocast with the cache on and off,
interleaved so both see the same machine noise, and prints the ratio of median step times.
Writes benchmarks/results/cast_cache.json.

    python benchmarks/cast_cache.py [--steps 30] [--batch 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_file import write_results
from torch import nn


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def step_time(model, optimizer, x, y, cache: bool) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(5):  # warm-up
        step_time(model, optimizer, x, y, True)
        step_time(model, optimizer, x, y, False)
    for _ in range(args.steps):
        for cache in (True, False):
            times[cache].append(step_time(model, optimizer, x, y, cache))
    cached, uncached = statistics.median(times[True]), statistics.median(times[False])
    result = {
        "model": "small CNN (2 conv, 2 linear), bf16 autocast on CPU",
        "batch": args.batch,
        "steps": args.steps,
        "median_step_s_cache_on": cached,
        "median_step_s_cache_off": uncached,
        "ratio_off_over_on": uncached / cached,
        "cpu": torch.cpu.get_capabilities().get("cpu_name")
        if hasattr(torch.cpu, "get_capabilities")
        else None,
    }
    write_results("cast_cache", result)
    print(
        f"median step: cache on {cached * 1e3:.2f} ms, cache off {uncached * 1e3:.2f} ms, "
        f"ratio off/on {uncached / cached:.3f}"
    )


if __name__ == "__main__":
    main()
