"""The op-list kernels in C++ (``list_kernel.cpp``), built for the installed torch on first use.

A list kernel runs on every call of a listed op inside autocast. In Python that call costs about
15 us (the dispatcher converts every argument to a Python object and back); the same kernel in
C++ costs about 1 us, which is what keeps a model under ``%oplist preset hmp`` within a few
percent of plain torch.autocast (``benchmarks/oplist_overhead.py``). The source is compiled with
``torch.utils.cpp_extension`` the first time lists are applied in an environment (about 15 s on
two cores, said on stderr) and loaded from torch's extension cache afterwards. Where it cannot be
built (no C++ compiler) the Python kernels, which do exactly the same, are used instead, with a
warning that says why.

``MPNB_LIST_KERNELS=python`` in the environment chooses the Python kernels.

Example:
    >>> import torch
    >>> if kind() == "compiled":
    ...     group = register("AutocastCPU", "cpu", [("relu", False, (0,))])
    ...     with torch.autocast("cpu", dtype=torch.bfloat16):
    ...         print(torch.relu(torch.ones(2)).dtype)
    ...     group.release()
    ... else:
    ...     print(torch.bfloat16)
    torch.bfloat16
"""

from __future__ import annotations

import os
import re
import sys
import threading
import warnings
import weakref
from pathlib import Path

import torch

from mpnb.errors import InvalidChoiceError

__all__: list[str] = []

#: The kernel implementations, chosen with the ``MPNB_LIST_KERNELS`` environment variable.
KINDS = ("compiled", "python")
SOURCE = Path(__file__).with_name("list_kernel.cpp")
#: One build per torch version: the kernel is compiled against that torch's headers.
EXTENSION = "mpnb_list_kernels_" + re.sub(r"\W", "_", torch.__version__)


class _Build:
    """Loads the extension once per process; remembers why when it cannot."""

    lock = threading.Lock()
    loaded = False
    failure: str | None = None

    @classmethod
    def load(cls) -> bool:
        with cls.lock:
            if not cls.loaded and cls.failure is None:
                try:
                    cls._compile_and_load()
                    cls.loaded = True
                # no compiler, no ninja, a failed build: all mean "use Python"
                except Exception as error:
                    cls.failure = f"{type(error).__name__}: {_last_lines(str(error))}"
                    warnings.warn(
                        "mpnb: the op lists use their Python kernels (about 15 us more per listed op call) "
                        f"because the C++ kernels could not be built: {cls.failure}",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            return cls.loaded

    @staticmethod
    def _compile_and_load() -> None:
        from torch.utils import (
            cpp_extension,
        )  # imports setuptools: only when lists are first applied

        build_dir = cpp_extension._get_build_directory(EXTENSION, verbose=False)
        if not os.path.exists(os.path.join(build_dir, f"{EXTENSION}.so")):
            print(
                f"mpnb: compiling the op-list kernels for torch {torch.__version__} (once; about 15 s)",
                file=sys.stderr,
                flush=True,
            )
        cpp_extension.load(
            EXTENSION,
            [str(SOURCE)],
            extra_cflags=["-O2"],
            build_directory=build_dir,
            is_python_module=False,
        )


def _last_lines(text: str, count: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " / ".join(lines[-count:]) or "no message"


def kind() -> str:
    """``"compiled"`` or ``"python"``: the kernels the next list override registers.

    Compiled unless ``MPNB_LIST_KERNELS=python`` or the build failed (see :func:`unavailable_reason`).
    """
    wanted = os.environ.get("MPNB_LIST_KERNELS", "compiled")
    if wanted not in KINDS:
        raise InvalidChoiceError("MPNB_LIST_KERNELS", wanted, KINDS)
    return "compiled" if wanted == "compiled" and _Build.load() else "python"


def unavailable_reason() -> str | None:
    """Why the C++ kernels could not be built in this process, or None."""
    return _Build.failure


class CompiledGroup:
    """Kernels registered together on one dispatch key; :meth:`release` puts back what was there.

    A group dropped without :meth:`release` is released when it is garbage-collected, as a
    ``torch.library.Library`` is.
    """

    def __init__(self, handle: int) -> None:
        self._release = weakref.finalize(self, torch.ops.mpnb_list_kernels.release, handle)
        self._release.atexit = False  # at exit the process takes the registrations with it

    def release(self) -> None:
        self._release()


def register(
    dispatch_key: str, device_type: str, entries: list[tuple[str, bool, tuple[int, ...]]]
) -> CompiledGroup:
    """Register C++ list kernels on ``dispatch_key``; call only when :func:`kind` is ``"compiled"``.

    Args:
        dispatch_key: ``"AutocastCPU"``, ``"AutocastCUDA"``, ...
        device_type: the autocast device whose dtype the lower list casts to.
        entries: ``(name, to_fp32, tensor_positions)`` per op, ``name`` as ``Library.impl`` takes
            it (``"softmax.int"``), the positions indexing the schema's arguments.
    """
    names = [name for name, _, _ in entries]
    to_fp32 = [int(fp32) for _, fp32, _ in entries]
    positions = [position for _, _, own in entries for position in own]
    counts = [len(own) for _, _, own in entries]
    return CompiledGroup(
        torch.ops.mpnb_list_kernels.register(
            dispatch_key, device_type, names, to_fp32, positions, counts
        )
    )
