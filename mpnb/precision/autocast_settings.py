"""A validated request for torch.autocast, and the check that a device really autocasts to a dtype.

torch.autocast only warns, then runs in fp32, when a device cannot autocast to a dtype; mpnb
checks first so that the user gets an error naming what the device can do.

Example:
    >>> import torch
    >>> settings = AutocastSettings(torch.device("cpu"), torch.bfloat16)
    >>> settings.describe()
    'bf16 autocast on cpu (no cast cache)'
    >>> with settings.context():
    ...     torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype
    torch.bfloat16
"""

from __future__ import annotations

import dataclasses

import torch

from mpnb._render import dtype_name
from mpnb.errors import DeviceUnavailableError
from mpnb.oplists.keys import AUTOCAST_KEYS
from mpnb.precision.backends import Backend

__all__ = ["AutocastSettings"]


@dataclasses.dataclass(frozen=True)
class AutocastSettings:
    """A validated request for torch.autocast.

    Attributes:
        device: where autocast applies (its type is what torch.autocast takes).
        dtype: the lower-precision dtype, meaningful when ``enabled``.
        enabled: False runs the block with autocast explicitly off.
        cache: keep the cast copies of weights for the whole block. Off by default: a
            cached autocast block that spans optimizer steps keeps computing with the
            weights as they were at the first step, so training silently stops learning.

    Example:
        >>> settings = AutocastSettings(torch.device("cpu"), torch.bfloat16, enabled=False)
        >>> settings.describe()
        'autocast off on cpu'
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), settings.context():
        ...     torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype
        torch.float32
    """

    device: torch.device
    dtype: torch.dtype
    enabled: bool = True
    cache: bool = False

    def context(self) -> torch.autocast:
        """A fresh torch.autocast for these settings."""
        return torch.autocast(
            self.device.type, dtype=self.dtype, enabled=self.enabled, cache_enabled=self.cache
        )

    def describe(self) -> str:
        """``"bf16 autocast on cpu"`` or ``"autocast off on cpu"``."""
        if not self.enabled:
            return f"autocast off on {self.device}"
        return f"{dtype_name(self.dtype)} autocast on {self.device}{'' if self.cache else ' (no cast cache)'}"


def check_autocast_dtype(backend: Backend, device: torch.device, dtype: torch.dtype) -> None:
    """Raise unless torch.autocast on ``device`` really runs in ``dtype``.

    Raises:
        DeviceUnavailableError: the device cannot autocast to ``dtype``; names the dtypes it can.
    """
    supported = backend.autocast_dtypes()
    refusal = None if dtype in supported else "not among the device's autocast dtypes"
    refusal = refusal or backend.autocast_probe(dtype)
    if refusal:
        raise DeviceUnavailableError(
            f"{backend.label} ({device}) cannot autocast to {dtype_name(dtype)}: {refusal}",
            [dtype_name(d) for d in supported],
        )


@dataclasses.dataclass(frozen=True)
class ThreadAutocast:
    """The thread's autocast switches: enabled and dtype per device type, and the cast-cache flag.

    ``torch.autocast`` puts these back as it found them when its block ends; code that changes
    them for the rest of the thread (``mpnb.hmp.convert``) captures and restores them here.

    Example:
        >>> found = ThreadAutocast.capture()
        >>> torch.set_autocast_enabled("cpu", True)
        >>> found.restore()
        >>> torch.is_autocast_enabled("cpu")
        False
    """

    devices: tuple[tuple[str, bool, torch.dtype], ...]
    cache: bool

    @classmethod
    def capture(cls) -> ThreadAutocast:
        """The switches as they are now."""
        devices = tuple(
            (
                device_type,
                torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type),
            )
            for device_type in AUTOCAST_KEYS
        )
        return cls(devices, torch.is_autocast_cache_enabled())

    def restore(self) -> None:
        """Put every switch back as captured."""
        for device_type, enabled, dtype in self.devices:
            torch.set_autocast_dtype(device_type, dtype)
            torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_cache_enabled(self.cache)

    def with_device(
        self, device_type: str, *, enabled: bool, dtype: torch.dtype, cache: bool
    ) -> ThreadAutocast:
        """These switches with ``device_type`` set as given, and the cache flag."""
        devices = tuple(
            (name, enabled, dtype) if name == device_type else (name, on, kind)
            for name, on, kind in self.devices
        )
        return ThreadAutocast(devices, cache)
