"""Mode ``off``: mpnb changes nothing; torch's own defaults and the user's settings apply.

Example:
    >>> from mpnb.precision.modes import parse_mode
    >>> off = parse_mode("off")
    >>> off.autocast_dtype, off.fp32_math, off.lightning_precision
    (None, None, None)
"""

from __future__ import annotations

import dataclasses

from mpnb.precision.backends import Backend
from mpnb.precision.modes.base import Fp32Wishes, Mode
from mpnb.precision.modes.registry import register

__all__: list[str] = []


@register
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Off(Mode):
    """Autocast off and every fp32-math flag as mpnb found it: the session before mpnb."""

    name = "off"
    summary = "mpnb changes nothing: torch's own defaults and your settings apply"

    def apply_fp32_math(self, session: Fp32Wishes, backend: Backend) -> None:
        """The flags go back to what they were before mpnb changed them."""
        session.want_fp32_math(None, None)
