"""The ``--device`` option the step benchmarks share: where the model and batches live, and a
clock that waits for the device (CUDA work is queued; a block's time counts only once it ran).

    >>> import torch
    >>> device = torch.device("cpu")
    >>> moved = to_device([(torch.zeros(2), torch.ones(2))], device)
    >>> moved[0][0].device.type
    'cpu'
"""

from __future__ import annotations

import argparse
import time

import torch


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cpu", help="cpu (default), cuda, or any torch device string"
    )


def to_device(batches, device: torch.device) -> list:
    """Each ``(inputs, targets)`` batch moved to ``device``."""
    return [(x.to(device), y.to(device)) for x, y in batches]


def settled_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once every queued kernel on ``device`` has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def device_label(device: torch.device) -> str:
    """``"cpu"`` or the accelerator's own name (``"NVIDIA H100 80GB HBM3"``), for the JSON."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def results_name(benchmark: str, device: torch.device) -> str:
    """The JSON's name: ``benchmark`` on the CPU, ``benchmark-cuda`` (and so on) elsewhere, so that a
    GPU run never overwrites the CPU figures.

    >>> results_name("peers", torch.device("cuda", 0))
    'peers-cuda'
    """
    return benchmark if device.type == "cpu" else f"{benchmark}-{device.type}"
