"""Errors mpnb raises for bad input: each names the bad value and the valid ones; and
:func:`warn_user`, how mpnb warns about a run.

Example:
    >>> from mpnb.errors import InvalidChoiceError
    >>> str(InvalidChoiceError("mode", "fp4", ["fp32", "bf16"]))
    "unknown mode 'fp4'; valid: fp32, bf16"
"""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import os
import sys
import warnings
from collections.abc import Iterable

import numpy
import torch

__all__ = ["MpnbError", "InvalidChoiceError", "DeviceUnavailableError"]

#: Packages whose frames stand between a warning about a run and the user's code that started it.
_LIBRARIES = (
    "mpnb",
    "torch",
    "transformers",
    "accelerate",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
)


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn ``"mpnb: <message>"``, pointing at the first caller outside mpnb, torch and the
    training frameworks (the notebook cell or script that started training), so the warning
    names the user's line and a warnings filter on it works.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_user("loss is nan at step 3")
        >>> str(caught[0].message), caught[0].filename.endswith("errors.py")
        ('mpnb: loss is nan at step 3', False)
    """
    folders = tuple(
        os.path.dirname(module.__file__) + os.sep
        for name in _LIBRARIES
        if (module := sys.modules.get(name)) is not None and getattr(module, "__file__", None)
    )
    frame, level = sys._getframe(1), 2  # level 1 is this function
    while frame is not None and frame.f_code.co_filename.startswith(folders):
        frame, level = frame.f_back, level + 1
    warnings.warn(f"mpnb: {message}", category, stacklevel=level if frame is not None else 2)


#: How much of a bad value an error message quotes.
QUOTE_LIMIT = 100


def quoted(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to about ``limit`` characters with the full length said.

    Example:
        >>> quoted("fp8")
        "'fp8'"
        >>> quoted("x" * 1000, limit=10)
        "'xxxxxxxxxx...' (1000 characters)"
    """
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}"[:-1] + f"...' ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit + 2 else f"{text[:limit]}... ({len(text)} characters)"


class MpnbError(ValueError):
    """Base class of mpnb's input errors; the IPython layer shows these as UsageError.

    Example:
        >>> import mpnb
        >>> try:
        ...     mpnb.set_mode("int4")
        ... except MpnbError as error:
        ...     print(type(error).__name__, "-", error)
        InvalidChoiceError - unknown mode 'int4'; valid: ...
    """


class InvalidChoiceError(MpnbError):
    """A value that is not one of a fixed set of choices.

    Args:
        what: what the value is for ("mode", "dtype", ...).
        value: the value the user gave.
        valid: the values that would have been accepted.
        hint: an optional sentence that says what to do instead.

    Example:
        >>> error = InvalidChoiceError("dtype", "fp8", ["bf16", "fp16"], "For fp32, turn autocast off.")
        >>> str(error)
        "unknown dtype 'fp8'; valid: bf16, fp16. For fp32, turn autocast off."
        >>> error.value, error.valid, isinstance(error, MpnbError)
        ('fp8', ['bf16', 'fp16'], True)
    """

    def __init__(self, what: str, value: object, valid: Iterable[str], hint: str = "") -> None:
        self.what = what
        self.value = value
        self.valid = list(valid)
        message = f"unknown {what} {quoted(value)}; valid: {', '.join(self.valid)}"
        super().__init__(f"{message}. {hint}" if hint else message)


class DeviceUnavailableError(MpnbError):
    """A device (or a dtype on a device) that this machine cannot provide.

    Args:
        message: what was asked for and why it cannot be had.
        available: what this machine does have, listed after the message.

    Example:
        >>> str(DeviceUnavailableError("device 'cuda:3': this machine has 1 GPU(s)", ["cuda", "cpu"]))
        "device 'cuda:3': this machine has 1 GPU(s); available here: cuda, cpu"
    """

    def __init__(self, message: str, available: Iterable[str]) -> None:
        self.available = list(available)
        super().__init__(f"{message}; available here: {', '.join(self.available) or 'none'}")


def check_flag(name: str, value: object) -> None:
    """Refuse an option ``name`` that is not true or false: ``True``, ``False``, numpy's bools,
    or 0 and 1. A string such as ``"off"`` is truthy, and would turn on what it meant to turn off.

    Example:
        >>> check_flag("record_grad_norm", True)
        >>> check_flag("record_grad_norm", "no")
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: record_grad_norm must be True or False, got 'no'
    """
    if not is_flag(value):
        raise MpnbError(f"{name} must be True or False, got {quoted(value)}")


