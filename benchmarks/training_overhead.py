"""What mpnb's Trainer costs per step over the torch.amp recipe written by hand.

The same model and batches trained twice, side by side: once by the canonical torch.amp
loop (torch.autocast + GradScaler, nothing else), once by ``mpnb.Trainer`` with telemetry
and a headless live dashboard (a FigureWidget with no browser) attached. Blocks of steps
alternate between the two (the order flips every round) so both see the same machine noise; a
Trainer block is one ``fit`` call, so what a fit costs once (the dashboard's last redraw, a few
ms) is spread over the block's steps: 50 by default, ``--block 10`` shows fits ten times shorter;
the median of the per-round ratios is printed per case, and the ratio of each side's fastest
block (noise only adds time, see ``paired_rounds.py``). As whole-block ratios move by several
percent between runs on a shared machine, a second set of rounds reads the Trainer's own time a
step: its time outside torch's own calls beyond the hand loop's (``torch_work.py``), which that
noise barely moves. Target: <= 1.03 (the own time's share of the hand loop's step; the ratio beside
it). Writes benchmarks/results/training_overhead.json.

    python benchmarks/training_overhead.py [--rounds 12] [--block 50] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from on_device import add_device_argument, device_label, results_name, settled_clock, to_device
from paired_rounds import fastest_ratio, median_ratio, paired_rounds
from results_file import write_results
from torch import nn
from torch_work import TorchWork, own_time_beyond

import mpnb
import mpnb.examples as ex
from mpnb.ui.plots.live import LiveDashboard

TARGET = 1.03


class TransformerRegressor(nn.Module):
    """One transformer encoder layer and a linear head, regressing a target sequence."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=2 * width, batch_first=True, dropout=0.0
        )
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), target)


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # looked up at each call, like mse: torch_work's wrapper then times it as torch's own work
    return nn.functional.cross_entropy(output, target)


def digit_batches(count: int = 20) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of 64 bundled digits."""
    images, labels = ex.load_digits()
    return [(images[i : i + 64], labels[i : i + 64]) for i in range(0, 64 * count, 64)]


def sequence_batches(count: int = 20) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` seeded batches of 32 random sequences (length 32, width 128) and targets."""
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(32, 32, 128, generator=generator),
            torch.randn(32, 32, 128, generator=generator),
        )
        for _ in range(count)
    ]


def cases(device: torch.device) -> dict[str, tuple]:
    digits, sequences = to_device(digit_batches(), device), to_device(sequence_batches(), device)
    return {
        "digits CNN, bf16": (ex.DigitsCNN, digits, cross_entropy, "bf16"),
        "digits CNN, fp16": (ex.DigitsCNN, digits, cross_entropy, "fp16"),
        "transformer layer d=128, bf16": (TransformerRegressor, sequences, mse, "bf16"),
    }


def hand_written(model, optimizer, scaler, dtype, loss_fn, batches) -> None:
    for x, y in batches:
        with torch.autocast(x.device.type, dtype=dtype):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def measure(name: str, make_model, batches, loss_fn, mode: str, rounds: int, block: int) -> dict:
    device = batches[0][0].device
    torch.manual_seed(0)
    reference = make_model().to(device)
    model_a, model_b = copy.deepcopy(reference), copy.deepcopy(reference)
    opt_a = torch.optim.Adam(model_a.parameters(), lr=1e-3)
    opt_b = torch.optim.Adam(model_b.parameters(), lr=1e-3)
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")
    dashboard = LiveDashboard(name)
    trainer = mpnb.Trainer(model_b, opt_b, loss_fn, mode=mode, device=device, dashboard=dashboard)

    def chunk(round_index: int) -> list:
        return [batches[(round_index * block + i) % len(batches)] for i in range(block)]

    def hand_block(round_index: int) -> float:
        start = settled_clock(device)
        hand_written(model_a, opt_a, scaler, dtype, loss_fn, chunk(round_index))
        return (settled_clock(device) - start) / block

    def trainer_block(round_index: int) -> float:
        steps = chunk(round_index)
        start = settled_clock(device)
        trainer.fit(steps, epochs=1)
        return (settled_clock(device) - start) / block

    hand_times, trainer_times = paired_rounds(hand_block, trainer_block, rounds)
    hand, ours = statistics.median(hand_times), statistics.median(trainer_times)
    paired = median_ratio(hand_times, trainer_times)
    with TorchWork() as work:
        steps = chunk(0)
        own = own_time_beyond(
            work,
            lambda: hand_written(model_a, opt_a, scaler, dtype, loss_fn, steps),
            lambda: trainer.fit(steps, epochs=1),
            block,
            rounds,
        )
    return {
        "case": name,
        "median_step_s_hand_written": hand,
        "median_step_s_trainer": ours,
        "ratio_trainer_over_hand": paired,
        "ratio_of_medians": ours / hand,
        "fastest_ratio": fastest_ratio(hand_times, trainer_times),
        "own_s_per_step": own,
        "own_share": own / hand,
        "steps_each": rounds * block,
        "dashboard_redraws": dashboard.redraws,
        "recorder_host_transfers": trainer.amp.recorder.host_transfers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=50, help="steps per block: one fit call")
    add_device_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = []
    for name, (make_model, batches, loss_fn, mode) in cases(device).items():
        row = measure(name, make_model, batches, loss_fn, mode, args.rounds, args.block)
        results.append(row)
        print(
            f"{name:32s} hand {row['median_step_s_hand_written'] * 1e3:7.2f} ms  "
            f"Trainer {row['median_step_s_trainer'] * 1e3:7.2f} ms  ratio {row['ratio_trainer_over_hand']:.3f} "
            f"(fastest blocks {row['fastest_ratio']:.3f})  own time {row['own_s_per_step'] * 1e6:5.1f} us "
            f"= {1 + row['own_share']:.3f}x"
        )
    worst = max(row["ratio_trainer_over_hand"] for row in results)
    worst_own = 1 + max(row["own_share"] for row in results)
    print(f"worst own time {worst_own:.3f}x, worst ratio {worst:.3f} (target <= {TARGET})")
    write_results(
        results_name("training_overhead", device),
        {
            "device": device_label(device),
            "target_ratio": TARGET,
            "worst_ratio": worst,
            "worst_own_time": worst_own,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
