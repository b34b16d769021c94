"""mpnb beside the peers: the same model and batches trained by the hand-written torch.amp loop
(the physical limit, 1.00), ``mpnb.Trainer``, mpnb's ``AmpStep`` in a hand loop, an Accelerate
loop, a Lightning Fabric loop and the Lightning Trainer, in bf16 (fp16 too with ``--fp16``,
where the peer supports it on the device).

For each batch size, blocks of ``--steps`` steps of every runner alternate with the hand loop
(the order flips every round, after a warm-up round); the figure is the median over rounds of
each block's time over the hand loop's block in the same round (in brackets: each side's fastest
block over the other's, the reading least moved by noise, which only adds time). The hand loop
on a second copy of the model runs too, as a control. Each block is a whole call, as
a user makes it (a ``fit``, a loop), so a trainer's own start counts. mpnb runs with telemetry
on and no display (``dashboard=None``), then with text progress and with the live dashboard
(headless: a FigureWidget with no browser). A peer that is not installed is skipped with the reason
(``pip install 'mpnb[bench]'`` installs them). For mpnb's runners and the control, a second set
of rounds reads their own time a step: the time outside torch's own calls beyond the hand loop's
(``torch_work.py``), a figure the machine's noise moves far less than a ratio of whole blocks.
Writes benchmarks/results/peers.json.

    python benchmarks/peers.py [--batches 8,32,256] [--rounds 7] [--steps 100] [--fp16] [--device cpu]
                               [--runners "mpnb.Trainer,AmpStep in a hand loop"]
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import statistics
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from on_device import add_device_argument, device_label, results_name, settled_clock, to_device
from paired_rounds import fastest_ratio, median_ratio, paired_rounds
from results_file import write_results
from torch import nn
from torch_work import TorchWork, own_time_beyond

import mpnb.examples as ex
from mpnb.training import AmpStep, Trainer

Batches = list[tuple[torch.Tensor, torch.Tensor]]
Runner = Callable[[Batches], None]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def hand_loop(model: nn.Module, device: torch.device, precision: str) -> Runner:
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def run(batches: Batches) -> None:
        for inputs, targets in batches:
            with torch.autocast(device.type, dtype=DTYPES[precision]):
                loss = nn.functional.cross_entropy(model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

    return run


def mpnb_trainer(
    model: nn.Module, device: torch.device, precision: str, dashboard: Any = None
) -> Runner:
    trainer = Trainer(
        model, torch.optim.Adam(model.parameters(), 1e-3), nn.functional.cross_entropy, mode=precision,
        device=device, dashboard=dashboard,
    )  # fmt: skip
    return lambda batches: trainer.fit(batches, epochs=1)


def mpnb_trainer_text(model: nn.Module, device: torch.device, precision: str) -> Runner:
    """Text progress, printed to a null device (as a script's output to a file costs)."""
    from mpnb.ui.plots.text import TextProgress

    return mpnb_trainer(
        model, device, precision, TextProgress("peers", stream=open(os.devnull, "w"))
    )


def mpnb_trainer_live(model: nn.Module, device: torch.device, precision: str) -> Runner:
    """The live dashboard, headless: a plotly FigureWidget redrawn with no browser attached."""
    from mpnb.ui.plots.live import LiveDashboard

    return mpnb_trainer(model, device, precision, LiveDashboard("peers"))


def amp_step_loop(model: nn.Module, device: torch.device, precision: str) -> Runner:
    amp = AmpStep(torch.optim.Adam(model.parameters(), 1e-3), mode=precision, device=device)

    def run(batches: Batches) -> None:
        for inputs, targets in batches:
            with amp.autocast():
                loss = nn.functional.cross_entropy(model(inputs), targets)
            amp.backward(loss)
            amp.step()
        amp.close()

    return run


def accelerate_loop(model: nn.Module, device: torch.device, precision: str) -> Runner:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # Accelerate keeps one process-wide state and refuses a second precision in it: start afresh
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision=precision, cpu=device.type == "cpu")
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), 1e-3))
    return _framework_loop(model, optimizer, accelerator.backward)


def _framework_loop(
    model: nn.Module, optimizer: Any, backward: Callable[[torch.Tensor], None]
) -> Runner:
    """The loop Accelerate and Fabric users write: the framework autocasts and scales in ``backward``."""

    def run(batches: Batches) -> None:
        for inputs, targets in batches:
            backward(nn.functional.cross_entropy(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()

    return run


def _lightning_precision(precision: str) -> str:
    return "bf16-mixed" if precision == "bf16" else "16-mixed"


def fabric_loop(model: nn.Module, device: torch.device, precision: str) -> Runner:
    import lightning as L

    fabric = L.Fabric(accelerator=device.type, devices=1, precision=_lightning_precision(precision))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), 1e-3))
    return _framework_loop(model, optimizer, fabric.backward)


