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

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from mpnb._stderr import quiet_loggers
from mpnb.errors import InvalidChoiceError, MpnbError
from mpnb.precision.backends import Backend, backend_for, resolve_device
from mpnb.precision.modes.base import EMULATED, Mode, option
from mpnb.precision.modes.registry import register

__all__ = ["Fp8Layers", "fp8_layers"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
INSTALL = "pip install 'mpnb[fp8]'"
#: fp8 tensor cores (torch._scaled_mm): Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x).
FP8_CAPABILITY = (8, 9)
#: e4m3's largest finite value and smallest subnormal: what saturates and what flushes to zero.
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
E4M3_SMALLEST = 2.0**-9
#: The same for e5m2, the format of the gradients (torchao's ``grad_output`` cast).
E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)
E5M2_SMALLEST = 2.0**-16
#: Per role: (largest, smallest subnormal, half the step below the largest: a value up to the
#: largest plus this rounds down to it, beyond it the cast clips).
_FORMATS = {
    "input": (E4M3_MAX, E4M3_SMALLEST, 16.0),
    "weight": (E4M3_MAX, E4M3_SMALLEST, 16.0),
    "grad_output": (E5M2_MAX, E5M2_SMALLEST, 4096.0),
}


def import_float8() -> ModuleType:
    """torchao's ``float8`` package, imported on first use.

    Raises:
        MpnbError: torchao is not installed (the message names the install command).
    """
    try:
        with _quiet_torchao():
            return importlib.import_module("torchao.float8")
    except ImportError as error:
        raise MpnbError(
            f"mode fp8 needs torchao, which is not installed ({error}): {INSTALL}"
        ) from None


def _quiet_torchao() -> contextlib.AbstractContextManager[None]:
    """torchao's imports warn about CUDA kernels a CPU build cannot load (not used here) and
    about enums torch now registers itself: quiet for a block."""
    return quiet_loggers(("torchao", "torch.utils._pytree"), logging.ERROR)


def torchao_installed() -> bool:
    """Whether torchao can be imported (without importing it)."""
    if "torchao" in sys.modules:
        return sys.modules["torchao"] is not None
    return importlib.util.find_spec("torchao") is not None


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
    if not backend.is_available():
        return backend.unavailable_reason()
    if torch.version.hip is not None:
        return "mpnb runs fp8 training on NVIDIA GPUs only (this is a ROCm build)"
    return fp8_refusal_for(torch.cuda.get_device_capability(), torch.cuda.get_device_name())


def fp8_hardware(device: str | torch.device | None = None) -> str:
    """``"real"`` or ``"emulated"``: how fp8 runs on ``device`` (no CPU has fp8 matmul units).

    Raises:
        MpnbError: fp8 does not run there (the reason: no fp8 units, an unsupported device).
    """
    target = resolve_device(device)
    refusal = fp8_refusal(backend_for(target))
    if refusal:
        raise MpnbError(f"mode fp8 is not available on {target}: {refusal}")
    return "emulated" if target.type == "cpu" else "real"


def check_fp8(device: str | torch.device | None = None) -> str:
    """What mode fp8 needs, checked before anything changes: torchao and fp8-capable hardware.
    Returns how fp8 runs (``"real"`` / ``"emulated"``).

    Raises:
        MpnbError: torchao is missing, or the device runs no fp8.
    """
    how = fp8_hardware(device)
    import_float8()
    return how


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
    return any(
        cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")
        for cls in type(module).__mro__
    )


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
    largest, smallest, rounds_down = _FORMATS[role]
    scale = largest / amax.clamp(min=1e-12)  # torchao's amax_to_scale
    if getattr(config, "round_scales_to_power_of_2", False):
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = magnitude * scale
    nonzero = (magnitude > 0).float()
    # e4m3: up to 464 rounds to 448 anyway (its step there is 32); beyond it the cast clips
    saturated = (scaled > largest + rounds_down).float().mean()
    flushed = ((scaled < smallest / 2).float() * nonzero).sum() / nonzero.sum().clamp(min=1)
    return [amax.amax(), saturated, flushed]


