"""What the modes that swap a model's Linear layers share: torchao's training layers in, the
originals back out.

Modes ``fp8``, ``mxfp8`` and ``nvfp4`` run the matmuls of a model's eligible ``nn.Linear``
layers in a low-precision format through torchao's training layers, and everything else under
bf16 autocast. Each is one module (:mod:`~mpnb.precision.modes.fp8`,
:mod:`~mpnb.precision.modes.mxfp8`, :mod:`~mpnb.precision.modes.nvfp4`) with two classes: a
:class:`LayerSwap` (which layers, how one is swapped, where the format runs) and a
:class:`LayerSwapMode` (the mode). This module holds the rest:

- which layers qualify: not the model's first or last Linear layer (the embedding side and the
  output lose the most, as Accelerate's and torchtitan's defaults have it), not one the user
  names in ``keep``, not one whose parent calls it by weight (``MultiheadAttention``'s
  ``out_proj``), not a parametrized or sharded one, and both dimensions a multiple of the
  format's block;
- the swap itself, recorded as it happens so that a failure half-way (an interrupt too) puts
  back every layer already swapped; the new layer holds the very same ``Parameter`` objects and
  shares the original's hook tables, so a ``state_dict`` never changes and a user's hooks fire;
- :meth:`LayerSwap.restore`, which puts every original module object back.

Example (mode fp8's layers; mxfp8's and nvfp4's behave alike):
    >>> import torch
    >>> from mpnb.precision.modes.fp8 import Fp8Layers
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 30),
    ...                             torch.nn.Linear(30, 4))
    >>> layers = Fp8Layers(model, device="cpu")
    >>> layers.kept
    {'0': 'the first Linear layer', '1': '32x30 is not a multiple of 16', '2': 'the last Linear layer'}
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.util
import logging
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.utils import parametrize

from mpnb._stderr import quiet_loggers
from mpnb.errors import MpnbError
from mpnb.precision.backends import Backend, resolve_device
from mpnb.precision.modes.base import EMULATED, Mode, option

__all__: list[str] = []  # the mode modules list their public names

#: The extra that installs torchao, the library of every layer-swapping mode.
TORCHAO_INSTALL = "pip install 'mpnb[fp8]'"


#: Why a Linear layer is kept out of the format (what :attr:`LayerSwap.kept` says).
FIRST_LAYER, LAST_LAYER, KEPT_BY_NAME = (
    "the first Linear layer",
    "the last Linear layer",
    "kept by name",
)


def quiet_torchao() -> contextlib.AbstractContextManager[None]:
    """torchao's imports warn about CUDA kernels a CPU build cannot load (not used here) and
    about enums torch now registers itself: quiet for a block."""
    return quiet_loggers(("torchao", "torch.utils._pytree"), logging.ERROR)


def import_torchao(module: str, mode: str) -> ModuleType:
    """torchao's ``module``, imported on first use (quietly).

    Raises:
        MpnbError: torchao is not installed (the message names ``mode`` and the install command).
    """
    imported = sys.modules.get(module)  # None too: a module blocked there imports as missing
    if imported is not None:  # quieting sets loggers' levels: each clears every logger's cache
        return imported
    try:
        with quiet_torchao():
            return importlib.import_module(module)
    except ImportError as error:
        raise MpnbError(
            f"mode {mode} needs torchao, which is not installed ({error}): {TORCHAO_INSTALL}"
        ) from None


def torchao_missing() -> str:
    """Why a torchao cast cannot run here, or an empty string where torchao is installed (a
    matmul format's ``unavailable``)."""
    return (
        "" if torchao_installed() else f"needs torchao, which is not installed: {TORCHAO_INSTALL}"
    )


def torchao_installed() -> bool:
    """Whether torchao can be imported (without importing it)."""
    if "torchao" in sys.modules:
        return sys.modules["torchao"] is not None
    return importlib.util.find_spec("torchao") is not None


def is_torchao_layer(module: nn.Module, class_name: str) -> bool:
    """Whether ``module`` is torchao's ``class_name`` (or a subclass of it, such as FSDP2's
    sharded copy), told without importing torchao."""
    return is_torchao_class(type(module), class_name)


@functools.lru_cache(maxsize=1024)
def is_torchao_class(kind: type, class_name: str) -> bool:
    """:func:`is_torchao_layer` of a module's class, read from its MRO once per class (a fit
    asks it of every module of the model, for each layer-swapping mode).

    >>> is_torchao_class(nn.Linear, "Float8Linear")
    False
    """
    return any(
        cls.__name__ == class_name and cls.__module__.startswith("torchao.") for cls in kind.__mro__
    )


def cuda_capability_refusal(backend: Backend, needs: tuple[int, int], what: str) -> str:
    """Why the current CUDA GPU lacks compute capability ``needs`` for ``what`` (empty if it has
    it), or why there is no NVIDIA GPU to ask."""
    if not backend.is_available():
        return backend.unavailable_reason()
    if torch.version.hip is not None:
        return f"mpnb runs {what} on NVIDIA GPUs only (this is a ROCm build)"
    capability = torch.cuda.get_device_capability()
    if tuple(capability) >= needs:
        return ""
    return (
        f"{what} needs a GPU of compute capability {needs[0]}.{needs[1]} or newer; "
        f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}"
    )


