"""Per-op precision lists: which ops always run in the autocast dtype and which always in fp32.

- :mod:`~mpnb.oplists.lists`: :class:`OpLists` (two lists with provenance), presets, op names.
- :mod:`~mpnb.oplists.override`: :class:`OpListOverride`, kernels on torch's Autocast dispatch keys.
- :mod:`~mpnb.oplists.session_lists`: the session's lists, replaced atomically, exported for Gaudi.
- :mod:`~mpnb.oplists.torch_rules`: torch's own autocast rules, read from the installed torch.
- :mod:`~mpnb.oplists.trace`: which op ran in which dtype, in which module (``mpnb.trace``).

This package is mechanism only: it imports torch and :mod:`mpnb.errors`, never the session
policy (:mod:`mpnb.precision.policy` owns the session's lists and imports this package).

Example:
    >>> from mpnb.oplists import OpListOverride, OpLists
    >>> import torch
    >>> with OpListOverride(OpLists.of(fp32=["linear"])), torch.autocast("cpu", dtype=torch.bfloat16):
    ...     torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype
    torch.float32
"""

from mpnb.oplists.keys import AUTOCAST_KEYS
from mpnb.oplists.lists import (
    LIST_NAMES,
    PRESETS,
    OpLists,
    aten_overloads,
    canonical_name,
    check_op,
    read_op_file,
)
from mpnb.oplists.override import OpListOverride
from mpnb.oplists.session_lists import SessionOpLists
from mpnb.oplists.torch_rules import AutocastRules, autocast_rules
from mpnb.oplists.trace import Trace, TraceRow

__all__ = [
    "OpLists",
    "PRESETS",
    "LIST_NAMES",
    "aten_overloads",
    "canonical_name",
    "check_op",
    "read_op_file",
    "OpListOverride",
    "AUTOCAST_KEYS",
    "SessionOpLists",
    "AutocastRules",
    "autocast_rules",
    "Trace",
    "TraceRow",
]
