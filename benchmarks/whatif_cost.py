"""What one what-if costs, in fp32 training steps of the same model and batch: the example CNN,
a 4-layer 1024-wide MLP and a GPT-2 from a small config. Side by side in paired rounds (the
order flipped every round): ten fp32 training steps (forward, backward, Adam step) against one
``mpnb.whatif`` over every format. Prints, per model, the what-if's cost in steps (the median of
the rounds' ratios times ten, and, in brackets, from each side's fastest round), by the wall
clock and by the process's CPU time: on a machine shared with other work the CPU time moves
less (another process takes the cores, not this one's work). The issue's budget: at most about
ten steps. Writes benchmarks/results/whatif_cost.json (a run of every model and format).

    python benchmarks/whatif_cost.py [--rounds 3] [--models cnn,mlp_4x1024,gpt2_small_config]
                                     [--formats fp8,mxfp8]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from paired_rounds import fastest_ratio, median_ratio, paired_rounds
from results_file import write_results
from torch import nn

import mpnb
import mpnb.examples as ex

STEPS = 10


def cnn():
    torch.manual_seed(0)
    train, _ = ex.digits(batch_size=64)
    return ex.DigitsCNN(), next(iter(train)), nn.functional.cross_entropy


def mlp():
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(1024, 10))
    return (
        model,
        (torch.randn(256, 1024), torch.randint(0, 10, (256,))),
        nn.functional.cross_entropy,
    )


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=512, n_positions=128)
    ids = torch.randint(0, 512, (8, 128), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}, None


def timed(work, cpu: list[float]) -> float:
    """Run ``work``; its wall seconds returned, its CPU seconds appended to ``cpu``."""
    wall, process = time.perf_counter(), time.process_time()
    work()
    cpu.append(time.process_time() - process)
    return time.perf_counter() - wall


def steps_timer(model, batch, loss_fn, cpu: list[float]):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)

    def loss():
        if loss_fn is None:
            return model(**batch).loss
        return loss_fn(model(batch[0]), batch[1])

    def steps() -> None:
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            loss().backward()
            optimizer.step()

    return lambda round_index: timed(steps, cpu)


def whatif_timer(model, batch, loss_fn, formats, cpu: list[float]):
    return lambda round_index: timed(lambda: mpnb.whatif(model, batch, loss_fn, formats), cpu)


MODELS = {"cnn": cnn, "mlp_4x1024": mlp, "gpt2_small_config": gpt2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"some of {', '.join(MODELS)}, by commas"
    )
    parser.add_argument(
        "--formats", default=None, help="the what-if's formats, by commas (default: every one)"
    )
    args = parser.parse_args()
    formats = args.formats.split(",") if args.formats else None
    chosen = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(MODELS))
    if unknown or not chosen:
        parser.error(f"--models {args.models!r}: valid are {', '.join(MODELS)}")
    warnings.filterwarnings("ignore")
    figures = {"steps_per_round": STEPS, "rounds": args.rounds, "formats": formats, "models": {}}
    for name in chosen:
        model, batch, loss_fn = MODELS[name]()
        steps_cpu, whatif_cpu = [], []
        steps, whatif = paired_rounds(
            steps_timer(model, batch, loss_fn, steps_cpu),
            whatif_timer(model, batch, loss_fn, formats, whatif_cpu),
            args.rounds,
        )
        steps_cpu, whatif_cpu = steps_cpu[1:], whatif_cpu[1:]  # round 0 warms up
        cost = STEPS * median_ratio(steps, whatif)
        fastest = STEPS * fastest_ratio(steps, whatif)
        cost_cpu = STEPS * median_ratio(steps_cpu, whatif_cpu)
        figures["models"][name] = {
            "fp32_step_s": min(steps) / STEPS,
            "whatif_s": min(whatif),
            "whatif_in_steps": round(cost, 2),
            "whatif_in_steps_fastest": round(fastest, 2),
            "whatif_in_steps_cpu_time": round(cost_cpu, 2),
        }
        print(
            f"{name:18s} fp32 step {min(steps) / STEPS * 1e3:7.1f} ms  what-if {min(whatif):6.2f} s"
            f"  = {cost:5.1f} steps ({fastest:.1f}); by CPU time {cost_cpu:5.1f} steps"
        )
    if formats is None and chosen == list(MODELS):
        write_results("whatif_cost", figures)
    else:  # the docs' performance page reads the full run
        print("a partial run: benchmarks/results/whatif_cost.json is left as it was")


if __name__ == "__main__":
    main()
