"""Switches for one block of code: :class:`autocast` (a checked torch.autocast, with per-block op
lists) and :class:`tf32` (reduced-precision fp32 math, for a block or for the session).

Both restore exactly what they found when the block ends, errors and interrupts included.
They act through the one :class:`~mpnb.precision.policy.Session`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from mpnb.errors import MpnbError, check_flag
from mpnb.oplists.lists import OpLists
from mpnb.oplists.override import OpListOverride
from mpnb.precision.autocast_settings import AutocastSettings
from mpnb.precision.policy import session

__all__ = ["autocast", "tf32"]


class autocast:  # noqa: N801 - named and used like torch.autocast
    """Run a block under torch.autocast, validated first and restored exactly after.

    Unlike torch.autocast, a dtype or device that cannot work raises a clear error
    instead of warning and silently running in fp32.

    Args:
        dtype: ``"bf16"`` / ``"fp16"`` (or aliases, or a torch dtype). Default: inside an
            autocast already (a fit's, an outer block's), its dtype; else the session mode's:
            its dtype, autocast off in a mode that runs without it (fp32, tf32), the device's
            preferred dtype where no mode is chosen (mode off). A fit's mode stands in for
            the session's while it runs (:meth:`Session.running <mpnb.precision.policy.Session.running>`).
        device: ``"cpu"``, ``"cuda"``, ``"hpu"``... Default: the session device.
        enabled: False runs the block with autocast off.
        cache: keep cast weight copies for the whole block (see AutocastSettings).
        fp32: ops to run in fp32 in this block (they win over the session's op lists).
        lower: ops to run in the autocast dtype in this block (likewise).

    Example:
        >>> with autocast("bf16", device="cpu"):
        ...     torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype
        torch.bfloat16
        >>> with autocast("bf16", device="cpu", fp32=["linear"]):
        ...     torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype
        torch.float32
    """

    def __init__(
        self,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        *,
        enabled: bool = True,
        cache: bool = False,
        fp32: Iterable[str] = (),
        lower: Iterable[str] = (),
    ) -> None:
        by_mode = False
        if dtype is None and enabled:
            kind = session.autocast_settings(None, device, enabled=False).device.type
            if torch.is_autocast_enabled(kind):  # inside a fit's or a block's: what runs there
                dtype = torch.get_autocast_dtype(kind)
            else:
                by_mode = session.mode_in_force.runs_without_autocast
        enabled = enabled and not by_mode
        self.settings = session.autocast_settings(dtype, device, enabled=enabled, cache=cache)
        self.oplists = OpLists.of(lower, fp32, source="this block")
        if self.oplists and not enabled:
            why = f"mode {session.mode_in_force.name} runs without it (give a dtype)"
            raise MpnbError(
                "op lists act only under autocast; this block has autocast off: "
                f"{why if by_mode else 'drop the lists or --off'}"
            )
        self._scopes: list[contextlib.ExitStack] = []

    def __enter__(self) -> AutocastSettings:
        with contextlib.ExitStack() as scope:
            scope.enter_context(self.settings.context())
            if self.oplists:
                scope.enter_context(OpListOverride(self.oplists, [self.settings.device.type]))
            self._scopes.append(scope.pop_all())
        return self.settings

    def __exit__(self, *exc_info: object) -> None:
        self._scopes.pop().__exit__(*exc_info)

    def __repr__(self) -> str:
        return f"mpnb.autocast({self.settings.describe()})"


class tf32:  # noqa: N801 - a switch that is also a context manager, like torch.set_grad_enabled
    """Turn reduced-precision fp32 math (TF32 on GPUs, bf16 math on CPUs) on or off.

    Called, it switches for the session. Used with ``with``, it switches for the block
    and then restores the mode and every flag exactly, on errors and interrupts too.

    Args:
        enabled: True for reduced-precision math; False to restore the flags.
        device: the device whose flags to set; default the session device.

    Example:
        >>> with tf32(True, device="cpu"):
        ...     torch.get_float32_matmul_precision()
        'medium'
        >>> torch.get_float32_matmul_precision()
        'highest'
    """

    def __init__(self, enabled: bool = True, device: str | torch.device | None = None) -> None:
        check_flag("tf32", enabled)  # a string "off" is truthy
        self._previous = session.snapshot()
        session.set_tf32(enabled, device)

    def __enter__(self) -> tf32:
        return self

    def __exit__(self, *exc_info: object) -> None:
        session.restore(self._previous)
