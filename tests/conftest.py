"""Shared fixtures: a real IPython shell with mpnb loaded, and a full snapshot of torch's
global precision state that every test must leave exactly as it found it."""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

import pytest
import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from mpnb.oplists.lists import PRESETS, aten_overloads
from mpnb.precision.fp32math import read_flags
from mpnb.precision.policy import session

DEVICE_TYPES = ("cpu", "cuda", "hpu")

# Every operator a test puts on a list: its dispatcher entry must be as torch made it after each test.
_LISTED_IN_TESTS = "linear softmax matmul addmm conv2d log_softmax mul layer_norm gelu lstm"
WATCHED_OPS = sorted(
    {
        f"{op._schema.name}.{op._schema.overload_name}".rstrip(".")
        for text in [_LISTED_IN_TESTS, *(lower + " " + fp32 for lower, fp32, _ in PRESETS.values())]
        for name in text.split()
        for op in aten_overloads(name)
    }
)


def dispatcher_state() -> dict[str, str]:
    """The dispatcher's table (every key's kernel) for each watched operator."""
    return {name: torch._C._dispatch_dump(name) for name in WATCHED_OPS}


def torch_state() -> dict[str, object]:
    """Autocast state per device type, the cast-cache flag, and every fp32-math getter."""
    state: dict[str, object] = {
        "autocast cache": torch.is_autocast_cache_enabled(),
        **read_flags(),
        **dispatcher_state(),
    }
    for device_type in DEVICE_TYPES:
        state[f"{device_type} autocast enabled"] = torch.is_autocast_enabled(device_type)
        state[f"{device_type} autocast dtype"] = torch.get_autocast_dtype(device_type)
    return state


def policy_state() -> tuple[object, ...]:
    """The session's own state, for 'bad input changes nothing' checks."""
    return (
        session.mode,
        session.device,
        session.fp32_math.level,
        session.oplists.lists.copy(),
        torch_state(),
    )


@pytest.fixture(autouse=True)
def leaves_torch_as_found():
    before = torch_state()
    yield
    session.reset()
    after = torch_state()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}


@pytest.fixture
def ip():
    """A real InteractiveShell with ``%load_ext mpnb`` done and torch imported."""
    with mpnb_shell() as shell:
        yield shell


@contextlib.contextmanager
def mpnb_shell() -> Iterator[InteractiveShell]:
    """The ``ip`` fixture's shell: a fresh singleton, closed on the way out."""
    InteractiveShell.clear_instance()
    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "mpnb")
        run(shell, "import torch\nlinear = torch.nn.Linear(8, 8)\nx = torch.randn(4, 8)")
        yield shell
        if "mpnb" in shell.extension_manager.loaded:
            shell.run_line_magic("unload_ext", "mpnb")
    finally:
        close_shell(shell)
        InteractiveShell.clear_instance()


def close_shell(shell: InteractiveShell) -> None:
    """Do now what IPython leaves to interpreter exit, less its full garbage collection.

    Each shell registers its exit operations with ``atexit``. That keeps the shell, and all its
    cells made, alive to the end of the run; at exit each then runs a full ``gc.collect()``
    (``DisplayHook.flush``): minutes of 100% CPU after pytest's summary, a few hundred shells on.
    """
    atexit.unregister(shell.atexit_operations)
    script_magics = shell.magics_manager.registry.get("ScriptMagics")
    if script_magics is not None:  # its exit hook holds the shell too
        script_magics.kill_bg_processes()
        atexit.unregister(script_magics.kill_bg_processes)
    shell.cleanup()  # puts back the sys.modules["__main__"] and sys streams it replaced
    if shell.history_manager is not None:
        shell.history_manager.close()  # stops its saving thread, closes its database
        shell.history_manager = None


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Shells made outside ``ip`` (a docstring's example, a test's own) are closed too."""
    # type(), not isinstance(): a lazy module's __class__ would warn.
    for shell in [o for o in gc.get_objects() if issubclass(type(o), InteractiveShell)]:
        close_shell(shell)


def run(shell, code: str):
    """Run a cell; fail the test with the cell's own error if it raised."""
    result = shell.run_cell(code)
    if result.error_before_exec or result.error_in_exec:
        raise AssertionError(f"cell failed: {result.error_before_exec or result.error_in_exec!r}")
    return result.result


def run_expecting(shell, code: str, error: type[BaseException]) -> BaseException:
    """Run a cell that must fail with ``error``; return the exception."""
    result = shell.run_cell(code)
    raised = result.error_in_exec or result.error_before_exec
    assert isinstance(raised, error), f"expected {error.__name__}, got {raised!r}"
    return raised


def usage_error(shell, code: str) -> str:
    """Run a cell that must be rejected as bad input; return the message."""
    return str(run_expecting(shell, code, UsageError))
