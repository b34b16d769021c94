"""Backends by device type, and turning what a user typed into an available device.

Example:
    >>> from mpnb.precision.backends import resolve_device, backend_for
    >>> resolve_device("cpu")
    device(type='cpu')
    >>> backend_for("cpu").label
    'CPU'
"""

from __future__ import annotations

import torch

from mpnb.errors import DeviceUnavailableError, InvalidChoiceError
from mpnb.precision.backends.base import Backend, MemorySnapshot, format_bytes
from mpnb.precision.backends.cpu import CpuBackend
from mpnb.precision.backends.cuda import CudaBackend
from mpnb.precision.backends.hpu import HpuBackend

__all__ = [
    "Backend",
    "MemorySnapshot",
    "format_bytes",
    "BACKENDS",
    "backend_for",
    "resolve_device",
    "available_device_types",
]

#: Every backend, in auto-detection order: the first available one is the default device.
BACKENDS: dict[str, Backend] = {"cuda": CudaBackend(), "hpu": HpuBackend(), "cpu": CpuBackend()}
_DEVICE_CHOICES = (*BACKENDS, "cuda:N", "hpu:N")


def available_device_types() -> list[str]:
    """Device types present on this machine, best first.

    Example:
        >>> available_device_types()[-1]
        'cpu'
    """
    return [name for name, backend in BACKENDS.items() if backend.is_available()]


def backend_for(device: str | torch.device) -> Backend:
    """The backend for a device or device type (``"cuda:1"`` -> the CUDA backend).

    Example:
        >>> backend_for("cuda:1").label, backend_for(torch.device("cpu")).type
        ('CUDA GPU', 'cpu')

    Raises:
        InvalidChoiceError: mpnb has no backend for that device type.
    """
    device_type = device.type if isinstance(device, torch.device) else _parse(device).type
    try:
        return BACKENDS[device_type]
    except KeyError:
        raise InvalidChoiceError("device", str(device), _DEVICE_CHOICES) from None


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """Turn ``device`` into a torch.device that is present here; None picks cuda > hpu > cpu.

    Example:
        >>> resolve_device(" CPU")
        device(type='cpu')
        >>> resolve_device("tpu")
        Traceback (most recent call last):
        ...
        mpnb.errors.InvalidChoiceError: unknown device 'tpu'; valid: cuda, hpu, cpu, cuda:N, hpu:N

    Raises:
        InvalidChoiceError: ``device`` is not a device name mpnb knows.
        DeviceUnavailableError: the device is not present, or its index is out of range.
    """
    if device is None:
        return torch.device(available_device_types()[0])
    parsed = device if isinstance(device, torch.device) else _parse(device)
    backend = backend_for(parsed)
    if not backend.is_available():
        raise DeviceUnavailableError(
            f"device {str(device)!r}: {backend.unavailable_reason()}", available_device_types()
        )
    if parsed.index is not None and parsed.index >= backend.device_count():
        raise DeviceUnavailableError(
            f"device {str(device)!r}: this machine has {backend.device_count()} {backend.label}(s)",
            available_device_types(),
        )
    return parsed


def _parse(device: str) -> torch.device:
    try:
        return torch.device(str(device).strip().lower())
    except (RuntimeError, ValueError):
        raise InvalidChoiceError("device", device, _DEVICE_CHOICES) from None
