"""fp8 and mxfp8 against bf16: the Trainer's step time on a transformer MLP block, per width and recipe.

Mode fp8 runs a model's large Linear layers through torchao's float8 training (``torch._scaled_mm``
on a GPU of compute capability 8.9+) and the rest under bf16 autocast, so the gain is the share
of the step spent in those layers' matmuls, less the cost of the casts to float8 (eager: no
``torch.compile`` fuses them). Narrow layers gain nothing or lose; wide ones gain. Each width
times bf16 and each fp8 recipe, each written by hand with torchao and through the Trainer (and
with ``--compiled`` the hand loops under ``torch.compile``), in rounds that take every runner in
turn (:func:`paired_rounds.round_robin`), ``--block`` steps (one ``fit``) a round.

Mode mxfp8 (torchao's MXFP8Linear through the Trainer, and ``mpnb.mx_layers`` in the hand loop,
eager and with ``--compiled`` compiled) is timed beside them: real on a GPU of compute
capability 10.0+ (B200, B300), emulated below (an H100 has no MX units) and on a CPU; the JSON
says which for each format.

On a CPU fp8 is emulated (numerics only): the script still runs, on a small width, and the JSON
says "emulated".

    python benchmarks/fp8_speed.py --device cuda     # writes results/fp8_speed-cuda.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from on_device import add_device_argument, device_label, results_name, settled_clock
from paired_rounds import fastest_ratio, median_ratio, round_robin
from results_file import write_results
from torch import nn

import mpnb
from mpnb.precision.modes.fp8 import fp8_hardware
from mpnb.precision.modes.mxfp8 import MxLayers

RECIPES = ("tensorwise", "rowwise")


class Block(nn.Module):
    """Input projection, a pre-norm MLP (4x wide) with a residual, output projection: the first
    and last Linear layers stay in bf16 (mode fp8 keeps them), the MLP's two go to fp8."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.down(nn.functional.gelu(self.up(self.norm(h))))
        return self.out(h)


def trainer_timer(
    model: nn.Module, batches: list, device: torch.device, recipe: str | None, mode: str = "fp8"
):
    """A function of the round's index that runs one ``Trainer.fit`` over ``batches`` and returns
    the seconds a step took: mode bf16 when ``recipe`` is None and ``mode`` is fp8, else
    ``mode`` with that recipe (mxfp8: none)."""
    trainer = mpnb.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-4),
        nn.functional.mse_loss,
        mode="bf16" if recipe is None and mode == "fp8" else mode,
        **({"recipe": recipe} if recipe is not None else {}),
        device=device,
        dashboard=None,
    )

    def timed(_round_index: int) -> float:
        start = settled_clock(device)
        trainer.fit(batches)
        return (settled_clock(device) - start) / len(batches)

    return timed


def hand_timer(
    model: nn.Module,
    batches: list,
    device: torch.device,
    recipe: str | None,
    compiled: bool = False,
):
    """The same steps written by hand: torchao's ``convert_to_float8_training`` on the MLP's two
    layers when ``recipe`` is given (``"mx"``: ``mpnb.mx_layers``, torchao's MXFP8Linear), bf16
    autocast, SGD; ``compiled``: the model under ``torch.compile``, as torchao's own figures are
    taken."""
    if recipe == "mx":
        mpnb.mx_layers(model, device=device).convert()  # for the benchmark's life
    elif recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda _module, name: name in ("up", "down"),
        )
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def timed(_round_index: int) -> float:
        start = settled_clock(device)
        for x, y in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(forward(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return (settled_clock(device) - start) / len(batches)

    return timed


def measure(
    width: int, tokens: int, block: int, rounds: int, device: torch.device, compiled: bool
) -> dict:
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(tokens, width, device=device, generator=generator)
    y = torch.randn(tokens, width, device=device, generator=generator)
    batches = [(x, y)] * block

    def model() -> nn.Module:
        torch.manual_seed(0)
        return Block(width).to(device)

    timers = {"bf16, by hand": hand_timer(model(), batches, device, None)}
    timers["bf16, Trainer"] = trainer_timer(model(), batches, device, None)
    for recipe in RECIPES:
        timers[f"fp8 {recipe}, torchao by hand"] = hand_timer(model(), batches, device, recipe)
        timers[f"fp8 {recipe}, Trainer"] = trainer_timer(model(), batches, device, recipe)
    timers["mxfp8, mx_layers by hand"] = hand_timer(model(), batches, device, "mx")
    timers["mxfp8, Trainer"] = trainer_timer(model(), batches, device, None, mode="mxfp8")
    if compiled:
        timers["bf16, by hand, compiled"] = hand_timer(model(), batches, device, None, True)
        timers["fp8 tensorwise, torchao by hand, compiled"] = hand_timer(
            model(), batches, device, "tensorwise", True
        )
        timers["mxfp8, mx_layers by hand, compiled"] = hand_timer(
            model(), batches, device, "mx", True
        )
    times = round_robin(timers, rounds)
    baseline = times["bf16, by hand"]
    row: dict = {"width": width, "ffn": 4 * width, "tokens": tokens, "runs": {}}
    for name, seconds in times.items():
        row["runs"][name] = {
            "median_step_s": statistics.median(seconds),
            "speedup_over_bf16_by_hand": 1 / median_ratio(baseline, seconds),
            "fastest_speedup": 1 / fastest_ratio(baseline, seconds),
        }
        print(
            f"width {width:5d}  {name:42s} {statistics.median(seconds) * 1e3:8.2f} ms  "
            f"{row['runs'][name]['speedup_over_bf16_by_hand']:.2f}x bf16 by hand"
        )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default=None, help="comma-separated (GPU: 1024,4096,8192)")
    parser.add_argument("--tokens", type=int, default=None, help="rows a batch (GPU: 8192)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=8, help="steps per round: one fit call")
    parser.add_argument("--compiled", action="store_true", help="also the hand loops compiled")
    add_device_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    hardware = fp8_hardware(device)
    on_gpu = device.type == "cuda"
    widths = args.widths or ("1024,4096,8192" if on_gpu else "256")
    tokens = args.tokens or (8192 if on_gpu else 256)
    results = [
        measure(int(width), tokens, args.block, args.rounds, device, args.compiled)
        for width in widths.split(",")
    ]
    write_results(
        results_name("fp8_speed", device),
        {
            "device": device_label(device),
            "fp8": hardware,
            "mxfp8": MxLayers.hardware(device),
            "rounds": args.rounds,
            "steps_per_round": args.block,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
