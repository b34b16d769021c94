"""What mpnb's telemetry costs inside other trainers: each framework with and without it.

The same model and data trained by transformers.Trainer (a 2-layer GPT-2 from a config),
the Lightning Trainer (an MLP) and an Accelerate loop (the same MLP), once plainly and once
with mpnb attached (``MpnbCallback(dashboard=None)`` / ``watch(..., dashboard=None)``: the
telemetry without a display). Runs of ``--steps`` optimizer steps alternate between the two
(the order flips every round); the median of the per-round ratios is printed per framework.
Each run includes the framework's own start and end (a ``train()`` / ``fit()`` call), as a
user pays them. Both sides train the same model object (no difference of memory layout), and a
control pairs the plain run with itself: its ratio shows how far this machine's noise reaches.
Target: <= 1.03. Writes benchmarks/results/integrations_overhead.json.

    python benchmarks/integrations_overhead.py [--rounds 7] [--steps 30] [--frameworks transformers,lightning,accelerate]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from paired_rounds import median_ratio, paired_rounds
from results_file import write_results
from torch import nn

TARGET = 1.03


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def mlp_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator))
        for _ in range(steps)
    ]


def transformers_runs(steps: int, tmp: str) -> tuple[Callable[[], None], Callable[[], None]]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from mpnb.integrations.transformers import MpnbCallback

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (steps * 8, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        tmp, use_cpu=True, bf16=True, per_device_train_batch_size=8, max_steps=steps, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_strategy="no",
    )  # fmt: skip
    plain = Trainer(model=model, args=args, train_dataset=data)
    watched = Trainer(
        model=copy.deepcopy(model), args=args, train_dataset=data, callbacks=[MpnbCallback(dashboard=None)]
    )
    return plain.train, watched.train


def lightning_runs(steps: int, tmp: str) -> tuple[Callable[[], None], Callable[[], None]]:
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
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=32)

    def run(module: L.LightningModule, callbacks: list) -> Callable[[], None]:
        def fit() -> None:
            trainer = L.Trainer(
                accelerator="cpu", precision="bf16-mixed", max_steps=steps, callbacks=callbacks, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(module, data)

        return fit

    module = Module()  # one module for both: no difference of memory layout between the two sides
    return run(module, []), run(module, [MpnbCallback(dashboard=None)])


def accelerate_runs(steps: int, tmp: str) -> tuple[Callable[[], None], Callable[[], None]]:
    from accelerate import Accelerator

    from mpnb.integrations.accelerate import watch

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

    return run(False), run(True)


FRAMEWORKS = {"transformers": transformers_runs, "lightning": lightning_runs, "accelerate": accelerate_runs}


def measure(plain: Callable[[], None], watched: Callable[[], None], rounds: int, steps: int) -> dict:
    def timed(run: Callable[[], None]) -> Callable[[int], float]:
        def seconds_per_step(round_index: int) -> float:
            start = time.perf_counter()
            run()
            return (time.perf_counter() - start) / steps

        return seconds_per_step

    plain_times, watched_times = paired_rounds(timed(plain), timed(watched), rounds)
    # the same plain run on both sides: how far this machine's noise alone moves the ratio
    control_a, control_b = paired_rounds(timed(plain), timed(plain), rounds)
    return {
        "median_step_s_plain": statistics.median(plain_times),
        "median_step_s_with_mpnb": statistics.median(watched_times),
        "ratio_with_over_plain": median_ratio(plain_times, watched_times),
        "ratio_plain_over_plain": median_ratio(control_a, control_b),
        "steps_per_run": steps,
        "rounds": rounds,
    }


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.frameworks.split(","):
            try:
                plain, watched = FRAMEWORKS[name](args.steps, tmp)
            except ImportError as missing:
                print(f"{name:13s} skipped: {missing}", file=sys.stderr)
                continue
            row = results[name] = measure(plain, watched, args.rounds, args.steps)
            print(
                f"{name:13s} plain {row['median_step_s_plain'] * 1e3:7.2f} ms/step  with mpnb "
                f"{row['median_step_s_with_mpnb'] * 1e3:7.2f} ms/step  ratio {row['ratio_with_over_plain']:.3f} "
                f"(target <= {TARGET}; plain against itself {row['ratio_plain_over_plain']:.3f})"
            )
    write_results("integrations_overhead", {"target_ratio": TARGET, "frameworks": results})


if __name__ == "__main__":
    main()
