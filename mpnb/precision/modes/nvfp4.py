"""Mode ``nvfp4``: torchao's NVFP4 training layers where a Blackwell GPU runs them; refused elsewhere.

NVFP4 stores each block of 16 values in 4 bits (e2m1: 0.5 to 6, fifteen values and zero) with an
fp8 (e4m3) scale per block and one fp32 scale per tensor. torchao's training layer
(``NVFP4Linear``) casts the operands of all three matmuls to it, with a random Hadamard
transform and stochastic rounding for the gradients, through triton kernels written for
Blackwell's FP4 tensor cores: it runs on CUDA GPUs of compute capability 10.0+ with triton, and
nowhere else (there is no emulated path to train with). Elsewhere the mode is refused with a
sentence that names the hardware and what runs here instead: mode ``mxfp8`` (emulated), and
``mpnb.whatif(model, batch)``, which measures what NVFP4 casts would do to each layer on any
machine.

The recipes that train in NVFP4 keep the LM head and the last blocks in bf16 (torchtitan's keeps
the last ~15% of its blocks): the last Linear layer is kept by default, name the blocks with
``keep``. Eligible layers have both dimensions multiples of 128 (torchao's kernels tile by 128;
the tokens of a batch must be a multiple of 128 too).

Example:
    >>> import torch
    >>> from mpnb.precision.modes import parse_mode
    >>> print(parse_mode("nvfp4").unavailable(torch.device("cpu")))  # doctest: +ELLIPSIS
    mode nvfp4 is not available on cpu: NVFP4 training needs an NVIDIA Blackwell GPU ... here mode mxfp8 trains (emulated), and mpnb.whatif(model, batch) measures what NVFP4 casts would do to each layer
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from mpnb.precision.backends import backend_for
from mpnb.precision.modes.layer_swap import (
    LayerSwap,
    LayerSwapMode,
    cuda_capability_refusal,
    import_torchao,
    keep_option,
    layer_names,
    torchao_missing,
)
from mpnb.precision.modes.matmul_format import (
    MatmulFormat,
    Threshold,
    blocked_cast,
    byte_table,
    largest_magnitude,
    read_bytes,
    rounding_limit,
)
from mpnb.precision.modes.registry import register

__all__: list[str] = []

#: FP4 tensor cores: Blackwell (compute capability 10.0 and newer).
NVFP4_CAPABILITY = (10, 0)
#: What runs on a machine without them.
ELSEWHERE = (
    "here mode mxfp8 trains (emulated), and mpnb.whatif(model, batch) measures what NVFP4 "
    "casts would do to each layer"
)


def nvfp4_refusal(device: torch.device) -> str:
    """Why torchao's NVFP4 training does not run on ``device``, with what runs instead (empty
    where it runs).

    Example:
        >>> nvfp4_refusal(torch.device("cpu"))  # doctest: +ELLIPSIS
        'NVFP4 training needs an NVIDIA Blackwell GPU (compute capability 10.0+, B200 or B300) with triton; this is a CPU'
    """
    needs = "NVFP4 training needs an NVIDIA Blackwell GPU (compute capability 10.0+, B200 or B300) with triton"
    backend = backend_for(device)
    if device.type != "cuda":
        return f"{needs}; this is a {backend.label}"
    refusal = cuda_capability_refusal(backend, NVFP4_CAPABILITY, "NVFP4 training")
    if refusal:
        return refusal
    if importlib.util.find_spec("triton") is None:
        return f"{needs}; triton is not installed (pip install triton)"
    return ""


class Nvfp4Layers(LayerSwap):
    """The eligible Linear layers of ``model`` swapped for torchao's ``NVFP4Linear``, undone
    exactly (:class:`~mpnb.precision.modes.layer_swap.LayerSwap`). The layer's random Hadamard
    signs and seed are buffers left out of the ``state_dict``, so a checkpoint saved in the mode
    loads into the plain model.

    Raises:
        MpnbError: on construction, where NVFP4 does not train (:func:`nvfp4_refusal`).

    Example:
        >>> Nvfp4Layers(torch.nn.Linear(128, 128), device="cpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mpnb.errors.MpnbError: mode nvfp4 is not available on cpu: NVFP4 training needs ...
    """

    mode = "nvfp4"
    layer_class = "NVFP4Linear"
    multiple_of = 128
    real_where = "FP4 tensor cores"
    instead = ELSEWHERE

    @classmethod
    def refusal(cls, device: torch.device) -> str:
        return nvfp4_refusal(device)

    @classmethod
    def emulated_on(cls, device: torch.device) -> bool:
        return False  # no emulated path: where it is not refused, it is real

    @classmethod
    def import_layers(cls) -> None:
        _training_module()

    def make_layer(self, linear: nn.Linear) -> nn.Module:
        layer = _training_module().NVFP4Linear.from_linear(linear)
        layer.weight, layer.bias = linear.weight, linear.bias
        for buffer in ("_sr_seed", "_rht_sign_vector"):  # the model's state_dict stays the same
            layer._non_persistent_buffers_set.add(buffer)
        layer.train(linear.training)
        return layer


def _training_module():
    return import_torchao("torchao.prototype.moe_training.nvfp4_training.nvfp4_training", "nvfp4")


#: NVFP4's block: 16 consecutive values share one e4m3 scale.
NVFP4_BLOCK = 16


def _nvfp4_quantize(
    padded: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """``padded`` (rows a multiple of the block long) through torchao's NVFP4 cast along its
    rows (e2m1 elements, an e4m3 scale a block, under one per-tensor scale; rounded to nearest):
    its elements times their block's e4m3 scale (exact in bf16), its block scales (the
    per-tensor scale included), e2m1's rounding limit, and the per-tensor scale as the factor."""
    formats = "torchao.prototype.mx_formats"
    nvfp4 = import_torchao(f"{formats}.nvfp4_tensor", "nvfp4")
    e2m1_largest = import_torchao(f"{formats}.constants", "nvfp4").F4_E2M1_MAX
    e2m1_bits = import_torchao(f"{formats}.mx_tensor", "nvfp4").MBITS_F4_E2M1
    amax = max(largest_magnitude(padded), _smallest_amax(e2m1_largest))
    per_tensor = nvfp4.per_tensor_amax_to_scale(torch.tensor(amax))
    cast = nvfp4.NVFP4Tensor.to_nvfp4(padded, per_tensor_scale=per_tensor)
    # read back as the cast's dequantize does (elements times their block's scale, times the
    # per-tensor scale: here the factor, applied to the product), a byte's two elements by
    # lookup (:func:`read_bytes`)
    elements = read_bytes(cast.qdata, _e2m1_pairs(padded.device))
    block_scales = cast.scale.to(elements.dtype).reshape(-1, 1)  # e4m3: exact in bf16
    values = (elements.reshape(-1, NVFP4_BLOCK) * block_scales).reshape(padded.shape)
    factor = cast.per_tensor_scale.float().reshape(())
    limit = rounding_limit(None, e2m1_largest, e2m1_bits)
    return values, cast.get_hp_scales(), limit, factor


