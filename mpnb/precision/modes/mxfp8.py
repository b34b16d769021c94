"""Mode ``mxfp8``: torchao's MXFP8 training layers, as a change to a model that is always undone.

MXFP8 (the OCP microscaling format) stores each block of 32 consecutive values in float8 e4m3
with one shared power-of-two scale (an e8m0 exponent) per block, instead of one scale for the
whole tensor as fp8's tensorwise recipe has it: a block of small values keeps its own scale, so
an outlier costs only its own 32 neighbours their resolution. Mode ``mxfp8`` (option ``keep``)
swaps a model's eligible ``nn.Linear`` layers for torchao's ``MXFP8Linear``, whose three
matmuls (the forward and both gradients) cast their operands to MXFP8, and runs everything
else under bf16 autocast.

Eligible: as for fp8 (:mod:`~mpnb.precision.modes.layer_swap`), with both dimensions multiples
of 32, the block; transformers' ``Conv1D`` layers (GPT-2's) too. The weight's gradient is
blocked along the rows of a batch (its tokens): a batch whose rows are not a multiple of 32 is
padded with rows of zeros, which change no block's scale and add nothing to any product. The swapped layer holds the very same ``Parameter`` objects; under autocast it
casts its input and weight to the autocast dtype first, as a bf16 Linear would (the master
weights stay fp32).

Where MXFP8 is real: CUDA GPUs of compute capability 10.0+ (Blackwell: B200, B300), with
torchao's kernels. Elsewhere torchao's emulation (``KernelPreference.EMULATED``: the same casts
in torch code, then a matmul in bf16) runs on any CUDA GPU and on a CPU: numerics only, no
speed-up. An H100 has no MX units, so there too it is emulated and said to be.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 64),
    ...                             torch.nn.Linear(64, 4))
    >>> weight = model[1].weight
    >>> with mx_layers(model, device="cpu") as layers:
    ...     type(model[1]).__name__, layers.converted, model[1].weight is weight
    ('MXFP8Linear', ['1'], True)
    >>> type(model[1]).__name__
    'Linear'
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from mpnb.precision.backends import backend_for
from mpnb.precision.modes.layer_swap import (
    LayerSwap,
    LayerSwapMode,
    cuda_capability_refusal,
    features,
    import_torchao,
    is_conv1d,
    keep_option,
    layer_names,
    torchao_missing,
)
from mpnb.precision.modes.matmul_format import (
    MatmulFormat,
    Threshold,
    blocked_cast,
    dtype_table,
    read_bytes,
    rounding_limit,
)
from mpnb.precision.modes.registry import register

__all__ = ["mx_layers"]

#: MX tensor cores: Blackwell (compute capability 10.0 and newer).
MX_CAPABILITY = (10, 0)
#: The MX block: 32 consecutive values share one e8m0 scale.
MX_BLOCK = 32


def mx_refusal(device: torch.device) -> str:
    """Why mpnb runs no MXFP8 training on ``device`` (empty where it runs, real or emulated).

    Example:
        >>> mx_refusal(torch.device("cpu"))
        ''
        >>> mx_refusal(torch.device("hpu"))
        'mpnb runs no MXFP8 training on a Habana Gaudi HPU (a CPU or an NVIDIA GPU runs it)'
    """
    backend = backend_for(device)
    if device.type == "cpu":
        return ""
    if device.type != "cuda":
        return f"mpnb runs no MXFP8 training on a {backend.label} (a CPU or an NVIDIA GPU runs it)"
    return cuda_capability_refusal(backend, (0, 0), "MXFP8 training")


@functools.cache
def _layer_type(transposed: bool = False) -> type[nn.Linear]:
    """torchao's ``MXFP8Linear``, taught to run under autocast: its input and weight cast to the
    autocast dtype first (torchao's layer multiplies the two as they come, and refuses a bf16
    input with an fp32 weight), as autocast does for a Linear layer. ``transposed``: in place of
    transformers' ``Conv1D``, whose weight is ``in x out``."""
    module = import_torchao("torchao.prototype.moe_training.mxfp8_linear", "mxfp8")

    class MXFP8Linear(module.MXFP8Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            weight = self.weight.t() if transposed else self.weight
            kind = input.device.type
            if torch.is_autocast_enabled(kind):
                dtype = torch.get_autocast_dtype(kind)
                input, weight = input.to(dtype), weight.to(dtype)
            elif input.dtype != weight.dtype:
                input = input.to(weight.dtype)
            rows = input.reshape(-1, input.shape[-1])
            short = -rows.shape[0] % MX_BLOCK  # the weight's gradient blocks run over the rows
            output = module._to_mxfp8_then_scaled_mm(  # torchao's casts take contiguous data
                nn.functional.pad(rows, (0, 0, 0, short)) if short else rows.contiguous(),
                weight.contiguous(),
                kernel_preference=self.kernel_preference,
                scale_calculation_mode=self.scale_calculation_mode,
                wgrad_with_hp=self.wgrad_with_hp,
            )
            output = output[: rows.shape[0]].reshape(*input.shape[:-1], output.shape[-1])
            if self.bias is not None:
                output = output + self.bias.to(output.dtype)
            return output

    return MXFP8Linear


#: Where e4m3 stops rounding to its largest value: a scaled value up to it rounds down to the
#: largest, beyond it the cast clips (saturates).
_E4M3_LIMIT = rounding_limit(torch.float8_e4m3fn)


def mx_cast_measures(tensor: torch.Tensor) -> list[torch.Tensor]:
    """What torchao's MXFP8 cast (``to_mx``: e4m3 elements, an e8m0 scale per 32 values along
    the last dimension, RCEIL rounding, as ``MXFP8Linear`` casts) does to ``tensor``: its largest
    magnitude, the share of its values that saturate (beyond e4m3's range once their block is
    scaled), the share of its nonzero values that flush to zero, and the range of its block
    scales in powers of two (the largest e8m0 exponent less the smallest, over blocks that hold
    a nonzero value). Four 0-d tensors on the tensor's device; nothing is read to the host.

    Example:
        >>> x = torch.ones(2, 64)
        >>> x[0, :32] = 1e4      # one block of large values: its own scale
        >>> x[1, 0] = 1e-12      # a value 1e-12 of its block's largest: flushed to zero
        >>> amax, saturated, flushed, octaves = mx_cast_measures(x)
        >>> float(amax), float(saturated), round(float(flushed), 4), float(octaves)
        (10000.0, 0.0, 0.0078, 13.0)
    """
    cast = import_torchao("torchao.prototype.mx_formats.mx_tensor", "mxfp8").to_mx
    rounding = import_torchao("torchao.prototype.mx_formats.config", "mxfp8").ScaleCalculationMode
    values = tensor.detach().float().nan_to_num(0.0, 0.0, 0.0)
    values = values.reshape(-1, values.shape[-1]).contiguous()
    scale, data = cast(values, torch.float8_e4m3fn, MX_BLOCK, rounding.RCEIL)
    exponents = scale.view(torch.uint8).float()  # e8m0: a biased power of two
    blocks = values.abs().reshape(*exponents.shape, MX_BLOCK)
    scaled = blocks / torch.exp2(exponents - 127).unsqueeze(-1)
    nonzero = (values != 0).float()
    saturated = (scaled > _E4M3_LIMIT).float().mean()
    flushed = ((data.float() == 0).float() * nonzero).sum() / nonzero.sum().clamp(min=1)
    used = blocks.amax(dim=-1) > 0
    lowest = torch.where(used, exponents, torch.full_like(exponents, 255.0)).amin()
    octaves = (torch.where(used, exponents, torch.zeros_like(exponents)).amax() - lowest).clamp(
        min=0
    )
    return [values.abs().amax(), saturated, flushed, octaves]


def _mxfp8_quantize(padded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, None]:
    """``padded`` (rows a multiple of the block long) through torchao's MXFP8 cast along its
    rows, with the layer's scale rounding (RCEIL: each block's scale rounded up, so no element
    saturates): its values read back (in bf16, exact: e4m3 times a power of two, unless a block
    scale is so small or large that the product leaves bf16's normal range: then float32), its
    block scales, e4m3's rounding limit, no factor."""
    mx = import_torchao("torchao.prototype.mx_formats.mx_tensor", "mxfp8")
    rounding = import_torchao("torchao.prototype.mx_formats.config", "mxfp8").ScaleCalculationMode
    cast = mx.MXTensor.to_mx(padded, torch.float8_e4m3fn, MX_BLOCK, rounding.RCEIL)
    scales = mx.get_fp_scale(cast.scale)
    # read back as the cast's dequantize does (elements times their block's scale), its
    # elements by lookup (:func:`read_bytes`)
    elements = read_bytes(cast.qdata, dtype_table(torch.float8_e4m3fn, padded.device))
    if not _bf16_safe(scales):  # an all-zero block's tiny scale is safe: its zeros are exact
        used = scales.reshape(-1)[elements.reshape(-1, MX_BLOCK).ne(0).any(dim=-1)]
        if not _bf16_safe(used):
            elements = elements.float()
    values = elements.reshape(-1, MX_BLOCK) * scales.to(elements.dtype).reshape(-1, 1)
    return values.reshape(padded.shape), scales, rounding_limit(torch.float8_e4m3fn), None


#: The block scales under which every e4m3 element times its scale is exact in bf16: no
#: smaller than 2**-117 (e4m3's smallest, 2**-9, times it stays normal in bf16), no larger
#: than 2**119 (448 times it stays finite).
_BF16_SAFE_SCALES = (2.0**-117, 2.0**119)


def _bf16_safe(scales: torch.Tensor) -> bool:
    """Whether every one of ``scales`` is in :data:`_BF16_SAFE_SCALES` (none: True), read from
    the scales alone (a block's scale to each 32 elements: a pass over the elements is needed
    only when some scale is outside)."""
    if not scales.numel():
        return True
    low, high = torch.aminmax(scales)
    return _BF16_SAFE_SCALES[0] <= float(low) <= float(high) <= _BF16_SAFE_SCALES[1]


class MxLayers(LayerSwap):
    """The eligible Linear layers of ``model`` swapped for torchao's ``MXFP8Linear``, undone
    exactly (:class:`~mpnb.precision.modes.layer_swap.LayerSwap`: which layers, the swap, the
    restore).

    Args:
        model: the model whose layers to convert.
        keep: names of Linear layers (or of modules containing them) to keep in high precision,
            besides the first and last Linear layers.
        device: where the model trains (default: the session device): decides real or emulated.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 48),
        ...                             torch.nn.Linear(48, 64), torch.nn.Linear(64, 64),
        ...                             torch.nn.Linear(64, 4))
        >>> layers = MxLayers(model, device="cpu")
        >>> layers.converted, layers.kept["1"]
        (['3'], '64x48 is not a multiple of 32')
        >>> print(layers.describe())
        mxfp8 (emulated: numerics only, no speed-up): 1 of 5 Linear layers
    """

    mode = "mxfp8"
    layer_class = "MXFP8Linear"
    multiple_of = MX_BLOCK
    real_where = "MX tensor cores"
    takes_conv1d = True

    @classmethod
    def refusal(cls, device: torch.device) -> str:
        return mx_refusal(device)

    @classmethod
    def emulated_on(cls, device: torch.device) -> bool:
        if device.type != "cuda" or not torch.cuda.is_available():
            return True
        return torch.cuda.get_device_capability() < MX_CAPABILITY

    @classmethod
    def import_layers(cls) -> None:
        _layer_type()

    @classmethod
    def cast_measures(
        cls, module: nn.Module, tensor: torch.Tensor, role: str
    ) -> list[torch.Tensor]:
        return mx_cast_measures(tensor)

    def make_layer(self, linear: nn.Module) -> nn.Module:
        kernels = import_torchao(
            "torchao.quantization.quantize_.common.kernel_preference", "mxfp8"
        ).KernelPreference
        transposed = is_conv1d(linear)
        inputs, outputs = features(linear)
        with torch.device("meta"):  # no weights of its own: it takes the original's
            layer = _layer_type(transposed)(
                inputs,
                outputs,
                bias=linear.bias is not None,
                kernel_preference=kernels.EMULATED if self.emulated else kernels.AUTO,
            )
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.train(linear.training)
        return layer


def mx_layers(
    model: nn.Module, keep: Iterable[str] = (), device: str | torch.device | None = None
) -> MxLayers:
    """The eligible Linear layers of ``model`` in MXFP8 for a ``with`` block (or until
    ``.restore()`` after ``.convert()``); the model is exactly as before afterwards.

    Run the forward pass under bf16 autocast (``mpnb.autocast("bf16")``, or ``%amp mxfp8``), as
    mode mxfp8 does. A ``Trainer`` in mode mxfp8 does all this for each fit.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 64),
        ...                             torch.nn.Linear(64, 4))
        >>> before = {k: v.clone() for k, v in model.state_dict().items()}
        >>> with mx_layers(model, device="cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        ...     model(torch.randn(8, 16)).shape
        torch.Size([8, 4])
        >>> all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        True

    Raises:
        MpnbError: torchao missing (``pip install 'mpnb[fp8]'``), a device that runs no MXFP8,
            an unknown kept name; nothing changes.
    """
    return MxLayers(model, keep=keep, device=device)


@register
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Mxfp8(LayerSwapMode):
    """The eligible Linear layers' matmuls in MXFP8 (torchao's ``MXFP8Linear``, :class:`MxLayers`),
    everything else under bf16 autocast; real on Blackwell GPUs, emulated elsewhere.

    Example:
        >>> import torch
        >>> from mpnb.precision.modes import parse_mode
        >>> mx = parse_mode("mxfp8", keep=["head"])
        >>> mx, mx.label, mx.autocast_dtype
        (Mode('mxfp8', keep=('head',)), 'mxfp8', torch.bfloat16)
        >>> mx.describe(torch.device("cpu"))
        'mxfp8 on cpu (emulated: numerics only, no speed-up)'
    """

    keep: tuple[str, ...] = keep_option()

    name = "mxfp8"
    aliases = ("mx", "mxfp8_e4m3")
    summary = (
        "eligible Linear layers' matmuls in MXFP8 (32-value blocks, one scale each; torchao), "
        "the rest under bf16 autocast"
    )
    layers: ClassVar[type[LayerSwap]] = MxLayers
    layers_function = "mpnb.mx_layers"
    #: MXFP8's products err by 4e-2 to 1e-1 on ordinary tensors; its scales, rounded up, leave
    #: no element past e4m3's largest value
    matmul_formats = (
        MatmulFormat(
            "mxfp8",
            Threshold(rel_error=0.15, overflow=0.0, underflow=0.01),
            writes=torch.bfloat16,  # the mode's autocast
            unavailable=torchao_missing,
            scaled_cast=blocked_cast(_mxfp8_quantize, MX_BLOCK),
            follows_axis=True,
        ),
    )
    framework_hint = (
        "ask for bf16 and convert the model's layers (run the training inside "
        "`with mpnb.mx_layers(model):`; Lightning: in configure_model)"
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", layer_names(self.keep, "mxfp8"))
