"""An op whose kernel refuses the autocast dtype on this machine, recognised in torch's error.

On a CPU without bf16 units oneDNN has no bf16 or fp16 LSTM: under autocast ``nn.LSTM`` stops
with oneDNN's bare "could not create a primitive descriptor for the LSTM forward propagation
primitive". Keeping that op in fp32 (the FP32 list) lets the rest of the model train in the
low dtype. :func:`refusal_error` turns torch's error into one that names the op and that fix.

Example:
    >>> import torch
    >>> error = RuntimeError("could not create a primitive descriptor for the LSTM forward "
    ...                      "propagation primitive. Run workload with ONEDNN_VERBOSE=all ...")
    >>> refused_op(error)
    'lstm'
    >>> print(refusal_error(error, torch.bfloat16))
    lstm cannot run in bf16 on this machine: oneDNN has no bf16 kernel for it here ... `%oplist add fp32 lstm` ...
    >>> refusal_error(error, None) is None  # autocast was off: not a dtype this remedies
    True
"""

from __future__ import annotations

import re

import torch

from mpnb.errors import MpnbError

__all__: list[str] = []

# oneDNN's primitive, as its error names it -> the op-list entry that runs it. Of oneDNN's
# recurrent primitives torch 2.13 reaches only LSTM (its GRU and RNN kernels are its own).
_PRIMITIVE_OPS = {"LSTM": "lstm"}

_REFUSAL = re.compile(
    r"could not create a primitive descriptor for the (?P<primitive>.+?) "
    r"(?:forward|backward) propagation primitive"
)

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class OpRefusedError(MpnbError):
    """An op whose kernel refused the autocast dtype on this machine; the remedy is the FP32 list.

    Attributes:
        op: the op-list entry (``"lstm"``).
        dtype: the autocast dtype it refused.
    """

    def __init__(self, op: str, dtype: torch.dtype) -> None:
        self.op, self.dtype = op, dtype
        name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
        super().__init__(
            f"{op} cannot run in {name} on this machine: oneDNN has no {name} kernel for it here "
            f"(a CPU without bf16 units). Keep {op} in fp32 and the rest of the model in {name}: "
            f"`%oplist add fp32 {op}` in a notebook, or "
            f'`mpnb.set_oplists(mpnb.OpLists.of(fp32=["{op}"]))` in Python.'
        )


def refused_op(error: BaseException) -> str | None:
    """The op-list entry whose kernel refused its inputs' dtype in ``error``, or None when
    ``error`` is something else."""
    if not isinstance(error, RuntimeError):
        return None
    match = _REFUSAL.search(str(error))
    return _PRIMITIVE_OPS.get(match["primitive"]) if match else None


def refusal_error(error: BaseException, dtype: torch.dtype | None) -> OpRefusedError | None:
    """The error to raise (``from error``) in place of ``error``, raised while autocast ran in
    ``dtype`` (None: autocast off); None when ``error`` is not an op refusing that dtype."""
    op = refused_op(error) if dtype is not None else None
    return OpRefusedError(op, dtype) if op is not None else None
