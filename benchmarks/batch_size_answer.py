"""max_batch_size on the seeds' CNN: the same answer run after run, right against a direct
measurement, in under 90 s.

The seeds' CNN (conv 1->420, pool, conv 420->1000, pool, linear 49000->10 on 28x28 images, Adam)
and a budget (1 GiB). ``--runs`` runs of ``mpnb.max_batch_size`` for fp32 and bf16, each timed;
then the direct measurement of ``direct_peak.py``: the hand-written recipe in a fresh process
per mode, peak resident set over the baseline at two batch sizes, the line followed to the
budget. Prints each run's sizes, bf16/fp32 ratio and seconds, the spread of the ratios across
runs, and each run's ratio over the direct one. Writes benchmarks/results/batch_size_answer.json.

    python benchmarks/batch_size_answer.py [--budget "1 GiB"] [--runs 3] [--direct-sizes 48,96]
"""

from __future__ import annotations

import argparse
import time

import torch
from direct_peak import IMAGE_SIZE, WIDTHS, direct_max_batch
from results_file import write_results
from torch import nn

import mpnb
from mpnb.analysis.batch_size import parse_bytes
from mpnb.examples import DigitsCNN

MODES = ("fp32", "bf16")


def make_run(mode: str):
    torch.manual_seed(0)
    model = DigitsCNN(WIDTHS, image_size=IMAGE_SIZE)
    trainer = mpnb.Trainer(
        model,
        torch.optim.Adam(model.parameters()),
        nn.functional.cross_entropy,
        mode=mode,
        device="cpu",
        dashboard=None,
    )
    images = torch.randn(16, 1, IMAGE_SIZE, IMAGE_SIZE)
    return trainer, [(images, torch.randint(0, 10, (16,)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="1 GiB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--direct-sizes", default="48,96")
    args = parser.parse_args()
    budget = parse_bytes(args.budget)
    runs = []
    for index in range(args.runs):
        started = time.perf_counter()
        report = mpnb.max_batch_size(make_run, MODES, memory_budget=budget)
        seconds = time.perf_counter() - started
        sizes = {mode: report.result(mode).batch_size for mode in MODES}
        checked = {mode: report.result(mode).checked for mode in MODES}
        ratio = report.ratio_to_fp32("bf16")
        runs.append({"sizes": sizes, "ratio": ratio, "seconds": seconds, "checked": checked})
        print(f"run {index + 1}: {sizes}, bf16/fp32 {ratio:.3f}, {seconds:.1f} s")
        print(report)
    small, large = (int(size) for size in args.direct_sizes.split(","))
    direct = {mode: direct_max_batch(mode, budget, (small, large)) for mode in MODES}
    direct_ratio = direct["bf16"] / direct["fp32"]
    ratios = [run["ratio"] for run in runs]
    spread = max(ratios) / min(ratios) - 1
    print(
        f"direct (a fresh process per mode, batches {small} and {large}): "
        f"fp32 {direct['fp32']:.0f}, bf16 {direct['bf16']:.0f}, bf16/fp32 {direct_ratio:.3f}"
    )
    print(
        f"ratio spread across runs: {spread:.1%}; "
        f"each run over the direct ratio: {', '.join(f'{r / direct_ratio:.3f}' for r in ratios)}; "
        f"slowest run {max(run['seconds'] for run in runs):.1f} s"
    )
    write_results(
        "batch_size_answer",
        {
            "budget": budget,
            "runs": runs,
            "direct": {**direct, "ratio": direct_ratio, "sizes": [small, large]},
            "ratio_spread": spread,
            "ratio_over_direct": [ratio / direct_ratio for ratio in ratios],
        },
    )


if __name__ == "__main__":
    main()
