"""Where every benchmark writes its JSON: ``benchmarks/results/<name>.json``, with the machine it ran on."""

from __future__ import annotations

import json
import os
import pathlib
import platform

import torch

RESULTS = pathlib.Path(__file__).parent / "results"


def write_results(name: str, figures: dict) -> pathlib.Path:
    """Write ``{"benchmark": name, **figures}`` plus torch version, CPU and thread count; return the path."""
    payload = {
        "benchmark": name,
        **figures,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"-> {path}")
    return path
