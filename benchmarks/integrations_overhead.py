"""What mpnb's telemetry costs inside other trainers: each framework with and without it.

The same model and data trained by transformers.Trainer (a 2-layer GPT-2 from a config),
the Lightning Trainer (an MLP) and an Accelerate loop (the same MLP), once plainly and once
with mpnb attached (``MpnbCallback(dashboard=None)`` / ``watch(..., dashboard=None)``: the
telemetry without a display). Runs of ``--steps`` optimizer steps alternate between the two
(the order flips every round); the median of the per-round ratios is printed per framework.
Each run includes the framework's own start and end (a ``train()`` / ``fit()`` call), as a
user pays them. Both sides train the same model object (no difference of memory layout), and a
control pairs the plain run with itself: its ratio shows how far this machine's noise reaches
(on a shared 2-core machine a whole-run ratio moves by several percent from noise alone); the
ratio of each side's fastest run is printed beside it (noise only adds time, see ``paired_rounds.py``).
Where the framework has callbacks, a third side trains with one that does nothing: the cost the
framework puts on any callback (its hook dispatch), which mpnb's cannot go below.
A last run with mpnb attached reads mpnb's own time directly (every mpnb hook and callback
method timed, see ``own_time.py``): its share of the plain step is the cost with the noise left out.
Target: <= 1.03 (ratio and own share). Writes benchmarks/results/integrations_overhead.json.

    python benchmarks/integrations_overhead.py [--rounds 21] [--steps 60] [--frameworks transformers,lightning,accelerate]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from own_time import OwnTime
from paired_rounds import fastest_ratio, median_ratio, paired_rounds
from results_file import write_results
from torch import nn

from mpnb.integrations.loop_telemetry import LoopTelemetry
from mpnb.integrations.observed import PrecisionObserver
from mpnb.training import step_watch

TARGET = 1.03
#: mpnb's code that runs in every framework's loop: the telemetry, the precision hook, the step hook.
TELEMETRY_CODE = [
    *((LoopTelemetry, name) for name in ("begin", "window_begin", "add_loss", "add_samples", "before_optimizer_step",
                                         "step_end", "outside_steps", "end")),
    (PrecisionObserver, "_observe"),
    (step_watch._StepFlag, "__call__"),
]  # fmt: skip


def methods(owner: type, *names: str) -> list[tuple[type, str]]:
    return [(owner, name) for name in names]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def mlp_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator))
        for _ in range(steps)
    ]


class Runs(NamedTuple):
    plain: Callable[[], None]
    watched: Callable[[], None]  # with mpnb attached
    mpnb_code: list[tuple[type, str]]  # mpnb's methods that run in it
    # with a callback that does nothing: what any callback costs
    empty: Callable[[], None] | None = None


def transformers_runs(steps: int, tmp: str) -> Runs:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.utils import logging as hf_logging

    from mpnb.integrations.transformers import MpnbCallback

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=128,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (steps * 8, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        tmp, use_cpu=True, bf16=True, per_device_train_batch_size=8, max_steps=steps, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_strategy="no",
    )  # fmt: skip
    # one model for both: no difference of memory layout between the two sides
    plain = Trainer(model=model, args=args, train_dataset=data)
    watched = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[MpnbCallback(dashboard=None)]
    )
    empty = Trainer(model=model, args=args, train_dataset=data, callbacks=[TrainerCallback()])
    for trainer in (plain, watched, empty):
        trainer.remove_callback(
            PrinterCallback
        )  # its line of metrics after every train() call, on every side
    hooks = methods(MpnbCallback, "on_train_begin", "_forward_done", "on_step_begin", "on_pre_optimizer_step",
                    "on_step_end", "on_train_end")  # fmt: skip
    return Runs(plain.train, watched.train, hooks, empty.train)


def lightning_runs(steps: int, tmp: str) -> Runs:
    import lightning as L

    from mpnb.integrations.lightning import MpnbCallback

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, index):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), 1e-3)

    inputs, targets = (torch.cat(part) for part in zip(*mlp_data(steps)))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, targets), batch_size=32
    )

    def run(module: L.LightningModule, callbacks: list) -> Callable[[], None]:
        def fit() -> None:
            trainer = L.Trainer(
                accelerator="cpu", precision="bf16-mixed", max_steps=steps, callbacks=callbacks, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(module, data)

        return fit

    module = Module()  # one module for both: no difference of memory layout between the two sides
    hooks = methods(MpnbCallback, "on_train_start", "on_train_batch_start", "on_before_optimizer_step",
                    "on_train_batch_end", "on_train_end")  # fmt: skip
    return Runs(
        run(module, []),
        run(module, [MpnbCallback(dashboard=None)]),
        hooks,
        run(module, [L.Callback()]),
    )


def accelerate_runs(steps: int, tmp: str) -> Runs:
    from accelerate import Accelerator

    from mpnb.integrations.accelerate import LoopRecorder, watch

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    data = mlp_data(steps)

    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), 1e-3))

    def run(recorded: bool) -> Callable[[], None]:
        # one model and optimizer for both sides: no difference of memory layout between them
        def loop() -> None:
            recorder = watch(accelerator, model, optimizer, dashboard=None) if recorded else None
            for inputs, targets in data:
                loss = nn.functional.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                if recorder is not None:
                    recorder.record(loss, (inputs, targets))
            if recorder is not None:
                recorder.close()

        return loop

    return Runs(run(False), run(True), methods(LoopRecorder, "record", "close"))


FRAMEWORKS = {
    "transformers": transformers_runs,
    "lightning": lightning_runs,
    "accelerate": accelerate_runs,
}


def measure(runs: Runs, rounds: int, steps: int) -> dict:
    def timed(run: Callable[[], None]) -> Callable[[int], float]:
        def seconds_per_step(round_index: int) -> float:
            start = time.perf_counter()
            run()
            return (time.perf_counter() - start) / steps

        return seconds_per_step

    plain_times, watched_times = paired_rounds(timed(runs.plain), timed(runs.watched), rounds)
    # the same plain run on both sides: how far this machine's noise alone moves the ratio
    control_a, control_b = paired_rounds(timed(runs.plain), timed(runs.plain), rounds)
    with OwnTime([*TELEMETRY_CODE, *runs.mpnb_code]) as own:
        runs.watched()
    plain_step = statistics.median(plain_times)
    row = {
        "median_step_s_plain": plain_step,
        "median_step_s_with_mpnb": statistics.median(watched_times),
        "ratio_with_over_plain": median_ratio(plain_times, watched_times),
        "ratio_plain_over_plain": median_ratio(control_a, control_b),
        "fastest_ratio_with_over_plain": fastest_ratio(plain_times, watched_times),
        "fastest_ratio_plain_over_plain": fastest_ratio(control_a, control_b),
        "mpnb_own_s_per_step": own.seconds / steps,
        "mpnb_own_share_of_plain_step": own.seconds / steps / plain_step,
        "steps_per_run": steps,
        "rounds": rounds,
    }
    if runs.empty is not None:  # what the framework spends on any callback, one that does nothing
        bare_times, empty_times = paired_rounds(timed(runs.plain), timed(runs.empty), rounds)
        row["ratio_empty_callback_over_plain"] = median_ratio(bare_times, empty_times)
    return row


def report(name: str, row: dict) -> str:
    """The framework's figures, one line each."""
    lines = [
        f"{name}: plain {row['median_step_s_plain'] * 1e3:.2f} ms/step, with mpnb "
        f"{row['median_step_s_with_mpnb'] * 1e3:.2f} ms/step",
        f"  with mpnb / plain   {row['ratio_with_over_plain']:.3f} (target <= {TARGET}; fastest runs "
        f"{row['fastest_ratio_with_over_plain']:.3f})",
        f"  plain / plain       {row['ratio_plain_over_plain']:.3f} (the noise; fastest runs "
        f"{row['fastest_ratio_plain_over_plain']:.3f})",
        f"  mpnb's own time     {row['mpnb_own_s_per_step'] * 1e6:.0f} us/step = "
        f"{1 + row['mpnb_own_share_of_plain_step']:.3f}x",
    ]
    if "ratio_empty_callback_over_plain" in row:
        lines.append(
            f"  an empty callback   {row['ratio_empty_callback_over_plain']:.3f} (the framework's cost of any callback)"
        )
    return "\n".join(lines)


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.frameworks.split(","):
            try:
                runs = FRAMEWORKS[name](args.steps, tmp)
            except ImportError as missing:
                print(f"{name:13s} skipped: {missing}", file=sys.stderr)
                continue
            results[name] = measure(runs, args.rounds, args.steps)
            print(report(name, results[name]), flush=True)
    write_results("integrations_overhead", {"target_ratio": TARGET, "frameworks": results})


if __name__ == "__main__":
    main()