def layer_names(keep: object, mode: str) -> tuple[str, ...]:
    """``keep`` as a tuple of layer names: one name, or an iterable of non-empty names.

    Raises:
        MpnbError: anything else, named with what it is.

    Example:
        >>> layer_names("head", "fp8"), layer_names(["a", " b "], "mxfp8")
        (('head',), ('a', 'b'))
    """
    names = (keep,) if isinstance(keep, str) else keep
    if isinstance(names, (bytes, dict)) or not isinstance(names, Iterable):
        raise MpnbError(
            f"{mode} keep takes layer names (a name or a list of them), got "
            f"{type(keep).__name__} {keep!r}"
        )
    names = tuple(names)
    bad = [name for name in names if not isinstance(name, str) or not name.strip()]
    if bad:
        raise MpnbError(f"{mode} keep takes non-empty layer names, got {bad!r} in {keep!r}")
    return tuple(name.strip() for name in names)


def keep_option() -> Any:
    """The ``keep`` option every layer-swapping mode takes (a field of the mode's dataclass)."""
    return option(
        (),
        "Linear layers (or modules holding them) to keep in bf16, besides the first and last",
        many=True,
    )


class LayerSwap:
    """The eligible Linear layers of ``model`` swapped for a format's torchao training layers,
    undone exactly. A subclass names the format and says how a layer is swapped.

    Everything is checked on construction (torchao installed, the device runs the format, the
    names in ``keep``); nothing changes until :meth:`convert` (or entering the ``with`` block).
    :meth:`restore` puts the original modules back; it is idempotent.

    Class attributes (what a subclass sets):
        mode: the mode's name (``"mxfp8"``), in messages.
        layer_class: the class name of torchao's layer (``"MXFP8Linear"``).
        multiple_of: both dimensions of a layer must be multiples of this.
        real_where: the hardware that runs the format for real, in words.
        takes_conv1d: whether transformers' ``Conv1D`` layers (GPT-2's) are swapped too.
        instead: what runs where the format does not (said after a refusal).

    Attributes:
        converted: the names of the layers converted (or to be converted), in model order.
        kept: each Linear layer left in high precision, with the reason.
        already: the layers that were the format's layers before (a model converted by hand).
        emulated: True where the format is emulated (no units for it): numerics only.
    """

    mode: ClassVar[str] = ""
    layer_class: ClassVar[str] = ""
    multiple_of: ClassVar[int] = 16
    real_where: ClassVar[str] = ""
    takes_conv1d: ClassVar[bool] = False
    instead: ClassVar[str] = ""

    def __init__(
        self,
        model: nn.Module,
        *,
        keep: Iterable[str] = (),
        device: str | torch.device | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise MpnbError(
                f"{self.mode} converts a torch.nn.Module's layers, got {type(model).__name__}"
            )
        self.model, self.keep = model, layer_names(keep, self.mode)
        self.device = resolve_device(device)
        self.emulated = self.hardware(self.device) == "emulated"
        # every name a module is registered under (the same layer at two places of a Sequential,
        # an attribute alias): keep may name any of them
        modules = dict(model.named_modules(remove_duplicate=False))
        unknown = [name for name in self.keep if name not in modules]
        if unknown:
            raise MpnbError(
                f"{self.mode} keep names no module of {type(model).__name__}: "
                f"{', '.join(map(repr, unknown))}{self._names_to_keep(modules, unknown)}"
            )
        self._check_keep_holds_layers(modules)
        self.kept, self.converted, self.already = self.plan(model, self.keep)
        self._check_already_converted()
        self._swapped: list[tuple[nn.Module, str, nn.Module]] = []

    @classmethod
    def _names_to_keep(cls, modules: dict[str, nn.Module], unknown: list[str]) -> str:
        """What ``keep`` could have named: the names closest to ``unknown``, else the model's
        layers this format swaps (the first few)."""
        names = [name for name in modules if name]
        close = dict.fromkeys(
            found for name in unknown for found in difflib.get_close_matches(name, names, n=3)
        )
        if close:
            return f"; closest: {', '.join(close)}"
        layers = [name for name, module in modules.items() if name and cls.is_candidate(module)]
        more = f" and {len(layers) - 8} more" if len(layers) > 8 else ""
        return f"; its Linear layers: {', '.join(layers[:8])}{more}" if layers else ""

    # -- what a subclass provides -----------------------------------------------------------

    @classmethod
    def refusal(cls, device: torch.device) -> str:
        """Why the format does not run on ``device``, in a sentence (empty where it does)."""
        raise NotImplementedError

    @classmethod
    def emulated_on(cls, device: torch.device) -> bool:
        """Whether ``device`` (where the format runs) lacks the units for it."""
        return device.type == "cpu"

    @classmethod
    def import_layers(cls) -> None:
        """Import torchao's layers (an :class:`MpnbError` naming the extra when it is missing)."""
        raise NotImplementedError

    def swap(self, names: list[str]) -> None:
        """Replace the layers named ``names`` by the format's layers (recorded by :meth:`convert`
        from the model afterwards, even when this fails half-way). By default one layer at a time
        through :meth:`make_layer`."""
        for name in names:
            parent_name, _, attribute = name.rpartition(".")
            original = self.model.get_submodule(name)
            setattr(self.model.get_submodule(parent_name), attribute, self.make_layer(original))

    def make_layer(self, linear: nn.Linear) -> nn.Module:
        """The format's layer in place of ``linear``, holding ``linear``'s own parameters."""
        raise NotImplementedError

    @classmethod
    def cast_measures(
        cls, module: nn.Module, tensor: torch.Tensor, role: str
    ) -> list[torch.Tensor]:
        """What the format's cast does to ``tensor``, the layer ``module``'s ``"input"``,
        ``"weight"`` or ``"grad_output"``: its largest magnitude, the share of its values that
        saturate, the share of its nonzero values that flush to zero, and the range of its block
        scales in powers of two (NaN for a format without blocks). 0-d tensors on the tensor's
        device (the numerics watch reads them at its flush); NaN where the format's cast is not
        measured."""
        return [torch.full((), float("nan"), device=tensor.device)] * 4

    def describe_recipe(self) -> str:
        """The recipe's words, first in :meth:`describe`'s brackets (empty: none)."""
        return ""

    # -- where it runs ------------------------------------------------------------------------

    @classmethod
    def hardware(cls, device: str | torch.device | None = None) -> str:
        """``"real"`` or ``"emulated"``: how the format runs on ``device``; torchao imported.

        Raises:
            MpnbError: it does not run there (the reason), or torchao is missing.
        """
        target = resolve_device(device)
        refusal = cls.refusal(target)
        if refusal:
            instead = f"; {cls.instead}" if cls.instead else ""
            raise MpnbError(f"mode {cls.mode} is not available on {target}: {refusal}{instead}")
        cls.import_layers()
        return "emulated" if cls.emulated_on(target) else "real"

    @classmethod
    def is_layer(cls, module: nn.Module) -> bool:
        """Whether ``module`` is one of this format's layers (without importing torchao)."""
        return is_torchao_layer(module, cls.layer_class)

    # -- which layers -------------------------------------------------------------------------

    def _check_keep_holds_layers(self, modules: dict[str, nn.Module]) -> None:
        """Refuse a name in ``keep`` that holds no layer this format could swap (a ReLU one off
        in a Sequential): keeping it would keep nothing, without a word. ``modules``: the
        model's, by name."""
        layers = [name for name, module in modules.items() if self.is_candidate(module)]
        for name in self.keep:
            if not any(named_in(layer, (name,)) for layer in layers):
                raise MpnbError(
                    f"{self.mode} keep names {name!r} ({type(modules[name]).__name__}), which "
                    f"holds no Linear layer {self.mode} could convert; its Linear layers: "
                    f"{', '.join(layers) or 'none'}"
                )

    @classmethod
    def plan(
        cls, model: nn.Module, keep: tuple[str, ...] = ()
    ) -> tuple[dict[str, str], list[str], list[str]]:
        """Which of ``model``'s layers the format would swap, keeping those named in ``keep``:
        (kept: name -> reason, to convert, already converted), in model order. Read from the
        model alone, on any machine (the device's refusal is the constructor's).

        Example:
            >>> from mpnb.precision.modes.mxfp8 import MxLayers
            >>> model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3)))
            >>> kept, converted, already = MxLayers.plan(model)
            >>> converted, kept["0"]
            (['1'], 'the first Linear layer')
        """
        parents = {
            f"{name}.{child}".lstrip("."): module
            for name, module in model.named_modules()
            for child, _ in module.named_children()
        }
        linears = [(n, m) for n, m in model.named_modules() if cls.is_candidate(m)]
        # a layer's other names: a swap replaces it at one place and leaves the others plain
        names: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            names.setdefault(id(module), []).append(name)
        kept: dict[str, str] = {}
        converted, already = [], []
        for index, (name, module) in enumerate(linears):
            if cls.is_layer(module):
                already.append(name)
                continue
            place = (index, len(linears))
            reason = cls._kept_because(name, module, place, parents.get(name), keep)
            others = names[id(module)][1:]
            if not reason and others:
                reason = (
                    f"also registered as {', '.join(others)}: swapped at one place, it would "
                    "run plain at the other"
                )
            if reason:
                kept[name] = reason
            else:
                converted.append(name)
        return kept, converted, already

    @classmethod
    def is_candidate(cls, module: nn.Module) -> bool:
        """Whether ``module`` is a layer this format may swap: a Linear layer, and transformers'
        ``Conv1D`` (GPT-2's transposed Linear) where the format takes it."""
        return isinstance(module, nn.Linear) or (cls.takes_conv1d and is_conv1d(module))

    @classmethod
    def _kept_because(
        cls,
        name: str,
        module: nn.Module,
        place: tuple[int, int],
        parent: nn.Module | None,
        keep: tuple[str, ...],
    ) -> str:
        """Why the Linear layer ``name``, at ``place`` (its index, of how many), stays in high
        precision (empty: it is converted)."""
        block = cls.multiple_of
        inputs, outputs = features(module)
        index, count = place
        if name == "":
            return "the model itself is the Linear layer"
        if index == 0:
            return FIRST_LAYER
        if index == count - 1:
            return LAST_LAYER
        if named_in(name, keep):
            return KEPT_BY_NAME
        if parametrize.is_parametrized(module):
            return (
                "its weight is parametrized (weight_norm...): torchao's layer takes a plain weight"
            )
        if inputs % block or outputs % block:
            return f"{inputs}x{outputs} is not a multiple of {block}"
        if isinstance(parent, nn.MultiheadAttention):
            return "its MultiheadAttention uses the weight directly"
        if is_sharded(module.weight):
            return f"sharded already ({cls.mode} converts a layer before FSDP shards it)"
        return ""

    def _check_already_converted(self) -> None:
        """Layers converted before (by hand, or before FSDP sharded them) train as they are:
        refuse them where a layer asked to be kept is one."""
        kept = [name for name in self.already if named_in(name, self.keep)]
        if kept:
            raise MpnbError(
                f"{self.mode} cannot train {type(self.model).__name__} as asked: "
                f"{', '.join(kept)}, asked to be kept, already {self.layer_class}. "
                f"{self.put_back_hint()}"
            )

    def put_back_hint(self) -> str:
        """How a user puts converted layers back."""
        return (
            f"Put its layers back first: `%amp off` (a model held by `%amp {self.mode} --model`), "
            "or leave the block that converted them"
        )

    @property
    def active(self) -> bool:
        """Whether the layers are converted now."""
        return bool(self._swapped)

    def check_converts(self) -> None:
        """Refuse a model the format would leave untouched (every layer would run in bf16: that
        is mode bf16).

        Raises:
            MpnbError: no eligible Linear layer; says why each was kept.
        """
        found = self.none_converted(self.model, (self.kept, self.converted, self.already))
        if found:
            raise MpnbError(found)

    @classmethod
    def none_converted(
        cls, model: nn.Module, plan: tuple[dict[str, str], list[str], list[str]]
    ) -> str:
        """Why the format would convert no layer of ``model`` under ``plan`` (:meth:`plan`'s),
        in a sentence; empty where it converts some."""
        kept, converted, already = plan
        if converted or already:
            return ""
        by_name = [name for name, why in kept.items() if why == KEPT_BY_NAME]
        if by_name and set(kept.values()) <= {FIRST_LAYER, LAST_LAYER, KEPT_BY_NAME}:
            return (
                f"{cls.mode} would convert no layer of {type(model).__name__}: keep names "
                f"every Linear layer between the first and the last ({', '.join(by_name)}), which "
                "it keeps itself, so it would train in bf16: use mode bf16, or keep fewer"
            )
        reasons = "; ".join(f"{name or 'the model'}: {why}" for name, why in kept.items())
        found = reasons or "it has no torch.nn.Linear layer"
        conv1d = not cls.takes_conv1d and any(is_conv1d(module) for module in model.modules())
        if conv1d:
            found += "; transformers' Conv1D layers (GPT-2's) are not torch.nn.Linear"
        if kept and not conv1d and set(kept.values()) <= {FIRST_LAYER, LAST_LAYER}:
            # no size to change: there is no Linear layer between the two it keeps
            remedy = (
                f"it keeps the first and the last Linear layer in bf16 itself and {type(model).__name__} "
                "has none between them: use mode bf16, or a model with Linear layers between "
                "its first and last"
            )
        else:
            remedy = (
                "use mode bf16, or a model with Linear layers whose sizes are multiples of "
                f"{cls.multiple_of}"
            )
        return (
            f"{cls.mode} would convert no layer of {type(model).__name__} ({found}), so it "
            f"would train in bf16: {remedy}"
        )

    # -- the swap -----------------------------------------------------------------------------

    def convert(self) -> LayerSwap:
        """Swap the eligible layers for the format's (sharing their parameters, and the hooks
        registered on them: a user's forward hook on a layer still fires).

        Whatever torchao raises half-way (an interrupt too) goes on only once every layer it
        swapped is back.

        Raises:
            MpnbError: nothing to convert (:meth:`check_converts`); the model is unchanged.
        """
        if self._swapped:
            return self
        self.check_converts()
        if not self.converted:  # all converted already (a sharded model converted before)
            return self
        before = dict(self.model.named_modules())
        try:
            try:
                with quiet_torchao():
                    self.swap(list(self.converted))
            finally:  # recorded even when the swap fails half-way, so restore undoes what it did
                after = dict(self.model.named_modules())
                for name in self.converted:
                    if after.get(name) is not before[name]:
                        parent_name, _, attribute = name.rpartition(".")
                        parent = self.model.get_submodule(parent_name)
                        self._swapped.append((parent, attribute, before[name]))
                        share_hooks(before[name], after[name])
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self) -> None:
        """Put every original layer object back where it was (parameters were shared all along).
        Not for a model FSDP has sharded since: its layers hold new (sharded) parameters that
        the original objects lack; a sharded model keeps its converted layers."""
        swapped, self._swapped = self._swapped, []
        for parent, attribute, original in reversed(swapped):
            setattr(parent, attribute, original)

    def describe(self) -> str:
        """``"mxfp8 (emulated: numerics only, no speed-up): 2 of 4 Linear layers"``."""
        where = EMULATED if self.emulated else f"{self.real_where}"
        recipe = self.describe_recipe()
        total = len(self.converted) + len(self.already) + len(self.kept)
        done = len(self.converted) + len(self.already)
        inside = f"{recipe}, {where}" if recipe else where
        return f"{self.mode} ({inside}): {done} of {total} Linear layers"

    def layer_lines(self) -> list[str]:
        """One line a Linear layer: converted, or kept and why (a fit's first lines, the status).

        Example:
            >>> import torch
            >>> from mpnb.precision.modes.fp8 import Fp8Layers
            >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
            ...                             torch.nn.Linear(32, 4))
            >>> print("\\n".join(Fp8Layers(model, device="cpu").layer_lines()))
            converted: 1
            kept in bf16: 0 (the first Linear layer), 2 (the last Linear layer)
        """
        lines = []
        done = [*self.already, *self.converted]
        if done:
            lines.append(f"converted: {', '.join(done)}")
        if self.kept:
            reasons = ", ".join(f"{name or 'the model'} ({why})" for name, why in self.kept.items())
            lines.append(f"kept in bf16: {reasons}")
        return lines

    def __enter__(self) -> LayerSwap:
        return self.convert()

    def __exit__(self, *exc_info: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "converted" if self.active else "not converted"
        return f"<{type(self).__name__} {self.describe()}, {state}>"


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


def swapped_layers_of(module: nn.Module) -> type[LayerSwap] | None:
    """The :class:`LayerSwap` of the registered mode whose layer ``module`` is (None: a layer of
    no layer-swapping mode)."""
    from mpnb.precision.modes.registry import registered

    for mode in registered(converts_layers=True):
        layers = getattr(mode, "layers", None)
        if isinstance(layers, type) and issubclass(layers, LayerSwap) and layers.is_layer(module):
            return layers
    return None


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (a Linear layer whose weight is stored
    transposed, ``in x out``: GPT-2's), told without importing transformers."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def features(module: nn.Module) -> tuple[int, int]:
    """A Linear (or ``Conv1D``) layer's (input, output) features."""
    if is_conv1d(module):
        return module.nx, module.nf
    return module.in_features, module.out_features


def share_hooks(original: nn.Module, converted: nn.Module) -> None:
    """Make ``converted`` use ``original``'s hook tables (the same dicts)."""
    for table in _HOOK_TABLES:
        if hasattr(original, table):
            object.__setattr__(converted, table, getattr(original, table))
    object.__setattr__(converted, "_is_full_backward_hook", original._is_full_backward_hook)


def named_in(name: str, names: tuple[str, ...]) -> bool:
    """Whether the module ``name`` is one of ``names`` or inside one of them."""
    return any(name == k or name.startswith(k + ".") for k in names if k)


def is_sharded(weight: torch.Tensor) -> bool:
    """A DTensor (FSDP's or tensor parallelism's), told without importing torch.distributed.tensor
    (over a second)."""
    return any(cls.__name__ == "DTensor" for cls in type(weight).__mro__)


class LayerSwapMode(Mode):
    """The base of the modes that swap Linear layers: bf16 autocast for the rest, the layers
    swapped for a fit (:meth:`model_scope`), and the words that say which and where.

    A subclass is a frozen dataclass with a ``keep`` field (:func:`keep_option`) and sets
    ``layers`` (its :class:`LayerSwap` class) besides the :class:`Mode` class attributes.
    """

    layers: ClassVar[type[LayerSwap]] = LayerSwap
    #: the public function that converts a model's layers for a ``with`` block.
    layers_function: ClassVar[str] = ""
    autocast_dtype = torch.bfloat16  # what runs outside the swapped layers
    converts_layers = True
    observed_as = ("bf16", "fp32", "tf32")  # what a forward pass reads with such layers in it

    keep: tuple[str, ...]  # a field of every subclass (keep_option)

    def check(self, device: torch.device) -> None:
        super().check(device)
        self.layers.hardware(device)

    def support(self, device: torch.device) -> str:
        refusal = self.layers.refusal(device)
        if refusal:
            return f"no: {refusal}"
        words = EMULATED if self.layers.emulated_on(device) else self.layers.real_where
        if not torchao_installed():
            words += f" (needs {TORCHAO_INSTALL})"
        return words

    def notes(self, backend: Backend) -> list[str]:
        notes = []
        device = torch.device(backend.type)
        if not self.layers.refusal(device) and self.layers.emulated_on(device):
            notes.append(
                f"{self.name} on this {backend.label} is emulated: numerics only, no speed-up "
                "(slower than fp32)"
            )
        notes.append(
            f"{self.name} converts a model's Linear layers: a Trainer does it for each fit; for "
            f"your own loop, `%amp {self.name} --model NAME` or `with {self.layers_function}(model):`"
        )
        return notes

    def status_rows(self, device: torch.device) -> list[tuple[str, str]]:
        kept = f"; kept in bf16 by name: {', '.join(self.keep)}" if self.keep else ""
        return [(self.name, f"{self.recipe_words()}{self.support(device)}{kept}")]

    def recipe_words(self) -> str:
        """The mode's recipe in a status row, ending in ", " (empty: none)."""
        return ""

    def layer_swap(self, model: nn.Module, device: torch.device, **extra: Any) -> LayerSwap:
        """This mode's :class:`LayerSwap` over ``model``: nothing changed yet."""
        return self.layers(model, keep=self.keep, device=device, **extra)

    def check_model(self, model: nn.Module, device: torch.device) -> None:
        self.layer_swap(model, device).check_converts()

    def casts_layer(self, module: nn.Module) -> bool:
        return self.layers.is_candidate(module)

    def converts_none_of(self, model: nn.Module) -> str:
        return self.layers.none_converted(model, self.layers.plan(model, self.keep))

    @contextlib.contextmanager
    def model_scope(self, model: nn.Module, device: torch.device) -> Iterator[LayerSwap]:
        with self.layer_swap(model, device) as layers:
            yield layers

    def prepare_sharded(self, model: nn.Module, device: torch.device) -> bool:
        self.layer_swap(model, device).convert()  # before sharding, for good
        return False

    def describe(self, device: torch.device) -> str:
        words = super().describe(device)
        return f"{words} ({EMULATED})" if self.layers.emulated_on(device) else words

    def slow_reason(self, model: nn.Module, device: torch.device) -> str | None:
        if self.layers.emulated_on(device):
            return f"{self.name} is emulated here (numerics only, no speed-up)"
        return None

    def compare_verdict(self, device: torch.device) -> str:
        return EMULATED if self.layers.emulated_on(device) else ""

    @classmethod
    def found_in(cls, model: nn.Module) -> bool:
        kinds = {type(module) for module in model.modules()}  # each class asked once
        return any(is_torchao_class(kind, cls.layers.layer_class) for kind in kinds)

    def missing_layers(self, framework: str, observed: str) -> str | None:
        if observed not in self.observed_as:
            return None
        return (
            f"{framework} was asked for {self.name} but trains in {observed}: no layer of the "
            f"model is torchao's {self.layers.layer_class} (convert the model's Linear layers, of "
            f"sizes that are multiples of {self.layers.multiple_of}, before training starts)"
        )
