"""An op whose kernel refuses the autocast dtype on this machine, recognised in torch's error.

Under CPU autocast torch runs ``nn.LSTM`` with oneDNN, and oneDNN builds a kernel in a reduced
dtype only where the CPU has the units it asks for that dtype (AVX-512 for bf16, AVX512-FP16 for
fp16, or AVX2-VNNI-2 for either); elsewhere the LSTM stops with oneDNN's bare "could not create a
primitive descriptor for the LSTM forward propagation primitive". An AVX512-BF16 CPU without
AVX512-FP16 thus trains the LSTM in bf16 and refuses it in fp16. :func:`refusal_error` turns
torch's error into one that names the op, the reason as read from this CPU (its units, and
whether the other dtype runs the op here), and the fix: keeping that op in fp32 (the FP32 list)
lets the rest of the model train in the low dtype.

Example:
    >>> import torch
    >>> error = RuntimeError("could not create a primitive descriptor for the LSTM forward "
    ...                      "propagation primitive. Run workload with ONEDNN_VERBOSE=all ...")
    >>> refused_op(error)
    'lstm'
    >>> print(refusal_error(error, torch.float16))
    lstm cannot run in fp16 under autocast on this CPU: ... `%oplist add fp32 lstm` ...
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
_OTHER = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}

# What oneDNN asks of an x86 CPU before it builds a kernel in a reduced dtype (its
# platform::has_data_type_support; "unsupported datatype" in ONEDNN_VERBOSE otherwise): the units
# by name, each as the flags torch.cpu.get_capabilities() reports for it.
_ONEDNN_UNITS = {
    torch.bfloat16: ("AVX-512", ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq")),
    torch.float16: ("AVX512-FP16", ("avx512_fp16",)),
}
_EITHER_DTYPE = ("AVX2-VNNI-2", ("avx_vnni", "avx_vnni_int8", "avx_ne_convert"))


class OpRefusedError(MpnbError):
    """An op whose kernel refused the autocast dtype on this machine; the remedy is the FP32 list.

    Attributes:
        op: the op-list entry (``"lstm"``).
        dtype: the autocast dtype it refused.
        reason: why, as read from this machine when it refused.
    """

    def __init__(self, op: str, dtype: torch.dtype, reason: str) -> None:
        self.op, self.dtype, self.reason = op, dtype, reason
        name = _name(dtype)
        super().__init__(
            f"{op} cannot run in {name} under autocast on this CPU: {reason}. Keep {op} in fp32 "
            f"and the rest of the model in {name}: `%oplist add fp32 {op}` in a notebook, or "
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
    return OpRefusedError(op, dtype, _reason(dtype)) if op is not None else None


def _name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _reason(dtype: torch.dtype) -> str:
    """Why oneDNN refused ``dtype``, from this CPU's units and from an LSTM run in the other
    reduced dtype (measured now, on the error's path only)."""
    units = dict(torch.cpu.get_capabilities())
    cpu = units.get("cpu_name", "unknown")
    needed = _ONEDNN_UNITS.get(dtype)
    if needed is None:
        said = f"oneDNN, which torch runs it with, refused {_name(dtype)}"
    else:
        has = [unit for unit, flags in (needed, _EITHER_DTYPE) if all(units.get(f) for f in flags)]
        said = (
            f"oneDNN, which torch runs it with, builds {_name(dtype)} kernels only on "
            f"{needed[0]} or {_EITHER_DTYPE[0]}, and this CPU ({cpu}) "
        )
        said += (
            f"has {has[0]}, yet refused it (ONEDNN_VERBOSE=all says why)" if has else "has neither"
        )
    other = _OTHER.get(dtype)
    if other is not None and _lstm_runs_in(other):
        said += f"; {_name(other)} autocast runs it here (mode='{_name(other)}')"
    return said


def _lstm_runs_in(dtype: torch.dtype) -> bool:
    """Whether a one-step LSTM runs under CPU autocast in ``dtype`` here (zero weights: no draw
    from torch's random state)."""
    x, state = torch.zeros(1, 1, 2), torch.zeros(1, 1, 2)
    weights = [torch.zeros(8, 2), torch.zeros(8, 2), torch.zeros(8), torch.zeros(8)]
    try:
        with torch.autocast("cpu", dtype=dtype):
            torch.lstm(x, (state, state), weights, True, 1, 0.0, True, False, False)
    except RuntimeError:
        return False
    return True
