"""What mpnb loads is a regular file, read no further than its size: ``/dev/zero``, a link to it or
a pipe as the path of ``Trainer.load``, ``History.load`` or ``OpLists.from_files`` is refused
before a byte is read, and a checkpoint whose record is deflated is refused before it is inflated.

Each load runs in a child process whose data segment is capped 1 GiB above what it holds after its
imports, so an unbounded read ends there rather than taking the machine's memory; the child
reports what each load raised and how far its peak resident memory grew."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch

from tests.child_process import child_environment

#: Peak growth a refused load may cause (the refusal itself, torch's first touch of its reader).
ALLOWED_GROWTH_MIB = 48
#: The deflated record's declared size: a 256 KiB file said to inflate to 256 MiB.
INFLATED = 256 << 20

CHILD = r"""
import json, resource, sys, time
import mpnb.examples as ex
from mpnb.oplists.lists import OpLists
from mpnb.training.history import History

trainer = ex.example_trainer("fp32", "cpu", widths=(4, 8), dashboard=None)[0]
loads = {
    "Trainer.load": trainer.load,
    "History.load": History.load,
    "OpLists.from_files": lambda path: OpLists.from_files(lower_path=path),
}
with open("/proc/self/status") as status:
    data_kib = next(int(line.split()[1]) for line in status if line.startswith("VmData"))
cap = (data_kib << 10) + (1 << 30)
resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
report = {}
for case in json.loads(sys.argv[1]):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    try:
        loads[case["load"]](case["path"])
        outcome = "loaded"
    except MemoryError:
        outcome = "MemoryError: read until the cap"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    report[case["id"]] = {
        "outcome": outcome,
        "growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
        "seconds": time.monotonic() - started,
    }
    print(json.dumps(report), flush=True)
"""


def deflated_checkpoint(path) -> None:
    """A real checkpoint of the example trainer whose weight record is replaced by a deflated one
    that inflates to :data:`INFLATED` bytes."""
    import mpnb.examples as ex

    trainer = ex.example_trainer("fp32", "cpu", widths=(4, 8), dashboard=None)[0]
    buffer = io.BytesIO()
    torch.save(trainer.state_dict(), buffer)
    with (
        zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as source,
        zipfile.ZipFile(path, "w") as out,
    ):
        for record in source.infolist():
            if record.filename.endswith("/data/0"):
                out.writestr(record.filename, bytes(INFLATED), compress_type=zipfile.ZIP_DEFLATED)
            else:
                out.writestr(record, source.read(record))


def hostile_paths(folder) -> list[dict[str, str]]:
    os.symlink("/dev/zero", folder / "zero.csv")
    os.symlink("/dev/zero", folder / "zero.pt")
    os.mkfifo(folder / "pipe.pt")
    deflated_checkpoint(folder / "deflated.pt")
    return [  # the deflated record first: its peak is measured before any other load's
        {
            "id": "Trainer.load deflated",
            "load": "Trainer.load",
            "path": str(folder / "deflated.pt"),
        },
        {"id": "Trainer.load /dev/zero", "load": "Trainer.load", "path": "/dev/zero"},
        {"id": "Trainer.load link", "load": "Trainer.load", "path": str(folder / "zero.pt")},
        {"id": "History.load /dev/zero", "load": "History.load", "path": "/dev/zero"},
        {"id": "History.load link", "load": "History.load", "path": str(folder / "zero.csv")},
        {"id": "OpLists.from_files /dev/zero", "load": "OpLists.from_files", "path": "/dev/zero"},
        {
            "id": "OpLists.from_files link",
            "load": "OpLists.from_files",
            "path": str(folder / "zero.csv"),
        },
        {"id": "Trainer.load pipe", "load": "Trainer.load", "path": str(folder / "pipe.pt")},
    ]


CASES = [
    (
        "Trainer.load /dev/zero",
        "'/dev/zero' is a character device: a checkpoint is read from a regular file",
    ),
    ("Trainer.load link", "zero.pt' is a character device"),
    ("Trainer.load deflated", "its record 'archive/data/0' is compressed"),
    (
        "History.load /dev/zero",
        "'/dev/zero' is a character device: a history is read from a regular file",
    ),
    ("History.load link", "zero.csv' is a character device"),
    (
        "OpLists.from_files /dev/zero",
        "'/dev/zero' is a character device: an op-list file is read from a regular file",
    ),
    ("OpLists.from_files link", "zero.csv' is a character device"),
    ("Trainer.load pipe", "pipe.pt' is a pipe"),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("hostile-paths")
    cases = hostile_paths(folder)
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(cases)],
            env=child_environment(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = done.stdout.splitlines()
    except subprocess.TimeoutExpired as timeout:  # a load that never returns (a pipe's open)
        lines = (timeout.stdout or b"").decode().splitlines()
    return json.loads(lines[-1]) if lines else {}


@pytest.mark.parametrize(("case", "refusal"), CASES, ids=[case for case, _ in CASES])
def test_a_path_that_is_no_regular_file_is_refused_before_it_is_read(outcomes, case, refusal):
    assert case in outcomes, f"{case}: the load never returned"
    found = outcomes[case]
    assert found["outcome"].startswith("MpnbError") and refusal in found["outcome"], found
    assert found["growth_mib"] < ALLOWED_GROWTH_MIB, found
