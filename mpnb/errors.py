"""Errors mpnb raises for bad input: each names the bad value and the valid ones.

Example:
    >>> from mpnb.errors import InvalidChoiceError
    >>> str(InvalidChoiceError("mode", "fp8", ["fp32", "bf16"]))
    "unknown mode 'fp8'; valid: fp32, bf16"
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MpnbError", "InvalidChoiceError", "DeviceUnavailableError"]


class MpnbError(ValueError):
    """Base class of mpnb's input errors; the IPython layer shows these as UsageError."""


class InvalidChoiceError(MpnbError):
    """A value that is not one of a fixed set of choices.

    Args:
        what: what the value is for ("mode", "dtype", ...).
        value: the value the user gave.
        valid: the values that would have been accepted.
        hint: an optional sentence that says what to do instead.
    """

    def __init__(self, what: str, value: object, valid: Iterable[str], hint: str = "") -> None:
        self.what = what
        self.value = value
        self.valid = list(valid)
        message = f"unknown {what} {value!r}; valid: {', '.join(self.valid)}"
        super().__init__(f"{message}. {hint}" if hint else message)


class DeviceUnavailableError(MpnbError):
    """A device (or a dtype on a device) that this machine cannot provide.

    Args:
        message: what was asked for and why it cannot be had.
        available: what this machine does have, listed after the message.
    """

    def __init__(self, message: str, available: Iterable[str]) -> None:
        self.available = list(available)
        super().__init__(f"{message}; available here: {', '.join(self.available) or 'none'}")
