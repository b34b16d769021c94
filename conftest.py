"""How the whole test run (tests/ and the lessons in notebooks/) shares out over xdist workers.

pyproject's addopts run the suite on one worker per core with ``--dist loadgroup``: a test
without an ``xdist_group`` mark is handed to whichever worker is free, on its own. These hooks
keep on one worker, in order, what must not be split or run twice at once:

- the cells of one notebook (they share its kernel), and any other non-function item by file;
- the tests of a module that share a class-, module- or package-scoped set-up (a kernel, a
  launch): built once on one worker instead of once on each;
- the groups in ``TOGETHER``: tests that must not overlap one another.

A test may also mark itself ``@pytest.mark.xdist_group("name")``; its mark wins.
"""

from __future__ import annotations

import os

import pytest

try:
    from _pytest.nodeid import NodeId  # pytest >= 9.2
except ImportError:
    NodeId = None

# Tests that run one at a time on one worker, by path prefix (relative to this folder).
TOGETHER = {
    # gloo process pairs. Among them the attacker (tests/distributed/test_security.py) attacks every
    # port that opens on the machine while it runs: a launch beside it would lose rows to it.
    "gloo": (
        "tests/distributed/",
        "tests/training/test_checkpoint_code.py",
        "notebooks/09_distributed.ipynb",
    ),
    # A Jupyter server and a Chromium each: two at once on two cores miss their page timeouts.
    "browser": ("tests/ui/test_browser.py",),
}

_SHARED_SCOPES = ("class", "module", "package")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "xdist_group(name): run on one xdist worker with the rest of its group"
    )
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        # Each worker's torch (and the kernels and ranks it starts) gets its share of the cores:
        # two workers each running two intra-op threads on two cores only trade places.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (cores or 1) // workers)))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = group_of(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)  # before xdist's own sends the node ids to the scheduler
def pytest_collection_finish(session: pytest.Session) -> None:
    """Where xdist's own hook could not, write each item's group into its node id.

    xdist (3.8) tells the scheduler an item's group by appending ``@group`` to ``item._nodeid``;
    pytest 9.2 keeps node ids as ``item._id`` and no longer reads that field, so every group
    silently falls apart (pytest-dev/pytest-xdist#1386).
    """
    if not session.config.getoption("loadgroup", False):
        return
    for item in session.items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs["name"])
                for m in item.iter_markers("xdist_group")
            }
        )
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and NodeId is not None:
            item._id = NodeId.parse(item.nodeid + suffix)


def group_of(item: pytest.Item) -> str | None:
    """The xdist group ``item`` must share a worker with, or None where it may go anywhere."""
    path = item.nodeid.split("::")[0]
    for name, prefixes in TOGETHER.items():
        if path.startswith(prefixes):
            return name
    if not isinstance(item, pytest.Function):
        return path
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is not None and any(
        definitions[-1].scope in _SHARED_SCOPES
        for definitions in fixtures.name2fixturedefs.values()
    ):
        return path
    return None
