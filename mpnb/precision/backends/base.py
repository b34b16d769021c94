"""What every backend answers: availability, autocast dtypes, memory, fp32 math, capabilities.

The base class holds the answers of a device mpnb knows nothing special about; each
backend overrides only what differs (the shape of Lightning's precision plugins).

Example:
    >>> from mpnb.precision.backends import backend_for
    >>> backend_for("cpu").autocast_dtypes()
    (torch.bfloat16, torch.float16)
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from mpnb.precision.names import Fp32Math

__all__ = ["Backend", "MemorySnapshot", "format_bytes"]


def format_bytes(size: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None or NaN (a device that reports nothing) -> ``"-"``.

    Example:
        >>> format_bytes(1536), format_bytes(float("nan"))
        ('1.5 KiB', '-')
    """
    if size is None or not math.isfinite(size):
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class MemorySnapshot:
    """Memory in use on a device, in bytes; a field the device cannot report is None.

    Attributes:
        source: where the numbers come from, in words.
        used: bytes in use now (tensors on an accelerator, the process RSS on CPU).
        peak: the most bytes in use so far.
        reserved: bytes held by the allocator's cache.
        limit: bytes the device lets this process use at most.

    Example:
        >>> snapshot = MemorySnapshot("torch's allocator", used=1536, peak=2048)
        >>> print(snapshot)
        used 1.5 KiB, peak 2.0 KiB (torch's allocator)
        >>> snapshot.fields()["limit"] is None
        True
    """

    source: str
    used: int | None = None
    peak: int | None = None
    reserved: int | None = None
    limit: int | None = None

    def __str__(self) -> str:
        parts = [
            f"{name} {format_bytes(value)}"
            for name, value in self.fields().items()
            if value is not None
        ]
        return f"{', '.join(parts)} ({self.source})"

    def fields(self) -> dict[str, int | None]:
        """The numeric fields by name."""
        return {
            "used": self.used,
            "peak": self.peak,
            "reserved": self.reserved,
            "limit": self.limit,
        }


class Backend:
    """A device type as mpnb sees it. Defaults describe a device with no special support.

    Example:
        >>> class ToyBackend(Backend):
        ...     type, label = "toy", "toy accelerator"
        >>> toy = ToyBackend()
        >>> toy.is_available(), toy.unavailable_reason(), toy.preferred_dtype()
        (False, 'no toy accelerator on this machine', torch.bfloat16)
    """

    type: str = "?"
    label: str = "unknown device"

    def is_available(self) -> bool:
        """Whether this machine has the device."""
        return False

    def unavailable_reason(self) -> str:
        """Why the device is missing, in a sentence."""
        return f"no {self.label} on this machine"

    def device_count(self) -> int:
        """How many devices of this type there are."""
        return 1 if self.is_available() else 0

    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes torch.autocast really lowers to on this device (it silently gives up on others)."""
        return ()

    def preferred_dtype(self) -> torch.dtype:
        """The autocast dtype to use when the user names none."""
        dtypes = self.autocast_dtypes()
        return torch.bfloat16 if torch.bfloat16 in dtypes or not dtypes else dtypes[0]

    def dtype_warnings(self, dtype: torch.dtype) -> list[str]:
        """Advice about autocasting to ``dtype`` on this device (slow paths, missing units)."""
        return []

    def emulated(self, dtype: torch.dtype) -> str | None:
        """Why this device has no units for ``dtype``, which it then emulates (slower than fp32,
        never faster), in a phrase; None where it computes in ``dtype`` natively."""
        return None

    def memory(self, index: int | None = None) -> MemorySnapshot:
        """Memory in use on the device."""
        return MemorySnapshot(source=f"{self.label} reports no memory statistics")

    def reset_peak_memory(self, index: int | None = None) -> bool:
        """Start a new peak: ``memory().peak`` counts from now. False if this device cannot."""
        return False

    def release_cached_memory(self) -> None:
        """Give memory the allocator keeps cached back to the device (between measurements)."""

    def capabilities(self) -> dict[str, object]:
        """What the hardware offers for mixed precision, by name."""
        return {}

    def has_fast_fp32_math(self) -> bool:
        """Whether reduced-precision fp32 math really changes anything on this hardware (measured)."""
        return False

    def describe_reduced_fp32_math(self) -> str:
        """What switching reduced-precision fp32 math on does here: its effect, or ``"no effect
        on this hardware"``. The words of the device report, the panel and compare's tf32 row."""
        if self.has_fast_fp32_math():
            return "faster fp32 matmuls and convolutions, about 3 significant digits"
        return "no effect on this hardware: fp32 stays exact"

    def apply_fp32_math(self, level: Fp32Math, legacy: bool = True) -> None:
        """Set this device's fp32-math flags to ``level``. Devices without a switch change nothing.

        Args:
            level: exact or reduced.
            legacy: use torch's legacy setters (they keep every getter readable); False
                uses only the fine-grained ``fp32_precision`` API, for when the user's own
                settings already mix the two.
        """

    def describe_fp32_math(self) -> str:
        """The current fp32-math state, in words a student understands."""
        return f"mpnb has no reduced-precision fp32 math switch for {self.label}; fp32 ops run as fp32."

    def autocast_probe(self, dtype: torch.dtype) -> str | None:
        """Enter torch.autocast for ``dtype`` and report why torch refused it, or None if it took.

        torch only warns and disables autocast for a dtype or device it cannot serve; this
        turns that silent fallback into an answer.
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autocast(self.type, dtype=dtype):
                    enabled = torch.is_autocast_enabled(self.type)
            except (RuntimeError, ValueError) as error:
                return str(error)
        if enabled:
            return None
        messages = [str(w.message).splitlines()[0] for w in caught]
        return "; ".join(messages) or "torch disabled autocast"
