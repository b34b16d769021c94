"""The CPU backend: bf16/fp16 autocast, oneDNN's bf16 fp32 math, process memory via psutil.

Example:
    >>> from mpnb.precision.backends.cpu import CpuBackend
    >>> CpuBackend().preferred_dtype()
    torch.bfloat16
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import sys

import psutil
import torch

from mpnb.precision.backends.base import Backend, MemorySnapshot
from mpnb.precision.fp32math import fine_grained, probe_reduced_math, set_fine_grained
from mpnb.precision.names import Fp32Math

__all__: list[str] = []

# Measured on a 2-core machine with AMX-bf16: a small CNN trains 47x slower under fp16
# autocast than in fp32, because fp16 convolution backward has no fast CPU kernel.
FP16_CONV_SLOWDOWN = 47

_BF16_UNITS = ("amx_bf16", "avx512_bf16")
#: Without one of these a CPU converts fp16 matrix products to fp32 and back: the example
#: transformer's fp16 step measured 72 ms beside bf16's 8 ms on an AVX512-BF16 Xeon.
_FP16_UNITS = ("amx_fp16", "avx512_fp16")


_PAGE_BYTES = resource.getpagesize()


def _resident_bytes() -> int | None:
    """The process's resident set size from ``/proc/self/statm`` (Linux; None elsewhere): one
    small read, ~8 us inside a training loop where ``/proc/self/status`` took ~30 us."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None
    try:
        return int(os.read(fd, 128).split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


def _peak_resident_bytes() -> int:
    """The highest resident set size so far (since :meth:`CpuBackend.reset_peak_memory` on Linux,
    whose reset ``getrusage`` follows), in bytes: a system call, no file read."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


@functools.cache
def _total_memory() -> int:
    return psutil.virtual_memory().total


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_freed_heap() -> None:
    """Hand freed heap memory back to the system where the C library can (glibc), so RSS is honest."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _cpu_capabilities() -> dict[str, object]:
    get = getattr(torch.cpu, "get_capabilities", None)
    return dict(get()) if get else {}


class CpuBackend(Backend):
    """The host CPU. Always available."""

    type = "cpu"
    label = "CPU"

    def is_available(self) -> bool:
        return True

    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16)

    def dtype_warnings(self, dtype: torch.dtype) -> list[str]:
        notes = []
        if dtype == torch.float16:
            notes.append(  # said of no model in particular: %amp has none in view
                "fp16 on CPU: a model with convolutions trains slowly, their backward having no "
                f"fast fp16 kernel (a small CNN measured {FP16_CONV_SLOWDOWN}x slower than fp32): "
                "use bf16 for it."
            )
        emulated = self.emulated(dtype)
        if emulated:
            notes.append(f"{emulated}, so expect no speed-up over fp32.")
        return notes

    def emulated(self, dtype: torch.dtype) -> str | None:
        if dtype == torch.bfloat16 and not self._bf16_units():
            return (
                f"bf16 is emulated on this CPU ({self._name()}: neither AMX-BF16 nor AVX512-BF16)"
            )
        if dtype == torch.float16 and not self._units(_FP16_UNITS):
            return (
                f"fp16 is emulated on this CPU ({self._name()}: neither AMX-FP16 nor AVX512-FP16)"
            )
        return None

    def memory(self, index: int | None = None) -> MemorySnapshot:
        # This runs every 250 ms of training: two cheap reads, psutil only where there is no /proc.
        used = _resident_bytes() or psutil.Process().memory_info().rss
        peak = _peak_resident_bytes()
        return MemorySnapshot(
            source="process resident memory",
            used=used,
            peak=max(peak, used),
            limit=_total_memory(),
        )

    def reset_peak_memory(self, index: int | None = None) -> bool:
        """Reset Linux's peak RSS. Freed heap malloc keeps still counts as resident: call
        :meth:`release_cached_memory` first for a clean start (it makes the next allocations
        fault their pages in again: measured 12% on the next steps of a small CNN)."""
        try:
            with open("/proc/self/clear_refs", "w") as file:
                file.write("5")  # "5": reset the peak resident set size (Linux 4.0+)
        except OSError:
            return False
        return True

    def release_cached_memory(self) -> None:
        release_freed_heap()

    def capabilities(self) -> dict[str, object]:
        caps = _cpu_capabilities()
        return {
            "name": self._name(),
            "cores": psutil.cpu_count(logical=True),
            **{unit: bool(caps.get(unit, False)) for unit in (*_BF16_UNITS, *_FP16_UNITS)},
        }

    def has_fast_fp32_math(self) -> bool:
        """Measured, not read off the flags: oneDNN keeps exact fp32 on some CPUs with AVX512-BF16."""
        return bool(self._bf16_units()) and probe_reduced_math(self, torch.device("cpu")).has_effect

    def apply_fp32_math(self, level: Fp32Math, legacy: bool = True) -> None:
        math = "bf16" if level is Fp32Math.REDUCED else "ieee"
        if legacy:
            # "medium" is the legacy spelling of oneDNN bf16 matmul math.
            torch.set_float32_matmul_precision("medium" if level is Fp32Math.REDUCED else "highest")
            set_fine_grained({"mkldnn.conv": math})
        else:
            set_fine_grained({"mkldnn.matmul": math, "mkldnn.conv": math})

    def describe_fp32_math(self) -> str:
        matmul = fine_grained("mkldnn.matmul")
        if matmul is None:  # torch before the fine-grained API
            matmul = "bf16" if torch.get_float32_matmul_precision() == "medium" else "ieee"
        if matmul != "bf16":
            return "exact: fp32 matmuls and convolutions use full fp32 math (TF32 does not exist on CPUs)."
        units = " and ".join(u.upper().replace("_", "-") for u in self._bf16_units())
        if self.has_fast_fp32_math():
            return (
                "reduced: oneDNN computes fp32 matmuls and convolutions with bf16 math on this CPU's "
                f"{units} units (faster; about 3 significant digits, relative error ~1e-3)."
            )
        if units:
            probe = probe_reduced_math(self, torch.device("cpu"))
            return (
                f"reduced requested, but oneDNN keeps exact fp32 math on this CPU ({units}; measured: "
                f"relative error {probe.exact_error:.1e} exact, {probe.reduced_error:.1e} reduced, "
                "both float32's own rounding where bf16 math errs by ~1e-3): "
                "no effect on this hardware (TF32 itself does not exist on CPUs)."
            )
        return (
            "reduced requested, but this CPU has neither AMX-BF16 nor AVX512-BF16, so oneDNN keeps "
            "exact fp32 math: no effect on this hardware (TF32 itself does not exist on CPUs)."
        )

    def _bf16_units(self) -> list[str]:
        return self._units(_BF16_UNITS)

    def _units(self, units: tuple[str, ...]) -> list[str]:
        caps = _cpu_capabilities()
        return [unit for unit in units if caps.get(unit)]

    def _name(self) -> str:
        return str(_cpu_capabilities().get("cpu_name", "unknown CPU"))
