"""What ``mpnb.Trainer(strategy="ddp")`` costs against the same hand-written DDP loop, 2 ranks.

Inside one :func:`mpnb.distributed.launch` (its start is not timed), every rank trains the example
CNN in bf16 on its share of the digits batches, once by a hand-written loop (DDP, torch.autocast,
each rank on every second batch) and once by ``mpnb.Trainer(..., strategy="ddp", dashboard=None)``
(telemetry on, streamed to the launching process as a notebook's live per-rank dashboard gets
it; here the launch shows nothing), in paired rounds (order flipped every round); rank 0's
per-round ratio is printed as a median. Target: <= 1.05. The telemetry channel's own cost per
step (sending each flush's rows, looking for a stop) is read directly, by timing those calls.
Writes benchmarks/results/distributed_overhead.json.

    python benchmarks/distributed_overhead.py [--rounds 7] [--steps 40] [--nproc 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from own_time import OwnTime
from paired_rounds import median_ratio, paired_rounds
from results_file import write_results
from torch import nn

import mpnb.examples as ex
from mpnb.distributed import RanksView, launch
from mpnb.distributed.channel import RankStream
from mpnb.training import Trainer

TARGET = 1.05


def rank_timings(rounds: int, steps: int) -> dict[str, list[float]]:
    """On each rank: seconds per step of the hand loop and of the Trainer, paired rounds."""
    images, labels = ex.load_digits()
    # as many batches of 64 as the steps need, going round the 1797 digits again where they run out
    picks = [
        torch.arange(start, start + 64) % len(images) for start in range(0, 64 * 2 * steps, 64)
    ]
    batches = [(images[pick], labels[pick]) for pick in picks]
    mine = batches[dist.get_rank() :: dist.get_world_size()][:steps]
    torch.manual_seed(0)
    hand_model = nn.parallel.DistributedDataParallel(ex.DigitsCNN())
    hand_optimizer = torch.optim.Adam(hand_model.parameters(), 1e-3)
    torch.manual_seed(0)
    model = ex.DigitsCNN()
    trainer = Trainer(
        model, torch.optim.Adam(model.parameters(), 1e-3), nn.functional.cross_entropy,
        mode="bf16", device="cpu", dashboard=None, strategy="ddp",
    )  # fmt: skip

    def hand(round_index: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for inputs, targets in mine:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(hand_model(inputs), targets)
            loss.backward()
            hand_optimizer.step()
            hand_optimizer.zero_grad()
        return (time.perf_counter() - start) / len(mine)

    channel = OwnTime([(RankStream, "update"), (RankStream, "_look_for_stop")])

    def with_mpnb(round_index: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        with channel:
            trainer.fit(
                batches[: 2 * steps], max_steps=steps
            )  # the Trainer deals the ranks' shares itself
        return (time.perf_counter() - start) / steps

    hand_times, mpnb_times = paired_rounds(hand, with_mpnb, rounds)
    return {
        "hand": hand_times,
        "mpnb": mpnb_times,
        "channel_s_per_step": channel.seconds / ((rounds + 1) * steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    timings = launch(
        rank_timings, args.rounds, args.steps, nproc=args.nproc, dashboard=RanksView()
    ).results
    ratios = [median_ratio(rank["hand"], rank["mpnb"]) for rank in timings]
    hand, mine = timings[0]["hand"], timings[0]["mpnb"]
    print(
        f"DDP, {args.nproc} ranks, example CNN bf16: hand loop {statistics.median(hand) * 1e3:.2f} ms/step, "
        f"mpnb.Trainer {statistics.median(mine) * 1e3:.2f} ms/step, ratio {ratios[0]:.3f} on rank 0 "
        f"({', '.join(f'{r:.3f}' for r in ratios)} by rank; target <= {TARGET}); telemetry channel "
        f"{timings[0]['channel_s_per_step'] * 1e6:.1f} us/step"
    )
    write_results(
        "distributed_overhead",
        {
            "nproc": args.nproc,
            "steps_per_round": args.steps,
            "median_step_s_hand": statistics.median(hand),
            "median_step_s_mpnb": statistics.median(mine),
            "ratio_by_rank": ratios,
            "target_ratio": TARGET,
            "channel_s_per_step_by_rank": [rank["channel_s_per_step"] for rank in timings],
        },
    )


if __name__ == "__main__":
    main()
