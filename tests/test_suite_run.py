"""The suite's own run: which tests share an xdist worker (the root conftest.py), how many
threads each worker's torch gets, and nothing left for interpreter exit."""

from __future__ import annotations

import collections
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

RECORD = """
import os, pathlib, torch

def record(name):
    line = f"{name} {os.environ['PYTEST_XDIST_WORKER']} {torch.get_num_threads()}\\n"
    with open(pathlib.Path(__file__).parent / "ran.txt", "a") as file:
        file.write(line)
"""

SHARED = """
import pytest, time
from record import record

@pytest.fixture(scope="module")
def built_once():
    return object()

@pytest.mark.parametrize("i", range(6))
def test_shared(built_once, i):
    time.sleep(0.1)
    record("shared")
"""

FREE = """
import pytest, time
from record import record

@pytest.mark.parametrize("i", range(12))
def test_free(i):
    time.sleep(0.2)
    record("free")
"""

GROUPED = """
import pytest, time
from record import record

@pytest.mark.xdist_group("serial")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    time.sleep(0.1)
    record("grouped")

@pytest.mark.xdist_group("serial")
def test_grouped_too():
    record("grouped")
"""


def test_a_module_set_up_and_a_marked_group_each_stay_on_one_worker(tmp_path):
    """The rest is shared out: both workers run some of the free tests."""
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -n 2 --dist loadgroup -p no:cacheprovider --strict-markers\n"
    )
    for name, text in [
        ("record.py", RECORD),
        ("test_shared.py", SHARED),
        ("test_free.py", FREE),
        ("test_grouped.py", GROUPED),
    ]:
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "OMP_NUM"))}
    # Only xdist: the other installed plugins (nbval, with the Jupyter stack it imports) have no
    # part in how the tests are shared out, and would cost each process seconds.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "xdist"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    workers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    threads = set()
    for line in (tmp_path / "ran.txt").read_text().splitlines():
        name, worker, count = line.split()
        workers[name][worker] += 1
        threads.add(int(count))
    assert sum(workers["shared"].values()) == 6 and len(workers["shared"]) == 1, workers
    assert sum(workers["grouped"].values()) == 5 and len(workers["grouped"]) == 1, workers
    assert sorted(workers["free"]) == ["gw0", "gw1"], workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert threads == {max(1, (cores or 1) // 2)}


EXIT_AFTER_SHELLS = """
import atexit, gc, os, sys
sys.path.insert(0, os.getcwd())
full = []
# Registered first, run last: after every exit hook the shells left.
atexit.register(lambda: os.write(1, f"full collections at exit: {len(full)}".encode()))
from tests.conftest import mpnb_shell
for _ in range(3):
    with mpnb_shell() as shell:
        shell.run_cell("model = torch.nn.Linear(64, 64)")
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1))
"""


def test_the_ip_fixtures_shells_leave_no_work_for_interpreter_exit():
    """IPython hands each shell's exit operations to ``atexit``: that kept every test's shell and
    all its cells made alive to the end of the run, then ran one full garbage collection per
    shell (``DisplayHook.flush``) after pytest's summary: minutes, a few hundred shells on."""
    result = subprocess.run(
        [sys.executable, "-c", EXIT_AFTER_SHELLS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("full collections at exit: 0"), result.stdout + result.stderr


def test_plotlys_widget_imports_jsonschema_without_compiling_rfc3987_syntax():
    """The test extra's rfc3987 keeps jsonschema from importing rfc3987_syntax: 2 s of CPU saved
    in each kernel, Jupyter server and pytest worker the suite starts."""
    code = (
        "import sys, plotly.graph_objects as go; go.FigureWidget; "
        "print('jsonschema' in sys.modules, 'rfc3987_syntax' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True", "False"]
