"""What the numerics watch costs a fit: the example CNN, a GPT-2 from a small config (4 layers,
128 wide, batch 8, sequence 64) and a 4-layer 1024-wide MLP, trained by mpnb.Trainer with
``watch_numerics=False`` and at several sampling intervals (the default among them), side by
side in paired rounds (the order flipped every round). Prints, per model and interval, the
median of the rounds' ratios (watched over unwatched) and, in brackets, the ratio of each side's
fastest round.

At a sparse interval the whole-fit ratio moves by more than the watch costs, so each model also
gets a derived figure. The watch works on sampled steps only (an unsampled step pays a modulo,
an empty hook list and a glance at its row at the flush), so watching every k-th step costs
about the every-step cost divided by k, and the every-step ratio stands far above the noise.
Writes benchmarks/results/numerics_watch_cost.json.

    python benchmarks/numerics_watch_cost.py [--rounds 5] [--steps 60] [--every 1,default]
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
from mpnb.numerics.watch import DEFAULT_EVERY


def cnn_fit(every: int | None, steps: int):
    train, _ = ex.digits(batch_size=64)
    batches = list(train)[:steps]
    torch.manual_seed(0)
    model = ex.DigitsCNN()
    trainer = mpnb.Trainer(
        model, torch.optim.Adam(model.parameters()), nn.functional.cross_entropy,
        mode="bf16", device="cpu", dashboard=None, watch_numerics=every,
    )  # fmt: skip
    return trainer, batches


def gpt2_fit(every: int | None, steps: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64)
    model = GPT2LMHeadModel(config)
    trainer = mpnb.Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), mode="bf16", device="cpu",
        dashboard=None, watch_numerics=every,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 512, (8, 64), generator=generator)
        batches.append({"input_ids": ids, "labels": ids})
    return trainer, batches


def mlp_fit(every: int | bool, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )  # fmt: skip
    trainer = mpnb.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=1e-3), nn.functional.cross_entropy,
        mode="bf16", device="cpu", dashboard=None, watch_numerics=every,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(64, 1024, generator=generator),
            torch.randint(0, 10, (64,), generator=generator),
        )
        for _ in range(steps)
    ]
    return trainer, batches


MODELS = (
    ("example CNN", cnn_fit),
    ("GPT-2 (4 layers, 128 wide, batch 8, seq 64)", gpt2_fit),
    ("MLP (4 layers, 1024 wide)", mlp_fit),
)


def timed(build, every: int | bool, steps: int):
    def run(_round: int) -> float:
        trainer, batches = build(every, steps)
        started = time.perf_counter()
        trainer.fit(batches, epochs=1)
        return time.perf_counter() - started

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", default="1,default", help="intervals; default: the Trainer's")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    figures = {}
    for name, build in MODELS:
        figures[name] = {}
        for value in args.every.split(","):
            every = True if value == "default" else int(value)
            plain, watched = paired_rounds(
                timed(build, False, args.steps), timed(build, every, args.steps), args.rounds
            )
            median, fastest = median_ratio(plain, watched), fastest_ratio(plain, watched)
            label = f"default (every {DEFAULT_EVERY})" if every is True else str(every)
            figures[name][label] = {"median_ratio": median, "fastest_ratio": fastest}
            print(f"{name}, every {label} steps: {median:.3f}x ({fastest:.3f}x)")
        every_step = figures[name].get("1")
        for every in sorted({10, 50, DEFAULT_EVERY}) if every_step else ():
            derived = 1 + (every_step["median_ratio"] - 1) / every
            figures[name][f"{every} derived"] = {"ratio": derived}
            print(f"{name}, every {every:3d} steps, derived from every step: {derived:.3f}x")
    write_results("numerics_watch_cost", {"steps": args.steps, "rounds": args.rounds, **figures})


if __name__ == "__main__":
    main()
