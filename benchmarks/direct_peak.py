"""One training step's peak memory, measured directly: the reference max_batch_size is held to.

A fresh process per mode, no mpnb in the measured loop: the seeds' CNN (conv 1->420, pool,
conv 420->1000, pool, linear 49000->10 on 28x28 images, Adam) is built and trained one warm-up
step on one sample (the optimizer's state appears). Then, for each batch size asked, smallest
first: the heap is trimmed, Linux's peak resident set is reset, and one step on a batch of that
size is trained with the hand-written torch.amp recipe. Prints a JSON line per size: the bytes
resident before the step that a step needs (parameters, optimizer state, batch) and the peak
resident set over the baseline.

glibc's malloc raises its mmap threshold as large blocks are freed, after which freed memory
stays resident and the peak depends on what ran before (on this CPU, bf16 at batch 24 and 48
then "used" 5.0 MB a sample, fp32 3.7). :func:`direct_max_batch` fixes the threshold
(``MALLOC_MMAP_THRESHOLD_``) so that the resident set follows what is allocated: 4.56 MB a sample
in fp32 and 3.51 in bf16 there, the same as torch's allocator counts. With the threshold fixed,
a step measured after another in the same process peaks as it does in a process of its own
(batches 12 and 24 on a 2-core CPU: within 0.3% in both modes), so one process serves a mode's
sizes and imports torch once.

    python benchmarks/direct_peak.py MODE BATCH [BATCH ...]     # MODE: fp32 or bf16

:func:`direct_max_batch` runs it at two sizes per mode (resident memory grows linearly with the
batch) and follows the line to a budget.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

#: Blocks from this size up are mapped and unmapped on their own (glibc's default start).
MMAP_THRESHOLD = 128 * 1024

#: The seeds' CNN: DigitsCNN's layout at the widths and image size of the seeds' article.
WIDTHS, IMAGE_SIZE = (420, 1000), 28


def _resident() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * 4096


def _peak_resident() -> int:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(mode: str, batch_sizes: list[int]) -> list[dict[str, float]]:
    """The point of each (mode, batch size), in this process, smallest batch first."""
    import torch
    from torch import nn

    from mpnb.examples import DigitsCNN

    torch.manual_seed(0)
    model = DigitsCNN(WIDTHS, image_size=IMAGE_SIZE)
    optimizer = torch.optim.Adam(model.parameters())

    def step(size: int) -> None:
        images = torch.randn(size, 1, IMAGE_SIZE, IMAGE_SIZE)
        labels = torch.randint(0, 10, (size,))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(1)
    points = []
    for batch_size in sorted(batch_sizes):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")  # reset the peak resident set (Linux 4.0+)
        before = _resident()
        step(batch_size)
        state = [value for per in optimizer.state.values() for value in per.values()]
        resident = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *state])
        resident += batch_size * (IMAGE_SIZE * IMAGE_SIZE * 4 + 8)
        points.append(
            {"batch": batch_size, "resident": resident, "added": _peak_resident() - before}
        )
    return points


class DirectMeasurement:
    """The direct measurement of one mode at two batch sizes, started in a fresh process at once:
    other work can go on meanwhile (a test runs mpnb's search beside it).

    ``max_batch(budget)`` waits for it and gives the batch size at which the measured peak meets
    ``budget``: the line through the two points.

    ``threads``: torch's intra-op threads in the measuring process; by default as many as this
    process's torch uses, so that both measure the same kernels. oneDNN's buffers depend on it:
    the seeds' CNN in bf16 peaked 16 MB lower on one thread than on two (a CPU with bf16 units).
    """

    def __init__(self, mode: str, sizes: tuple[int, int], threads: int | None = None) -> None:
        import torch

        self.sizes = sizes
        threads = threads or torch.get_num_threads()
        self.process = subprocess.Popen(
            [sys.executable, __file__, mode, *map(str, sizes)],
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                "OMP_NUM_THREADS": str(threads),
            },
        )

    def stop(self) -> None:
        """End the measuring process if it still runs (nothing happens once it has ended)."""
        self.process.kill()
        self.process.wait()

    def max_batch(self, budget: int) -> float:
        output, _ = self.process.communicate()
        if self.process.returncode:
            raise subprocess.CalledProcessError(self.process.returncode, self.process.args, output)
        lines = output.strip().splitlines()[-len(self.sizes) :]
        (small, low), (large, high) = [
            (point["batch"], point["resident"] + point["added"]) for point in map(json.loads, lines)
        ]
        per_sample = (high - low) / (large - small)
        return small + (budget - low) / per_sample


def direct_max_batch(mode: str, budget: int, sizes: tuple[int, int]) -> float:
    """The batch size at which the directly measured peak meets ``budget``: the line through
    the points of two batch sizes, measured in a fresh process."""
    return DirectMeasurement(mode, sizes).max_batch(budget)


if __name__ == "__main__":
    for measured in measure(sys.argv[1], [int(size) for size in sys.argv[2:]]):
        print(json.dumps(measured))
