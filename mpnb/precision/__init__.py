"""Precision: the modes, the session policy that applies them, the fp32-math switch, and the backends.

- :mod:`~mpnb.precision.modes`: the modes (``off``, ``fp32``, ``tf32``, ``fp16``, ``bf16``, ``fp8``),
  one class in one module each, and their registry.
- :mod:`~mpnb.precision.names`: the names of autocast dtypes, and the fp32-math levels.
- :mod:`~mpnb.precision.policy`: the one :class:`Session` per process and the switches on it
  (:func:`set_mode`, the session's op lists).
- :mod:`~mpnb.precision.blocks`: switches for one block, :class:`autocast` and :class:`tf32`.
- :mod:`~mpnb.precision.fp32math`: torch's reduced-precision fp32 flags, changed and restored exactly.
- :mod:`~mpnb.precision.backends`: what each device type (cpu, cuda, hpu) can do and reports.
- :mod:`~mpnb.precision.status`: the session status and the device capability report.
- :mod:`~mpnb.precision.hmp`: Habana's ``hmp`` API, ported onto the session policy.

Example:
    >>> from mpnb.precision import Mode, autocast
    >>> import torch
    >>> with autocast("bf16", device="cpu"):
    ...     torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype
    torch.bfloat16
    >>> from mpnb.precision.modes import parse_mode
    >>> parse_mode("fp16").autocast_dtype
    torch.float16
"""

from mpnb.precision.autocast_settings import AutocastSettings
from mpnb.precision.blocks import autocast, tf32
from mpnb.precision.modes import Mode
from mpnb.precision.names import Fp32Math
from mpnb.precision.policy import (
    Session,
    get_mode,
    get_oplists,
    set_mode,
    set_oplists,
)
from mpnb.precision.status import DeviceReport, Status, devices

__all__ = [
    "Mode",
    "Fp32Math",
    "Session",
    "AutocastSettings",
    "autocast",
    "tf32",
    "set_mode",
    "get_mode",
    "set_oplists",
    "get_oplists",
    "Status",
    "DeviceReport",
    "devices",
]
