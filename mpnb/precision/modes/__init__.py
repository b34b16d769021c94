"""Precision modes: one class in one module each, registered once by name.

- :mod:`~mpnb.precision.modes.base`: :class:`Mode`, the base whose defaults do nothing, and
  :class:`Fp32Math`.
- :mod:`~mpnb.precision.modes.registry`: :func:`register`, :func:`parse_mode`, :func:`mode_names`.
- the modes, in the order the registry lists them: :mod:`~mpnb.precision.modes.off`,
  :mod:`~mpnb.precision.modes.fp32`, :mod:`~mpnb.precision.modes.tf32`,
  :mod:`~mpnb.precision.modes.fp16`, :mod:`~mpnb.precision.modes.bf16`,
  :mod:`~mpnb.precision.modes.fp8`, :mod:`~mpnb.precision.modes.mxfp8`,
  :mod:`~mpnb.precision.modes.nvfp4` (torchao's low-precision training layers: the fp8 extra;
  what they share in :mod:`~mpnb.precision.modes.layer_swap`).

A new mode is a new module here: a :class:`Mode` subclass that overrides what differs, and one
:func:`register` call. The Trainer, ``%amp``, the control panel, compare, the CLI and the
integrations then know it.

Example:
    >>> from mpnb.precision.modes import mode_names, parse_mode
    >>> mode_names()
    ('off', 'fp32', 'tf32', 'fp16', 'bf16', 'fp8', 'mxfp8', 'nvfp4')
    >>> parse_mode("bf16").summary
    'autocast to bfloat16; eligible ops run in bf16, the rest in fp32'
"""

# __all__ lists what users call; the helpers imported "as" themselves are for the rest of mpnb.
from mpnb.precision.modes.base import Mode
from mpnb.precision.modes.registry import chosen_mode as chosen_mode
from mpnb.precision.modes.registry import find_mode as find_mode
from mpnb.precision.modes.registry import mode_found_in as mode_found_in
from mpnb.precision.modes.registry import mode_names, parse_mode, register
from mpnb.precision.modes.registry import option_specs as option_specs
from mpnb.precision.modes.registry import reference_name as reference_name
from mpnb.precision.modes.registry import registered as registered
from mpnb.precision.modes.registry import unregister as unregister
from mpnb.precision.names import Fp32Math as Fp32Math

# The built-in modes register themselves on import, in this order.
from mpnb.precision.modes import off, fp32, tf32, fp16, bf16, fp8, mxfp8, nvfp4  # noqa: F401  isort: skip
from mpnb.precision.modes.registry import keep_registered

keep_registered()

__all__ = ["Mode", "parse_mode", "register", "mode_names"]
