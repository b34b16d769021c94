"""Mode ``fp8``: torchao's float8 training, as a change to a model that is always undone.

Mode ``fp8`` (:class:`Fp8`, options ``recipe`` and ``keep``) runs the matmuls of a model's eligible ``nn.Linear`` layers in float8 with
torchao's float8 training (``convert_to_float8_training`` with a ``Float8LinearConfig`` recipe:
``tensorwise``, ``rowwise`` or ``rowwise_with_gw_hp``) and everything else under bf16 autocast.
Eligible, as Accelerate's default has it: both dimensions divisible by 16 (fp8 matmul kernels
need it), not the model's first or last Linear layer (embedding-side and output layers lose the
most in fp8), not a layer the user names, and not one its parent calls by weight (a
``MultiheadAttention``'s ``out_proj``).

Converting replaces each eligible layer by torchao's ``Float8Linear`` holding the very same
``Parameter`` objects. :class:`Fp8Layers` records what it replaced and puts every original
module object back on :meth:`~Fp8Layers.restore` (its hooks and attributes with it), on any
exit of its ``with`` block: the ``state_dict`` keys and values never change, so a checkpoint
saved in fp8 loads into the plain model and back.

With FSDP2 (``Trainer(strategy="fsdp")``) the layers are converted before the model is sharded,
with torchao's float8 all-gather for the tensorwise recipe (``all_gather=True``): each float8
weight is wrapped in torchao's ``WeightWithDynamicFloat8CastTensor`` (a new ``Parameter`` over the
same storage), which FSDP gathers in float8; :func:`precompute_fsdp_scales` refreshes their
scales in one all-reduce after each optimizer step. Sharding replaces every parameter for good,
so a sharded model keeps its float8 layers: :meth:`Fp8Layers.restore` is for models not sharded.

Where fp8 is real: CUDA GPUs of compute capability 8.9+ (``torch._scaled_mm``), NVIDIA's only
(not ROCm builds). On a CPU torchao emulates the fp8 casts and multiplies in fp32: numerics only,
no speed-up (emulation is slower than fp32). Elsewhere the mode is refused with the reason
(:func:`fp8_hardware`).

This is the one module of mpnb that knows torchao's float8 API; the numerics watch asks it what
a float8 layer's casts do (:func:`fp8_cast_measures`).

torchao is an optional extra (``pip install 'mpnb[fp8]'``); ``import mpnb`` does not import it.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
    ...                             torch.nn.Linear(32, 4))
    >>> weight = model[1].weight
    >>> with fp8_layers(model, device="cpu") as layers:
    ...     type(model[1]).__name__, layers.converted, model[1].weight is weight
    ('Float8Linear', ['1'], True)
    >>> type(model[1]).__name__
    'Linear'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import nn

from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.precision.backends import Backend, backend_for
from mpnb.precision.modes.base import option
from mpnb.precision.modes.layer_swap import (
    LayerSwap,
    LayerSwapMode,
    cuda_capability_refusal,
    import_torchao,
    is_torchao_layer,
    keep_option,
    layer_names,
    torchao_missing,
)
from mpnb.precision.modes.matmul_format import (
    MatmulFormat,
    Threshold,
    count_past,
    dtype_table,
    read_bytes,
    rounding_limit,
    scale_range,
)
from mpnb.precision.modes.registry import register

__all__ = ["Fp8Layers", "fp8_layers"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: fp8 tensor cores (torch._scaled_mm): Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x).
FP8_CAPABILITY = (8, 9)
#: e4m3's largest finite value and smallest subnormal: what saturates and what flushes to zero.
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
E4M3_SMALLEST = 2.0**-9
#: The same for e5m2, the format of the gradients (torchao's ``grad_output`` cast).
E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)
E5M2_SMALLEST = 2.0**-16
#: Per role: (largest, smallest subnormal, the rounding limit: a value up to it rounds down to
#: the largest, beyond it the cast clips).
_FORMATS = {
    "input": (E4M3_MAX, E4M3_SMALLEST, rounding_limit(torch.float8_e4m3fn)),
    "weight": (E4M3_MAX, E4M3_SMALLEST, rounding_limit(torch.float8_e4m3fn)),
    "grad_output": (E5M2_MAX, E5M2_SMALLEST, rounding_limit(torch.float8_e5m2)),
}


def import_float8() -> ModuleType:
    """torchao's ``float8`` package, imported on first use.

    Raises:
        MpnbError: torchao is not installed (the message names the install command).
    """
    return import_torchao("torchao.float8", "fp8")


def check_recipe(recipe: str) -> str:
    """``recipe`` as torchao names it.

    Raises:
        InvalidChoiceError: not one of :data:`RECIPES`.
    """
    name = str(recipe).strip().lower()
    if name not in RECIPES:
        raise InvalidChoiceError("fp8 recipe", recipe, RECIPES)
    return name


def fp8_refusal_for(capability: tuple[int, int], name: str) -> str:
    """Why a GPU of ``capability`` runs no fp8 training (empty when it does).

    Example:
        >>> fp8_refusal_for((8, 0), "A100")
        'fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); A100 has 8.0'
        >>> fp8_refusal_for((9, 0), "H100")
        ''
    """
    if tuple(capability) >= FP8_CAPABILITY:
        return ""
    major, minor = capability
    return (
        "fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
        f"{name} has {major}.{minor}"
    )


def fp8_refusal(backend: Backend) -> str:
    """Why fp8 training does not run on ``backend``'s device, in a sentence (empty where it runs)."""
    if backend.type == "cpu":
        return ""  # emulated: torchao casts, then multiplies in fp32
    if backend.type != "cuda":
        return f"mpnb runs no fp8 training on a {backend.label}"
    refusal = cuda_capability_refusal(backend, (0, 0), "fp8 training")
    if refusal:
        return refusal
    return fp8_refusal_for(torch.cuda.get_device_capability(), torch.cuda.get_device_name())


