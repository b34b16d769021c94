"""What enforcing op lists costs per training step, against plain torch.autocast.

The example CNN and the example transformer, each trained in bf16 under session op lists
(kernels on every Autocast key, as `%oplist` sets them) and without, in alternating blocks;
prints the median of the per-round ratios (each round times both, in alternating order) per
model and list:

- ``torch rules``: a lower list naming the ops torch's CPU autocast lowers anyway. mpnb sees
  that torch's kernels already do this and registers nothing: the same work on both sides, so
  the ratio shows how far this machine's noise reaches (alternating blocks rather than single
  steps: a step right after the lists change runs on cold dispatch tables, measured 1.06-1.10x
  with nothing registered).
- ``kernels``: the same list with a list kernel forced for every entry (as if torch's rule
  could not be read): the same computation, so the ratio is the list kernels' own cost (the C++
  kernels of ``mpnb/oplists/list_kernel.cpp``). Target: <= 1.05.
- ``python kernels``: the same with the Python kernels (``MPNB_LIST_KERNELS=python``), which
  are used where the C++ ones cannot be built.
- ``hmp``: Habana's default lists, which also move relu, dropout, mul and the norms to bf16:
  the ratio adds what running those ops in bf16 costs on this machine (no target: an effect
  of the lists, not of the mechanism).

Writes benchmarks/results/oplist_overhead.json (``oplist_overhead-cuda.json`` with ``--device cuda``).

    python benchmarks/oplist_overhead.py [--rounds 12] [--block 10] [--models cnn,transformer] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics

import torch
from on_device import add_device_argument, device_label, results_name, settled_clock, to_device
from paired_rounds import median_ratio, paired_rounds
from results_file import write_results
from torch import nn

import mpnb.examples as ex
from mpnb.oplists import OpLists, compiled_kernels, override
from mpnb.precision.policy import session

TARGET = 1.05


def train_block(model, optimizer, batches) -> float:
    device = batches[0][0].device
    start = settled_clock(device)
    for x, y in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return (settled_clock(device) - start) / len(batches)


#: Ops torch's CPU autocast lowers itself (mpnb.oplists.torch_rules reads the full list).
TORCH_LOWERED = "conv1d conv2d conv3d linear matmul mm bmm addmm baddbmm addbmm"


@contextlib.contextmanager
def kernels_forced(forced: bool, kind: str = "compiled"):
    """Make mpnb register a kernel of ``kind`` even for entries that repeat torch's rule (measurement only)."""
    saved_rule, saved_kind = override.torch_rule, os.environ.get("MPNB_LIST_KERNELS")
    if forced:
        override.torch_rule = lambda op, device_type: None
    os.environ["MPNB_LIST_KERNELS"] = kind
    try:
        yield
    finally:
        override.torch_rule = saved_rule
        if saved_kind is None:
            del os.environ["MPNB_LIST_KERNELS"]
        else:
            os.environ["MPNB_LIST_KERNELS"] = saved_kind


def measure(model_name: str, batches, rounds: int, lists: OpLists, label: str) -> dict[str, float]:
    """Median step time with and without the lists, alternating blocks of steps."""
    torch.manual_seed(0)
    plain_model = ex.MODELS[model_name]().to(batches[0][0].device)
    listed_model = copy.deepcopy(plain_model)
    plain_opt = torch.optim.Adam(plain_model.parameters(), 1e-3)
    listed_opt = torch.optim.Adam(listed_model.parameters(), 1e-3)

    def plain_block(round_index: int) -> float:
        return train_block(plain_model, plain_opt, batches)

    def listed_block(round_index: int) -> float:
        session.oplists.replace(lists)  # the session lists, as %oplist sets them
        try:
            return train_block(listed_model, listed_opt, batches)
        finally:
            session.oplists.reset()

    plain, listed = paired_rounds(plain_block, listed_block, rounds)
    ratio = median_ratio(plain, listed)
    print(
        f"digits {model_name} bf16: plain autocast {statistics.median(plain) * 1e3:.2f} ms, with {label} lists "
        f"{statistics.median(listed) * 1e3:.2f} ms, ratio {ratio:.3f}"
        + {
            "kernels": f" (target <= {TARGET})",
            "python kernels": " (the fallback)",
            "hmp": " (the lists' effect included)",
        }.get(label, " (no kernels)")
    )
    return {
        "median_step_s_plain": statistics.median(plain),
        "median_step_s_lists": statistics.median(listed),
        "ratio_lists_over_plain": ratio,
        "ratio_of_medians": statistics.median(listed) / statistics.median(plain),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--models", default="cnn,transformer")
    add_device_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    images, labels = ex.load_digits()
    batches = to_device(
        [(images[i : i + 64], labels[i : i + 64]) for i in range(0, 64 * args.block, 64)], device
    )
    torch_rules = OpLists.of(lower=TORCH_LOWERED.split())
    lists = {
        "torch rules": torch_rules,
        "kernels": torch_rules,
        "python kernels": torch_rules,
        "hmp": OpLists.preset("hmp"),
    }
    models = {}
    for name in args.models.split(","):
        models[name] = {}
        for label, chosen in lists.items():
            with kernels_forced(
                label.endswith("kernels"), "python" if label == "python kernels" else "compiled"
            ):
                models[name][label] = measure(name, batches, args.rounds, chosen, label)
    write_results(
        results_name("oplist_overhead", device),
        {
            "device": device_label(device),
            "mechanism": f"session op lists: {compiled_kernels.kind()} kernels on every Autocast dispatch key",
            "lists": {
                label: {"lower": sorted(chosen.lower), "fp32": sorted(chosen.fp32)}
                for label, chosen in lists.items()
            },
            "models": models,
            "target_ratio": TARGET,
            "steps_each": args.rounds * args.block,
        },
    )


if __name__ == "__main__":
    main()
