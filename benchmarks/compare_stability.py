"""Do three back-to-back ``mpnb compare`` runs tell the same story? Interleaved turns against 0.1's order.

The example CNN on the bundled digits (the README's ``mpnb compare``), fp32 and bf16 (fp16
convolutions have no fast CPU kernels; on a GPU add it with --modes), compared three times
in each of two schedules, the schedules alternating run by run:

- ``interleaved``: mpnb's default, timed turns of a tenth of the steps (at most 10), modes in
  alternating order;
- ``sequential``: each mode's steps in one go, one mode after another, as mpnb 0.1 did
  (``block=steps``).

Prints per schedule and run each mode's median step and IQR and the bf16 speedup with its
interval, then the spread of the speedup across the three runs, (max - min) / median, for
both schedules side by side: the goal is within 10% on a quiet machine. Writes
benchmarks/results/compare_stability.json.

    python benchmarks/compare_stability.py [--steps 100] [--runs 3] [--modes fp32,bf16]
"""

from __future__ import annotations

import argparse
import statistics

from results_file import write_results

import mpnb.examples as ex
from mpnb.analysis.comparison import compare

GOAL = 0.10


def make_run(mode: str):
    trainer, train, _ = ex.example_trainer(mode, "cpu", dashboard=None)
    return trainer, train


def one_comparison(modes: list[str], steps: int, warmup: int, block: int | None) -> dict:
    comparison = compare(make_run, modes, steps=steps, warmup=warmup, block=block, progress=None)
    return {
        row["mode"]: {
            "median_step_ms": row["median_step_s"] * 1e3,
            "iqr_ms": row["step_time_iqr_s"] * 1e3,
            "speedup": row["speedup_vs_fp32"],
            "speedup_low": row["speedup_low"],
            "speedup_high": row["speedup_high"],
            "verdict": row["speedup_verdict"],
        }
        for row in comparison.rows()
    }


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", default="fp32,bf16")
    args = parser.parse_args()
    modes = args.modes.split(",")
    schedules = {"interleaved": None, "sequential": args.steps}
    runs: dict[str, list[dict]] = {name: [] for name in schedules}
    for index in range(args.runs):
        order = (
            list(schedules) if index % 2 == 0 else list(reversed(schedules))
        )  # drift favours neither
        for name in order:
            result = one_comparison(modes, args.steps, args.warmup, schedules[name])
            runs[name].append(result)
            figures = "  ".join(
                f"{mode} {r['median_step_ms']:.2f} ms (IQR {r['iqr_ms']:.2f})"
                + (
                    f" speedup {r['speedup']:.2f}x ({r['speedup_low']:.2f}-{r['speedup_high']:.2f})"
                    if mode != "fp32"
                    else ""
                )
                for mode, r in result.items()
            )
            print(f"run {index + 1} {name:<11}  {figures}", flush=True)
    summary = {}
    for name, results in runs.items():
        summary[name] = {
            mode: {
                "speedups": [r[mode]["speedup"] for r in results],
                "speedup_spread": spread([r[mode]["speedup"] for r in results]),
            }
            for mode in modes
            if mode != "fp32"
        }
    for mode in modes:
        if mode == "fp32":
            continue
        line = "  ".join(
            f"{name}: {', '.join(f'{s:.2f}x' for s in summary[name][mode]['speedups'])} "
            f"(spread {summary[name][mode]['speedup_spread']:.0%})"
            for name in schedules
        )
        print(f"{mode} speedup across {args.runs} runs  {line}  (goal: spread <= {GOAL:.0%})")
    write_results(
        "compare_stability",
        {
            "steps": args.steps,
            "warmup": args.warmup,
            "modes": modes,
            "runs": runs,
            "summary": summary,
            "goal_spread": GOAL,
        },
    )


if __name__ == "__main__":
    main()