def fp8_hardware(device: str | torch.device | None = None) -> str:
    """``"real"`` or ``"emulated"``: how fp8 runs on ``device`` (no CPU has fp8 matmul units).

    Raises:
        MpnbError: fp8 does not run there (the reason: no fp8 units, an unsupported device), or
            torchao is missing.
    """
    return Fp8Layers.hardware(device)


def float8_config(recipe: str, emulate: bool, all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``; ``emulate`` where no fp8 units exist;
    ``all_gather``: FSDP2 gathers the float8 layers' weights in float8 (tensorwise only)."""
    float8 = import_float8()
    config = float8.Float8LinearConfig.from_recipe_name(check_recipe(recipe))
    if all_gather:  # through __init__, so torchao's own checks of the combination run
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    # a frozen dataclass (torch.compile needs it frozen); torchao sets its own fields this way too
    object.__setattr__(config, "emulate", emulate)
    return config


def precompute_fsdp_scales(model: nn.Module) -> None:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp``: the scales of ``model``'s
    float8-all-gathered weights (sharded by FSDP2) from their current values, in one all-reduce,
    for the next all-gathers. A collective: every rank calls it at the same point (after each
    optimizer step, and after weights change otherwise: a checkpoint loaded). Does nothing for
    a model without such weights."""
    import_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is one of torchao's float8 training layers (without importing torchao);
    FSDP2's sharded ``FSDPFloat8Linear`` (a subclass it makes) is one too."""
    return is_torchao_layer(module, "Float8Linear")


def fp8_cast_measures(module: nn.Module, tensor: torch.Tensor, role: str) -> list[torch.Tensor]:
    """What casting ``tensor`` (a float8 layer's ``"input"`` or ``"weight"`` to e4m3, or its
    ``"grad_output"`` to e5m2) does, as the layer's recipe scales it: its largest magnitude
    (amax, from which the scale is made), the share of its values that saturate (beyond the
    format's largest value once scaled) and the share of its nonzero values that flush to zero
    (below half the format's smallest subnormal once scaled). Three 0-d tensors on the tensor's
    device; nothing is read to the host.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16),
        ...                             torch.nn.Linear(16, 4))
        >>> x = torch.tensor([[1e3, 1.0, 1e-6, 0.0]])  # 1e-6 is 1e-9 of the amax
        >>> with fp8_layers(model, device="cpu"):
        ...     amax, saturated, flushed = fp8_cast_measures(model[1], x, "input")
        >>> float(amax), float(saturated), round(float(flushed), 3)  # 1 of 3 nonzero values flushed
        (1000.0, 0.0, 0.333)
    """
    config = getattr(module, "config", None)
    cast = getattr(config, f"cast_config_{role}", None)
    rowwise = getattr(getattr(cast, "scaling_granularity", None), "name", "") == "AXISWISE"
    magnitude = tensor.detach().abs().float().nan_to_num(0.0, 0.0, 0.0)
    if rowwise:
        amax = magnitude.amax(dim=-1, keepdim=True)
    else:
        amax = magnitude.amax()
    largest, smallest, limit = _FORMATS[role]
    scale = largest / amax.clamp(min=1e-12)  # torchao's amax_to_scale
    if getattr(config, "round_scales_to_power_of_2", False):
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = magnitude * scale
    nonzero = (magnitude > 0).float()
    # e4m3: up to 464 rounds to 448 anyway (its step there is 32); beyond it the cast clips
    saturated = (scaled > limit).float().mean()
    flushed = ((scaled < smallest / 2).float() * nonzero).sum() / nonzero.sum().clamp(min=1)
    return [amax.amax(), saturated, flushed]


def float8_recipe_cast(recipe: str) -> Any:
    """A what-if cast (:class:`~mpnb.precision.modes.matmul_format.MatmulFormat`) by torchao's
    float8 recipe ``recipe``: its element type for the operand's role (e4m3, e5m2 for
    gradients in the default recipe), its scaling granularity (a tensor's, or a row's along the
    contraction), its scales rounded to powers of two where the recipe rounds them.

    Example:
        >>> cast = float8_recipe_cast("tensorwise")
        >>> values, overflow, scales, factor = cast(torch.tensor([[448.0, 1.0, 1e-6]]), "activation", 1)
        >>> values.tolist(), overflow, scales, factor.item()
        ([[448.0, 1.0, 0.0]], 0, (1.0, 1.0), 1.0)
    """
    check_recipe(recipe)

    def cast_float8(tensor: torch.Tensor, role: str, dim: int) -> tuple:
        config_module = import_torchao("torchao.float8.config", "fp8")
        utils = import_torchao("torchao.float8.float8_utils", "fp8")
        config = config_module.Float8LinearConfig.from_recipe_name(recipe)
        setting = {
            "activation": config.cast_config_input,
            "weight": config.cast_config_weight,
            "gradient": config.cast_config_grad_output,
        }[role]
        dtype, granularity = setting.target_dtype, setting.scaling_granularity
        amax = utils.tensor_to_amax(
            tensor,
            scaling_granularity=granularity,
            axiswise_dim=dim if granularity is config_module.ScalingGranularity.AXISWISE else None,
        )
        multiplier = utils.amax_to_scale(
            amax, dtype, round_scales_to_power_of_2=config.round_scales_to_power_of_2
        )
        scaled = tensor * multiplier
        limit = rounding_limit(dtype)
        # the scale maps each amax to the largest value: a pass only where rounding passed it
        past = bool((amax * multiplier >= limit).any())
        overflow = count_past(scaled.abs(), limit) if past else 0
        codes = utils.to_fp8_saturated(scaled, dtype)
        # the elements (exact in bf16), and what reads them back as the operand (a tensor's,
        # or a row's along the contraction: one a row of a, a column of b)
        values = read_bytes(codes, dtype_table(dtype, codes.device))
        factor = (1 / multiplier).float()
        return values, overflow, scale_range(factor, amax), factor

    return cast_float8


#: fp8's products err by 4e-2 to 6e-2 on ordinary tensors; its scales leave no element past
#: the largest value; a layer that flushes 1% of its nonzero elements loses what it holds.
_FP8_THRESHOLD = Threshold(rel_error=0.15, overflow=0.0, underflow=0.01)


class Fp8Layers(LayerSwap):
    """The eligible Linear layers of ``model`` converted to torchao's float8 training, undone
    exactly (:class:`~mpnb.precision.modes.layer_swap.LayerSwap`: which layers, the swap, the
    restore).

    Args:
        model: the model whose layers to convert.
        recipe: torchao's recipe: ``"tensorwise"`` (default), ``"rowwise"`` or
            ``"rowwise_with_gw_hp"``.
        keep: names of Linear layers (or of modules containing them) to keep in high precision,
            besides the first and last Linear layers.
        device: where the model trains (default: the session device): decides real or emulated.
        all_gather: the model is to be sharded by FSDP2 after conversion: its float8 weights are
            wrapped for torchao's float8 all-gather (tensorwise recipe only; the rowwise ones
            gather in high precision). The wrapped weights are new ``Parameter`` objects over
            the same storage: point an optimizer at them (FSDP's sharding replaces them anyway).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 48),
        ...                             torch.nn.Linear(48, 32), torch.nn.Linear(32, 4))
        >>> layers = Fp8Layers(model, keep=["2"], device="cpu")
        >>> layers.converted, layers.kept["0"], layers.kept["2"]
        (['1'], 'the first Linear layer', 'kept by name')
        >>> print(layers.describe())
        fp8 (tensorwise, emulated: numerics only, no speed-up): 1 of 4 Linear layers
        >>> _ = layers.convert(); type(model[1]).__name__
        'Float8Linear'
        >>> layers.restore(); type(model[1]).__name__
        'Linear'
    """

    mode = "fp8"
    layer_class = "Float8Linear"
    multiple_of = 16  # fp8 matmul kernels need it
    real_where = "fp8 tensor cores"

    def __init__(
        self,
        model: nn.Module,
        *,
        recipe: str = "tensorwise",
        keep: Iterable[str] = (),
        device: str | torch.device | None = None,
        all_gather: bool = False,
    ) -> None:
        self.recipe = check_recipe(recipe)
        self.all_gather = all_gather and self.recipe == "tensorwise"
        super().__init__(model, keep=keep, device=device)
        self.config = float8_config(self.recipe, self.emulated, self.all_gather)

    @classmethod
    def refusal(cls, device: torch.device) -> str:
        return fp8_refusal(backend_for(device))

    @classmethod
    def import_layers(cls) -> None:
        import_float8()

    def swap(self, names: list[str]) -> None:
        wanted = set(names)
        import_float8().convert_to_float8_training(
            self.model, module_filter_fn=lambda _, name: name in wanted, config=self.config
        )

    @classmethod
    def cast_measures(
        cls, module: nn.Module, tensor: torch.Tensor, role: str
    ) -> list[torch.Tensor]:
        return [*fp8_cast_measures(module, tensor, role), torch.full((), float("nan"))]

    def describe_recipe(self) -> str:
        return self.recipe

    def _check_already_converted(self) -> None:
        """Float8 layers of another recipe are refused too (they would train as they are)."""
        other = {
            name: recipe
            for name in self.already
            if (recipe := _recipe_of(self.model.get_submodule(name).config)) != self.recipe
        }
        if other:
            raise MpnbError(
                f"fp8 ({self.recipe}) cannot train {type(self.model).__name__} as asked: "
                f"{', '.join(other)} already float8 with recipe {next(iter(other.values()))}. "
                f"{self.put_back_hint()}"
            )
        super()._check_already_converted()


def _recipe_of(config: Any) -> str:
    """The name of the recipe a float8 layer's config was made from ("another" if none)."""
    for recipe in RECIPES:
        made = float8_config(recipe, getattr(config, "emulate", False))
        if all(
            getattr(config, part, None) == getattr(made, part)
            for part in ("cast_config_input", "cast_config_weight", "cast_config_grad_output")
        ):
            return recipe
    return "another"


def fp8_layers(
    model: nn.Module,
    recipe: str = "tensorwise",
    keep: Iterable[str] = (),
    device: str | torch.device | None = None,
) -> Fp8Layers:
    """The eligible Linear layers of ``model`` in fp8 for a ``with`` block (or until
    ``.restore()`` after ``.convert()``); the model is exactly as before afterwards.

    Run the forward pass under bf16 autocast (``mpnb.autocast("bf16")``, or ``%amp fp8``), as
    mode fp8 does. A ``Trainer`` in mode fp8 does all this for each fit.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
        ...                             torch.nn.Linear(32, 4))
        >>> before = {k: v.clone() for k, v in model.state_dict().items()}
        >>> with fp8_layers(model, device="cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        ...     model(torch.randn(8, 16)).shape
        torch.Size([8, 4])
        >>> all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        True

    Raises:
        MpnbError: torchao missing (``pip install 'mpnb[fp8]'``), a device without fp8, an
            unknown recipe or kept name; nothing changes.
    """
    return Fp8Layers(model, recipe=recipe, keep=keep, device=device)


@register
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Fp8(LayerSwapMode):
    """The eligible Linear layers' matmuls in float8 (torchao's float8 training, :class:`Fp8Layers`),
    everything else under bf16 autocast; real on CUDA GPUs of compute capability 8.9+, emulated
    on a CPU.

    Example:
        >>> import torch
        >>> from mpnb.precision.modes import parse_mode
        >>> fp8 = parse_mode("fp8", recipe="rowwise", keep="head")
        >>> fp8, fp8.label, fp8.autocast_dtype
        (Mode('fp8', recipe='rowwise', keep=('head',)), 'fp8:rowwise', torch.bfloat16)
        >>> fp8.describe(torch.device("cpu"))
        'fp8:rowwise on cpu (emulated: numerics only, no speed-up)'
        >>> parse_mode("fp8", recipe="blockwise")
        Traceback (most recent call last):
        ...
        mpnb.errors.InvalidChoiceError: unknown fp8 recipe 'blockwise'; valid: tensorwise, rowwise, rowwise_with_gw_hp
    """

    recipe: str = option(
        "tensorwise", "torchao's float8 recipe (default tensorwise)", choices=RECIPES
    )
    keep: tuple[str, ...] = keep_option()

    name = "fp8"
    aliases = ("float8",)
    summary = "eligible Linear layers' matmuls in fp8 (torchao float8 training), the rest under bf16 autocast"
    layers: ClassVar[type[LayerSwap]] = Fp8Layers
    layers_function = "mpnb.fp8_layers"
    matmul_formats = (
        MatmulFormat(
            "fp8",
            _FP8_THRESHOLD,
            writes=torch.bfloat16,  # the mode's autocast
            unavailable=torchao_missing,
            scaled_cast=float8_recipe_cast("tensorwise"),
            trains_as="fp8:tensorwise",
        ),
        MatmulFormat(
            "fp8_rowwise",
            _FP8_THRESHOLD,
            writes=torch.bfloat16,  # the mode's autocast
            unavailable=torchao_missing,
            scaled_cast=float8_recipe_cast("rowwise"),
            follows_axis=True,
            trains_as="fp8:rowwise",
        ),
    )
    framework_hint = (
        "ask for bf16 and convert the model's layers (run the training inside "
        "`with mpnb.fp8_layers(model):`; Lightning: in configure_model), or use Accelerate's "
        "mixed_precision='fp8'"
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", check_recipe(self.recipe))
        object.__setattr__(self, "keep", layer_names(self.keep, "fp8"))

    def recipe_words(self) -> str:
        return f"torchao {self.recipe}, "

    def layer_swap(self, model: nn.Module, device: torch.device, **extra: Any) -> LayerSwap:
        return Fp8Layers(model, recipe=self.recipe, keep=self.keep, device=device, **extra)

    def prepare_sharded(self, model: nn.Module, device: torch.device) -> bool:
        # before sharding: torchao's float8 all-gather wraps the unsharded weights
        layers = self.layer_swap(model, device, all_gather=True)
        return layers.convert().all_gather  # type: ignore[attr-defined]

    def refresh_sharded(self, model: nn.Module) -> None:
        precompute_fsdp_scales(model)
