"""The Habana Gaudi (HPU) backend, following Habana's documented PyTorch API.

``habana_frameworks`` is imported only when it is installed, so detection is free on
other machines. The module is passed in as ``load_hpu`` so the backend's logic can be
exercised on machines without Gaudi.

Example:
    >>> from mpnb.precision.backends.hpu import HpuBackend
    >>> HpuBackend(load_hpu=lambda: None).is_available()
    False
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType

import torch

from mpnb.precision.backends.base import Backend, MemorySnapshot

__all__: list[str] = []


def import_habana_hpu() -> ModuleType | None:
    """Return ``habana_frameworks.torch.hpu`` when Habana's package is installed, else None."""
    if importlib.util.find_spec("habana_frameworks") is None:
        return None
    importlib.import_module("habana_frameworks.torch.core")  # registers the hpu device with torch
    return importlib.import_module("habana_frameworks.torch.hpu")


class HpuBackend(Backend):
    """Habana Gaudi accelerators.

    Args:
        load_hpu: returns Habana's ``hpu`` module, or None where it is not installed.
    """

    type = "hpu"
    label = "Habana Gaudi HPU"

    def __init__(self, load_hpu: Callable[[], ModuleType | None] = import_habana_hpu) -> None:
        self._load_hpu = load_hpu
        self._hpu: ModuleType | None = None
        self._loaded = False

    def _module(self) -> ModuleType | None:
        if not self._loaded:
            self._hpu = self._load_hpu()
            self._loaded = True
        return self._hpu

    def is_available(self) -> bool:
        hpu = self._module()
        return bool(hpu is not None and hpu.is_available())

    def unavailable_reason(self) -> str:
        if self._module() is None:
            return "no Habana Gaudi HPU: the habana_frameworks package is not installed"
        return "no Habana Gaudi HPU: habana_frameworks sees no device"

    def device_count(self) -> int:
        return self._module().device_count() if self.is_available() else 0

    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16) if self.is_available() else ()

    def dtype_warnings(self, dtype: torch.dtype) -> list[str]:
        if dtype == torch.float16:
            return ["fp16 on HPU needs Gaudi2 or later; Gaudi's native lower precision is bf16."]
        return []

    def memory(self, index: int | None = None) -> MemorySnapshot:
        if not self.is_available():
            return super().memory(index)
        hpu = self._module()
        # Habana's memory_reserved() reports the memory limit, not a cache size.
        return MemorySnapshot(
            source="habana_frameworks.torch.hpu memory statistics",
            used=hpu.memory_allocated(index),
            peak=hpu.max_memory_allocated(index),
            limit=hpu.memory_reserved(index),
        )

    def reset_peak_memory(self, index: int | None = None) -> bool:
        hpu = self._module() if self.is_available() else None
        if hpu is None or not hasattr(hpu, "reset_peak_memory_stats"):
            return False
        hpu.reset_peak_memory_stats(index)
        return True

    def capabilities(self) -> dict[str, object]:
        if not self.is_available():
            return {}
        hpu = self._module()
        return {"name": hpu.get_device_name(), "count": hpu.device_count(), "bf16": True}
