"""fp16's limits and the one "underflow share": the vocabulary the watch and the advisor share.

Each limit is read from ``torch.finfo(torch.float16)`` and named for what it is (torch's names in
brackets): the largest finite value (``max``), the smallest normal magnitude
(``smallest_normal``, also ``tiny``) and the smallest subnormal magnitude (``2**-24``, fp16's
smallest step, for which torch has no name).

Which figure uses which: an overflow and a headroom are measured against the largest finite
value; the underflow share against the smallest subnormal, below which fp16 cannot hold a value
at all (under half of it, a value becomes zero). Between the smallest subnormal and the smallest
normal fp16 still holds a value, with fewer significant bits: a loss of precision, not an
underflow, and no figure of mpnb counts it.

Example:
    >>> FP16_LARGEST_FINITE, FP16_SMALLEST_NORMAL == 2.0**-14, FP16_SMALLEST_SUBNORMAL == 2.0**-24
    (65504.0, True, True)
    >>> float(underflow_share(torch.tensor([0.0, 1e-9, 1e-3, 1.0])))  # 1e-9 of three nonzero values
    0.3333333432674408
"""

from __future__ import annotations

import torch

__all__: list[str] = []

_FP16 = torch.finfo(torch.float16)
#: fp16's largest finite value (``finfo.max``, 65504): anything larger overflows to inf.
FP16_LARGEST_FINITE = float(_FP16.max)
#: fp16's smallest normal magnitude (``finfo.smallest_normal``, 2**-14): below it, fewer bits.
FP16_SMALLEST_NORMAL = float(_FP16.smallest_normal)
#: fp16's smallest subnormal magnitude (2**-24, its last mantissa bit under the smallest normal):
#: below it fp16 holds nothing (under half of it, zero).
FP16_SMALLEST_SUBNORMAL = float(_FP16.smallest_normal) * float(_FP16.eps)


def underflow_counts(magnitude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lost, nonzero)`` of a tensor of magnitudes: how many nonzero values lie below fp16's
    smallest subnormal (:data:`FP16_SMALLEST_SUBNORMAL`), the values fp16 would lose, and how
    many are nonzero (inf and NaN count as nonzero values that did not underflow). Two counts on
    the device, nothing read back; the one definition :func:`underflow_share` and the numerics
    watch both use.

    >>> lost, nonzero = underflow_counts(torch.tensor([0.0, 1e-9, 1e-3, float("nan")]))
    >>> int(lost), int(nonzero)
    (1, 3)
    """
    nonzero = torch.count_nonzero(magnitude)
    below = torch.count_nonzero(magnitude < FP16_SMALLEST_SUBNORMAL)  # the zeros among them
    return below - (magnitude.numel() - nonzero), nonzero


def underflow_share(values: torch.Tensor) -> torch.Tensor:
    """Of the nonzero values of ``values``, the share whose magnitude is below fp16's smallest
    subnormal (:data:`FP16_SMALLEST_SUBNORMAL`): the values fp16 would lose. Zeros are left out
    (fp16 holds them exactly); inf and NaN count as nonzero values that did not underflow. 0 when
    no value is nonzero.

    Computed on the device, as a 0-dim float32 tensor: nothing is read back to the host.

    >>> float(underflow_share(torch.zeros(3)))
    0.0
    """
    lost, nonzero = underflow_counts(values.detach().abs().float())
    return lost.float() / nonzero.clamp_min(1).float()