class Fp8Layers:
    """The eligible Linear layers of ``model`` converted to torchao's float8 training, undone exactly.

    Everything is checked on construction (torchao installed, the device runs fp8, the recipe,
    the names in ``keep``); nothing changes until :meth:`convert` (or entering the ``with``
    block). :meth:`restore` puts the original modules back; it is idempotent.

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

    Attributes:
        converted: the names of the layers converted (or to be converted), in model order.
        kept: each Linear layer left in high precision, with the reason.
        emulated: True where fp8 is emulated (a CPU): numerics only, no speed-up.

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

    def __init__(
        self,
        model: nn.Module,
        *,
        recipe: str = "tensorwise",
        keep: Iterable[str] = (),
        device: str | torch.device | None = None,
        all_gather: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise MpnbError(f"fp8 converts a torch.nn.Module's layers, got {type(model).__name__}")
        self.model, self.recipe, self.keep = model, check_recipe(recipe), _layer_names(keep)
        self.emulated = check_fp8(device) == "emulated"
        self.all_gather = all_gather and self.recipe == "tensorwise"
        self.config = float8_config(self.recipe, self.emulated, self.all_gather)
        names = {name for name, _ in model.named_modules()}
        unknown = [name for name in self.keep if name not in names]
        if unknown:
            raise MpnbError(
                f"fp8 keep names no module of {type(model).__name__}: {', '.join(map(repr, unknown))}"
            )
        self.kept, self.converted, self.already = _eligible(model, self.keep)
        self._check_already_converted()
        self._swapped: list[tuple[nn.Module, str, nn.Module]] = []

    def _check_already_converted(self) -> None:
        """Layers that are float8 already (converted by a ``%amp fp8 --model`` hold, by the user,
        or before FSDP sharded them) train as they are: refuse them where that is not what was
        asked (another recipe, or a layer asked to be kept)."""
        other = {
            name: recipe
            for name in self.already
            if (recipe := _recipe_of(self.model.get_submodule(name).config)) != self.recipe
        }
        kept = [name for name in self.already if _named_in(name, self.keep)]
        if other or kept:
            found = (
                f"{', '.join(other)} already float8 with recipe {next(iter(other.values()))}"
                if other
                else f"{', '.join(kept)}, asked to be kept, already float8"
            )
            raise MpnbError(
                f"fp8 ({self.recipe}) cannot train {type(self.model).__name__} as asked: {found}. "
                "Put its layers back first: `%amp off` (a model held by `%amp fp8 --model`), or "
                "leave the `with mpnb.fp8_layers(model):` block that converted them"
            )

    @property
    def active(self) -> bool:
        """Whether the layers are converted now."""
        return bool(self._swapped)

    def check_converts(self) -> None:
        """Refuse a model fp8 would leave untouched (every layer would run in bf16: that is mode bf16).

        Raises:
            MpnbError: no eligible Linear layer; says why each was kept.
        """
        if self.converted or self.already:
            return
        reasons = "; ".join(f"{name or 'the model'}: {why}" for name, why in self.kept.items())
        found = reasons or "it has no torch.nn.Linear layer"
        if any(type(module).__name__ == "Conv1D" for module in self.model.modules()):
            found += "; transformers' Conv1D layers (GPT-2's) are not torch.nn.Linear"
        raise MpnbError(
            f"fp8 would convert no layer of {type(self.model).__name__} ({found}), so it would "
            "train in bf16: use mode bf16, or a model with Linear layers of sizes divisible by 16"
        )

    def convert(self) -> Fp8Layers:
        """Swap the eligible layers for torchao's ``Float8Linear`` (sharing their parameters, and
        the hooks registered on them: a user's forward hook on a layer still fires).

        Whatever torchao raises half-way (an interrupt too) goes on only once every layer it
        swapped is back.

        Raises:
            MpnbError: nothing to convert (:meth:`check_converts`); the model is unchanged.
        """
        if self._swapped:
            return self
        self.check_converts()
        if not self.converted:  # all float8 already (a sharded model converted before sharding)
            return self
        float8 = import_float8()
        wanted = set(self.converted)
        before = dict(self.model.named_modules())
        try:
            try:
                with _quiet_torchao():
                    float8.convert_to_float8_training(
                        self.model,
                        module_filter_fn=lambda _, name: name in wanted,
                        config=self.config,
                    )
            finally:  # recorded even when torchao fails half-way, so restore undoes what it did
                after = dict(self.model.named_modules())
                for name in self.converted:
                    if after.get(name) is not before[name]:
                        parent_name, _, attribute = name.rpartition(".")
                        parent = self.model.get_submodule(parent_name)
                        self._swapped.append((parent, attribute, before[name]))
                        _share_hooks(before[name], after[name])
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self) -> None:
        """Put every original layer object back where it was (parameters were shared all along).
        Not for a model FSDP has sharded since: its layers hold new (sharded) parameters that
        the original objects lack; a sharded model keeps its float8 layers."""
        swapped, self._swapped = self._swapped, []
        for parent, attribute, original in reversed(swapped):
            setattr(parent, attribute, original)

    def describe(self) -> str:
        """``"fp8 (tensorwise, emulated: numerics only, no speed-up): 2 of 4 Linear layers"``."""
        where = EMULATED if self.emulated else "fp8 tensor cores"
        total = len(self.converted) + len(self.already) + len(self.kept)
        done = len(self.converted) + len(self.already)
        return f"fp8 ({self.recipe}, {where}): {done} of {total} Linear layers"

    def __enter__(self) -> Fp8Layers:
        return self.convert()

    def __exit__(self, *exc_info: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "converted" if self.active else "not converted"
        return f"<Fp8Layers {self.describe()}, {state}>"


#: The hook tables of ``nn.Module``: a converted layer shares its original's, so hooks a user
#: registered on the layer keep firing (and a handle removes them from both).
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _share_hooks(original: nn.Module, converted: nn.Module) -> None:
    for table in _HOOK_TABLES:
        if hasattr(original, table):
            object.__setattr__(converted, table, getattr(original, table))
    object.__setattr__(converted, "_is_full_backward_hook", original._is_full_backward_hook)


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


def _eligible(
    model: nn.Module, keep: tuple[str, ...]
) -> tuple[dict[str, str], list[str], list[str]]:
    """(kept: name -> reason, to convert, already float8) over the model's Linear layers."""
    parents = {
        f"{name}.{child}".lstrip("."): module
        for name, module in model.named_modules()
        for child, _ in module.named_children()
    }
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    kept: dict[str, str] = {}
    converted, already = [], []
    for index, (name, module) in enumerate(linears):
        if is_float8(module):
            already.append(name)
        elif name == "":
            kept[name] = "the model itself is the Linear layer"
        elif index == 0:
            kept[name] = "the first Linear layer"
        elif index == len(linears) - 1:
            kept[name] = "the last Linear layer"
        elif _named_in(name, keep):
            kept[name] = "kept by name"
        elif parametrize.is_parametrized(module):
            kept[name] = (
                "its weight is parametrized (weight_norm...): torchao's layer takes a plain weight"
            )
        elif module.in_features % 16 or module.out_features % 16:
            kept[name] = f"{module.in_features}x{module.out_features} is not divisible by 16"
        elif isinstance(parents.get(name), nn.MultiheadAttention):
            kept[name] = "its MultiheadAttention uses the weight directly"
        elif _sharded(module.weight):
            kept[name] = "sharded already (fp8 converts a layer before FSDP shards it)"
        else:
            converted.append(name)
    return kept, converted, already


