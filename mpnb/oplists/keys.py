"""Where torch.autocast's kernels live: one Autocast dispatch key per device type.

Example:
    >>> AUTOCAST_KEYS["cpu"]
    'AutocastCPU'
"""

from __future__ import annotations

__all__ = ["AUTOCAST_KEYS"]

#: Device type -> the dispatch key where torch.autocast's kernels live.
AUTOCAST_KEYS = {
    "cpu": "AutocastCPU",
    "cuda": "AutocastCUDA",
    "hpu": "AutocastHPU",
    "xpu": "AutocastXPU",
    "mps": "AutocastMPS",
}
