"""Do ``mpnb.compare``'s step times agree with the same loop timed by hand? And what does bf16 buy here?

Per case (the example CNN on the digits, a transformer encoder layer) and mode (fp32, bf16),
the same model from the same seed on the same batches is trained twice per round, right
after each other: by ``mpnb.compare`` (Trainer, telemetry, text progress) and by the
torch.amp recipe written by hand, each step timed with ``time.perf_counter`` the same way
(end of step to end of step, warm-up steps left out). Rounds alternate which goes first. Per mode the ratio of
compare's reported median step time over the hand-timed median is printed (median over
rounds). Target: within 3% (0.97 to 1.03). The bf16-over-fp32 speedup of both is recorded
too: on a CPU without bf16 units (no AMX / AVX512-BF16) bf16 is slower than fp32.
Writes benchmarks/results/compare_overhead.json.

    python benchmarks/compare_overhead.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_file import write_results
from training_overhead import TransformerRegressor, digit_batches, mse, sequence_batches

import mpnb
import mpnb.examples as ex
from mpnb.precision.backends import backend_for

TOLERANCE = 0.03
MODES = ("fp32", "bf16")


def cases() -> dict[str, dict]:
    cnn = {
        "model": ex.DigitsCNN,
        "batches": digit_batches(),
        "loss": torch.nn.functional.cross_entropy,
        "steps": 40,
    }
    layer = {
        "model": TransformerRegressor,
        "batches": sequence_batches(10),
        "loss": mse,
        "steps": 30,
    }
    return {"digits CNN": cnn, "transformer layer d=128": layer}


def fresh(case: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = case["model"]()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def by_hand(case: dict, mode: str, steps: int, warmup: int) -> float:
    """The torch.amp recipe (no scaler needed for fp32 / bf16), each step timed; the median."""
    model, optimizer = fresh(case)
    batches = case["batches"]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16")
    times = []
    last = time.perf_counter()
    for index in range(warmup + steps):
        x, y = batches[index % len(batches)]
        with autocast:
            loss = case["loss"](model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return statistics.median(times[warmup:])


def by_compare(case: dict, mode: str, steps: int, warmup: int) -> float:
    def make_run(mode):
        model, optimizer = fresh(case)
        trainer = mpnb.Trainer(
            model, optimizer, case["loss"], mode=mode, device="cpu", dashboard=None
        )
        return trainer, case["batches"]

    comparison = mpnb.compare(make_run, [mode], steps=steps, warmup=warmup, progress="text")
    return comparison.result(mode).median_step_s


def measure(name: str, case: dict, rounds: int, warmup: int) -> dict:
    steps = case["steps"]
    hand: dict[str, list[float]] = {mode: [] for mode in MODES}
    ours: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(rounds):
        for mode in MODES:
            if round_index % 2 == 0:
                ours[mode].append(by_compare(case, mode, steps, warmup))
                hand[mode].append(by_hand(case, mode, steps, warmup))
            else:
                hand[mode].append(by_hand(case, mode, steps, warmup))
                ours[mode].append(by_compare(case, mode, steps, warmup))
    row: dict = {"case": name, "steps_per_run": steps, "warmup": warmup, "rounds": rounds}
    for mode in MODES:
        ratios = [a / b for a, b in zip(ours[mode], hand[mode])]
        row[mode] = {
            "median_step_s_compare": statistics.median(ours[mode]),
            "median_step_s_hand": statistics.median(hand[mode]),
            "ratio_compare_over_hand": statistics.median(ratios),
        }
    row["bf16_speedup_over_fp32_compare"] = (
        row["fp32"]["median_step_s_compare"] / row["bf16"]["median_step_s_compare"]
    )
    row["bf16_speedup_over_fp32_hand"] = (
        row["fp32"]["median_step_s_hand"] / row["bf16"]["median_step_s_hand"]
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    results = []
    for name, case in cases().items():
        row = measure(name, case, args.rounds, args.warmup)
        results.append(row)
    print()
    for row in results:
        for mode in MODES:
            figures = row[mode]
            print(
                f"{row['case']:24s} {mode}  compare {figures['median_step_s_compare'] * 1e3:7.2f} ms  "
                f"by hand {figures['median_step_s_hand'] * 1e3:7.2f} ms  ratio {figures['ratio_compare_over_hand']:.3f}"
            )
        print(
            f"{row['case']:24s} bf16 speedup over fp32: {row['bf16_speedup_over_fp32_compare']:.2f}x (compare), "
            f"{row['bf16_speedup_over_fp32_hand']:.2f}x (by hand)"
        )
    ratios = [row[mode]["ratio_compare_over_hand"] for row in results for mode in MODES]
    worst = max(abs(ratio - 1) for ratio in ratios)
    print(f"largest disagreement {worst:.1%} (target <= {TOLERANCE:.0%})")
    capabilities = backend_for(torch.device("cpu")).capabilities()
    write_results(
        "compare_overhead",
        {
            "tolerance": TOLERANCE,
            "largest_disagreement": worst,
            "results": results,
            "cpu": capabilities,
        },
    )


if __name__ == "__main__":
    main()