def _named_in(name: str, names: tuple[str, ...]) -> bool:
    """Whether the module ``name`` is one of ``names`` or inside one of them."""
    return any(name == k or name.startswith(k + ".") for k in names if k)


def _sharded(weight: torch.Tensor) -> bool:
    """A DTensor (FSDP's or tensor parallelism's), told without importing torch.distributed.tensor
    (over a second)."""
    return any(cls.__name__ == "DTensor" for cls in type(weight).__mro__)


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


def _layer_names(keep: object) -> tuple[str, ...]:
    """``keep`` as a tuple of layer names: one name, or an iterable of non-empty names.

    Raises:
        MpnbError: anything else, named with what it is.
    """
    names = (keep,) if isinstance(keep, str) else keep
    if isinstance(names, (bytes, dict)) or not isinstance(names, Iterable):
        raise MpnbError(
            f"fp8 keep takes layer names (a name or a list of them), got {type(keep).__name__} {keep!r}"
        )
    names = tuple(names)
    bad = [name for name in names if not isinstance(name, str) or not name.strip()]
    if bad:
        raise MpnbError(f"fp8 keep takes non-empty layer names, got {bad!r} in {keep!r}")
    return tuple(name.strip() for name in names)


def _emulated(device: torch.device) -> bool:
    """No CPU has fp8 matmul units: torchao casts to fp8, then multiplies in fp32."""
    return device.type == "cpu"


