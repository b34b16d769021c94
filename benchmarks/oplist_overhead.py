"""What enforcing op lists costs per training step, against plain torch.autocast.

The example CNN trained in bf16 with Habana's default lists as the session's op lists
(kernels on every Autocast key, as `%oplist preset hmp` sets them) and without, in
alternating blocks; prints the ratio
of median step times. Target: <= 1.05. Writes benchmarks/results/oplist_overhead.json.

    python benchmarks/oplist_overhead.py [--rounds 12] [--block 10]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from results_file import write_results
from torch import nn

import mpnb.examples as ex
from mpnb.precision.policy import session

TARGET = 1.05


def train_block(model, optimizer, batches) -> float:
    start = time.perf_counter()
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--preset", default="hmp")
    args = parser.parse_args()
    images, labels = ex.load_digits()
    batches = [(images[i : i + 64], labels[i : i + 64]) for i in range(0, 64 * args.block, 64)]
    torch.manual_seed(0)
    plain_model = ex.DigitsCNN()
    listed_model = copy.deepcopy(plain_model)
    plain_opt = torch.optim.Adam(plain_model.parameters(), 1e-3)
    listed_opt = torch.optim.Adam(listed_model.parameters(), 1e-3)
    plain, listed = [], []
    for round_index in range(args.rounds + 1):  # round 0 warms up
        plain_time = train_block(plain_model, plain_opt, batches)
        session.oplists.preset(args.preset)  # the session lists, as %oplist preset sets them
        try:
            listed_time = train_block(listed_model, listed_opt, batches)
        finally:
            session.oplists.reset()
        if round_index:
            plain.append(plain_time)
            listed.append(listed_time)
    ratio = statistics.median(listed) / statistics.median(plain)
    print(
        f"digits CNN bf16: plain autocast {statistics.median(plain) * 1e3:.2f} ms, with '{args.preset}' lists "
        f"{statistics.median(listed) * 1e3:.2f} ms, ratio {ratio:.3f} (target <= {TARGET})"
    )
    write_results(
        "oplist_overhead",
        {
            "mechanism": "session op lists: python kernels on every Autocast dispatch key (torch.library, allow_override)",
            "preset": args.preset,
            "median_step_s_plain": statistics.median(plain),
            "median_step_s_lists": statistics.median(listed),
            "ratio_lists_over_plain": ratio,
            "target_ratio": TARGET,
            "steps_each": args.rounds * args.block,
        },
    )


if __name__ == "__main__":
    main()
