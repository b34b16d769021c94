"""max_batch_size's default search on a small transformer: how long it takes, and what it answers.

A two-layer transformer encoder language model (vocabulary 1,000, width 128, 4 heads, sequences
of 64 tokens, AdamW) on the CPU, ``mpnb.max_batch_size(make_run)`` with every default (fp32 and
bf16, half the available memory as the budget, ``limit=65536``, ``trial_seconds=5``), timed
``--runs`` times. The target: under 30 s on a 2-core machine. Prints each run's report and time;
writes benchmarks/results/batch_size_search.json.

    python benchmarks/batch_size_search.py [--runs 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from results_file import write_results
from torch import nn

import mpnb

MODES = ("fp32", "bf16")
VOCABULARY, WIDTH, LAYERS, TOKENS = 1000, 128, 2, 64


class TinyLanguageModel(nn.Module):
    """Token embeddings, a learnt position, a transformer encoder and a head over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH)
        self.position = nn.Parameter(torch.zeros(TOKENS, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS)
        self.head = nn.Linear(WIDTH, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens) + self.position)).flatten(0, 1)


def make_run(mode: str):
    torch.manual_seed(0)
    model = TinyLanguageModel()
    trainer = mpnb.Trainer(
        model,
        torch.optim.AdamW(model.parameters()),
        lambda logits, tokens: nn.functional.cross_entropy(logits, tokens.flatten()),
        mode=mode,
        device="cpu",
        dashboard=None,
    )
    tokens = torch.randint(0, VOCABULARY, (8, TOKENS))
    return trainer, [(tokens, tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    runs = []
    for index in range(args.runs):
        started = time.perf_counter()
        report = mpnb.max_batch_size(make_run, MODES)
        seconds = time.perf_counter() - started
        print(report)
        print(f"run {index + 1}: {seconds:.1f} s")
        runs.append(
            {
                "seconds": seconds,
                "sizes": {mode: report.result(mode).batch_size for mode in MODES},
                "checked": {mode: report.result(mode).checked for mode in MODES},
                "real_steps": {
                    mode: [t.batch_size for t in report.result(mode).trials if t.kind == "step"]
                    for mode in MODES
                },
                "budget": report.budget,
            }
        )
    slowest = max(run["seconds"] for run in runs)
    print(f"slowest run {slowest:.1f} s (target: under 30 s)")
    write_results(
        "batch_size_search",
        {
            "model": "TinyLanguageModel",
            "modes": list(MODES),
            "runs": runs,
            "slowest_seconds": slowest,
        },
    )


if __name__ == "__main__":
    main()