@register
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Fp8(Mode):
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
    keep: tuple[str, ...] = option(
        (),
        "Linear layers (or modules holding them) to keep in bf16, besides the first and last",
        many=True,
    )

    name = "fp8"
    aliases = ("float8",)
    summary = "eligible Linear layers' matmuls in fp8 (torchao float8 training), the rest under bf16 autocast"
    autocast_dtype = torch.bfloat16  # what runs outside the float8 layers
    converts_layers = True
    observed_as = ("bf16", "fp32", "tf32")  # what a forward pass reads with float8 layers in it
    framework_hint = (
        "ask for bf16 and convert the model's layers (run the training inside "
        "`with mpnb.fp8_layers(model):`; Lightning: in configure_model), or use Accelerate's "
        "mixed_precision='fp8'"
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", check_recipe(self.recipe))
        object.__setattr__(self, "keep", _layer_names(self.keep))

    def check(self, device: torch.device) -> None:
        super().check(device)
        check_fp8(device)

    def support(self, device: torch.device) -> str:
        refusal = fp8_refusal(backend_for(device))
        if refusal:
            return f"no: {refusal}"
        words = EMULATED if _emulated(device) else "fp8 tensor cores"
        if not torchao_installed():
            words += f" (needs {INSTALL})"
        return words

    def notes(self, backend: Backend) -> list[str]:
        notes = []
        if backend.type == "cpu":
            notes.append(
                f"fp8 on this {backend.label} is emulated: numerics only, no speed-up (slower than fp32)"
            )
        notes.append(
            "fp8 converts a model's Linear layers: a Trainer does it for each fit; for your own "
            "loop, `%amp fp8 --model NAME` or `with mpnb.fp8_layers(model):`"
        )
        return notes

    def status_rows(self, device: torch.device) -> list[tuple[str, str]]:
        kept = f"; kept in bf16 by name: {', '.join(self.keep)}" if self.keep else ""
        return [("fp8", f"torchao {self.recipe}, {self.support(device)}{kept}")]

    def _layers(
        self, model: nn.Module, device: torch.device, all_gather: bool = False
    ) -> Fp8Layers:
        return Fp8Layers(
            model, recipe=self.recipe, keep=self.keep, device=device, all_gather=all_gather
        )

    def check_model(self, model: nn.Module, device: torch.device) -> None:
        self._layers(model, device).check_converts()

    @contextlib.contextmanager
    def model_scope(self, model: nn.Module, device: torch.device) -> Iterator[Fp8Layers]:
        with self._layers(model, device) as layers:
            yield layers

    def prepare_sharded(self, model: nn.Module, device: torch.device) -> bool:
        # before sharding: torchao's float8 all-gather wraps the unsharded weights
        return self._layers(model, device, all_gather=True).convert().all_gather

    def refresh_sharded(self, model: nn.Module) -> None:
        precompute_fsdp_scales(model)

    def describe(self, device: torch.device) -> str:
        words = super().describe(device)
        return f"{words} ({EMULATED})" if _emulated(device) else words

    def slow_reason(self, model: nn.Module, device: torch.device) -> str | None:
        return "fp8 is emulated here (numerics only, no speed-up)" if _emulated(device) else None

    def compare_verdict(self, device: torch.device) -> str:
        return EMULATED if _emulated(device) else ""

    @classmethod
    def found_in(cls, model: nn.Module) -> bool:
        return any(is_float8(module) for module in model.modules())

    def missing_layers(self, framework: str, observed: str) -> str | None:
        if observed not in self.observed_as:
            return None
        return (
            f"{framework} was asked for fp8 but trains in {observed}: no layer of the model is "
            "torchao's Float8Linear (convert_to_float8_training converts only Linear layers its "
            "module_filter_fn accepts, of sizes divisible by 16, before training starts)"
        )
