"""Every lesson and the precision lab as on Binder: one CPU and 2 GB of memory.

mybinder.org gives a user 1 CPU and 2 GB. Each notebook runs top to bottom in a fresh kernel
(``jupyter nbconvert --execute``) pinned to one core (``taskset -c 0``, so torch runs one
thread), while the peak resident memory of the whole process tree (nbconvert and its kernel)
is sampled every 0.1 s. A notebook fits Binder when it runs without error and its peak stays
under 2 GiB. Prints the table the docs' lessons page shows; writes
benchmarks/results/binder_lessons.json.

    python benchmarks/binder_lessons.py [NAME.ipynb ...]
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import psutil
from results_file import write_results

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 2 * 2**30  # Binder's memory per user
NOTEBOOKS = [
    *sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")),
    ROOT / "widgets/precision_lab.ipynb",
]


def _tree_rss(process: psutil.Process) -> int:
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run(notebook: pathlib.Path, folder: pathlib.Path) -> dict:
    """Run one notebook on core 0; its seconds, peak memory and whether it ran to the end."""
    command = [
        "taskset",
        "-c",
        "0",
        sys.executable,
        "-m",
        "jupyter",
        "nbconvert",
        "--to",
        "notebook",
        "--execute",
        "--ExecutePreprocessor.timeout=900",
        "--ExecutePreprocessor.store_widget_state=False",
        "--output",
        str(folder / notebook.name),
        str(notebook),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    process = psutil.Popen(
        command,
        cwd=notebook.parent,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = 0
    while process.poll() is None:
        peak = max(peak, _tree_rss(process))
        time.sleep(0.1)
    seconds = time.perf_counter() - started
    error = process.stderr.read()[-400:] if process.returncode else ""
    return {
        "seconds": seconds,
        "peak_memory": peak,
        "ran": process.returncode == 0,
        "fits": process.returncode == 0 and peak < LIMIT,
        "error": error,
    }


def main(names: list[str]) -> None:
    chosen = [n for n in NOTEBOOKS if not names or n.name in names]
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for notebook in chosen:
            results[notebook.name] = run(notebook, pathlib.Path(folder))
            row = results[notebook.name]
            print(
                f"{notebook.name:32} {row['seconds']:6.0f} s  {row['peak_memory'] / 2**30:5.2f} GiB"
                f"  {'fits' if row['fits'] else 'DOES NOT FIT'}",
                flush=True,
            )
    write_results(
        "binder_lessons",
        {
            "limit": LIMIT,
            "cores": "taskset -c 0",
            "load_average": os.getloadavg(),
            "notebooks": results,
        },
    )


if __name__ == "__main__":
    main(sys.argv[1:])
