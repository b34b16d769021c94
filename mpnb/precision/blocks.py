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


def _check_order(dtype: object, device: object) -> None:
    """Refuse a device given where the dtype goes (torch.autocast's order, device first),
    naming the call to write.

    >>> _check_order("bf16", "cpu"), _check_order(torch.bfloat16, None)
    (None, None)
    """
    if not isinstance(dtype, str):
        return
    try:
        torch.device(dtype)
    except (RuntimeError, ValueError):  # no device: a dtype's or a mode's name, checked later
        return
    if isinstance(device, torch.dtype):
        raise MpnbError(
            f"the dtype goes first: mpnb.autocast({device}, device={dtype!r}) (torch.autocast "
            "takes the device first)"
        )
    raise MpnbError(f"{dtype!r} is a device: mpnb.autocast(dtype, device={dtype!r})")


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
        device: ``"cpu"``, ``"cuda"``, ``"hpu"``... Default: the session device. The dtype
            goes first (torch.autocast's order is the other way round: a device given first is
            refused with the call to write); ``device_type=``, torch's keyword, is taken too.
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
        device_type: str | None = None,
    ) -> None:
        if device_type is not None:  # torch.autocast's name for it
            if device is not None:
                raise MpnbError("give device= or device_type=, not both: they name one thing")
            device = device_type
        _check_order(dtype, device)
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