def is_flag(value: object) -> bool:
    """Whether ``value`` says true or false as :func:`check_flag` takes it.

    >>> is_flag(numpy.False_), is_flag(0), is_flag("off")
    (True, True, False)
    """
    return isinstance(value, (bool, numpy.bool_)) or (isinstance(value, int) and value in (0, 1))


def check_number(
    name: str,
    value: object,
    *,
    above: float = 0.0,
    below: float = math.inf,
    whole: bool = False,
    finite: bool = True,
    meaning: str = "",
) -> float | int:
    """``value`` as a plain Python number (what a file of plain data can hold), or an error for an
    option ``name`` that is not a number strictly between ``above`` and ``below``: a Python or
    numpy number or a one-element tensor, as torch takes; a whole number with ``whole``; a finite
    one unless ``finite`` is False (then ``below`` may be reached by inf). ``meaning`` says what
    the number is, in the message.

    Example:
        >>> check_number("init_scale", numpy.float32(1024))
        1024.0
        >>> check_number("clip_grad_norm", math.inf, finite=False)
        inf
        >>> check_number("growth_factor", 0.5, above=1.0, meaning="the loss scale's growth")
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: growth_factor must be a number above 1 (the loss scale's growth), got 0.5
        >>> check_number("flush_every", 2.5, whole=True)
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: flush_every must be a whole number above 0, got 2.5
    """
    number = plain_number(value, whole)
    valid = (
        number is not None
        and not math.isnan(number)
        and (math.isfinite(number) or not finite)
        and above < number
        and (number < below or (not finite and number == below == math.inf))
    )
    if not valid:
        kind = "whole number" if whole else "number"
        bounds = f"above {above:g}" + (f" and below {below:g}" if below < math.inf else "")
        said = f" ({meaning})" if meaning else ""
        raise MpnbError(f"{name} must be a {kind} {bounds}{said}, got {quoted(value)}")
    return number  # type: ignore[return-value]


def check_count(name: str, value: object, *, least: int = 1, meaning: str = "") -> int:
    """``value`` as a plain Python int, or an error for a count ``name`` that is not a whole
    number of at least ``least``: a Python or numpy integer or a one-element integer tensor
    (not a bool, nor a float even where it is whole). ``meaning`` says what is counted.

    Example:
        >>> check_count("epochs", numpy.int64(3)), check_count("warmup", 0, least=0)
        (3, 0)
        >>> check_count("accumulate", 2.0, meaning="micro-batches an optimizer step")
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: accumulate must be a whole number >= 1 (micro-batches an optimizer step), got 2.0
    """
    number = plain_number(value, whole=True)
    if number is None or number < least:
        said = f" ({meaning})" if meaning else ""
        raise MpnbError(f"{name} must be a whole number >= {least}{said}, got {quoted(value)}")
    return number  # type: ignore[return-value]


def plain_number(value: object, whole: bool = False) -> float | int | None:
    """``value`` as a plain Python int (``whole``) or float, or None where it is no such number
    (a bool, a string, a tensor of several elements, an int too large for a float)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        value = value.item()
    if isinstance(value, (bool, numpy.bool_)):
        return None
    try:
        if whole:
            return operator.index(value)  # type: ignore[arg-type]
        if isinstance(value, numbers.Real):
            return float(value)
    except (TypeError, OverflowError):
        return None
    return None


#: What a ``make_run`` is, as compare and a what-if's proof call it.
MAKE_RUN_USAGE = "make_run(mode) -> (trainer, data), a fresh run of that mode each call"


def check_function(name: str, value: object, usage: str, call: str) -> None:
    """Refuse an argument ``name`` that is no function of one argument (a list of modes, a
    trainer, a format's name where the function goes: the arguments swapped; a function of no
    parameter), saying what the function does (``usage``) and the order of the ``call``'s
    arguments.

    Example:
        >>> check_function("make_run", ["fp32", "bf16"], "make_run(mode) -> (trainer, data)",
        ...                "compare(make_run, modes, steps)")
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: make_run takes a function, make_run(mode) -> (trainer, data); got a list ['fp32', 'bf16']. The arguments go compare(make_run, modes, steps)
    """
    if not callable(value) or isinstance(value, type):
        raise MpnbError(
            f"{name} takes a function, {usage}; got a {type(value).__name__} "
            f"{quoted(value, limit=60)}. The arguments go {call}"
        )
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # a builtin: nothing to read
        return
    try:
        signature.bind(None)
    except TypeError:
        shown = getattr(value, "__name__", type(value).__name__)
        raise MpnbError(
            f"{name} takes a function, {usage}; {shown}{signature} cannot be called with "
            "one argument: give it one parameter"
        ) from None