def lightning_trainer(model: nn.Module, device: torch.device, precision: str) -> Runner:
    import lightning as L

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch, index):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), 1e-3)

    module = Module()

    def run(batches: Batches) -> None:
        trainer = L.Trainer(
            accelerator=device.type, devices=1, precision=_lightning_precision(precision), max_epochs=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(
            module, torch.utils.data.DataLoader(batches, batch_size=None)
        )  # the batches as they are

    return run


RUNNERS = {
    "hand loop again": hand_loop,  # the control: how far noise and another copy of the model move a ratio
    "mpnb.Trainer": mpnb_trainer,
    "Trainer + text progress": mpnb_trainer_text,
    "Trainer + live dashboard": mpnb_trainer_live,
    "AmpStep in a hand loop": amp_step_loop,
    "Accelerate": accelerate_loop,
    "Lightning Fabric": fabric_loop,
    "Lightning Trainer": lightning_trainer,
}
#: The runners whose own time is read too (mpnb's, and the control, which should read about 0).
OWN_TIME_RUNNERS = ("hand loop again", "mpnb.Trainer", "Trainer + text progress", "Trainer + live dashboard",
                    "AmpStep in a hand loop")  # fmt: skip
#: Peers that have no fp16 autocast on a CPU (Lightning turns 16-mixed into bf16 there; Accelerate trains fp32).
NO_CPU_FP16 = ("Accelerate", "Lightning Fabric", "Lightning Trainer")


def digits_batches(size: int, steps: int, device: torch.device) -> Batches:
    images, labels = ex.load_digits()
    picks = [
        torch.arange(start, start + size) % len(images) for start in range(0, size * steps, size)
    ]
    return to_device([(images[pick], labels[pick]) for pick in picks], device)


def measure(
    batch: int, precision: str, device: torch.device, rounds: int, steps: int, runners: list[str]
) -> dict:
    batches = digits_batches(batch, steps, device)
    torch.manual_seed(0)
    base = ex.DigitsCNN().to(device)
    hand = hand_loop(copy.deepcopy(base), device, precision)

    def timed(run: Runner) -> Callable[[int], float]:
        def seconds_per_step(round_index: int) -> float:
            start = settled_clock(device)
            run(batches)
            return (settled_clock(device) - start) / steps

        return seconds_per_step

    row: dict[str, dict] = {}
    for name in runners:
        make = RUNNERS[name]
        if precision == "fp16" and device.type == "cpu" and name in NO_CPU_FP16:
            row[name] = {"skipped": "no fp16 autocast of its own on a CPU"}
            continue
        try:
            runner = make(copy.deepcopy(base), device, precision)
        except ImportError as missing:
            row[name] = {"skipped": f"not installed ({missing.name}): pip install 'mpnb[bench]'"}
            continue
        hand_times, runner_times = paired_rounds(timed(hand), timed(runner), rounds)
        row[name] = {
            "ratio": median_ratio(hand_times, runner_times),
            "fastest_ratio": fastest_ratio(hand_times, runner_times),
            "median_step_s": statistics.median(runner_times),
            "median_step_s_hand": statistics.median(hand_times),
        }
        if name in OWN_TIME_RUNNERS:
            own = own_time_over_hand(make, base, batches, device, precision, rounds)
            row[name].update(own_s_per_step=own, own_share=own / statistics.median(hand_times))
    return row


def own_time_over_hand(
    make: Callable[..., Runner],
    base: nn.Module,
    batches: Batches,
    device: torch.device,
    precision: str,
    rounds: int,
) -> float:
    """Seconds a step of ``make``'s runner spends outside torch's own calls, beyond what the hand
    loop spends there (see ``torch_work.py``): its own cost with the machine's noise subtracted."""
    with TorchWork() as work:  # both built inside: a loss function they hold is the timed one
        hand = hand_loop(copy.deepcopy(base), device, precision)
        runner = make(copy.deepcopy(base), device, precision)
        return own_time_beyond(
            work, lambda: hand(batches), lambda: runner(batches), len(batches), rounds
        )


def hand_step_s(row: dict) -> float:
    """The hand loop's median step in one batch size's row: from the first runner that was measured."""
    return next(
        (cell["median_step_s_hand"] for cell in row.values() if "median_step_s_hand" in cell),
        math.nan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32,256")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--steps", type=int, default=100, help="steps per block (one fit, one loop)"
    )
    parser.add_argument("--fp16", action="store_true", help="also fp16 (bf16 always)")
    parser.add_argument(
        "--runners", default=",".join(RUNNERS), help="which of: " + ", ".join(RUNNERS)
    )
    add_device_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")
    sizes = [int(size) for size in args.batches.split(",")]
    runners = args.runners.split(",")
    unknown = [name for name in runners if name not in RUNNERS]
    if unknown:
        parser.error(f"unknown runners {unknown}; valid: {', '.join(RUNNERS)}")
    results = {}
    for precision in ["bf16", *(["fp16"] if args.fp16 else [])]:
        table = {
            size: measure(size, precision, device, args.rounds, args.steps, runners)
            for size in sizes
        }
        results[precision] = {str(size): row for size, row in table.items()}
        print(
            f"\n{device_label(device)}, digits CNN, {precision}: step time over the hand-written torch.amp loop"
        )
        print(f"{'':24s}" + "".join(f"batch {size:<14d}" for size in sizes))
        hand_ms = "".join(f"{hand_step_s(table[size]) * 1e3:6.2f} ms           " for size in sizes)
        print(f"{'hand loop (1.00)':24s}{hand_ms}")
        for name in runners:
            cells = [table[size][name] for size in sizes]
            text = "".join(
                f"{cell['ratio']:6.3f}x ({cell['fastest_ratio']:5.3f})  "
                if "ratio" in cell
                else "   -                "
                for cell in cells
            )
            skipped = next((cell["skipped"] for cell in cells if "skipped" in cell), "")
            print(f"{name:24s}{text}{skipped}")
        print(
            "own time a step, beyond the hand loop's (run time minus torch's own calls), share of its step"
        )
        for name in (name for name in runners if name in OWN_TIME_RUNNERS):
            cells = [table[size][name] for size in sizes]
            print(f"{name:24s}" + "".join(
                f"{cell['own_s_per_step'] * 1e6:6.1f} us ({cell['own_share'] * 100:4.1f}%)  " if "own_share" in cell
                else "   -                "
                for cell in cells
            ))  # fmt: skip
    sys.stdout.flush()
    write_results(
        results_name("peers", device),
        {
            "device": device_label(device),
            "rounds": args.rounds,
            "steps_per_block": args.steps,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