def _smallest_amax(e2m1_largest: float) -> float:
    """The smallest tensor amax torchao's NVFP4 cast can scale by. It multiplies the values by
    (1 / per-tensor scale) / block scale, with a per-tensor scale of amax / (448 * 6) and block
    scales of at least e4m3's smallest normal: below ~5e-34 that factor is inf in float32 (and
    below ~4e-42 the per-tensor scale is 0: NaN), scrambling every value. A tinier tensor, or
    an all-zero one, is cast under this amax instead: its values rounded or flushed, as the
    format holds them (twice the bound: a margin for the float32 roundings on the way)."""
    e4m3 = torch.finfo(torch.float8_e4m3fn)
    return 2 * e4m3.max * e2m1_largest / (torch.finfo(torch.float32).max * e4m3.tiny)


@functools.cache
def _e2m1_pairs(device: torch.device) -> torch.Tensor:
    """The two e2m1 values of each packed byte, as torchao unpacks and decodes them, kept on
    ``device``."""
    kernels = import_torchao("torchao.prototype.mx_formats.kernels", "nvfp4")
    pairs = byte_table(lambda codes: kernels.f4_unpacked_to_f32(kernels.unpack_uint4(codes)))
    return pairs.to(device)


def nvfp4_layers(
    model: nn.Module, keep: Iterable[str] = (), device: str | torch.device | None = None
) -> Nvfp4Layers:
    """The eligible Linear layers of ``model`` in NVFP4 for a ``with`` block, where a Blackwell
    GPU runs them (see :func:`nvfp4_refusal`); the model is exactly as before afterwards."""
    return Nvfp4Layers(model, keep=keep, device=device)


@register
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Nvfp4(LayerSwapMode):
    """The eligible Linear layers' matmuls in NVFP4 (torchao's ``NVFP4Linear``,
    :class:`Nvfp4Layers`), everything else under bf16 autocast; Blackwell GPUs only.

    Example:
        >>> import torch
        >>> from mpnb.precision.modes import parse_mode
        >>> nvfp4 = parse_mode("nvfp4", keep=["blocks.10", "blocks.11"])
        >>> nvfp4.support(torch.device("cpu"))  # doctest: +ELLIPSIS
        'no: NVFP4 training needs an NVIDIA Blackwell GPU ...'
    """

    keep: tuple[str, ...] = keep_option()

    name = "nvfp4"
    aliases = ("fp4",)
    summary = (
        "eligible Linear layers' matmuls in NVFP4 (4-bit, 16-value blocks; torchao, Blackwell "
        "GPUs), the rest under bf16 autocast"
    )
    layers: ClassVar[type[LayerSwap]] = Nvfp4Layers
    layers_function = "mpnb.precision.modes.nvfp4.nvfp4_layers"
    #: NVFP4's products err by 0.09 to 0.14 and it flushes 5-7% of ordinary tensors' elements;
    #: its e4m3 block scales, rounded to nearest, saturate a few percent by up to 1/16 of a
    #: value: 10% of the elements before it counts
    matmul_formats = (
        MatmulFormat(
            "nvfp4",
            Threshold(rel_error=0.3, overflow=0.1, underflow=0.15),
            writes=torch.bfloat16,  # the mode's autocast
            unavailable=torchao_missing,
            scaled_cast=blocked_cast(_nvfp4_quantize, NVFP4_BLOCK),
            follows_axis=True,
        ),
    )
    framework_hint = (
        "ask for bf16 and convert the model's layers with torchao's NVFP4TrainingConfig "
        "(quantize_) before training"
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", layer_names(self.keep, "nvfp4"))
